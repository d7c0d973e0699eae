"""Does the cost model pick the right split count? Every forced count against the automatic
choice, side by side in one process on the same inputs (H200).

    FA4AOT_CACHE_DIR=<store> python benchmarks/split_sweep.py [--small] --out sweep.json

bf16 hd128 decode, one query row, dense K/V. Per shape and split count n (FA4AOT_SPLIT_KV=n,
through `Runtime.split`): CUDA-graph replay time (5 calls per graph; host excluded) and eager
do_bench median, and torch SDPA's cuDNN backend on the same inputs. "auto" is the cost model's
n. Prints, per shape, the best n in a graph and how far auto's graph time is from it.
--small: short contexts (1K-4K), where the split's fixed costs decide.
--large: batches that (nearly) fill the SMs unsplit (b16-b128), where the plan never splits and
the fold runs at parity with cuDNN: does any split count beat it?
--page P: the issue's paged shapes (PAGED) with K/V in pages of P keys behind a shuffled page
table (flash_attn_varlen_func); cuDNN runs on the same keys gathered dense.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SHAPES = [  # (batch, s_k, hq, hk)
    (1, 65536, 32, 8),
    (1, 131072, 8, 1),
    (2, 32768, 64, 8),
    (4, 32768, 32, 8),
    (1, 8192, 32, 8),
    (1, 4096, 32, 8),
    (2, 4096, 32, 8),
    (4, 4096, 32, 8),
    (2, 16384, 32, 8),
    (8, 4096, 32, 8),
    (8, 16384, 32, 8),
]
COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)
# --small: short contexts, where the split's fixed costs decide (chunks down to 128 keys)
SMALL = [(b, sk, 32, 8) for sk in (1024, 2048, 4096) for b in (1, 2, 4, 8, 16)]
# --large: the grid cells above cuDNN in 2026-12-01-s9-c (the fold, 0.1-1.6% behind)
LARGE = [(16, 65536, 32, 8), (16, 131072, 32, 8), (32, 16384, 32, 8), (32, 65536, 32, 8),
         (32, 4096, 32, 8), (32, 1024, 32, 8), (64, 1024, 32, 8), (128, 1024, 32, 8)]
LARGE_COUNTS = (1, 2, 3, 4, 8, 16, 32)
# --page: the shapes decode_split.py also runs paged
PAGED = [(1, 8192, 32, 8), (1, 65536, 32, 8), (1, 131072, 8, 1), (2, 32768, 64, 8),
         (4, 32768, 32, 8)]
PAGED_COUNTS = (1, 4, 8, 16, 24, 32, 48, 64, 128)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--small", action="store_true", help="the SMALL shapes instead")
    ap.add_argument("--large", action="store_true", help="the LARGE shapes instead")
    ap.add_argument("--page", type=int, help="the PAGED shapes in pages of this many keys")
    a = ap.parse_args()
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import eager_us, graph_us

    import fa4aot
    import fa4aot.runtime as R

    rt = R.default_runtime()
    dt, d = torch.bfloat16, 128
    rows = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shapes, counts = (SMALL, COUNTS) if a.small else (SHAPES, COUNTS)
    if a.large:
        shapes, counts = LARGE, LARGE_COUNTS
    page = a.page
    if page:
        shapes, counts = PAGED, PAGED_COUNTS
    for b, sk, hq, hk in shapes:
        torch.cuda.empty_cache()
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=dt)
        out = torch.empty_like(q)
        if page:
            npg = -(-sk // page)
            kp = torch.randn(b * npg, page, hk, d, device="cuda", dtype=dt)
            vp = torch.randn_like(kp)
            table = torch.randperm(b * npg, device="cuda", dtype=torch.int32).view(b, npg)
            kw = dict(cu_seqlens_q=torch.arange(b + 1, device="cuda", dtype=torch.int32),
                      max_seqlen_q=1, max_seqlen_k=sk, page_table=table, causal=True,
                      seqused_k=torch.full((b,), sk, device="cuda", dtype=torch.int32))
            q2, o2 = q[:, 0], out[:, 0]

            def call():
                return fa4aot.flash_attn_varlen_func(q2, kp, vp, out=o2, **kw)

            k = kp[table.long()].reshape(b, npg * page, hk, d)[:, :sk]
            v = vp[table.long()].reshape(b, npg * page, hk, d)[:, :sk]
        else:
            k = torch.randn(b, sk, hk, d, device="cuda", dtype=dt)
            v = torch.randn_like(k)
            call = lambda: fa4aot.flash_attn_func(q, k, v, causal=True, out=out)  # noqa: E731
        rt.split = -1
        sp = rt.split_for(0, dt, b * hk, sk, d, d, page, False, b)
        auto = sp.n if sp else 1
        ref = call()[0].clone()
        row = {"b": b, "sk": sk, "hq": hq, "hk": hk, "page": page, "auto": auto, "graph": {},
               "eager": {}}
        for n in ("auto",) + counts:
            rt.split = -1 if n == "auto" else n
            if n != "auto":
                sp = rt.split_for(0, dt, b * hk, sk, d, d, page, False, b)
                if n > 1 and (sp is None or sp.n != n):
                    continue  # not a count the plan allows here (chunks under the minimum)
            o = call()[0]
            assert (o.float() - ref.float()).abs().max().item() < 2e-2, (b, sk, n)
            row["graph"][str(n)] = graph_us(call, calls=5, replays=15)
            row["eager"][str(n)] = eager_us(call)
        rt.split = -1
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            cudnn = lambda: sdpa(qt, kt, vt, enable_gqa=True)  # noqa: E731
            cudnn()
            row["cudnn_graph"] = graph_us(cudnn, calls=5, replays=15)
            row["cudnn_eager"] = eager_us(cudnn)
        g = {n: t for n, t in row["graph"].items() if n != "auto"}
        best = min(g, key=g.get)
        row["best_graph"] = best
        row["auto_vs_best_graph"] = row["graph"]["auto"] / g[best]
        e = {n: t for n, t in row["eager"].items() if n != "auto"}
        row["best_eager"] = min(e, key=e.get)
        row["auto_vs_best_eager"] = row["eager"]["auto"] / e[row["best_eager"]]
        print(
            f"b{b} sk{sk} {hq}:{hk}{f' page {page}' if page else ''} auto n={auto}: graph "
            f"{row['graph']['auto']:.1f} "
            f"(best n={best} {g[best]:.1f}, x{row['auto_vs_best_graph']:.2f}); eager "
            f"{row['eager']['auto']:.1f} (best n={row['best_eager']} "
            f"{e[row['best_eager']]:.1f}) | "
            + " ".join(f"{n}:{t:.1f}/{e[n]:.1f}" for n, t in g.items())
            + f" | cudnn {row['cudnn_graph']:.1f}/{row['cudnn_eager']:.1f} (graph/eager)",
            flush=True,
        )
        rows.append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
