"""Would FA4's Ampere forward (FlashAttentionForwardSm80: mma.sync, cp.async, one warp per CTA,
a 16-row M tile) stream a split decode step faster than the sm90 chunk kernel? (H200)

    FA4AOT_CACHE_DIR=<store> python benchmarks/warp_probe.py --kernels .gpu-warp [--cells ...]

The kernels in --kernels (warp_<tile_m>x<tile_n>x<stages>x<threads>.so, built by
benchmarks/warp_build.py with the chunk modes of compiler.trace_chunk_modes, so they take the
chunk kernel's ABI) replace the split kernel's `launch` for their columns, at the split counts
listed per cell. bf16 hd128 32:8, one decode row, dense K/V. Per cell, side by side: the plan
("auto"), torch SDPA's cuDNN backend, and each (kernel, n); eager (do_bench medians) and CUDA
graphs; each output against cuDNN's (max abs difference; out poisoned with NaN first).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

CELLS = "16:16384,16:65536,16:131072,32:131072,64:131072,8:65536,4:32768,1:65536,16:4096,128:16384"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", required=True)
    ap.add_argument("--cells", default=CELLS)
    ap.add_argument("--out")
    a = ap.parse_args()
    import torch
    import tvm_ffi
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fa4aot.runtime as R
    from fa4aot.runtime import launch as L

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import at_split, decode_columns, decode_inputs, eager_us, graph_us, parse_cells

    rt = R.default_runtime()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kern = rt.split_kernel(0, torch.bfloat16, 128, 128, None)
    orig = (kern.launch, kern.launch_wide, kern.launch_wide1)
    warps = {}
    for f in sorted(os.listdir(a.kernels)):
        if f.endswith(".so"):
            tm, tn, st, th = (int(x) for x in f[5:-3].split("x"))
            smem = (tm * 128 + 2 * tn * 128 * st) * 2
            per_sm = min(227 * 1024 // (smem + 1024), 32)
            fn = tvm_ffi.load_module(os.path.join(a.kernels, f))["fa4aot_fwd"]
            warps[f[:-3]] = (L.SM90.fwd(fn), per_sm)

    def use(launch):  # the chunk kernel of split steps (launch_split) and of the fold (launch)
        kern.launch, kern.launch_wide, kern.launch_wide1 = launch
        kern.launch_split = launch[0]
        rt._split_runs.clear()

    rows = []
    for b, sk in parse_cells(a.cells):
        torch.cuda.empty_cache()
        q, k, v, out = decode_inputs(b, sk)
        fns = decode_columns(q, k, v, out)
        rt.split = -1
        sp = rt.split_for(0, torch.bfloat16, b * 8, sk, 128, 128, None, False, b)
        row = {"b": b, "sk": sk, "auto_n": sp.n if sp else 1,
               "limit_us": 2 * b * sk * 8 * 128 * 2 / 4.8e6, "cols": {}}
        cols = {}
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ref = fns["cudnn"]().float()
            use(orig)
            cols["auto"] = (orig, fns["fa4aot"])
            for name, (launch, per_sm) in warps.items():
                ns = sorted({max(1, min(128, round(sms * per_sm * w / (8 * b))))
                             for w in (1, 2, 3, 4)})
                for n in ns:
                    cols[f"{name} n={n}"] = ((launch, None, None), at_split(n, fns["fa4aot"]))
            for c, (launch, fn) in cols.items():
                use(launch)
                out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                diff = (out.float().transpose(1, 2) - ref).abs().max().item()
                e, g = eager_us(fn), graph_us(fn)
                row["cols"][c] = {"eager": e, "graph": g, "diff": diff}
            row["cols"]["cudnn"] = {"eager": eager_us(fns["cudnn"]), "graph": graph_us(fns["cudnn"])}
            use(orig)
            e, g = eager_us(fns["fa4aot"]), graph_us(fns["fa4aot"])
            row["cols"]["auto2"] = {"eager": e, "graph": g}
        cd = row["cols"]["cudnn"]
        print(f"b{b} sk{sk} auto n={row['auto_n']} limit {row['limit_us']:.1f}  cudnn "
              f"{cd['eager']:.1f}/{cd['graph']:.1f}", flush=True)
        best = min((x for x in row["cols"].items()), key=lambda kv: kv[1]["eager"])
        for c, x in sorted(row["cols"].items(), key=lambda kv: kv[1]["eager"]):
            print(f"   {c:28s} eager {x['eager']:8.1f} ({x['eager'] / cd['eager']:.3f})  graph "
                  f"{x['graph']:8.1f} ({x['graph'] / cd['graph']:.3f})"
                  + (f"  diff {x['diff']:.1e}" if "diff" in x else ""), flush=True)
        row["best_eager"] = best[0]
        rows.append(row)
        del q, k, v, out, ref
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
