"""Where a split decode step's GPU time goes: each kernel's duration (torch.profiler, CUPTI),
fa4aot's split step against torch SDPA's cuDNN backend on the same inputs (H200).

    FA4AOT_CACHE_DIR=<store> python benchmarks/split_profile.py [--out FILE]

bf16 hd128 decode, one query row, dense K/V, causal. Per shape: every kernel a call launches,
with its mean duration over 20 calls (each call alone: synchronized, so no overlap between
calls), and their sum; the rest of a step's graph time is gaps between kernels.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

SHAPES = [  # (batch, s_k, hq, hk)
    (1, 65536, 32, 8), (1, 131072, 8, 1), (2, 32768, 64, 8), (4, 32768, 32, 8),
    (32, 4096, 32, 8), (1, 8192, 32, 8), (1, 1024, 32, 8), (2, 4096, 32, 8), (8, 4096, 32, 8),
]


def kernels(fn, n=20):
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            fn()
            torch.cuda.synchronize()
    per = collections.defaultdict(list)
    for e in p.events():
        if e.device_type.name == "CUDA" and e.device_time > 0:
            per[e.name[:70]].append(e.device_time)
    return {k: (len(v) / n, sum(v) / len(v)) for k, v in per.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fa4aot

    sdpa = torch.nn.functional.scaled_dot_product_attention
    dev, dt = torch.device("cuda"), torch.bfloat16

    def shape(b, sk, hq, hk):
        q = torch.randn(b, 1, hq, 128, device=dev, dtype=dt)
        k = torch.randn(b, sk, hk, 128, device=dev, dtype=dt)
        v = torch.randn(b, sk, hk, 128, device=dev, dtype=dt)
        out = torch.empty_like(q)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        row = {"shape": f"b{b} sk{sk} {hq}:{hk}"}
        row["fa4aot"] = kernels(lambda: fa4aot.flash_attn_func(q, k, v, causal=True, out=out))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            row["cudnn"] = kernels(lambda: sdpa(qt, kt, vt, enable_gqa=True))
        return row

    res = []
    for b, sk, hq, hk in SHAPES:
        row = shape(b, sk, hq, hk)
        res.append(row)
        print(row["shape"], flush=True)
        for side in ("fa4aot", "cudnn"):
            tot = sum(c * t for c, t in row[side].values())
            print(f"  {side}: sum {tot:.1f} us")
            for name, (c, t) in row[side].items():
                print(f"    {c:.0f}x {t:8.1f} us  {name}")
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
