"""Does a decode kernel run at the same clocks as cuDNN's when it runs for a while? (H200)

    FA4AOT_CACHE_DIR=<store> python benchmarks/clock_probe.py --out clock.json

A decode step's 4-8 query rows fill a 64-row (fa4aot's fold and chunk kernels) or 128-row
(FA4's own kernel) MMA tile, so a memory-bound step still issues 8-32x the useful tensor-core
work. This probe asks whether that costs clocks: for each column (fa4aot as planned, FA4's
unsplit kernel via FA4AOT_SPLIT_KV=0, torch SDPA's cuDNN backend; same inputs), it runs the
call back to back for SECONDS while `nvidia-smi -lms 50` samples the SM clock, the memory
clock and the board power, and reports the time per call (CUDA events over the whole run)
with the medians of the samples. Then the same call in short bursts (a CUDA graph of a few
calls, replayed with idle gaps: benchmarks/_timing.graph_us), the regime of fold_kernels.py.
Columns alternate in 2 rounds (order reversed in the second). bf16 hd128, 32:8, one query row,
causal, dense K/V.
--kernels: also the fold on each of its kernels (chunk, fwd_wide, fwd_wide1), whatever
constraints.fold_kernel would choose; --cells b:keys,...: other cells.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CELLS = [(16, 131072), (64, 65536), (32, 16384), (128, 1024)]
SECONDS = 2.0


def sampled(fn, seconds: float):
    """Run fn back to back for `seconds`, sampling clocks and power: (us per call, samples)."""
    import torch

    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw", "--format=csv,noheader,nounits",
         "-lms", "50"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 0
    a.record()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(4):
            fn()
        n += 4
        torch.cuda.synchronize()  # keep the queue short: the samples cover the calls
    b.record()
    torch.cuda.synchronize()
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    rows = []
    for line in lines:
        try:
            rows.append([float(x) for x in line.split(",")])
        except ValueError:
            pass
    rows = rows[6:] or rows  # the first 0.3 s: idle
    med = [statistics.median(r[i] for r in rows) for i in range(3)] if rows else [None] * 3
    return a.elapsed_time(b) * 1e3 / n, {"sm_mhz": med[0], "mem_mhz": med[1], "watts": med[2],
                                          "samples": len(rows)}


def fold_on(fn, part):
    """fn (fa4aot's call) with its fold forced onto `part` (None: the chunk kernel; "planned":
    as the runtime plans it): the step's run is made once (under an overridden
    constraints.fold_kernel), then put back in the runtime's cache before every call (another
    column's call replaces it: they share its key)."""
    import fa4aot.constraints as C
    import fa4aot.runtime as R

    rt = R.default_runtime()
    serves = C.fold_kernel
    rt._split_runs.clear()
    if part != "planned":
        C.fold_kernel = lambda *a: part  # noqa: E731
    try:
        fn()
    finally:
        C.fold_kernel = serves
    (key, run), = rt._split_runs.items()
    if part != "planned" and getattr(run, "wide", "?") != part:
        raise SystemExit(f"fold on {part}: the runtime made {run!r}")
    rt._split_runs.clear()
    forced = serves if part == "planned" else (lambda *a: part)

    def call():  # (the override also holds while a CUDA graph captures, which caches nothing)
        rt._split_runs[key] = run
        C.fold_kernel = forced
        try:
            fn()
        finally:
            C.fold_kernel = serves

    return call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--kernels", action="store_true", help="also each fold kernel, forced")
    ap.add_argument("--cells", help="b:keys[,b:keys...] instead of CELLS")
    a = ap.parse_args()
    cells = CELLS
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import decode_columns, decode_inputs, graph_us, parse_cells

    if a.cells:
        cells = parse_cells(a.cells)

    out_rows = []
    for b, sk in cells:
        torch.cuda.empty_cache()
        fns = decode_columns(*decode_inputs(b, sk))
        cols = {"fa4aot": fns["fa4aot"], "fa4_unsplit": fns["unsplit"], "cudnn": fns["cudnn"]}
        if a.kernels:
            cols["fa4aot"] = fold_on(fns["fa4aot"], "planned")
            for part in (None, "fwd_wide", "fwd_wide1"):
                cols[f"fold:{part or 'chunk'}"] = fold_on(fns["fa4aot"], part)
        res = {c: {"sustained": [], "burst_us": []} for c in cols}
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            for rnd in range(2):
                for c in (list(cols) if rnd == 0 else list(cols)[::-1]):
                    us, s = sampled(cols[c], SECONDS)
                    res[c]["sustained"].append({"us": us, **s})
                    res[c]["burst_us"].append(graph_us(cols[c], calls=2, replays=10))
        row = {"b": b, "sk": sk, "columns": res}
        out_rows.append(row)
        for c, r in res.items():
            us = statistics.median(x["us"] for x in r["sustained"])
            sm = statistics.median(x["sm_mhz"] for x in r["sustained"])
            w = statistics.median(x["watts"] for x in r["sustained"])
            print(f"b{b:<4} sk{sk:<7} {c:<12} sustained {us:9.1f} us  SM {sm:6.0f} MHz  "
                  f"{w:5.0f} W | bursts {statistics.median(r['burst_us']):9.1f} us", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": out_rows}, f, indent=1)


if __name__ == "__main__":
    main()
