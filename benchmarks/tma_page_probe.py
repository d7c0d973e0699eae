"""Does a paged split step over pages of 64 keys gain from FA4's TMA paged path? (H200)

    FA4AOT_CACHE_DIR=<store> python benchmarks/tma_page_probe.py [--kernel .gpu-tma/tma_p64.so]

The paged split chunk kernel runs FA4's cp.async paged path for pages of 64 (FA4 takes its TMA
path only where the page size equals the kernel's 128-key tile); its part `fwd_tma`
(constraints.tma_page) is the same kernel with 64-key tiles on the TMA path, which a split step
over pages of 64 runs (SplitKernel.launch_split). Column "p64" runs the cp.async kernel,
"p64_tma" the TMA one: the store's part, or --kernel (built by benchmarks/tma_page_build.py,
as the s15-c run did before the part existed). bf16 hd128 32:8, one decode row,
per cell, 3 interleaved rounds (median of rounds): the dense step (same shape, its own inputs),
pages of 64 on the cp.async kernel ("p64"), the same with the TMA kernel ("p64_tma"; for a step the
plan leaves unsplit, the fold on it, which the runtime does not do), pages of 128 ("p128");
eager (do_bench medians) and CUDA graphs; p64_tma's output against the dense step on the same
(gathered) keys, NaN-poisoned first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

# split steps, then steps the plan leaves unsplit (the fold: b16 on the chunk kernel, 128 CTAs;
# b8/4K, 64)
CELLS = "1:8192,1:16384,1:65536,2:32768,4:32768,8:16384,16:16384,16:65536,8:4096"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel")
    ap.add_argument("--cells", default=CELLS)
    ap.add_argument("--out")
    a = ap.parse_args()
    import torch
    import tvm_ffi

    import fa4aot
    import fa4aot.runtime as R
    from fa4aot.runtime import launch as L

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import decode_inputs, eager_us, graph_us, parse_cells

    rt = R.default_runtime()
    kern = rt.split_kernel(0, torch.bfloat16, 128, 128, 64)
    plan_launch = kern.launch  # the cp.async chunk kernel
    tma_launch = (L.SM90.fwd(tvm_ffi.load_module(a.kernel)["fa4aot_fwd"]) if a.kernel
                  else kern.launch_split)
    if tma_launch is plan_launch:
        raise SystemExit("the store's paged split kernel has no fwd_tma part: pass --kernel")
    dev, dt, hq, hk, d = "cuda", torch.bfloat16, 32, 8, 128

    def paged(b, sk, page):
        npg = -(-sk // page)
        q = torch.randn(b, hq, d, device=dev, dtype=dt)
        kp = torch.randn(b * npg, page, hk, d, device=dev, dtype=dt)
        vp = torch.randn(b * npg, page, hk, d, device=dev, dtype=dt)
        table = torch.randperm(b * npg, device=dev, dtype=torch.int32).view(b, npg)
        kw = dict(cu_seqlens_q=torch.arange(b + 1, device=dev, dtype=torch.int32),
                  max_seqlen_q=1, max_seqlen_k=sk, page_table=table,
                  seqused_k=torch.full((b,), sk, device=dev, dtype=torch.int32), causal=True)
        out = torch.empty_like(q)
        kd = kp[table.long()].reshape(b, npg * page, hk, d)[:, :sk]
        vd = vp[table.long()].reshape(b, npg * page, hk, d)[:, :sk]
        return (lambda: fa4aot.flash_attn_varlen_func(q, kp, vp, out=out, **kw)), out, q, kd, vd

    def use(launch):  # what the page-64 steps run: split (launch_split) and fold (launch)
        kern.launch = kern.launch_split = launch
        rt._split_runs.clear()

    rows = []
    for b, sk in parse_cells(a.cells):
        torch.cuda.empty_cache()
        qd, kd_, vd_, od = decode_inputs(b, sk)
        dense = lambda: fa4aot.flash_attn_func(qd, kd_, vd_, causal=True, out=od)  # noqa: E731
        p64, o64, q64, kd, vd = paged(b, sk, 64)
        p128, _, _, _, _ = paged(b, sk, 128)
        ref = fa4aot.flash_attn_func(q64[:, None], kd, vd, causal=True)[0][:, 0].float()
        use(tma_launch)
        o64.fill_(float("nan"))
        p64()
        torch.cuda.synchronize()
        row = {"b": b, "sk": sk, "tma_nan": bool(o64.isnan().any()),
               "tma_max_diff_vs_dense": (o64.float() - ref).abs().max().item()}
        use(plan_launch)
        o64.fill_(float("nan"))
        p64()
        torch.cuda.synchronize()
        row["plan_max_diff_vs_dense"] = (o64.float() - ref).abs().max().item()
        cols = {"dense": (plan_launch, dense), "p64": (plan_launch, p64),
                "p64_tma": (tma_launch, p64), "p128": (plan_launch, p128)}
        got = {c: {"eager": [], "graph": []} for c in cols}
        for _ in range(3):
            for c, (launch, fn) in cols.items():
                use(launch)
                got[c]["eager"].append(eager_us(fn))
                got[c]["graph"].append(graph_us(fn, calls=5, replays=20))
        use(plan_launch)
        for c in cols:
            row[c] = {m: statistics.median(x) for m, x in got[c].items()}
        rows.append(row)
        de, dg = row["dense"]["eager"], row["dense"]["graph"]
        print(f"b{b} sk{sk}: tma diff {row['tma_max_diff_vs_dense']:.1e} (plan "
              f"{row['plan_max_diff_vs_dense']:.1e}) nan {row['tma_nan']}", flush=True)
        for c in cols:
            e, g = row[c]["eager"], row[c]["graph"]
            print(f"   {c:8s} eager {e:8.1f} ({e / de:.3f})  graph {g:8.1f} ({g / dg:.3f})",
                  flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
