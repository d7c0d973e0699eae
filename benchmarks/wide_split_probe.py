"""Do split steps gain from two CTAs per SM? (H200)

    FA4AOT_CACHE_DIR=<store> python benchmarks/wide_split_probe.py --out wide-split.json

The plan splits a long-context decode step at b1-b8 (32:8) into n chunks so that b * 8 * n CTAs
fill one wave at one CTA per SM (128 CTAs on 132 SMs), on the chunk kernel (128-key tiles). At
b4/4K cuDNN launches 256 CTAs of 128 threads and 86 KB, two per SM (benchmarks/kernel_probe.py,
2026-12-02-s16-c-smoke). This times, side by side in one process on the same inputs: the plan
("auto": since `fwd_wide_split`, split.wide_split may already put the step on it); the chunk
kernel at 2n chunks (two waves at one CTA per SM); the chunks on the part `fwd_wide_split`
(`fwd_wide` compiled through the chunk modes: 64-key tiles, two CTAs per SM) at n and 2n; torch
SDPA's cuDNN backend. Columns alternate in 3 rounds (order reversed every other round), eager
do_bench and CUDA-graph medians; each column's output is compared with the plan's (max abs
difference), and a column that differs by more than 1e-2 is reported and not timed. (In
2026-12-02-s16-d, before `fwd_wide_split`, the wide columns ran `fwd_wide`, which lacks the
chunk modes: wrong outputs, diffs 3e-2 to inf, timed then.) n: the chunk kernel's plan
(split.plan_split without wide). --wide-ns N,...: the wide kernel at those chunk counts instead
(`wide n=1`: the step unsplit, i.e. the fold). --chunk-ns N,...: also the chunk kernel at those
counts (0: unsplit), e.g. the one-wave plan the wide split replaced.
bf16 hd128 32:8, one query row, causal, dense K/V (--varlen: also as varlen K).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

CELLS = "1:65536,2:65536,4:65536,8:65536,2:131072,4:131072,8:131072,8:16384"
ROUNDS = 3


def varlen_call(q, k, v, out):
    """fa4aot.flash_attn_varlen_func on the dense inputs' packed views (no copies), writing
    `out`: every sequence holds the bound's keys."""
    import torch

    import fa4aot

    b, sk, hk, d = k.shape
    cu_q = torch.arange(b + 1, device=q.device, dtype=torch.int32)
    cu_k = cu_q * sk
    qv, kv, vv, ov = (t.view(-1, *t.shape[2:]) for t in (q, k, v, out))

    def call():
        fa4aot.flash_attn_varlen_func(qv, kv, vv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      max_seqlen_q=1, max_seqlen_k=sk, causal=True, out=ov)

    return call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default=CELLS)
    ap.add_argument("--wide-ns", help="comma-separated chunk counts: the columns `wide n=N` "
                    "(N=1: the unsplit step, the fold) instead of the chunk kernel's at 2n and "
                    "the wide kernel's at n and 2n")
    ap.add_argument("--chunk-ns", help="comma-separated chunk counts: also the columns "
                    "`chunk n=N` (the chunk kernel, 128-key tiles, one CTA per SM; N=0: the "
                    "step unsplit, FA4AOT_SPLIT_KV=0; N=auto: the chunk kernel's own plan)")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--varlen", action="store_true",
                    help="add the same step over the K as varlen (cu_seqlens_k, the dense K's "
                    "packed view): `varlen auto` (its plan, wide where split.wide_split says) "
                    "and `varlen n=N` (the chunk kernel's plan: before the wide split took "
                    "varlen K; n=1, the fold)")
    ap.add_argument("--paged-kernel", help="a paged wide split kernel (.so from "
                    "wide_chunk_build.py --page P): add the step over the K as pages of "
                    "--page (seqused_k, the table in sequence order): `paged auto` (its plan) "
                    "and `paged wide n=N` at --wide-ns")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--paged", action="store_true", help="add the step over the K as pages of "
                    "--page: `paged auto` (its plan, wide where split.wide_split says) and "
                    "`paged n=N` (the chunk kernel's plan, as before the paged wide split); "
                    "with --wide-ns, also `paged wide n=N` on the store's paged wide split "
                    "kernel")
    ap.add_argument("--out")
    a = ap.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fa4aot.runtime as R

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import (at_split, decode_columns, decode_inputs, interleaved_medians,
                         paged_call, parse_cells, print_columns)

    rt = R.default_runtime()
    kern = rt.split_kernel(0, torch.bfloat16, 128, 128, None)
    if kern.launch_wide_split is None:
        sys.exit("the store's split kernel has no part fwd_wide_split (fa4aot build adds it)")
    chunk = kern.launch_split
    pk = pwide = None
    if a.paged_kernel:
        import tvm_ffi

        from fa4aot.runtime import launch as L

        pk = rt.split_kernel(0, torch.bfloat16, 128, 128, a.page)
        pchunk = pk.launch_split
        pwide = L.SM90.fwd(tvm_ffi.load_module(a.paged_kernel)["fa4aot_fwd"], guard=False)
    elif a.paged and a.wide_ns:
        # the store's paged wide split kernel (fwd_wide_split of the paged chunk kernel)
        pk = rt.split_kernel(0, torch.bfloat16, 128, 128, a.page)
        pchunk, pwide = pk.launch_split, pk.launch_wide_split
        if pwide is None:
            sys.exit(f"the store's paged split kernel (pages of {a.page}) has no fwd_wide_split")

    def use(launch):  # the split's chunks on `launch` (a SplitRun binds it when made)
        kern.launch_split = launch
        if pk is not None:  # (the paged columns' wide kernel: launch is pwide)
            pk.launch_split = pwide if launch is pwide else pchunk
        rt._split_runs.clear()

    rows = []
    for b, sk in parse_cells(a.cells):
        torch.cuda.empty_cache()
        q, k, v, out = decode_inputs(b, sk)
        fns = decode_columns(q, k, v, out)
        rt.split = -1
        sp = rt.split_for(0, torch.bfloat16, b * 8, sk, 128, 128, None, False, b)
        n = sp.n if sp else 1
        plan = rt.split_for(0, torch.bfloat16, b * 8, sk, 128, 128, None, False, b, one_row=True)
        cols = {"auto": (chunk, fns["fa4aot"])}  # name: (chunk launcher, the call)
        if a.wide_ns:
            for w in (int(x) for x in a.wide_ns.split(",")):
                cols[f"wide n={w}"] = (kern.launch_wide_split, at_split(w, fns["fa4aot"]))
        else:
            cols[f"chunk n={2 * n}"] = (chunk, at_split(2 * n, fns["fa4aot"]))
            cols[f"wide n={n}"] = (kern.launch_wide_split, at_split(n, fns["fa4aot"]))
            cols[f"wide n={2 * n}"] = (kern.launch_wide_split, at_split(2 * n, fns["fa4aot"]))
        for c in (a.chunk_ns.split(",") if a.chunk_ns else ()):
            m = n if c == "auto" else int(c)
            cols[f"chunk n={m}"] = (chunk, at_split(m if m > 1 else 0, fns["fa4aot"]))
        if a.varlen:
            vfn = varlen_call(q, k, v, out)
            cols["varlen auto"] = (chunk, vfn)
            cols[f"varlen n={n}"] = (chunk, at_split(n, vfn))
        if pk is not None or a.paged:
            pfn = paged_call(q, k, v, out, a.page)
            cols["paged auto"] = (chunk, pfn)
            cols[f"paged n={n}"] = (chunk, at_split(n, pfn))
        if pk is not None:
            for w in (int(x) for x in (a.wide_ns or "8,16").split(",")):
                if w > 1:
                    cols[f"paged wide n={w}"] = (pwide, at_split(w, pfn))
        cols["cudnn"] = (chunk, fns["cudnn"])
        row = {"b": b, "sk": sk, "auto_n": n, "diff": {}, "eager": {}, "graph": {}}
        use(chunk)
        fns["fa4aot"]()
        ref = out.clone()
        for c, (launch, fn) in cols.items():
            if c in ("auto", "cudnn"):
                continue
            use(launch)
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            row["diff"][c] = (out.float() - ref.float()).abs().max().item()
        use(chunk)
        # a column whose output is not the plan's (beyond the chunking's rounding) computed
        # something else: not timed (2026-12-02-s16-d: fwd_wide takes FA4's ABI without the
        # chunk modes, so a split's chunks on it read the wrong keys; the diffs were 3e-2-inf)
        wrong = [c for c, d in row["diff"].items() if not d <= 1e-2]
        for c in wrong:
            print(f"b{b} sk{sk} {c}: output differs from the plan's by {row['diff'][c]:.1e}: "
                  "not timed", flush=True)
            del cols[c]
        row["wrong"] = wrong
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            row["eager"], row["graph"] = interleaved_medians(
                {c: fn for c, (_, fn) in cols.items()}, a.rounds,
                before=lambda c: use(cols[c][0]), after=lambda: use(chunk))
        ce, cg = row["eager"]["cudnn"], row["graph"]["cudnn"]
        print(f"b{b} sk{sk} chunk plan n={n}, auto n={plan.n if plan else 1}"
              f"{'w' if plan and plan.wide else ''}  cudnn {ce:.1f}/{cg:.1f}", flush=True)
        print_columns(row, cols, 16)
        rows.append(row)
        del q, k, v, out, ref
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
