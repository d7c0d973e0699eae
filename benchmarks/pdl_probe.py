"""Does programmatic dependent launch (PDL) shorten a split decode step? (H200)

    FA4AOT_CACHE_DIR=<store> python benchmarks/pdl_probe.py --kernels DIR [--cells ...]

A dense split step is two kernels on one stream: the chunk kernel (or the wide split kernel)
and fa4aot's merge, and before them the caller's last kernel. Between kernels the GPU drains
one grid and then launches the next. A PDL secondary launches as the previous grid's CTAs exit
and waits in griddepcontrol.wait before it reads. The kernels in DIR (benchmarks/pdl_build.py,
launched plainly, or the merge as a PDL secondary) replace the step's kernels in these columns,
side by side in one process on the same inputs:

- `store`: the store's kernels as served (since compiler._pdl_secondary, every one a PDL
  secondary);
- `plain`: every kernel launched plainly (chunk_plain.so, wide_plain.so, merge_plain.so, and
  the fold's fold_plain.so, fold1_plain.so: what the store shipped before this session);
- `merge-pdl`: those chunk kernels with the merge as a PDL secondary (merge_pdl.so: the store
  of 9a5d6d5);
- `cudnn`: torch SDPA's cuDNN backend.

(2026-12-02-s17-a/b ran an earlier column set: `base` / `store` the store's kernels, `plain`,
`pdl` (the PDL merge), `trig+pdl` and `trig` (chunk kernels running
griddepcontrol.launch_dependents at each CTA's first tile).) Columns alternate in 3 rounds
(order reversed every other round); eager (do_bench) and CUDA graph medians. Each column's
output, on a NaN-poisoned out, is compared with `store`'s: they must be bit-identical (the same
arithmetic). bf16 hd128 32:8, one query row, causal, dense K/V.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

CELLS = "1:8192,2:65536,4:65536,2:131072,8:16384,16:1024,16:16384,16:65536,32:16384"
ROUNDS = 3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", required=True)
    ap.add_argument("--cells", default=CELLS)
    ap.add_argument("--out")
    a = ap.parse_args()
    import torch
    import tvm_ffi
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fa4aot.runtime as R
    from fa4aot.runtime import launch as L

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import (decode_columns, decode_inputs, interleaved_medians, parse_cells,
                         print_columns)

    def so(name, fn):
        return tvm_ffi.load_module(os.path.join(a.kernels, name + ".so"))[fn]

    rt = R.default_runtime()
    kern = rt.split_kernel(0, torch.bfloat16, 128, 128, None)
    if kern.launch_wide_split is None or not kern.fa4aot_merge:
        sys.exit("the store's split kernel lacks fwd_wide_split or fa4aot's merge")
    names = ("launch_split", "launch_wide_split", "launch", "launch_wide", "launch_wide1")
    store = (*(getattr(kern, n) for n in names), kern.merge)
    plain = tuple(L.SM90.fwd(so(f, "fa4aot_fwd")) for f in (
        "chunk_plain", "wide_plain", "chunk_plain", "fold_plain", "fold1_plain"))
    kernels = {
        "store": store,
        "plain": (*plain, L.fa4aot_merge(so("merge_plain", "fa4aot_merge"))),
        "merge-pdl": (*plain, L.fa4aot_merge(so("merge_pdl", "fa4aot_merge"))),
    }

    def use(k):  # a step's kernels: the split's and the fold's (bound when a run is made)
        for n, launch in zip(names, k[:-1]):
            setattr(kern, n, launch)
        kern.merge = k[-1]
        rt._split_runs.clear()

    rows = []
    for b, sk in parse_cells(a.cells):
        torch.cuda.empty_cache()
        q, k, v, out = decode_inputs(b, sk)
        fns = decode_columns(q, k, v, out)
        rt.split = -1
        sp = rt.split_for(0, torch.bfloat16, b * 8, sk, 128, 128, None, False, b, one_row=True)
        row = {"b": b, "sk": sk, "n": sp.n if sp else 1, "wide": bool(sp and sp.wide),
               "diff": {}, "eager": {}, "graph": {}}
        outs = {}
        for c, ks in kernels.items():
            use(ks)
            out.fill_(float("nan"))
            fns["fa4aot"]()
            torch.cuda.synchronize()
            outs[c] = out.clone()
        use(store)
        for c in kernels:
            row["diff"][c] = (outs[c].float() - outs["store"].float()).abs().max().item()
        cols = {**{c: fns["fa4aot"] for c in kernels}, "cudnn": fns["cudnn"]}
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            row["eager"], row["graph"] = interleaved_medians(
                cols, ROUNDS, before=lambda c: use(kernels.get(c, store)),
                after=lambda: use(store))
        ce, cg = row["eager"]["cudnn"], row["graph"]["cudnn"]
        print(f"b{b} sk{sk} n={row['n']}{'w' if row['wide'] else ''}  cudnn {ce:.1f}/{cg:.1f}",
              flush=True)
        print_columns(row, kernels, 9)
        rows.append(row)
        del q, k, v, out, outs
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
