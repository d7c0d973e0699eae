"""Does the L2 promotion of FA4's TMA descriptors cost a decode step DRAM efficiency? (H200)

    gcc -O2 -shared -fPIC -I/usr/local/cuda/include -o /tmp/l2promo_shim.so \\
        benchmarks/l2promo_shim.c -ldl
    LD_PRELOAD=/tmp/l2promo_shim.so FA4AOT_CACHE_DIR=<store> \\
        python benchmarks/l2promo_probe.py --out l2promo.json

FA4's sm90 forward loads a 128-key K or V tile at hd128 as two TMA boxes of 64 columns (128 B of
each key's 256-byte head slice per box, 128B swizzle), so each key's slice reaches DRAM as two
128-byte requests from two instructions. A descriptor's L2 promotion sets how much L2 fetches per
miss; CuTe-DSL builds the descriptors inline in the host code, with no option for it. The shim
(benchmarks/l2promo_shim.c, an experiment's LD_PRELOAD, not part of fa4aot) rewrites the
promotion field of every TMA descriptor launched through the CuTe runtime, and this script
times the same fa4aot call with the descriptors as built ("built") and with each promotion
forced, beside torch SDPA's cuDNN backend, in one process on the same inputs: eager
(do_bench medians) and CUDA graphs (captured with the setting in force), in 3 alternating rounds,
medians. It first reports the promotion the built descriptors carry, and checks each setting's
output bit-identical to the built one's.

bf16 hd128 32:8, one query row, causal, dense K/V: the cells where the plan leaves 128 (b16) or
256 (b32) CTAs on 132 SMs and streams at the HBM limit, and two split cells.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys

CELLS = [(16, 16384), (16, 65536), (16, 131072), (32, 131072), (64, 65536), (8, 65536),
         (1, 65536)]
NAMES = {0: "none", 1: "64B", 2: "128B", 3: "256B"}
ROUNDS = 3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--cells", help="b:keys[,b:keys...] (default: %s)" % CELLS)
    ap.add_argument("--modes", default="3,2,0", help="promotions to force (0 none .. 3 256B)")
    a = ap.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import decode_columns, decode_inputs, eager_us, graph_us, parse_cells

    shim = ctypes.CDLL(None)
    try:
        setp, seen, patched = shim.l2promo_set, shim.l2promo_seen, shim.l2promo_patched
    except AttributeError:
        sys.exit("run with LD_PRELOAD=<l2promo_shim.so> (see the docstring)")
    patched.restype = ctypes.c_long
    torch.zeros(1, device="cuda")  # a current context: the shim encodes maps to learn the field
    r = setp(-1)
    if r < -1:
        sys.exit(f"the shim could not learn the descriptor's promotion field ({r})")
    modes = [int(m) for m in a.modes.split(",")]
    cells = parse_cells(a.cells) if a.cells else CELLS
    res = {"device": torch.cuda.get_device_name(), "cells": []}

    def at(mode, fn):
        def call():
            setp(mode)
            try:
                return fn()
            finally:
                setp(-1)
        return call

    for b, sk in cells:
        torch.cuda.empty_cache()
        q, k, v, out = decode_inputs(b, sk)
        base = decode_columns(q, k, v, out)
        ours, cudnn = base["fa4aot"], base["cudnn"]
        out.fill_(float("nan"))
        seen()
        ours()
        torch.cuda.synchronize()
        mask = seen()
        row = {"b": b, "sk": sk, "built_promotion": [NAMES.get(p, "unknown") for p in range(5)
                                                     if mask >> p & 1]}
        for f in ("calls", "tmaps", "err"):
            row["shim_" + f] = getattr(shim, "l2promo_" + f)()
        print({k: v for k, v in row.items() if k.startswith("shim_")}, flush=True)
        ref = out.clone()
        cols = {"built": ours}
        for m in modes:
            cols[NAMES[m]] = at(m, ours)
            out.fill_(float("nan"))
            n0 = patched()
            cols[NAMES[m]]()
            torch.cuda.synchronize()
            row[f"{NAMES[m]}_patched"] = patched() - n0
            row[f"{NAMES[m]}_identical"] = bool(torch.equal(out, ref))
        cols["cudnn"] = cudnn
        eager = {c: [] for c in cols}
        graph = {c: [] for c in cols}
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            for i in range(ROUNDS):
                names = list(cols) if i % 2 == 0 else list(cols)[::-1]
                for c in names:
                    eager[c].append(eager_us(cols[c]))
                    if c in ("built", "cudnn"):
                        graph[c].append(graph_us(cols[c], calls=5, replays=10))
                    else:  # the descriptors are captured with the setting in force
                        m = [k for k, n in NAMES.items() if n == c][0]
                        setp(m)
                        try:
                            graph[c].append(graph_us(ours, calls=5, replays=10))
                        finally:
                            setp(-1)
        for c in cols:
            row[c] = statistics.median(eager[c])
            row[c + "_graph"] = statistics.median(graph[c])
        row["rounds"] = {c: [round(x, 2) for x in eager[c]] for c in cols}
        res["cells"].append(row)
        line = f"b{b:<3} sk{sk:<7} built={'/'.join(row['built_promotion'])}"
        for c in cols:
            line += f" {c} {row[c]:.1f}/{row[c + '_graph']:.1f}"
        line += "  vs cudnn (eager/graph):"
        for c in cols:
            if c != "cudnn":
                line += (f" {c} {row[c] / row['cudnn']:.3f}/"
                         f"{row[c + '_graph'] / row['cudnn_graph']:.3f}")
        line += " identical " + ",".join(
            f"{NAMES[m]}:{row[NAMES[m] + '_identical']}({row[NAMES[m] + '_patched']})"
            for m in modes)
        print(line, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
