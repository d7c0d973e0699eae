"""Where a decode call's host time goes: cProfile over eager calls with the GPU kept busy, per
layout of the same keys (padded KV cache / caller's paged K / dense K), for comparing one
layout's host path with another's (H200).

    FA4AOT_CACHE_DIR=<store> python benchmarks/host_profile.py [--shape b:keys:hq:hk]
        [--calls 2000] [--top 25]

Per column: us per call without the profiler (`_timing.host_us_interleaved`), then the
functions with the most own time per call under cProfile (which slows Python calls, so read
the differences between columns, not the absolute figures).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys


def main():
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import decode_inputs, host_us_interleaved, padded_call, paged_call

    import fa4aot

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1:131072:8:1")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    b, sk, hq, hk = (int(x) for x in a.shape.split(":"))
    d = 128
    q, k, v, out = decode_inputs(b, sk, hq, hk, d)
    cols = {
        "padded": padded_call(q, k, v, out),
        "paged 128": paged_call(q, k, v, out, 128),
        "dense": lambda: fa4aot.flash_attn_func(q, k, v, causal=True, out=out),
    }
    host = host_us_interleaved(cols, n=100, repeats=7)
    print(f"b{b} sk{sk} {hq}:{hk}: host us per call "
          + ", ".join(f"{c} {host[c][0]:.1f}" for c in cols), flush=True)
    for c, fn in cols.items():
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        n = 0
        while n < a.calls:
            torch.cuda._sleep(100_000_000)  # (the GPU busy: launches do not wait on it)
            prof.enable()
            for _ in range(100):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            n += 100
        st = pstats.Stats(prof)
        total = st.total_tt / n * 1e6
        print(f"\n== {c}: {total:.1f} us per call under cProfile; own time per call (us):")
        rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[: a.top]
        for (file, line, name), (cc, nc, tt, ct, _) in rows:
            where = f"{os.path.basename(file)}:{line}" if line else file
            print(f"  {tt / n * 1e6:7.2f} {nc / n:5.1f}x  {name}  ({where})")


if __name__ == "__main__":
    main()
