"""Would a split that fills every SM beat the plan where the plan leaves SMs idle? (H200)

    FA4AOT_CACHE_DIR=<store> python benchmarks/balanced_probe.py [--cells 16:65536,...]

bf16 hd128 32:8, one decode row, dense K/V. The plan's steps at long contexts run 128 CTAs
(b16 unsplit, b8 in 2 chunks, b4 in 4, b1 in 16) on the H200's 132 SMs. Splitting each
sequence's KV into n = 132 / gcd(CTAs, 132) chunks makes the CTAs an exact number of waves;
the chunks are whole 128-key tiles, as even as the tiles allow (chunk j starts at tile
floor(j * T / n) of T), not the plan's equal chunks with a short last one. This probe sets
those bounds (patching split.make_split / split.dense_cu_seqlens_k for its own process) and
times, side by side in 3 interleaved rounds, the plan ("auto"), the balanced split
("balanced", FA4AOT_SPLIT_KV=n) and torch SDPA's cuDNN backend: eager (do_bench medians) and
CUDA graphs. Each output is checked against cuDNN's first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

CELLS = "16:16384,16:65536,16:131072,8:131072,4:65536,1:65536,32:131072"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default=CELLS)
    ap.add_argument("--out")
    a = ap.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fa4aot.runtime as R
    from fa4aot import split as S

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import at_split, decode_columns, decode_inputs, eager_us, graph_us, parse_cells

    make_split, tile = S.make_split, 128

    def balanced_split(n, seqlen_k, *, page_size, sink, align=128):
        if page_size is not None:
            return make_split(n, seqlen_k, page_size=page_size, sink=sink, align=align)
        t = -(-max(seqlen_k, 1) // tile)
        n = min(n, t)
        return S.Split(n, -(-t // n) * tile, n + (1 if sink else 0))

    def balanced_cu(torch, batch, seqlen_k, sp, device):
        t = -(-max(seqlen_k, 1) // tile)
        j = torch.arange(sp.slots, device=device, dtype=torch.int64)
        starts = ((j * t) // sp.n * tile).clamp_(max=seqlen_k).to(torch.int32)
        rows = torch.arange(batch, device=device, dtype=torch.int32)[:, None] * seqlen_k + starts
        tail = torch.full((1,), batch * seqlen_k, device=device, dtype=torch.int32)
        return torch.cat([rows.flatten(), tail])

    S.make_split, S.dense_cu_seqlens_k = balanced_split, balanced_cu
    rt = R.default_runtime()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for b, sk in parse_cells(a.cells):
        torch.cuda.empty_cache()
        rt._split_runs.clear()
        q, k, v, out = decode_inputs(b, sk)
        fns = decode_columns(q, k, v, out)
        ctas = b * 8
        n = sms // math.gcd(ctas, sms)
        rt.split = -1
        sp = rt.split_for(0, torch.bfloat16, ctas, sk, 128, 128, None, False, b)
        auto_n = sp.n if sp else 1

        cols = {"auto": at_split(-1, fns["fa4aot"]), "balanced": at_split(n, fns["fa4aot"]),
                "cudnn": fns["cudnn"]}
        row = {"b": b, "sk": sk, "ctas": ctas, "auto_n": auto_n, "balanced_n": n}
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ref = cols["cudnn"]().float()
            for c in ("auto", "balanced"):
                out.fill_(float("nan"))
                cols[c]()
                o = out.transpose(1, 2).float()
                row[f"err_{c}"] = ((o - ref).norm() / ref.norm()).item()
            rt.split = n
            got = rt.split_for(0, torch.bfloat16, ctas, sk, 128, 128, None, False, b)
            rt.split = -1
            row["balanced_plan"] = [got.n, got.chunk, got.slots] if got else None
            eager = {c: [] for c in cols}
            graph = {c: [] for c in cols}
            for rnd in range(3):
                for c in (list(cols) if rnd % 2 == 0 else list(cols)[::-1]):
                    eager[c].append(eager_us(cols[c]))
                    graph[c].append(graph_us(cols[c], calls=5, replays=10))
        for c in cols:
            row[c] = statistics.median(eager[c])
            row[c + "_graph"] = statistics.median(graph[c])
        rows.append(row)
        print(f"b{b:<3} sk{sk:<7} auto n={auto_n:<3} balanced n={n} plan {row['balanced_plan']} | "
              f"eager auto {row['auto']:.1f} balanced {row['balanced']:.1f} cudnn "
              f"{row['cudnn']:.1f} ({row['balanced'] / row['cudnn']:.3f}, auto "
              f"{row['auto'] / row['cudnn']:.3f}) | graph auto {row['auto_graph']:.1f} balanced "
              f"{row['balanced_graph']:.1f} cudnn {row['cudnn_graph']:.1f} "
              f"({row['balanced_graph'] / row['cudnn_graph']:.3f}) | err {row['err_auto']:.1e} "
              f"{row['err_balanced']:.1e}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
