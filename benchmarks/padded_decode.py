"""Decode over a KV cache in batch form with seqused_k (FA2's flash_attn_with_kvcache layout,
`padded` in a spec): fa4aot's split of it against the same keys as a dense K and torch SDPA's
cuDNN backend, on the same inputs, in one process (H200).

    FA4AOT_CACHE_DIR=<store> python benchmarks/padded_decode.py [--shapes b:keys:hq:hk,...]
        [--out results.json]

Per shape (hd128 bf16, one query row, causal), columns:
- `padded`: flash_attn_varlen_func(q packed, K (b, keys, hk, d), seqused_k = keys): the cache
  split as its own page pool (runtime/splitkv, kind "padded");
- `padded 2x cap`: the same keys at the start of a cache of twice the capacity, max_seqlen_k =
  keys (an over-allocated serving cache; the plan follows max_seqlen_k);
- `paged 128`: the same K as a caller's paged K, pages of 128 in sequence order (seqused_k);
- `dense`: flash_attn_func on the same K (the dense split, as planned);
- `unsplit`: the dense call with FA4AOT_SPLIT_KV=0 (FA4's kernel; the default store has no
  unsplit kernel for the padded layout itself);
- `cudnn`: torch SDPA over the dense K.
limit: K+V bytes / 4.8 TB/s. Times: CUDA-graph replays and eager (do_bench), medians of three
interleaved rounds (`_timing.interleaved_medians`); host: us per call with the GPU kept busy
(`_timing.host_us_interleaved`, 7 rounds). Each column's output is compared with the unsplit
kernel's (max abs difference). --kernels: the CUDA kernels one eager call of each fa4aot column
launches (torch.profiler), for the first shape.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SHAPES = [(1, 65536, 32, 8), (1, 131072, 8, 1), (2, 32768, 64, 8), (4, 32768, 32, 8),
          (32, 4096, 32, 8), (1, 8192, 32, 8), (16, 65536, 32, 8)]


def main():
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import (decode_columns, decode_inputs, host_us_interleaved,
                         interleaved_medians, padded_call, paged_call, print_columns)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--shapes", help="b:keys:hq:hk,... (default: SHAPES)")
    ap.add_argument("--kernels", action="store_true")
    a = ap.parse_args()
    shapes = SHAPES if not a.shapes else [
        tuple(int(x) for x in c.split(":")) for c in a.shapes.split(",")]
    rows = []
    for b, sk, hq, hk in shapes:
        d = 128
        torch.cuda.empty_cache()
        q, k, v, out = decode_inputs(b, sk, hq, hk, d)
        fns = decode_columns(q, k, v, out)
        k2 = torch.empty(b, 2 * sk, hk, d, device="cuda", dtype=k.dtype)
        v2 = torch.empty_like(k2)
        k2[:, :sk], v2[:, :sk] = k, v
        k2[:, sk:].normal_()
        v2[:, sk:].normal_()
        cols = {"padded": padded_call(q, k, v, out),
                "padded 2x cap": padded_call(q, k2, v2, out, sk),
                "paged 128": paged_call(q, k, v, out, 128),
                "dense": fns["fa4aot"], "unsplit": fns["unsplit"], "cudnn": fns["cudnn"]}
        ours = ("padded", "padded 2x cap", "paged 128", "dense")
        fns["unsplit"]()
        ref = out.clone()
        diff = {}
        if a.kernels and not rows:
            from torch.profiler import ProfilerActivity, profile

            for c in ours:
                cols[c]()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    cols[c]()
                    torch.cuda.synchronize()
                names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
                print(f"kernels of one {c} call: {len(names)}: "
                      + "; ".join(n[:60] for n in names), flush=True)
        for c in ours:
            out.fill_(float("nan"))
            cols[c]()
            torch.cuda.synchronize()
            diff[c] = (out.float() - ref.float()).abs().max().item()
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            eager, graph = interleaved_medians(cols, 3)
        host = {c: v[0] for c, v in host_us_interleaved(
            {c: cols[c] for c in ours}, n=100, repeats=7).items()}
        row = {"b": b, "sk": sk, "hq": hq, "hk": hk,
               "limit_us": 2 * b * sk * hk * d * 2 / 4.8e6, "eager": eager, "graph": graph,
               "diff": diff, "host": host}
        rows.append(row)
        print(f"b{b} sk{sk} {hq}:{hk}  limit {row['limit_us']:.1f}  cudnn "
              f"{eager['cudnn']:.1f}/{graph['cudnn']:.1f} (eager/graph)", flush=True)
        print_columns(row, cols, 14, {c: f"host {host[c]:.1f}" for c in ours})
        del q, k, v, out, ref, k2, v2
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
