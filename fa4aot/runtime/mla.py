"""Absorbed MLA (FA4's `qv`) on Blackwell: `flash_attn_varlen_func(q, k, v, qv=...)` served from
the stored MLA kernels (fa4aot/build/mla.py builds them), exact or with its head ratio padded.

The form the stored kernels take (compile_keys.mla_features): q (total_q, h, 64) rope part and qv
(total_q, h, 512) latent part, packed with cu_seqlens_q; one latent K/V head, K (.., 1, 64) and
V (.., 1, 512) packed with cu_seqlens_k or paged (page_table + seqused_k); causal or not, LSE
or not; bf16/fp16. LSE is FA4's qv layout, heads last: (total_q, h).

- validate: the entry point's varlen checks for q/k/v, then qv's and the output buffers'
  (`validate.check_mla`: O must be 32-byte aligned, as FA4 compiles O with dv 512);
  what fa4aot does not model (head dims other than 64/512, several latent heads, FP8 with
  descales, windows, sinks, softcap, seqused_q) is refused by `mla_features` at planning, as
  UnsupportedVariant naming each feature;
- plan: `plan.resolve`, as every call: the call's own variant (its route, 2CTA / 1CTA /
  1CTA-kb64, read from batch x heads against the device's SM count, as FA4 reads it), else
  select.choose's cheapest padded ratio. A ratio FA4's 2CTA kernel refuses (GLM-4.7-Flash's 20,
  10, 5) has no variant of its own and is always padded (20 -> 32, 10 -> 16, 5 -> 8 with the
  default builds): each latent group's query heads get zero heads (q and qv), the padded
  call runs exactly, and O and LSE are cropped back into the caller's buffers (SGLang's
  `_pad_mla_q_heads` / `_unpad_mla_result`). Heads are independent rows of attention and the
  softmax scale, 1/sqrt(64 + 512), does not depend on them: the crop is the unpadded result;
- launch: `launch.fwd_prepare` (as FA4 lays the call out) and the plan's MLA launcher
  (`abi.bind_mla_fwd` over `abi.launch_mla`: FA4's 20 slots).

Never split: FA4 splits MLA only on its 1CTA kernel with its own plan (`_mla_fwd_plan`), which
fa4aot does not build, and its public default is num_splits=1; FA4AOT_SPLIT_KV is not read here.
Inputs the kernel cannot take as they are (a base or a stride not 16-byte aligned, a strided
last dim) are copied as FA4's `maybe_contiguous` does (refused if the caller denied copies with
padding=False); aligned strided views are passed as FA4 passes them.
"""

from __future__ import annotations

import torch

from fa4aot.errors import UnsupportedVariant
from fa4aot.model.compile_keys import CallFeatures
from fa4aot.policy.select import pad_heads
from fa4aot.runtime import launch as L
from fa4aot.runtime import pad as X
from fa4aot.runtime import plan as P
from fa4aot.runtime import validate as V

BATCH_FORM = (
    "qv with q in batch form (b, s_q, h, d): the stored MLA kernels take q packed, through "
    "flash_attn_varlen_func with cu_seqlens_q: pass q.reshape(b * s_q, h, 64) and qv likewise, "
    "cu_seqlens_q = arange(0, (b + 1) * s_q, s_q) (int32) and max_seqlen_q = s_q"
)
# The plan-cache key's query-length bound: every boundary FA4's MLA kernels have (route at 64
# rows, Q stages and one M tile at 128 and 256 rows) lies below 257 rows, and rows >= length
_ROWS_CAP = 257


def varlen(
    rt, q, k, v, qv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
    seqused_k, page_table, softmax_scale, causal, window_size, learnable_sink, return_lse, out,
    lse, padding, softcap, pack_gqa, q_descale, k_descale, v_descale, checked=None,
):  # fmt: skip
    """flash_attn_varlen_func with qv (see the module docstring) -> (out, lse). checked: the
    padded call's re-entry from _padded, (dev, batch, total_q, seqlen_k, hk, d, dv,
    page_size) of the outer call, whose checks hold for it (fresh, contiguous padded q and
    qv; no out or lse; no window, sink, softcap, seqused_q or descales: the outer call's plan
    had none, as mla_features refuses them): not checked twice."""
    if checked is None:
        if cu_seqlens_q is None:
            raise UnsupportedVariant(BATCH_FORM)
        (dev, batch, total_q, _, seqlen_k, hq, hk, d, dv, page_size, wl, wr, sink_dt, cap, _,
         aligned) = V.check_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_q, seqused_k,
            page_table, window_size, learnable_sink, return_lse, None, None, softcap, pack_gqa,
        )  # fmt: skip
        return_lse = V.check_mla(q, qv, dv, dev, out, lse) or bool(return_lse)
        ds = None
        if q_descale is not None or k_descale is not None or v_descale is not None:
            ds = V.descale_set(q.dtype, q_descale, k_descale, v_descale)
        pad_ok = rt.padding if padding is None else bool(padding)
        if not aligned:
            q, k, v = V._prep(q, "q", pad_ok), V._prep(k, "k", pad_ok), V._prep(v, "v", pad_ok)
        if not V._aligned(qv):
            qv = V._prep(qv, "qv", pad_ok)
    else:
        dev, batch, total_q, seqlen_k, hk, d, dv, page_size = checked
        hq, return_lse, pad_ok = q.shape[1], bool(return_lse), False
        wl = wr = sink_dt = cap = ds = None
    got = rt._devices.get(dev)
    if got is None:
        V.require_cuda(dev, q)
        got = rt.device(dev)
    rows = total_q if max_seqlen_q is None else max_seqlen_q
    key = (
        "mla", q.dtype, d, dv, hq, hk, bool(causal), return_lse, cu_seqlens_k is not None,
        seqused_q is not None, seqused_k is not None, page_size, max_seqlen_q is None,
        min(rows, _ROWS_CAP), 2 * batch > got[1], dev, pad_ok, wl, wr, sink_dt, cap, pack_gqa,
        ds,
    )  # fmt: skip
    plan = rt._plans.get(key)
    if plan is None:
        V.require_cuda(dev, q)
        feat = CallFeatures(
            V.DTYPE_NAMES[q.dtype], d, dv, hq, hk, bool(causal), wl, wr, return_lse, sink_dt,
            batch, None, total_q, max_seqlen_q, cu_seqlens_q=True,
            cu_seqlens_k=cu_seqlens_k is not None, seqused_q=seqused_q is not None,
            seqused_k=seqused_k is not None, page_size=page_size, softcap=cap,
            pack_gqa=pack_gqa, descales=ds, qv=dv,
        )
        plan = P.resolve(rt, key, dev, pad_ok, feat)
        if plan is None:
            return P.on_miss(
                rt, dev, pad_ok, feat, "jit_flash_attn_varlen_func", (q, k, v),
                dict(qv=qv, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k,
                     page_table=page_table, softmax_scale=softmax_scale, causal=causal,
                     return_lse=return_lse),
                out, lse,
            )  # fmt: skip
    if plan.pad is not None:
        return _padded(
            rt, plan.pad.ratio, q, k, v, qv, hk, out, lse,
            dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                 max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, page_table=page_table,
                 softmax_scale=softmax_scale, causal=causal, return_lse=return_lse,
                 checked=(dev, batch, total_q, seqlen_k, hk, d, dv, page_size)),
        )  # fmt: skip
    if total_q == 0 or seqlen_k == 0 or batch == 0:
        if out is None:
            out = q.new_empty((total_q, hq, dv))
        if lse is None and return_lse:
            lse = q.new_empty((total_q, hq), dtype=torch.float32)
        return X.empty(out, lse, None, varlen=True)
    p = L.fwd_prepare(
        plan.variant.arch, q, k, v, qv=qv, varlen_q=True, max_seqlen_q=max_seqlen_q,
        softmax_scale=softmax_scale, causal=causal, return_lse=return_lse, out=out, lse=lse,
    )  # fmt: skip
    plan.launch(
        p.q, p.qv, p.k, p.v, p.kernel_out, p.kernel_lse, p.softmax_scale, cu_seqlens_q,
        cu_seqlens_k, None, seqused_k, page_table, p.window_left, p.window_right, None,
        p.descales,
    )  # fmt: skip
    return p.out, p.lse


def _padded(rt, ratio2, q, k, v, qv, hk, out, lse, kw):
    """The call with each latent group's query heads padded from r to `ratio2` with zero heads
    (q and qv; zeros, as SGLang pads: a zero row attends uniformly and stays finite), run on the
    padded ratio's exact kernel (the re-entry, `checked`, does not pad again nor check again),
    then O (total_q, h, 512) and LSE (total_q, h) cropped into the caller's buffers, or fresh
    ones."""

    total_q, hq, dv = q.shape[0], q.shape[1], qv.shape[-1]
    r = hq // hk
    po, pl = varlen(
        rt, pad_heads(q, r, ratio2, hk), k, v, pad_heads(qv, r, ratio2, hk), seqused_q=None,
        window_size=(None, None), learnable_sink=None, out=None, lse=None, padding=False,
        softcap=0.0, pack_gqa=None, q_descale=None, k_descale=None, v_descale=None, **kw,
    )  # fmt: skip
    if out is None:
        out = po.new_empty((total_q, hq, dv))
    X.copy_wide(out.view(total_q, hk, r, dv), po.view(total_q, hk, ratio2, dv)[:, :, :r])
    if pl is not None:
        if lse is None:
            lse = pl.new_empty((total_q, hq))
        lse.view(total_q, hk, r).copy_(pl.view(total_q, hk, ratio2)[..., :r])
    return out, lse
