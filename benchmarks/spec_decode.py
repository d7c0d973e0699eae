"""Speculative decoding (several query rows a sequence): fa4aot's split with the rows packed
(split.plan_packed) against the same split with them unrolled (the plan before it), the
unsplit kernel and torch SDPA's cuDNN backend, on the same inputs, in one process (H200).

    FA4AOT_CACHE_DIR=<store> python benchmarks/spec_decode.py [--out results.json]

Per shape (32:8 hd128 bf16, causal: row t of s_q sees len - s_q + 1 + t keys, FA4's
bottom-right alignment), columns:
- `fa4aot`: the dense K (viewed as its own pages, split.dense_page_size), as planned;
- `packed` / `packed serial`: the same call packed wherever the plan can pack it (the cost
  model's PACKED_EXTRA_S set below zero), its causal tail on a side stream beside the chunks
  (runtime.splitkv.TAIL_STREAM, the default) / after them on the caller's stream;
- `n=N` (with --ns): the same call packed in N chunks (FA4AOT_SPLIT_KV=N: no one-wave cap on
  the chunks and the tail's empty slot);
- `unrolled`: the same call with split.plan_packed off (each row a decode row of its own);
- `paged P` / `paged P unrolled`: the same keys as a caller's paged K (pages of P in sequence
  order, seqused_k; the tail's metadata computed per step), packed and unrolled;
- `varlen`: the same keys as a caller's packed K (cu_seqlens_k): its rows unrolled on the
  chunk kernel's bounds mode (compiler.trace_chunk_modes(bounds=True));
- `unsplit`: FA4AOT_SPLIT_KV=0 (FA4's kernel);
- `cudnn`: torch SDPA unmasked (its is_causal is top-left aligned, a different mask): the
  same bytes read, at most s_q - 1 keys fewer per row computed.
limit: K+V bytes / 4.8 TB/s. Times: CUDA-graph replays and eager (do_bench), medians of three
interleaved rounds (`_timing.interleaved_medians`; packing switched before each column). Each
column's output is compared with the unsplit kernel's (max abs difference).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SHAPES = [(1, 65536, 2), (1, 65536, 4), (1, 8192, 4), (2, 32768, 4), (4, 16384, 2),
          (8, 4096, 4), (1, 131072, 4), (4, 32768, 4), (16, 16384, 4)]
PAGES = (16, 128)


def main():
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import decode_columns, decode_inputs, interleaved_medians

    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fa4aot
    import fa4aot.runtime as R
    from fa4aot.policy import split as S
    from fa4aot.runtime import splitkv as SK

    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--shapes", help="b:keys:rows,... (default: SHAPES)")
    ap.add_argument("--ns", default="", help="forced chunk counts, a column each (e.g. 15,16)")
    a = ap.parse_args()
    shapes = SHAPES if not a.shapes else [
        tuple(int(x) for x in c.split(":")) for c in a.shapes.split(",")]
    rt = R.default_runtime()
    plan_packed = S.plan_packed

    extra_s = S.PACKED_EXTRA_S

    split = rt.split

    def packing(on: bool, tail_stream: bool = True, force: bool = False, n: int = 0):
        S.plan_packed = plan_packed if on else (lambda **kw: None)
        S.PACKED_EXTRA_S = -1.0 if force else extra_s
        SK.TAIL_STREAM = tail_stream
        rt.split = n or split
        rt._split_runs.clear()

    def mode(c: str):
        packing("unrolled" not in c, "serial" not in c, c.startswith("packed"),
                int(c[2:]) if c.startswith("n=") else 0)

    rows = []
    for b, sk, sq in shapes:
        hq, hk, d = 32, 8, 128
        torch.cuda.empty_cache()
        q, k, v, out = decode_inputs(b, sk, hq, hk, d, rows=sq)
        fns = decode_columns(q, k, v, out)
        cols = {"fa4aot": fns["fa4aot"], "packed": fns["fa4aot"],
                "packed serial": fns["fa4aot"], "unrolled": fns["fa4aot"]}
        cols.update({f"n={n}": fns["fa4aot"] for n in a.ns.split(",") if n})
        cu_q = torch.arange(0, b * sq + 1, sq, device="cuda", dtype=torch.int32)
        used = torch.full((b,), sk, device="cuda", dtype=torch.int32)
        for p in PAGES:
            table = torch.arange(b * sk // p, device="cuda", dtype=torch.int32).view(b, -1)
            kp, vp = k.view(-1, p, hk, d), v.view(-1, p, hk, d)

            def paged(kp=kp, vp=vp, table=table, qv=q.view(b * sq, hq, d),
                      ov=out.view(b * sq, hq, d)):
                fa4aot.flash_attn_varlen_func(
                    qv, kp, vp, cu_seqlens_q=cu_q, max_seqlen_q=sq, max_seqlen_k=sk,
                    page_table=table, seqused_k=used, causal=True, out=ov)

            cols[f"paged {p}"] = paged
            cols[f"paged {p} unrolled"] = paged
        cu_k = torch.arange(0, (b + 1) * sk, sk, device="cuda", dtype=torch.int32)

        def varlen(kf=k.view(b * sk, hk, d), vf=v.view(b * sk, hk, d),
                   qv=q.view(b * sq, hq, d), ov=out.view(b * sq, hq, d)):
            fa4aot.flash_attn_varlen_func(
                qv, kf, vf, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=sq,
                max_seqlen_k=sk, causal=True, out=ov)

        cols["varlen"] = varlen
        cols["unsplit"], cols["cudnn"] = fns["unsplit"], fns["cudnn"]
        diff = {}
        packing(True)
        fns["unsplit"]()
        ref = out.clone()
        for c, fn in cols.items():
            if c in ("unsplit", "cudnn"):
                continue
            mode(c)
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            diff[c] = (out.float() - ref.float()).abs().max().item()
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            eager, graph = interleaved_medians(
                cols, 3, before=mode,
                after=lambda: packing(True))
        row = {"b": b, "sk": sk, "sq": sq, "hq": hq, "hk": hk,
               "limit_us": 2 * b * sk * hk * d * 2 / 4.8e6, "eager": eager, "graph": graph,
               "diff": diff}
        rows.append(row)
        print(f"b{b} sk{sk} sq{sq} 32:8  limit {row['limit_us']:.1f}  cudnn "
              f"{eager['cudnn']:.1f}/{graph['cudnn']:.1f} (eager/graph)", flush=True)
        for c in cols:
            if c == "cudnn":
                continue
            e, g = eager[c], graph[c]
            print(f"   {c:18s} eager {e:8.1f} ({e / eager['cudnn']:.3f})  graph {g:8.1f} "
                  f"({g / graph['cudnn']:.3f}, {g / row['limit_us']:.2f}x limit)"
                  + (f"  diff {diff[c]:.1e}" if c in diff else ""), flush=True)
        del q, k, v, out, ref
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
