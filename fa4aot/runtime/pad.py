"""Running a call on another variant's kernel: the decode fold (views, no copies) and padding
(query heads per KV group and head dims padded, O and LSE cropped back). See select.py for how
such a plan is chosen and docs/design.md for why each is exact."""

from __future__ import annotations

import math

import torch

from fa4aot.model.fp8 import check_descales


def pad_last2(x: torch.Tensor, hk: int, r: int, r2: int, d2: int) -> torch.Tensor:
    """(..., hk*r, d) -> (..., hk*r2, d2): r2 - r query heads appended to each KV group, d2 - d
    columns to the head dim. The extra columns are zeros (they enter every dot product); the
    extra heads' rows are left uninitialized: attention rows are independent (softmax, LSE and
    P@V are per row) and those rows are cropped from O and LSE, so one copy kernel suffices.
    FP8 (one-byte elements) pads with zero heads instead: an uninitialized byte may encode an
    FP8 NaN, and how FA4's FP8 kernel scales P across a tile's rows has not been read here."""
    d = x.shape[-1]
    if r2 == r and d2 == d:
        return x
    lead = x.shape[:-2]
    y = x.new_empty((*lead, hk, r2, d2))
    if x.element_size() == 1 and r2 > r:
        y[..., r:, :].zero_()
    if d2 > d:
        y[..., d:].zero_()
    copy_wide(y[..., :r, :d], x.reshape(*lead, hk, r, d))
    return y.view(*lead, hk * r2, d2)


def copy_wide(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for same-dtype strided views, moved as 8-byte words where both views allow
    it (contiguous rows of a multiple of 8 bytes, 8-byte aligned): torch's strided copy kernel
    is per element, so 2-byte elements cost it 4x the index math. Bit-for-bit the same copy."""
    if dst.dtype == src.dtype and dst.element_size() < 8:
        try:
            dst, src = dst.view(torch.int64), src.view(torch.int64)
        except RuntimeError:
            pass  # a row not a whole number of aligned words: copy element by element
    dst.copy_(src)


def folded(
    plan, q, k, v, out, lse, softmax_scale, return_lse, varlen, seqlen_k, kv_args, descales=None
):
    """A decode step (one query row per sequence) run on the non-causal kernel of ratio
    `plan.pad.ratio` (`plan.launch`): the call's r query heads per KV group as r / ratio query
    rows (select.py). q, O and a dense call's LSE are strided views; a varlen call's LSE (heads,
    tokens) is the transpose of the kernel's (batch, heads, rows) and takes one copy.
    kv_args: (cu_seqlens_k, seqused_k, page_table), passed through. descales: FP8 (Blackwell)
    (q, k, v) descales or None; the fold keeps the batch and the KV heads, so they pass on as
    they are, checked against the kernel's set; FP8 q/k/v go as uint8 views and O is bfloat16,
    as FA4 lays out an FP8 call (launch.fwd_prepare)."""
    b, hq, d, dv = q.shape[0], q.shape[-2], q.shape[-1], v.shape[-1]
    m = plan.pad.fold
    h2 = hq // m
    extra = {}
    fp8 = q.element_size() == 1
    if fp8:  # (descales with other inputs were refused by the entry point)

        qd, kd, vd = descales or (None, None, None)
        check_descales(
            plan.variant.descales, dtype=q.dtype, batch=b, num_heads_kv=k.shape[-2],
            device=q.device, q_descale=qd, k_descale=kd, v_descale=vd,
        )  # fmt: skip
        extra["descales"] = descales
    if out is None:
        out = q.new_empty((*q.shape[:-1], dv), dtype=torch.bfloat16 if fp8 else q.dtype)
    lf = None
    if return_lse:
        if varlen:
            if lse is None:
                lse = q.new_empty((hq, b), dtype=torch.float32)
            lf = q.new_empty((b, h2, m), dtype=torch.float32)
        else:
            if lse is None:
                lse = q.new_empty((b, hq, 1), dtype=torch.float32)
            lf = lse.view(b, h2, m)
    if b == 0 or seqlen_k == 0:
        return empty(out, lse, None, varlen)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    cu_seqlens_k, seqused_k, page_table = kv_args
    qf = q.view(b, h2, m, d).transpose(1, 2)
    if fp8:  # FA4's export workaround (interface.py 1852-1856)
        qf, k, v = qf.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    plan.launch(
        qf,
        k,
        v,
        out.view(b, h2, m, dv).transpose(1, 2),
        lf,
        float(softmax_scale),
        None,
        cu_seqlens_k,
        None,
        seqused_k,
        page_table,
        **extra,
    )
    if varlen and return_lse:
        lse.copy_(lf.view(b, hq).t())
    return out, lse


def padded(entry, choice, q, k, v, hk, sink, softmax_scale, kw, varlen, out=None, lse=None):
    """Run `entry` on padded inputs with the exact padded variant, crop O and LSE back (into
    the caller's buffers when given)."""
    hq, d, dv = q.shape[-2], q.shape[-1], v.shape[-1]
    r, r2 = hq // hk, choice.ratio
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)  # the caller's head_dim, not the padded one
    qp = pad_last2(q, hk, r, r2, choice.head_dim)
    kp = pad_last2(k, hk, 1, 1, choice.head_dim)
    vp = pad_last2(v, hk, 1, 1, choice.head_dim_v)
    sinkp = None
    if sink is not None:
        # padded heads' sinks: any finite value (their rows are cropped); 0 keeps them tame
        sinkp = torch.nn.functional.pad(sink.reshape(hk, r), (0, r2 - r)).reshape(hk * r2)
    po, pl = entry(
        qp, kp, vp, softmax_scale=softmax_scale, learnable_sink=sinkp, padding=False, **kw
    )
    # crop straight into the caller's buffers (or fresh ones): one copy each, none when nothing
    # was padded
    lead, dv2 = po.shape[:-2], choice.head_dim_v
    if out is None and r2 == r and dv2 == dv:
        out = po
    else:
        if out is None:
            out = po.new_empty((*lead, hq, dv))
        copy_wide(out.view(*lead, hk, r, dv), po.view(*lead, hk, r2, dv2)[..., :r, :dv])
    if pl is not None:
        if lse is None and r2 == r:
            lse = pl
        else:
            if lse is None:
                lse = pl.new_empty((hq, pl.shape[1]) if varlen else (pl.shape[0], hq, pl.shape[2]))
            if varlen:  # (hq2, total_q)
                n = pl.shape[1]
                lse.view(hk, r, n).copy_(pl.view(hk, r2, n)[:, :r])
            else:  # (b, hq2, sq)
                b, n = pl.shape[0], pl.shape[2]
                lse.view(b, hk, r, n).copy_(pl.view(b, hk, r2, n)[:, :, :r])
    return out, lse


def empty(out, lse, sink, varlen):
    out.zero_()
    if lse is not None:
        if sink is None:
            lse.fill_(float("-inf"))
        else:
            lse.copy_(
                sink[:, None].expand_as(lse) if varlen else sink[None, :, None].expand_as(lse)
            )
    return out, lse
