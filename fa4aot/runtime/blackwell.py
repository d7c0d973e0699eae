"""The exact path on Blackwell (sm100/sm103): FA4's forward as `_flash_attn_fwd` runs it there.

Reached from the entry points through `Plan.special` (set once per plan for a Blackwell
artifact, so the sm90 exact path tests nothing new). Per call it does what FA4 does before and
around its kernel (runtime/launch.py: `fwd_prepare` lays the call out, `cu_hint_prepare` sizes
the batch > 256 helpers' buffers; the launchers abi.py binds pass the argument lists), with
host-known values only (no device sync):

- FP8: the descales are checked (`fp8.check_descales`: the kernel's set, shape (batch, kv
  heads), float32, on q's device, no stride-0 mode); q/k/v go to the kernel as uint8 views
  and O is bfloat16 (`fp8.fp8_out_dtype`);
- `max_seqlen_q` (the forward's last slot, which sizes the kernel's M grid): the caller's host
  hint, else s_q for q in batch form, else total_q, as FA4 derives it; a hint below the
  query length of a batch-form q without seqused_q is refused (it would skip rows);
- varlen q with batch > 256: FA4's tile cumsum, then its blocks-to-batch index, both passed on;
- split-KV: FA4's own split kernels (`Variant.split_kv`) with the combine stored beside them.
  For q in batch form and equal head dims, the count is FA4's heuristic
  (`constraints.native_num_splits` over the keys the mask loads, as FA4's `seqlen_k_loaded`;
  FA4AOT_SPLIT_KV=N forces N, 0 never splits), the kernel the
  split variant of the call (`features(..., num_splits=n, max_seqlen_k=bound)`, ping-pong or
  not), run only when a store holds it; float32 partials are scratch per (device, stream,
  shape), fresh while a CUDA graph is captured. A packed q whose sequences all hold
  max_seqlen_q rows (total_q == batch * max_seqlen_q, batch <= 256: a vLLM/SGLang decode or
  speculative step) splits as the same call in batch form (q and O viewed, the LSE copied once
  into its (h, total_q) layout); any other packed q runs unsplit (FA4 would compute per-batch
  split counts with its scheduler-metadata kernel, which fa4aot does not ship).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import torch

from fa4aot.errors import ContractViolation
from fa4aot.model import fp8 as F8
from fa4aot.model.compile_keys import CallFeatures, native_split_variant
from fa4aot.runtime import launch as L
from fa4aot.runtime import pad as X
from fa4aot.runtime.validate import descale_set

_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_MAX_SCRATCH = 16
_MAX_DECISIONS = 4096


def refusal(arch: str, feat: CallFeatures) -> str | None:
    """Why the runtime cannot serve the call `feat` on `arch` (checked when its plan is made),
    or None: FP8 off Blackwell (FA4 has no FP8 forward there), descales beside non-FP8
    inputs. (An hd256 call, whose pack_gqa and 2CTA kernel FA4 picks by the batch against the
    SM count, is modelled: compile_keys.features, Variant.two_cta, plan.hd256_class.)"""
    dtype = feat.dtype
    why = F8.fp8_mismatch_reason(arch, dtype, dtype)
    if why:
        return why
    if feat.descales and not F8.is_fp8(dtype):
        return f"descales {feat.descales!r} with {dtype} inputs: descales scale FP8 q/k/v only"
    return None


def extras(dtype, q_descale, k_descale, v_descale) -> str:
    """The entry points' check of their FP8 descales (only when one is given): refuses them
    with non-FP8 inputs; -> the descale set ("qkv"). (qv takes runtime/mla.py.)"""

    return descale_set(dtype, q_descale, k_descale, v_descale)


class Options(NamedTuple):
    """A Blackwell call's scalars and optional tensors, as the entry point resolved them."""

    softmax_scale: float | None
    causal: bool
    window_left: int | None
    window_right: int | None
    return_lse: bool
    sink: Any  # learnable_sink or None
    descales: tuple | None  # (q, k, v) descale tensors, or None
    max_seqlen_q: int | None
    max_seqlen_k: int | None


class Tensors(NamedTuple):
    """The varlen / paged tensors FA4's varlen entry takes (all None for a dense call)."""

    cu_seqlens_q: Any
    cu_seqlens_k: Any
    seqused_q: Any
    seqused_k: Any
    page_table: Any


class Shape(NamedTuple):
    """A call's host-known sizes. seqlen_q: s_q of a batch-form q (None when packed);
    seqlen_k: the host bound on KV lengths the entry point computed."""

    batch: int
    total_q: int
    seqlen_q: int | None
    seqlen_k: int
    hq: int
    hk: int
    dev: int


NO_TENSORS = Tensors(None, None, None, None, None)


def run(rt, plan, q, k, v, out, lse, opts: Options, tensors: Tensors, shape: Shape):
    """An exact Blackwell call (see the module docstring). -> (out, lse)."""
    (softmax_scale, causal, window_left, window_right, return_lse, sink, descales, max_seqlen_q,
     max_seqlen_k) = opts
    cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table = tensors
    batch, total_q, seqlen_q, seqlen_k, hq, hk, dev = shape
    variant = plan.variant
    qd = kd = vd = None
    if descales is not None:
        qd, kd, vd = descales
    if descales is not None or variant.descales is not None:
        F8.check_descales(
            variant.descales, dtype=q.dtype, batch=batch, num_heads_kv=hk, device=q.device,
            q_descale=qd, k_descale=kd, v_descale=vd,
        )  # fmt: skip
    varlen_q = cu_seqlens_q is not None
    if (
        max_seqlen_q is not None
        and seqlen_q is not None
        and seqused_q is None
        and max_seqlen_q < seqlen_q
    ):
        raise ContractViolation(
            f"max_seqlen_q={max_seqlen_q} is below the query length {seqlen_q} of q in batch "
            "form: FA4's Blackwell kernel sizes its M grid from it and would skip rows"
        )
    if total_q == 0 or seqlen_k == 0 or batch == 0:
        return _empty(q, v, out, lse, return_lse, sink, varlen_q, shape)
    if sink is not None and sink.stride(0) != 1:
        sink = sink.contiguous()
    target, n = plan, 1
    # a packed q whose sequences all hold max_seqlen_q rows (total_q == batch * max_seqlen_q,
    # each at most max_seqlen_q: the caller's contract) is q in batch form, (b, s, h, d),
    # viewed: a decode or speculative step. FA4's split kernels take that form (a packed q's
    # split would need its scheduler-metadata kernel). (batch <= 256: a larger one takes FA4's
    # tile cumsum helpers, and fills the SMs unsplit)
    even = (
        varlen_q and max_seqlen_q is not None and seqused_q is None
        and total_q == batch * max_seqlen_q and not variant.cu_hint
    )  # fmt: skip
    if (
        rt.split and (not varlen_q or even) and seqused_q is None
        and variant.head_dim == variant.head_dim_v
    ):  # fmt: skip
        bound = L.max_seqlen_k_bound(v, page_table, max_seqlen_k)
        rows = seqlen_q if max_seqlen_q is None else max_seqlen_q
        key = (batch, rows, -(-bound // 128), rt.split)
        got = plan.native.get(key)
        if got is None:
            got = _native_split(rt, plan, dev, batch, rows, bound, even)
            if len(plan.native) > _MAX_DECISIONS:
                plan.native.clear()
            plan.native[key] = got
        n, split_plan = got
        if n > 1:
            target = split_plan
    if n > 1 and even:
        return _in_batch_form(rt, plan, q, k, v, out, lse, opts, tensors, shape)
    op = lp = None
    if n > 1:
        op, lp = _partials(rt, dev, q, n, batch, seqlen_q, hq, v.shape[-1])
    p = L.fwd_prepare(
        variant.arch, q, k, v, varlen_q=varlen_q, max_seqlen_q=max_seqlen_q,
        softmax_scale=softmax_scale, causal=causal, window_left=window_left,
        window_right=window_right, return_lse=return_lse, out=out, lse=lse, num_splits=n,
        q_descale=qd, k_descale=kd, v_descale=vd, out_partial=op, lse_partial=lp,
    )  # fmt: skip
    cu_total = b2b = None
    if variant.cu_hint:
        facts = plan.facts
        h = L.cu_hint_prepare(
            batch, total_q, facts["tile_m"], hq // hk, facts["pack_gqa"], q.device
        )
        plan.tile(
            h.cu_total_m_blocks,
            cu_seqlens_q if plan.helper_cu else None,
            seqused_q if plan.helper_seqused else None,
        )
        plan.b2b(h.cu_total_m_blocks, h.blocks_to_batch_idx)
        cu_total, b2b = h.cu_total_m_blocks, h.blocks_to_batch_idx
    target.launch(
        p.q, p.k, p.v, p.kernel_out, p.kernel_lse, p.softmax_scale, cu_seqlens_q,
        cu_seqlens_k, seqused_q, seqused_k, page_table, p.window_left, p.window_right, sink,
        cu_total, p.max_seqlen_q, p.descales, b2b,
    )  # fmt: skip
    if n > 1:
        target.combine(*p.combine(cu_seqlens_q, seqused_q))
        p.finish()
    return p.out, p.lse


def _empty(q, v, out, lse, return_lse, sink, varlen_q, shape):
    """A call with no query rows, no keys or no sequences: FA4's outputs for it."""
    if out is None:
        dt = getattr(torch, F8.fp8_out_dtype(q.dtype))
        out = q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=dt)
    if lse is None and return_lse:
        b, total_q, sq, hq = shape.batch, shape.total_q, shape.seqlen_q, shape.hq
        lse = q.new_empty((hq, total_q) if varlen_q else (b, hq, sq), dtype=torch.float32)
    return X.empty(out, lse, sink, varlen=varlen_q)


def _in_batch_form(rt, plan, q, k, v, out, lse, opts, tensors, shape):
    """A packed q of max_seqlen_q rows a sequence run as the same call in batch form: q, out
    as views; LSE (h, total_q) written from the batch form's (b, h, s) by one copy."""
    batch, total_q, s, hq = shape.batch, shape.total_q, opts.max_seqlen_q, shape.hq
    out4, lse4 = run(
        rt, plan, q.view(batch, s, hq, q.shape[-1]), k, v,
        None if out is None else out.view(batch, s, hq, out.shape[-1]), None,
        opts._replace(return_lse=opts.return_lse or lse is not None, max_seqlen_q=None),
        tensors._replace(cu_seqlens_q=None, seqused_q=None), shape._replace(seqlen_q=s),
    )
    if out is None:
        out = out4.view(total_q, hq, out4.shape[-1])
    if lse is not None or opts.return_lse:
        rows = lse4.transpose(0, 1).reshape(hq, total_q)  # (h, b, s) -> (h, b * s)
        if lse is None:
            lse = rows.contiguous()
        else:
            lse.copy_(rows)
    return out, lse


def _native_split(rt, plan, dev, batch, rows, bound, batch_form=False):
    """-> (num_splits, the split kernel's plan) for a call of these host-known sizes, or
    (1, None): `compile_keys.native_split_variant` says one split, or no store holds the split
    kernel (the call then runs unsplit on its own kernel). The kernel's tile_m and pack_gqa are
    its record's (plan.fwd_facts checked the variant's equal to them). batch_form: a packed q
    of max_seqlen_q rows per sequence, split as q in batch form (run)."""
    if plan.feat is None:
        return 1, None
    arch, sms = rt.device(dev)
    feat = replace(plan.feat, cu_seqlens_q=False) if batch_form else plan.feat
    n, sv = native_split_variant(
        arch, sms, plan.variant, feat, batch, rows, bound, plan.window_left,
        plan.window_right, rt.split,
    )  # fmt: skip
    if sv is None:
        return 1, None
    cache = rt._native_plans
    if sv.id not in cache:
        cache[sv.id] = rt.plan(sv, sms)
    split_plan = cache[sv.id]
    if split_plan is None or split_plan.combine is None:
        return 1, None
    return n, split_plan


def _partials(rt, dev, q, n, batch, seqlen_q, hq, dv):
    """float32 out_partial (n, b, s, h, dv) and lse_partial (n, b, h, s), as FA4 allocates
    them (launch.fwd_prepare), kept per (device, stream, shape): calls on one stream are ordered,
    so a call never overwrites partials an earlier one's combine still reads; while a CUDA graph
    is captured nothing is reused or kept (the graph gets its own, from its pool)."""
    if q.is_cuda:
        capturing = _is_capturing()
        stream = _raw_stream(dev)
    else:  # (CPU tensors: the tests' stand-in kernels)
        capturing, stream = False, 0
    key = (dev, stream, n, batch, seqlen_q, hq, dv)
    got = None if capturing else rt._native_scratch.get(key)
    if got is None:
        got = (
            torch.empty((n, batch, seqlen_q, hq, dv), dtype=torch.float32, device=q.device),
            torch.empty((n, batch, hq, seqlen_q), dtype=torch.float32, device=q.device),
        )
        if not capturing:
            if len(rt._native_scratch) >= _MAX_SCRATCH:
                rt._native_scratch.clear()
            rt._native_scratch[key] = got
    return got
