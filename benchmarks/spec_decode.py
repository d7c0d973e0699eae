"""Speculative decoding over a dense KV (several query rows a sequence): fa4aot's split (the
dense K viewed as its own pages, split.dense_page_size) against the unsplit kernel and torch
SDPA's cuDNN backend, on the same inputs, in one process (H200).

    FA4AOT_CACHE_DIR=<store> python benchmarks/spec_decode.py [--out results.json]

fa4aot runs causal (row t of s_q sees len - s_q + 1 + t keys, FA4's bottom-right alignment);
cuDNN runs unmasked (torch SDPA's is_causal is top-left aligned, a different mask): the same
bytes read, at most s_q - 1 keys fewer per row computed. Times: CUDA-graph replays, medians of
three interleaved rounds (`_timing.graph_us`), and eager (`_timing.eager_us`)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def main():
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import decode_columns, decode_inputs, eager_us, graph_us

    from torch.nn.attention import SDPBackend, sdpa_kernel

    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    for b, sk, sq in [(1, 65536, 2), (1, 65536, 4), (1, 8192, 4), (2, 32768, 4), (4, 16384, 2),
                      (8, 4096, 4)]:
        hq, hk, d = 32, 8, 128
        torch.cuda.empty_cache()
        q, k, v, out = decode_inputs(b, sk, hq, hk, d, rows=sq)
        fns = decode_columns(q, k, v, out)
        ours, unsplit = fns["fa4aot"], fns["unsplit"]
        ours()
        o1 = out.clone()
        unsplit()
        diff = (o1.float() - out.float()).abs().max().item()
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            g = {n: [] for n in fns}
            e = {n: [] for n in fns}
            for rnd in range(3):
                for n in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
                    g[n].append(graph_us(fns[n], calls=5, replays=9))
                    e[n].append(eager_us(fns[n]))
        row = {"b": b, "sk": sk, "sq": sq, "hq": hq, "hk": hk,
               "kv_mb": b * sk * hk * d * 4 / 1e6, "max_diff_vs_unsplit": diff}
        for n in fns:
            row[f"{n}_graph"] = statistics.median(g[n])
            row[n] = statistics.median(e[n])
        rows.append(row)
        print(f"b{b} sk{sk} sq{sq} 32:8: graph fa4aot {row['fa4aot_graph']:.1f} unsplit "
              f"{row['unsplit_graph']:.1f} cudnn {row['cudnn_graph']:.1f} | eager fa4aot "
              f"{row['fa4aot']:.1f} unsplit {row['unsplit']:.1f} cudnn {row['cudnn']:.1f} | "
              f"diff vs unsplit {diff:.1e}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
