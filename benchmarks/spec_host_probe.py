"""Host time of a speculative decode step, dense K against a paged one (varlen q), with a
cProfile of the paged call and torch's sync debug mode on (does any call synchronize?).

    FA4AOT_CACHE_DIR=<store> python benchmarks/spec_host_probe.py [--cells 1:8192:4,...]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time


def main():
    import torch

    import fa4aot

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import decode_inputs, eager_us, graph_us

    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="1:8192:4,1:65536:2,2:32768:4")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    hq, hk, d = 32, 8, 128
    for cell in a.cells.split(","):
        b, sk, sq = (int(x) for x in cell.split(":"))
        q, k, v, out = decode_inputs(b, sk, hq, hk, d, rows=sq)
        cu_q = torch.arange(0, b * sq + 1, sq, device="cuda", dtype=torch.int32)
        used = torch.full((b,), sk, device="cuda", dtype=torch.int32)
        fns = {"dense": lambda: fa4aot.flash_attn_func(q, k, v, causal=True, out=out)}
        for p in (16, 128):
            table = torch.arange(b * sk // p, device="cuda", dtype=torch.int32).view(b, -1)
            kp, vp = k.view(-1, p, hk, d), v.view(-1, p, hk, d)

            def paged(kp=kp, vp=vp, table=table):
                fa4aot.flash_attn_varlen_func(
                    q.view(b * sq, hq, d), kp, vp, cu_seqlens_q=cu_q, max_seqlen_q=sq,
                    max_seqlen_k=sk, page_table=table, seqused_k=used, causal=True,
                    out=out.view(b * sq, hq, d))

            fns[f"paged {p}"] = paged
        for name, fn in fns.items():
            fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(100):
                fn()
            host = (time.perf_counter() - t) / 100 * 1e6
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            fn()
            torch.cuda.set_sync_debug_mode(0)
            print(f"b{b} sk{sk} sq{sq} {name:9s} host {host:6.1f} us  eager {eager_us(fn):7.1f}"
                  f"  graph {graph_us(fn, 5, 10):7.1f}", flush=True)
            if a.profile and name == "paged 16":
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(50):
                    fn()
                pr.disable()
                torch.cuda.synchronize()
                pstats.Stats(pr).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
