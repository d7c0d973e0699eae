"""The compiler-free runtime: FA4's forward calling convention, served from the store.

Never imports `cutlass` or `flash_attn` (unless FA4AOT_ON_MISS=jit and a call misses). A call
goes validate -> plan -> launch, one module each:

- `validate`: the arguments -> host-known sizes and static features, or a typed refusal;
  the call's `CallFeatures` (model/compile_keys.py), which planning works from, are built on
  plan-cache misses;
- `plan`: the `Runtime` (stores, loaded artifacts, caches) and the choice of exact kernel,
  decode fold or padding per call key (`plan.resolve`), and of split-KV (`Runtime.split_for`);
- `abi` spells FA4's kernel ABI (slot tables, argument lists, the launcher each loaded part
  is bound to); `launch` picks an artifact's binders by arch and FA4 source, and lays out a
  Blackwell call as FA4 does;
- `splitkv` and `pad` run the composite plans (split-KV decode; fold and padding);
- `mla` serves absorbed-MLA (qv) calls on Blackwell, exact or head-ratio padded.

The per-call path is kept short (target: under 15 us of host time): everything that depends
only on a call's static features is resolved once and cached by a key tuple of host-known
values; the entry points below only check, look up and launch.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import torch

from fa4aot.errors import Fa4aotError, UnsupportedVariant
from fa4aot.model.compile_keys import CallFeatures
from fa4aot.model.constraints import (
    BIN_BATCH_SEARCH_THRESH as _BIN_BATCH,  # varlen: cu_total path above it
)
from fa4aot.policy import split as S
from fa4aot.runtime import blackwell as B
from fa4aot.runtime import fp8kv as FK
from fa4aot.runtime import mla as M
from fa4aot.runtime import pad as X
from fa4aot.runtime import plan as P
from fa4aot.runtime import splitkv as SK
from fa4aot.runtime import validate as V
from fa4aot.runtime import vllm_abi as VA
from fa4aot.runtime.launch import SM90_VLLM as _VLLM
from fa4aot.runtime.plan import Runtime
from fa4aot.runtime.validate import _prep
from fa4aot.runtime.vllm_abi import FP8_KV as _FP8_KV

# The decode/prefill choice depends on the query length only up to the largest tile_m (192):
# plan-cache keys clamp it there, so prefill calls of every length share one entry.
_Q_KEY_CAP = 193
_SPLIT_ROWS = S.MAX_ROWS
_SPLIT_MIN = S.NEVER_SPLIT_KEYS
_F32 = torch.float32

_DEFAULT: Runtime | None = None
_DEFAULT_LOCK = threading.Lock()


def default_runtime() -> Runtime:
    global _DEFAULT
    if _DEFAULT is None:
        with _DEFAULT_LOCK:
            if _DEFAULT is None:
                _DEFAULT = Runtime()
    return _DEFAULT


V.default_runtime = default_runtime


def reset(roots: list[Path] | None = None, on_miss: str | None = None) -> Runtime:
    """Replace the process-wide runtime (tests; a server reconfiguring its store)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        _DEFAULT = Runtime(roots, on_miss)
    return _DEFAULT


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    learnable_sink: torch.Tensor | None = None,
    return_lse: bool = False,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    padding: bool | None = None,
    softcap: float = 0.0,
    pack_gqa: bool | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    qv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dense forward with FA4's calling convention: q (b, sq, hq, d), k/v (b, sk, hk, d[v]).

    Returns (out, lse): out (b, sq, hq, dv) in q's dtype (bfloat16 for FP8 inputs), lse
    (b, hq, sq) float32 or None.
    out / lse: caller-owned buffers to write into (as FA4's internal `_flash_attn_fwd` takes
    them; e.g. for CUDA graphs); `lse` given implies return_lse.
    padding: allow serving the call from a padded variant (and copying inputs whose layout the
    kernel cannot take); None: FA4AOT_PADDING (default allow).
    q_descale / k_descale / v_descale (FA4's `_flash_attn_fwd` names; Blackwell FP8 only):
    float32 (batch, num_kv_heads); which of them are passed selects the kernel. qv (absorbed
    MLA) in this batch form is refused: the stored MLA kernels take q packed, through
    flash_attn_varlen_func (runtime/mla.py; the refusal says how to reshape).
    """
    if qv is not None:
        raise UnsupportedVariant(M.BATCH_FORM)
    dq, b, sq, sk, hq, hk, d, dv, wl, wr, sink_dt, cap, return_lse, aligned = V.check_dense(
        q, k, v, window_size, learnable_sink, return_lse, out, lse, softcap, pack_gqa
    )
    ds = None
    if q_descale is not None or k_descale is not None or v_descale is not None:
        ds = B.extras(q.dtype, q_descale, k_descale, v_descale)
    rt = _DEFAULT or default_runtime()
    pad_ok = rt.padding if padding is None else bool(padding)
    if not aligned:
        q, k, v = _prep(q, "q", pad_ok), _prep(k, "k", pad_ok), _prep(v, "v", pad_ok)
    # the split's chunk kernels carry no softcap (split.py): a capped call runs unsplit
    if (
        0 < sq <= _SPLIT_ROWS and rt.split and wl is None and wr is None and cap is None
        and sk > _SPLIT_MIN and b and dq >= 0
    ):
        got = SK.split_step(  # (the step as a plain tuple in splitkv.Step's order)
            rt, dq, q, k, v, ("dense", b, sq, hq, hk, d, dv, sk, None, causal, False),
            None, None, None, learnable_sink, softmax_scale, out, lse, return_lse,
        )
        if got is not None:
            return got
    key = (
        "dense", q.dtype, d, dv, hq // hk, bool(causal), wl, wr, return_lse, sink_dt,
        sq if sq < _Q_KEY_CAP else _Q_KEY_CAP, dq, pad_ok, cap, pack_gqa, ds,
        d == 256 and P.hd256_class(rt, dq, b, hq, hk),
    )
    plan = rt._plans.get(key)
    if plan is None or plan.special:  # not planned yet; a fold, padding or Blackwell plan
        plan = _dense_unplanned(
            rt, key, plan, dq, pad_ok, q, k, v, out, lse, softmax_scale, causal, window_size,
            learnable_sink, return_lse, softcap, pack_gqa, q_descale, k_descale, v_descale,
            (b, sq, sk, hq, hk, d, dv, wl, wr, sink_dt, cap, ds),
        )  # fmt: skip
        if type(plan) is tuple:  # served: (out, lse)
            return plan
    # exact
    if out is None:
        # empty_like skips shape parsing (~1 us); for a contiguous q it is contiguous too
        out = torch.empty_like(q) if dv == d and q.is_contiguous() else q.new_empty(b, sq, hq, dv)
    if lse is None and return_lse:
        lse = q.new_empty(b, hq, sq, dtype=torch.float32)
    if sq == 0 or sk == 0 or b == 0:
        return X.empty(out, lse, learnable_sink, varlen=False)
    if learnable_sink is not None and learnable_sink.stride(0) != 1:
        learnable_sink = learnable_sink.contiguous()
    plan.launch(
        q, k, v, out, lse, 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale),
        None, None, None, None, None, plan.window_left, plan.window_right, learnable_sink,
    )
    return out, lse


def _dense_unplanned(
    rt, key, plan, dq, pad_ok, q, k, v, out, lse, softmax_scale, causal, window_size,
    learnable_sink, return_lse, softcap, pack_gqa, q_descale, k_descale, v_descale, shape,
):  # fmt: skip
    """flash_attn_func off its exact path: a key not planned yet (planned from the call's
    CallFeatures; where no stored kernel serves it, the miss policy's (out, lse)), or a
    Blackwell, fold or padding plan, served here -> (out, lse); else the new exact plan."""
    b, sq, sk, hq, hk, d, dv, wl, wr, sink_dt, cap, ds = shape
    if plan is None:
        V.require_cuda(dq, q)
        feat = CallFeatures(
            V.DTYPE_NAMES[q.dtype], d, dv, hq, hk, bool(causal), wl, wr, return_lse, sink_dt,
            b, sq, b * sq, None, softcap=cap, pack_gqa=pack_gqa, descales=ds,
        )
        plan = P.resolve(rt, key, dq, pad_ok, feat)
        if plan is None:
            return P.on_miss(
                rt, dq, pad_ok, feat, "jit_flash_attn_func", (q, k, v),
                dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                     learnable_sink=learnable_sink, return_lse=return_lse, softcap=softcap,
                     pack_gqa=pack_gqa),
                out, lse,
            )
        if not plan.special:
            return plan
    ds_t = None if ds is None else (q_descale, k_descale, v_descale)
    if plan.pad is None:
        return B.run(
            rt, plan, q, k, v, out, lse,
            B.Options(softmax_scale, causal, wl, wr, return_lse, learnable_sink, ds_t, None,
                      None),
            B.NO_TENSORS, B.Shape(b, b * sq, sq, sk, hq, hk, dq),
        )
    if plan.pad.fold > 1:
        return X.folded(plan, q, k, v, out, lse, softmax_scale, return_lse, False, sk,
                        (None, None, None), ds_t)
    # (FP8: padding keeps the KV heads and the batch, so the descales pass on as they are)
    return X.padded(
        flash_attn_func, plan.pad, q, k, v, hk, learnable_sink, softmax_scale,
        dict(causal=causal, window_size=window_size, return_lse=return_lse, softcap=softcap,
             pack_gqa=pack_gqa, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale),
        varlen=False, out=out, lse=lse,
    )


def flash_attn_varlen_func(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
    seqused_q: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None, softmax_scale: float | None = None,
    causal: bool = False, window_size: tuple[int | None, int | None] = (None, None),
    learnable_sink: torch.Tensor | None = None, return_lse: bool = False, *,
    out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
    padding: bool | None = None, softcap: float = 0.0, pack_gqa: bool | None = None,
    q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None, qv: torch.Tensor | None = None,
    fp8_kv_dequant: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Varlen / paged forward with FA4's calling convention.

    q: (total_q, hq, d) with cu_seqlens_q (batch+1,) int32 [or (b, sq, hq, d) without it].
    k/v: (total_k, hk, d) with cu_seqlens_k; or paged (num_pages, page_size, hk, d) with
    page_table (batch, max_pages) int32 and seqused_k (batch,) int32.
    Caller's contract (not checked: it would need a device sync): cu_seqlens start at 0, are
    non-decreasing and end at the packed length; max_seqlen_q, when given, bounds every
    sequence's query length; max_seqlen_k, when given, bounds every sequence's KV length (a
    split-KV decode step reads no key beyond it); page_table entries index the KV pool and
    cover ceil(seqused_k / page_size) pages per sequence; seqused_k <= pages * page_size.
    Returns (out, lse): out like q with head_dim_v; lse (hq, total_q) float32 or None.
    out / lse: caller-owned buffers, as in flash_attn_func; descales as there (on Blackwell
    max_seqlen_q is the kernel's own argument: rows past it go uncomputed).
    qv (absorbed MLA, Blackwell): q (total_q, h, 64) rope part with cu_seqlens_q, qv (total_q,
    h, 512) latent part, one latent K/V head packed or paged; LSE (total_q, h), heads last.
    Head ratios FA4's kernel refuses are padded (runtime/mla.py); never split.
    fp8_kv_dequant (vLLM's FA4 copy's name; None: inferred): a bf16/fp16 q over paged e4m3
    k/v with k_descale / v_descale float32 (batch, num_kv_heads), dequantized in the kernel;
    served from a store built with `fa4aot build --fa4 vllm` (sm90, pages of the kernel's
    tile_n: 64 at head dim 512); out in q's dtype (runtime/fp8kv.py).
    """
    shape = None if qv is not None or fp8_kv_dequant else V.check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_q, seqused_k, page_table,
        window_size, learnable_sink, return_lse, out, lse, softcap, pack_gqa,
        fp8_kv_dequant is None,
    )  # fmt: skip
    if shape is None:  # qv or fp8_kv_dequant given, or FP8-KV dequant inferred from the dtypes
        return _varlen_other(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
            seqused_k, page_table, softmax_scale, causal, window_size, learnable_sink,
            return_lse, out, lse, padding, softcap, pack_gqa, q_descale, k_descale, v_descale,
            qv, fp8_kv_dequant,
        )  # fmt: skip
    (dev, batch, total_q, sq_dense, seqlen_k, hq, hk, d, dv, page_size, wl, wr, sink_dt, cap,
     return_lse, aligned) = shape
    ds = (None if q_descale is None and k_descale is None and v_descale is None
          else B.extras(q.dtype, q_descale, k_descale, v_descale))
    rt, varlen_q = _DEFAULT or default_runtime(), cu_seqlens_q is not None
    pad_ok = rt.padding if padding is None else bool(padding)
    if not aligned:
        q, k, v = _prep(q, "q", pad_ok), _prep(k, "k", pad_ok), _prep(v, "v", pad_ok)
    if (rt.split and wl is None and wr is None and cap is None and seqused_q is None and batch
            and dev >= 0):
        rows = max_seqlen_q if varlen_q else sq_dense
        # a packed K with seqused_k ("used"): one row a sequence, the ragged plan alone
        if rows is not None and 0 < rows <= _SPLIT_ROWS and total_q == batch * rows and (
                page_size is not None or cu_seqlens_k is None or seqused_k is None or rows == 1):
            kind = ("paged" if page_size is not None else "varlen" if cu_seqlens_k is not None
                    and seqused_k is None else "used" if cu_seqlens_k is not None
                    else "dense" if seqused_k is None else "padded")  # (splitkv.Step)
            if kind == "dense":
                bound = seqlen_k  # (its exact length: the chunk bounds are constants)
            elif type(max_seqlen_k) is int and max_seqlen_k >= 0:  # (bounds every KV length)
                bound = min(max_seqlen_k, seqlen_k) if kind == "padded" else max_seqlen_k
            else:
                bound = seqlen_k if page_size is None else page_table.size(1) * page_size
            if bound > _SPLIT_MIN:
                got = SK.split_step(  # (the step as a plain tuple in splitkv.Step's order)
                    rt, dev, q, k, v,
                    (kind, batch, rows, hq, hk, d, dv, bound, page_size, causal, varlen_q),
                    cu_seqlens_k, seqused_k, page_table, learnable_sink, softmax_scale, out,
                    lse, return_lse,
                )  # fmt: skip
                if got is not None:
                    return got
    eff_q = max_seqlen_q if max_seqlen_q is not None else (total_q if varlen_q else sq_dense)
    key = (
        "varlen", q.dtype, d, dv, hq // hk, bool(causal), wl, wr, return_lse, sink_dt, varlen_q,
        cu_seqlens_k is not None, seqused_q is not None, seqused_k is not None, page_size,
        batch > _BIN_BATCH, max_seqlen_q is None, eff_q if eff_q < _Q_KEY_CAP else _Q_KEY_CAP,
        total_q == batch,  # with max_seqlen_q == 1: one row per sequence, the decode fold applies
        dev, pad_ok, cap, pack_gqa, ds, d == 256 and P.hd256_class(rt, dev, batch, hq, hk),
    )
    plan = rt._plans.get(key)
    if plan is None or plan.special:  # not planned yet; a fold, padding or Blackwell plan
        plan = _varlen_unplanned(
            rt, key, plan, pad_ok, q, k, v, out, lse, shape, ds, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, page_table, softmax_scale, causal,
            window_size, learnable_sink, softcap, pack_gqa, q_descale, k_descale, v_descale,
        )  # fmt: skip
        if type(plan) is tuple:  # served: (out, lse)
            return plan
    # the exact sm90 plan, in this frame: the per-call path has no pass-through layer
    if out is None:  # (empty_like: as in flash_attn_func)
        out = (torch.empty_like(q) if dv == d and q.is_contiguous()
               else q.new_empty(*q.shape[:-1], dv))
    if lse is None and return_lse:
        lse = q.new_empty(*((hq, total_q) if varlen_q else (batch, hq, sq_dense)), dtype=_F32)
    if total_q == 0 or seqlen_k == 0:
        return X.empty(out, lse, learnable_sink, varlen=varlen_q)
    if learnable_sink is not None and learnable_sink.stride(0) != 1:
        learnable_sink = learnable_sink.contiguous()
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if page_table is not None and plan.abi is _VLLM and rt.split:  # the copy's own split-KV
        got = VA.split_step(rt, plan, dev, q, k, v, out, batch, hk, max_seqlen_k, page_table,
                            seqused_k, cu_seqlens_q, scale)
        if got is not None:
            return got, lse
    cu_total = None
    if plan.tile is None:
        pass
    elif max_seqlen_q == 1 and plan.helper_cu and not plan.helper_seqused and plan.decode_blocks:
        # Decode (every sequence has 0 or 1 query rows): the helper would compute, per sequence,
        # ceil(rows * qhead_per_kvhead / tile) = rows (qhead_per_kvhead <= tile_m), i.e.
        # cu_total == cu_seqlens_q. Passing it saves a kernel launch and an allocation.
        cu_total = cu_seqlens_q
    else:
        cu_total = _tile_counts(plan, batch, cu_seqlens_q, seqused_q)
    plan.launch(
        q, k, v, out, lse, scale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
        plan.window_left, plan.window_right, learnable_sink, cu_total,
    )
    return out, lse


def _tile_counts(plan, batch, cu_seqlens_q, seqused_q):
    """The cumulative query-tile counts per sequence, from FA4's helper kernel."""
    cu_total = (cu_seqlens_q if cu_seqlens_q is not None else seqused_q).new_empty(batch + 1)
    plan.tile(
        cu_total,
        cu_seqlens_q if plan.helper_cu else None,
        seqused_q if plan.helper_seqused else None,
    )
    return cu_total


def _varlen_other(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
    page_table, softmax_scale, causal, window_size, learnable_sink, return_lse, out, lse,
    padding, softcap, pack_gqa, q_descale, k_descale, v_descale, qv, fp8_kv_dequant,
):  # fmt: skip
    """flash_attn_varlen_func for FP8-KV dequant, asked for or inferred (runtime/fp8kv.py), or
    else, with qv, absorbed MLA (runtime/mla.py)."""
    if (qv is None and not fp8_kv_dequant) or (
        (fp8_kv_dequant or getattr(k, "dtype", None) in _FP8_KV)
        and FK.is_fp8_kv(q, k, v, fp8_kv_dequant)
    ):  # (the first: check_varlen found the dtypes FP8-KV's)
        return FK.varlen(
            _DEFAULT or default_runtime(), q, k, v, cu_seqlens_q, max_seqlen_q, seqused_k,
            page_table, softmax_scale, causal, window_size, learnable_sink, return_lse, out,
            lse, k_descale, v_descale, max_seqlen_k,
        )  # fmt: skip
    return M.varlen(
        _DEFAULT or default_runtime(), q, k, v, qv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, seqused_q, seqused_k, page_table, softmax_scale, causal, window_size,
        learnable_sink, return_lse, out, lse, padding, softcap, pack_gqa, q_descale,
        k_descale, v_descale,
    )  # fmt: skip


def _varlen_unplanned(
    rt, key, plan, pad_ok, q, k, v, out, lse, shape, ds, cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, page_table, softmax_scale, causal,
    window_size, learnable_sink, softcap, pack_gqa, q_descale, k_descale, v_descale,
):  # fmt: skip
    """flash_attn_varlen_func off its exact path: a key not planned yet (planned from the call's
    CallFeatures; where no stored kernel serves it, the miss policy's (out, lse)), or a
    Blackwell, fold or padding plan, served here -> (out, lse); else the new exact plan.
    shape: check_varlen's."""
    (dev, batch, total_q, sq_dense, seqlen_k, hq, hk, d, dv, page_size, wl, wr, sink_dt, cap,
     return_lse, _) = shape
    varlen_q = cu_seqlens_q is not None
    if plan is None:
        V.require_cuda(dev, q)
        feat = CallFeatures(
            V.DTYPE_NAMES[q.dtype], d, dv, hq, hk, bool(causal), wl, wr, return_lse, sink_dt,
            batch, sq_dense, total_q, max_seqlen_q, cu_seqlens_q=varlen_q,
            cu_seqlens_k=cu_seqlens_k is not None, seqused_q=seqused_q is not None,
            seqused_k=seqused_k is not None, page_size=page_size, softcap=cap,
            pack_gqa=pack_gqa, descales=ds,
        )
        plan = P.resolve(rt, key, dev, pad_ok, feat)
        if plan is None:
            return P.on_miss(
                rt, dev, pad_ok, feat, "jit_flash_attn_varlen_func", (q, k, v),
                dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_q=seqused_q,
                     seqused_k=seqused_k, page_table=page_table, softmax_scale=softmax_scale,
                     causal=causal, window_size=window_size, learnable_sink=learnable_sink,
                     return_lse=return_lse, softcap=softcap, pack_gqa=pack_gqa),
                out, lse,
            )
        if not plan.special:
            return plan
    ds_t = None if ds is None else (q_descale, k_descale, v_descale)
    if plan.pad is None:
        return B.run(
            rt, plan, q, k, v, out, lse,
            B.Options(softmax_scale, causal, wl, wr, return_lse, learnable_sink, ds_t,
                      max_seqlen_q, max_seqlen_k),
            B.Tensors(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table),
            B.Shape(batch, total_q, sq_dense, seqlen_k, hq, hk, dev),
        )
    if plan.pad.fold > 1:  # q (batch, hq, d), one row per sequence (see the key)
        return X.folded(
            plan, q, k, v, out, lse, softmax_scale, return_lse, varlen_q, seqlen_k,
            (cu_seqlens_k, seqused_k, page_table), ds_t,
        )
    return X.padded(
        flash_attn_varlen_func, plan.pad, q, k, v, hk, learnable_sink, softmax_scale,
        dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
             max_seqlen_k=max_seqlen_k, seqused_q=seqused_q, seqused_k=seqused_k,
             page_table=page_table, causal=causal, window_size=window_size,
             q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
             return_lse=return_lse, softcap=softcap, pack_gqa=pack_gqa),
        varlen=varlen_q, out=out, lse=lse,
    )


__all__ = [
    "Runtime",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "default_runtime",
    "reset",
    "Fa4aotError",
]
