"""Ragged decode steps at run time (policy/ragged.py: the plan): the metadata kernel maps the
batch's keys to equal entries on the GPU, the chunk kernel runs the entries as its batch, the
ragged merge writes the caller's out and LSE. Three launches, no host sync, and every size the
launches take comes from the plan's bounds, so a captured CUDA graph replays for any lengths
under them."""

from __future__ import annotations

import math

import torch

from fa4aot.policy import ragged as RG
from fa4aot.runtime.splitruns import _to_ffi


class RaggedRun:
    """What a ragged step of one shape needs besides its inputs, made once per (device,
    stream, shape) like SplitRun: the bound kernels, the entries' scratch (q rows, lengths or
    bounds, page-table rows, partials, each sequence's first entry) and their kernel-facing
    views. GQA folded and rows packed: query head h = kh * r + g of row t is row g * rows + t
    of KV head kh of the 1:1 chunk kernel, which reads each entry's keys once for all of
    them."""

    fold = packed = False
    ragged = True
    __slots__ = ("rg", "launch", "meta", "merge", "scale", "r", "paged", "used", "meta_args",
                 "qv", "kq", "ko", "kl", "op_m", "lp_m", "first", "out_v", "table_v",
                 "no_sink", "lse_scratch", "out_shape", "lse_shape", "o4", "l3", "q3",
                 "lse_rows", "tail", "len_v")

    def __init__(self, kern, q, b, hq, hk, d, dv, rg: RG.Ragged, page_size, causal, varlen_q,
                 ffi, no_sink, used=False):
        r, w, dvc, rows = hq // hk, rg.entries, q.device, rg.rows
        bb = b * rows  # decode rows
        self.rg, self.r, self.paged, self.used = rg, r, page_size is not None, used
        self.tail = rows if rows > 1 and causal else 0
        self.launch, self.meta, self.merge = kern.launch_split, kern.ragged_meta, kern.ragged_merge
        if used:  # a packed K with seqused_k: each entry's first key and keys
            self.launch, self.meta = kern.launch_used, kern.ragged_meta_used
        self.scale = float(1.0 / math.sqrt(d))
        self.meta_args = (rg.n, rg.align, page_size or 0, rows, int(causal))
        i32, f32 = torch.int32, torch.float32
        # no fill where the step writes all it reads: a fill captured in a graph replays each step
        qv = q.new_empty((w, r, rows, hk, d))  # an entry's rows (g, t) of KV head kh
        op = q.new_empty((w, r * rows, hk, dv))
        kl = torch.empty((w, hk, r * rows), dtype=f32, device=dvc)
        self.first = torch.empty(b + 1, dtype=i32, device=dvc)
        self.table_v = None
        if self.paged:
            self.out_v = torch.empty(w, dtype=i32, device=dvc)
            # zeros: a valid page for rows the metadata kernel leaves unwritten; 16 readable
            # bytes before the first entry, as the TMA paged path needs (abi.GUARD_ALIGN)
            g = torch.zeros(4 + w * max(rg.pages, 1), dtype=i32, device=dvc)
            self.table_v = g[4:].view(w, max(rg.pages, 1))
        else:
            self.out_v = torch.empty(w + 1, dtype=i32, device=dvc)
        self.len_v = torch.empty((w, 1), dtype=i32, device=dvc) if used else None
        self.no_sink = no_sink  # (r, hk) float32 -inf: the merge's sink term without a sink
        self.lse_scratch = torch.empty((bb, r, hk), dtype=f32, device=dvc)
        self.out_shape = (bb, hq, dv) if varlen_q else (b, rows, hq, dv)
        self.lse_shape = (hq, bb) if varlen_q else (b, hq, rows)
        self.o4, self.l3, self.q3 = (bb, r, hk, dv), (bb, r, hk), (bb, hq, d)
        # a batch-form LSE (b, hq, rows) of several rows: written through scratch, viewed
        # (b, rows, r, hk) as the merge's (decode row, r, hk)
        self.lse_rows = (b, rows, r, hk) if rows > 1 and not varlen_q else None
        conv = _to_ffi if ffi else (lambda t: t)
        self.qv = conv(qv.permute(0, 2, 3, 1, 4))  # the metadata kernel's (w, t, kh, g, d)
        self.kq = conv(qv.view(w, r * rows, hk, d))
        self.ko = conv(op)
        self.kl = conv(kl)
        self.op_m = self.ko  # the merge's (entry, M * rows, heads, dv): the same view
        self.lp_m = conv(kl.permute(0, 2, 1))  # (w, r * rows, hk)
        if used:  # (the metadata kernel's first keys: the entries' w; the chunk kernel's: w + 1)
            self.len_v = (conv(self.out_v[:w]), conv(self.len_v), conv(self.len_v[:, 0]))
        self.first, self.out_v = conv(self.first), conv(self.out_v)
        self.table_v = None if self.table_v is None else conv(self.table_v)
        self.no_sink = conv(self.no_sink)


def plan(rt, dev, dtype, b, rows, hk, d, dv, seqlen_k, page_size, sink, causal, kern,
         used=False):
    """The ragged plan of a decode step of `rows` query rows a sequence on split kernel `kern`
    (None: the store lacks it or its ragged parts; the uniform plan then decides); used: over
    a packed K with seqused_k (its own parts: fwd_used, ragged_meta_used)."""
    if kern is None or kern.ragged_meta is None or (used and kern.launch_used is None):
        return None
    _, sms = rt.device(dev)
    return RG.plan_ragged(
        batch=b, rows=rows, kv_heads=hk, seqlen_k=seqlen_k,
        bytes_per_key=(d + dv) * dtype.itemsize,
        page_size=page_size, sink=sink, num_sms=sms, setting=rt.split,
        max_slots=kern.max_slots, causal=causal,
    )


def ragged_step(run: RaggedRun, q, k, v, cu_seqlens_k, seqused_k, page_table, sink,
                softmax_scale, out, lse, return_lse):
    """Serve a decode step on its RaggedRun; None, having launched nothing, where q's rows are
    not 16-byte aligned (the metadata kernel copies them 16 bytes at a time) or a caller's
    out of several rows a sequence does not view as decode rows: the caller runs it unsplit.
    q: (b, rows, hq, d) or (b * rows, hq, d); out / lse: the caller's or None."""
    q3 = q if q.dim() == 3 else q.reshape(run.q3)
    if q3.stride(0) % 8 or q3.stride(1) % 8:
        return None
    if (out is not None and out.dim() == 4 and out.size(1) > 1
            and out.stride(0) != out.size(1) * out.stride(1)):
        return None
    if run.paged:
        run.meta(seqused_k, page_table, q3, run.qv, run.out_v, run.table_v, run.first,
                 *run.meta_args)
        kv = (None, None, None, run.out_v, run.table_v)
    elif run.used:
        run.meta(seqused_k, cu_seqlens_k, q3, run.qv, run.len_v[0], run.len_v[1], run.first,
                 *run.meta_args)
        kv = (None, run.out_v, None, run.len_v[2], None)
    else:
        run.meta(cu_seqlens_k, None, q3, run.qv, run.out_v, None, run.first, *run.meta_args)
        kv = (None, run.out_v, None, None, None)
    run.launch(run.kq, k, v, run.ko, run.kl,
               run.scale if softmax_scale is None else float(softmax_scale), *kv)
    if out is None:
        out = q.new_empty(*run.out_shape)
    if return_lse and lse is None:
        lse = q.new_empty(*run.lse_shape, dtype=torch.float32)
    r, oh = run.r, out.stride(-2)
    so = out.stride(0) if out.dim() == 3 or out.size(1) == 1 else out.stride(1)
    out_m = torch.as_strided(out, run.o4, (so, oh, r * oh, 1))
    if lse is None or run.lse_rows is not None:
        lse_m = run.lse_scratch
    elif lse.dim() == 2:  # a packed q's (hq, b)
        s0, s1 = lse.stride()
        lse_m = torch.as_strided(lse, run.l3, (s1, s0, r * s0))
    else:  # (b, hq, 1)
        lse_m = torch.as_strided(lse, run.l3, (lse.stride(0), lse.stride(1), r * lse.stride(1)))
    if sink is None:
        sk = run.no_sink
    else:
        s = sink if sink.dtype == torch.float32 else sink.float()
        sk = torch.as_strided(s, (r, s.numel() // r), (s.stride(0), r * s.stride(0)))
    run.merge(run.op_m, run.lp_m, run.first, sk, out_m, lse_m, run.rg.rows, run.tail)
    if lse is not None and run.lse_rows is not None:  # (b, hq, rows) <- (b, rows, r, hk)
        s0, s1, s2 = lse.stride()
        torch.as_strided(lse, run.lse_rows, (s0, s2, s1, r * s1)).copy_(
            run.lse_scratch.view(run.lse_rows))
    return out, lse
