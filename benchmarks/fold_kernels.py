"""Which kernel should a decode step the plan leaves unsplit run on? The fold (one chunk per
sequence; runtime/splitkv.FoldRun) on the chunk kernel (FA4's sm90 forward, 64-row M tile, 128
keys a tile, one CTA per SM) against the wide fold kernels (64 keys a tile: fwd_wide, two CTAs
per SM, and for a dense K fwd_wide1, one; compiler.trace_wide_fold, constraints.fold_kernel),
FA4's own kernel (FA4AOT_SPLIT_KV=0), and torch SDPA's cuDNN backend on the same dense K/V;
side by side in one process (H200).

    FA4AOT_CACHE_DIR=<store> python benchmarks/fold_kernels.py --out fold.json
    FA4AOT_CACHE_DIR=<store> python benchmarks/fold_kernels.py --long --out fold-long.json
    FA4AOT_CACHE_DIR=<store> python benchmarks/fold_kernels.py --cells 48:1024,32:8192 --out f.json

bf16 hd128 32:8, one query row, causal; dense K/V and paged at 16, 64 and 128 keys a page
(pages in order); --long: dense only, b16-b64 at 16K-64K keys and b32 at 128K (the long contexts
where the fold streams at the HBM limit: fwd_wide1 against fwd_wide); --cells: dense only, the
cells given (--layouts: in these layouts). "auto" is the runtime's own choice
(constraints.fold_kernel), printed with its time over the best of the three fold kernels. Per
cell, each column is one CUDA graph of several calls; the graphs replay
in 5 interleaved rounds (the order reversed every other round) and the medians are quoted, so
a slow phase of the shared host or a clock change hits every column alike. Also prints the
largest difference of the fwd_wide kernel's output from the chunk kernel's and from FA4's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

CELLS = [(b, sk) for b in (8, 16, 32, 64, 128) for sk in (1024, 4096, 16384)]
LAYOUTS = ("dense", 16, 64, 128)
LONG_CELLS = [(b, sk) for b in (16, 24, 32, 48, 64) for sk in (16384, 65536)] + [(32, 131072)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--long", action="store_true", help="dense K only, 16K-128K keys")
    ap.add_argument("--cells", help="dense K only, these cells: b:keys[,b:keys...]")
    ap.add_argument("--layouts", help="with --cells: dense,16,64,128 (default dense)")
    a = ap.parse_args()
    cells = CELLS
    if a.long:
        cells = LONG_CELLS
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fa4aot
    import fa4aot.constraints as C
    import fa4aot.runtime as R

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import capture, decode_inputs, parse_cells, replay_us

    if a.cells:
        cells = parse_cells(a.cells)

    rt = R.default_runtime()
    serves = C.fold_kernel
    hq, hk, d = 32, 8, 128
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    layouts = LAYOUTS if cells is CELLS else ("dense",)
    if a.layouts:
        layouts = [x if x == "dense" else int(x) for x in a.layouts.split(",")]
    for layout in layouts:
        for b, sk in cells:
            torch.cuda.empty_cache()
            q, k, v, out = decode_inputs(b, sk, hq, hk, d)
            if layout == "dense":
                def call():
                    return fa4aot.flash_attn_func(q, k, v, causal=True, out=out)
            else:
                p = layout
                kp, vp = k.view(b * sk // p, p, hk, d), v.view(b * sk // p, p, hk, d)
                table = torch.arange(b * sk // p, device="cuda", dtype=torch.int32).view(b, -1)
                used = torch.full((b,), sk, device="cuda", dtype=torch.int32)
                cu_q = torch.arange(b + 1, device="cuda", dtype=torch.int32)
                q2, out2 = q.view(b, hq, d), out.view(b, hq, d)

                def call():
                    return fa4aot.flash_attn_varlen_func(
                        q2, kp, vp, cu_seqlens_q=cu_q, max_seqlen_q=1, seqused_k=used,
                        page_table=table, max_seqlen_k=sk, causal=True, out=out2)
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            est = b * sk * hk * 2 * d * 2 / 4.3e6  # us at 4.3 TB/s
            calls = max(2, min(20, int(4000 / max(est, 1))))
            graphs, outs = {}, {}
            modes = ("chunk", "fwd_wide", "fwd_wide1", "fa4", "auto")
            for mode in modes if layout == "dense" else modes[:2] + modes[3:]:
                if mode != "auto":  # auto: constraints.fold_kernel's choice
                    C.fold_kernel = (lambda c, s, paged, keys, m=mode:
                                     m if m.startswith("fwd") else None)
                rt._split_runs.clear()
                rt.split = 0 if mode == "fa4" else 1  # 1: one chunk, i.e. the fold
                try:
                    graphs[mode] = capture(call, calls)
                except fa4aot.ArtifactMissing:  # (no FA4 kernel for it in the store)
                    continue
                finally:
                    C.fold_kernel = serves
                graphs[mode].replay()
                torch.cuda.synchronize()
                outs[mode] = out.clone()
                kind = [(type(r).__name__, getattr(r, "wide", None) or "chunk")
                        for r in rt._split_runs.values() if r]
                if mode == "auto":
                    auto = kind[0][1] if kind else "?"
                elif mode != "fa4" and kind != [("FoldRun", mode)]:
                    raise SystemExit(f"{layout} b{b} sk{sk} {mode}: served by {kind}")
            rt.split = -1
            rt._split_runs.clear()
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                graphs["cudnn"] = capture(lambda: sdpa(qt, kt, vt, enable_gqa=True), calls)
            times = {m: [] for m in graphs}
            for rnd in range(5):
                order = list(graphs) if rnd % 2 == 0 else list(graphs)[::-1]
                for m in order:
                    times[m].append(replay_us(graphs[m], calls))
            med = {m: statistics.median(t) for m, t in times.items()}
            diff = {m: (outs["fwd_wide"].float() - outs[m].float()).abs().max().item()
                    for m in ("chunk", "fwd_wide1", "fa4") if m in outs}
            for m in ("fa4", "fwd_wide1"):
                med.setdefault(m, float("nan"))
                diff.setdefault(m, float("nan"))
            best = min((m for m in ("chunk", "fwd_wide", "fwd_wide1") if m in graphs),
                       key=med.get)
            row = {"layout": layout, "b": b, "sk": sk, "us": med, "wide_maxdiff": diff,
                   "auto": auto, "best": best}
            rows.append(row)
            print(f"{str(layout):>5} b{b:<4} sk{sk:<6} chunk {med['chunk']:8.1f} wide "
                  f"{med['fwd_wide']:8.1f} ({med['fwd_wide'] / med['chunk']:.3f}) wide1 "
                  f"{med['fwd_wide1']:8.1f} ({med['fwd_wide1'] / med['chunk']:.3f}) fa4 "
                  f"{med['fa4']:8.1f} cudnn(dense) {med['cudnn']:8.1f} | wide/cudnn "
                  f"{med['fwd_wide'] / med['cudnn']:.3f} wide1/cudnn "
                  f"{med['fwd_wide1'] / med['cudnn']:.3f} | maxdiff vs chunk "
                  f"{diff['chunk']:.1e} vs wide1 {diff['fwd_wide1']:.1e} vs fa4 "
                  f"{diff['fa4']:.1e} | auto {auto} {med['auto']:8.1f} "
                  f"({med['auto'] / med[best]:.3f} of the best, {best})", flush=True)
            del graphs
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
