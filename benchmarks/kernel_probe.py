"""Which kernels a decode step launches, and with what grid: fa4aot as planned against torch
SDPA's cuDNN backend, on the same dense inputs (H200). torch.profiler's trace gives each kernel's
name, grid, block, registers, shared memory and duration.

    FA4AOT_CACHE_DIR=<store> python benchmarks/kernel_probe.py [--cells 16:65536,32:131072]

bf16 hd128 32:8, one query row per sequence; 5 calls of each column after a warm-up, the
median duration per kernel name.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="16:16384,16:65536,32:131072,64:16384")
    ap.add_argument("--out")
    a = ap.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import decode_columns, decode_inputs, parse_cells

    rows = []
    for b, sk in parse_cells(a.cells):
        torch.cuda.empty_cache()
        cols = decode_columns(*decode_inputs(b, sk))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            for name in ("fa4aot", "cudnn"):
                fn = cols[name]
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        fn()
                    torch.cuda.synchronize()
                path = os.path.join(tempfile.mkdtemp(), "trace.json")
                prof.export_chrome_trace(path)
                events = json.load(open(path))["traceEvents"]
                kern = {}
                for e in events:
                    if e.get("cat") != "kernel":
                        continue
                    args = e.get("args", {})
                    key = (e["name"][:90], str(args.get("grid")), str(args.get("block")),
                           args.get("registers per thread"), args.get("shared memory"))
                    kern.setdefault(key, []).append(e.get("dur", 0))
                for (kname, grid, block, regs, smem), durs in kern.items():
                    r = {"b": b, "sk": sk, "column": name, "kernel": kname, "grid": grid,
                         "block": block, "regs": regs, "smem": smem, "calls": len(durs),
                         "median_us": statistics.median(durs)}
                    rows.append(r)
                    print(f"b{b} sk{sk} {name:6} grid {grid} block {block} regs {regs} smem "
                          f"{smem} x{len(durs)} {r['median_us']:.1f} us  {kname}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
