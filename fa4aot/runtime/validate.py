"""Validation: a call's arguments -> what planning needs, or a typed refusal.

Every check raises `ContractViolation` (or `UnsupportedVariant` for an FP8 input) naming the
argument; "not a CUDA tensor" is refused last (`require_cuda`, on a plan-cache miss), so every
input check is testable on a CPU. `check_dense` / `check_varlen` run on every call and return
plain tuples (the hot path reads each tensor attribute once and builds no object); the
`compile_keys.CallFeatures` planning works from are built only when a call's plan is not
cached yet.
"""

from __future__ import annotations

from typing import Any

import torch

from fa4aot.errors import ContractViolation
from fa4aot.model.fp8 import check_fp8_dtypes
from fa4aot.runtime.vllm_abi import FP8_KV

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# every dtype a call may have (FP8: Blackwell only, refused at planning elsewhere)
DTYPE_NAMES = {**DTYPES, torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}
_SINK_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# -- contract checks ------------------------------------------------------------------------


# The process-wide runtime's accessor: fa4aot.runtime (which imports this module) sets it.
default_runtime = None


def _fail(msg: str) -> ContractViolation:
    return ContractViolation(msg)


def _aligned(t: torch.Tensor) -> bool:
    """FA4's kernels assume a 16-byte aligned base, unit last stride, 16-byte aligned strides."""
    if t.data_ptr() % 16:
        return False
    if t.is_contiguous():  # head_dim is a multiple of 8 elements (checked at selection)
        return True
    st = t.stride()
    if st[-1] != 1 and t.shape[-1] != 1:
        return False
    e = 16 // t.element_size()
    for s, n in zip(st[:-1], t.shape[:-1]):
        if s == 0 or (s % e and n != 1):
            return False
    return True


def _prep(t: torch.Tensor, name: str, contiguous_ok: bool) -> torch.Tensor:
    if _aligned(t):
        return t
    if contiguous_ok:
        # FA4's maybe_contiguous does the same; the copy is the price of a strided input.
        return t.clone(memory_format=torch.contiguous_format)
    raise _fail(
        f"{name} must have a 16-byte aligned base, a contiguous last dim and 16-byte "
        f"aligned strides (got strides {tuple(t.stride())}); pass .contiguous()"
    )


def _int_like(x: Any) -> bool:
    """An int subclass other than bool (e.g. an IntEnum); the hot path tests `type(x) is int`."""
    return isinstance(x, int) and not isinstance(x, bool)


def _vec_ok(t: Any, n: int, device: int) -> bool:
    """Hot-path test for an int32 (n,) vector on `device`, contiguous (False: `_int_vec` then
    names what is wrong)."""
    return (
        type(t) is torch.Tensor
        and t.dtype is torch.int32
        and t.shape == (n,)
        and t.get_device() == device
        and (t.stride(0) == 1 or n < 2)
    )


def _int_vec(t: Any, name: str, n: int | None, device: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise _fail(f"{name} must be int32, got {t.dtype}")
    if t.dim() != 1 or (n is not None and t.shape[0] != n):
        raise _fail(f"{name} must have shape ({n},), got {tuple(t.shape)}")
    if t.get_device() != device:
        raise _fail(f"{name} is on {t.device}, q is on device {device}")
    if t.stride(0) != 1 and t.shape[0] > 1:
        raise _fail(f"{name} must be contiguous")
    return t


def _check_page_table(page_table: Any, batch: int, dev: int) -> None:
    """Names what is wrong with a page table that failed the hot-path test (or returns: a
    non-contiguous table whose rows do not overlap is accepted)."""
    if not isinstance(page_table, torch.Tensor) or page_table.dtype != torch.int32:
        raise _fail(
            f"page_table must be an int32 tensor, got {getattr(page_table, 'dtype', type(page_table).__name__)}"
        )
    if page_table.dim() != 2 or page_table.shape[0] != batch:
        raise _fail(
            f"page_table must have shape ({batch}, max_pages), got {tuple(page_table.shape)}"
        )
    if page_table.get_device() != dev:
        raise _fail(f"page_table is on {page_table.device}, q is on device {dev}")
    if page_table.stride(-1) != 1 and page_table.shape[-1] > 1:
        raise _fail("page_table must be contiguous in its last dimension")
    if page_table.data_ptr() % 4 or (
        page_table.shape[0] > 1 and page_table.stride(0) < page_table.shape[1]
    ):
        raise _fail("page_table rows must not overlap; pass page_table.contiguous()")


def _check_qkv(q, k, v, fp8_kv: bool = False) -> tuple[int, Any, Any, Any, bool] | None:
    """Checks shared by both entry points; -> q's device index (-1: not CUDA, refused later,
    after every other check, so that input checks are testable on a CPU), the three shapes and
    whether q/k/v are aligned (`_aligned`; False: the entry point copies or refuses them,
    `_prep`). On the hot path every attribute is read once. fp8_kv: None instead of a refusal for an
    FP8-KV dequant call (`_fp8_kv`), which flash_attn_varlen_func serves (runtime/fp8kv.py)."""
    if not (
        isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    ):
        bad = next(n for n, t in (("q", q), ("k", k), ("v", v)) if not isinstance(t, torch.Tensor))
        raise _fail(f"{bad} must be a torch.Tensor, got {type(locals()[bad]).__name__}")
    dq = q.get_device()
    if k.get_device() != dq or v.get_device() != dq:
        if fp8_kv and _fp8_kv(q, k):
            return None
        raise _fail(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    dt = q.dtype
    if (dt not in DTYPES or k.dtype is not dt or v.dtype is not dt) and not (
        dt in _FP8 and k.dtype is dt and v.dtype is dt  # one FP8 dtype: planning checks the arch
    ):
        # an FP8 KV cache beside a bf16 q was refused as a plain dtype mismatch, naming no way
        # out: fp8.check_fp8_dtypes says what FA4 needs, on the device's arch
        if fp8_kv and _fp8_kv(q, k):
            return None
        if any(t.dtype in _FP8 for t in (q, k, v)):
            check_fp8_dtypes(_arch_of(dq), q, k, v)
        if dt not in DTYPES:
            raise _fail(f"q dtype must be bfloat16 or float16, got {dt}")
        raise _fail(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    qs, ks, vs = q.shape, k.shape, v.shape
    if len(qs) < 3 or len(ks) < 3 or len(vs) < 3:  # found by fuzzing: 0-d/1-d inputs hit IndexError
        raise _fail(
            f"q, k, v must be (..., heads, head_dim), got shapes {tuple(qs)}, "
            f"{tuple(ks)}, {tuple(vs)}"
        )
    if qs[-1] != ks[-1]:
        raise _fail(f"q and k head_dim differ: {qs[-1]} vs {ks[-1]}")
    hq, hk = qs[-2], ks[-2]
    if vs[-2] != hk:
        raise _fail(f"k and v must have the same number of heads, got {hk} and {vs[-2]}")
    if hk == 0 or hq % hk:
        raise _fail(f"num q heads ({hq}) must be a multiple of num kv heads ({hk})")
    # (no call for the usual contiguous, aligned inputs)
    aligned = (
        q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        and not (q.data_ptr() % 16 or k.data_ptr() % 16 or v.data_ptr() % 16)
    ) or (_aligned(q) and _aligned(k) and _aligned(v))
    return dq, qs, ks, vs, aligned


def _fp8_kv(q, k) -> bool:
    """An e4m3 K beside a bf16/fp16 q: an FP8-KV dequant call (fp8kv.is_fp8_kv's inference; such
    dtypes fail the plain checks, so the hot path never asks)."""
    return q.dtype in DTYPES and k.dtype in FP8_KV


def _arch_of(dq: int) -> str:
    """The arch of device `dq` for an FP8 message (sm90 for a non-CUDA tensor: the message the
    runtime gave before it served Blackwell; the device check refuses those calls anyway)."""
    if dq < 0:
        return "sm90"
    return default_runtime().device(dq)[0]


def descale_set(dtype, q_descale, k_descale, v_descale) -> str:
    """Which descales a call passes ("qkv", "kv"...), the FP8 key field; refuses descales with
    non-FP8 inputs (FA4 asserts the same). Only called when one is given."""
    if dtype not in _FP8:
        raise _fail(
            f"q/k/v_descale given with {str(dtype).removeprefix('torch.')} inputs: descales "
            "scale FP8 q/k/v only (FA4 asserts the same)"
        )
    return "".join(n for n, t in zip("qkv", (q_descale, k_descale, v_descale)) if t is not None)


def _check_buffer(name: str, t, shape: tuple, dtype, dtype_name: str, dq: int) -> None:
    if (
        not isinstance(t, torch.Tensor)
        or tuple(t.shape) != tuple(shape)
        or t.dtype is not dtype
        or t.get_device() != dq
    ):
        raise _fail(
            f"{name} must be a {dtype_name} tensor of shape {tuple(shape)} on q's device, "
            f"got {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}"
        )


def _check_outputs(q, out, lse, out_shape: tuple, lse_shape: tuple, dq: int) -> None:
    """Caller-owned output buffers are written in place, never copied: check them fully."""
    if out is not None:
        odt = torch.bfloat16 if q.dtype in _FP8 else q.dtype  # fp8.fp8_out_dtype: FP8 in, bf16 out
        _check_buffer("out", out, out_shape, odt, str(odt), dq)
        if not _aligned(out):
            raise _fail(
                "out must have a 16-byte aligned base, a contiguous last dim and 16-byte "
                f"aligned strides (got strides {tuple(out.stride())})"
            )
    if lse is not None:
        _check_buffer("lse", lse, lse_shape, torch.float32, "float32", dq)
        if not lse.is_contiguous() or lse.data_ptr() % 4:
            raise _fail("lse must be contiguous")


def require_cuda(dq: int, q) -> None:
    if dq < 0:
        raise _fail(f"q, k, v must be CUDA tensors, got device {q.device}")


def _window(window_size) -> tuple[int | None, int | None]:
    try:
        wl, wr = window_size
    except (TypeError, ValueError):
        raise _fail(f"window_size must be a pair (left, right), got {window_size!r}") from None
    for w in (wl, wr):
        if w is not None and (isinstance(w, bool) or not isinstance(w, int)):
            raise _fail(f"window_size entries must be int or None, got {window_size!r}")
    return wl, wr


def _softcap(softcap) -> float | None:
    """FA4's softcap: 0 means none; the value is baked into the kernel (Variant.softcap)."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap < 0:
        raise _fail(f"softcap must be a number >= 0 (0: none), got {softcap!r}")
    return float(softcap) if softcap else None


def _sink(learnable_sink, hq: int, device: int) -> str | None:
    if learnable_sink is None:
        return None
    if not isinstance(learnable_sink, torch.Tensor) or learnable_sink.dtype not in _SINK_DTYPES:
        raise _fail("learnable_sink must be a float32/bfloat16/float16 tensor")
    if tuple(learnable_sink.shape) != (hq,) or learnable_sink.get_device() != device:
        raise _fail(
            f"learnable_sink must have shape ({hq},) on device {device}, got "
            f"{tuple(learnable_sink.shape)} on {learnable_sink.device}"
        )
    return _SINK_DTYPES[learnable_sink.dtype]



def check_mla(q, qv, dv: int, dev: int, out, lse) -> bool:
    """An absorbed-MLA call's checks beyond check_varlen's (q packed: (total_q, h, d)): qv
    (total_q, h, dv) of q's dtype on q's device; the caller's O (total_q, h, dv), 32-byte
    aligned (FA4 compiles O with that alignment at dv 512: interface.py 1543) and LSE
    (total_q, h) float32, heads last (FA4's qv layout). -> whether an LSE buffer was given."""
    if not isinstance(qv, torch.Tensor):
        raise _fail(f"qv must be a torch.Tensor, got {type(qv).__name__}")
    if qv.dtype is not q.dtype or qv.get_device() != dev:
        raise _fail(f"qv must have q's dtype and device ({q.dtype}, {q.device}), got "
                    f"{qv.dtype} on {qv.device}")  # fmt: skip
    want = (*q.shape[:-1], dv)
    if tuple(qv.shape) != want:
        raise _fail(f"qv must be (total_q, heads, head_dim_v) = {want} (q's rows and heads, v's "
                    f"head dim), got {tuple(qv.shape)}")  # fmt: skip
    if out is not None:
        odt = torch.bfloat16 if q.dtype in _FP8 else q.dtype
        _check_buffer("out", out, want, odt, str(odt), dev)
        if not _aligned(out) or out.data_ptr() % 32 or any(
            s % (32 // out.element_size()) for s, n in zip(out.stride()[:-1], out.shape) if n > 1
        ):
            raise _fail(
                "out must have a 32-byte aligned base and strides and a contiguous last dim "
                f"(FA4's MLA kernels assume it at head_dim_v 512; got strides {out.stride()})"
            )
    if lse is not None:
        _check_outputs(q, None, lse, None, want[:2], dev)
    return lse is not None


# -- the two entry points' checks (hot path) ---------------------------------------------------


def check_dense(q, k, v, window_size, learnable_sink, return_lse, out, lse, softcap, pack_gqa):
    """flash_attn_func's checks -> (device, b, sq, sk, hq, hk, d, dv, window_left,
    window_right, sink dtype name, softcap, return_lse, q/k/v aligned)."""
    dq, qs, ks, vs, aligned = _check_qkv(q, k, v)
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        raise _fail(
            f"flash_attn_func takes 4-D q/k/v (batch, seqlen, heads, head_dim), got "
            f"{q.dim()}-D/{k.dim()}-D/{v.dim()}-D; use flash_attn_varlen_func for packed inputs"
        )
    b, sq, hq, d = qs
    _, sk, hk, dv = vs
    if ks[0] != b or ks[1] != sk or vs[0] != b:
        raise _fail(f"k/v shapes {tuple(ks)}/{tuple(vs)} do not match q {tuple(qs)}")
    if window_size == (None, None):
        wl = wr = None
    else:
        wl, wr = _window(window_size)
    sink_dt = None if learnable_sink is None else _sink(learnable_sink, hq, dq)
    cap = None if type(softcap) is float and softcap == 0.0 else _softcap(softcap)
    if pack_gqa is not None and type(pack_gqa) is not bool:
        raise _fail(f"pack_gqa must be True, False or None, got {pack_gqa!r}")
    return_lse = bool(return_lse) or lse is not None
    if out is not None or lse is not None:
        _check_outputs(q, out, lse, (b, sq, hq, dv), (b, hq, sq), dq)
    return dq, b, sq, sk, hq, hk, d, dv, wl, wr, sink_dt, cap, return_lse, aligned


def check_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_q, seqused_k, page_table,
    window_size, learnable_sink, return_lse, out, lse, softcap, pack_gqa, fp8_kv=False,
):
    """flash_attn_varlen_func's checks -> (device, batch, total_q, dense sq or None, seqlen_k
    bound (a dense K's length, a packed K's total, a page pool's keys), hq, hk, d, dv,
    page_size, window_left, window_right, sink dtype name, softcap, return_lse, q/k/v
    aligned); with fp8_kv, None for an FP8-KV dequant call (`_check_qkv`)."""
    got = _check_qkv(q, k, v, fp8_kv)
    if got is None:
        return None
    dev, qs, ks, vs, aligned = got
    if cu_seqlens_q is not None:
        if len(qs) != 3:
            raise _fail(
                f"with cu_seqlens_q, q must be (total_q, heads, head_dim), got {tuple(q.shape)}"
            )
        if not isinstance(cu_seqlens_q, torch.Tensor):
            raise _fail("cu_seqlens_q must be an int32 tensor")
        batch = cu_seqlens_q.shape[0] - 1 if cu_seqlens_q.dim() == 1 else -1
        if batch < 0:
            raise _fail(f"cu_seqlens_q must have shape (batch+1,), got {tuple(cu_seqlens_q.shape)}")
        if not _vec_ok(cu_seqlens_q, batch + 1, dev):
            _int_vec(cu_seqlens_q, "cu_seqlens_q", batch + 1, dev)
        total_q, hq, d = qs
        sq_dense = None
    else:
        if len(qs) != 4:
            raise _fail(
                f"without cu_seqlens_q, q must be (batch, seqlen, heads, head_dim), got {tuple(q.shape)}"
            )
        batch, sq_dense, hq, d = qs
        total_q = batch * sq_dense
    if max_seqlen_q is not None and (
        (type(max_seqlen_q) is not int and not _int_like(max_seqlen_q)) or max_seqlen_q < 0
    ):
        raise _fail(f"max_seqlen_q must be a non-negative host int or None, got {max_seqlen_q!r}")
    if seqused_q is not None and not _vec_ok(seqused_q, batch, dev):
        _int_vec(seqused_q, "seqused_q", batch, dev)
    if page_table is not None:
        if cu_seqlens_k is not None:
            raise _fail(
                "page_table and cu_seqlens_k cannot be combined: pass KV lengths as seqused_k"
            )
        if not (
            type(page_table) is torch.Tensor
            and page_table.dtype is torch.int32
            and page_table.dim() == 2
            and page_table.shape[0] == batch
            and page_table.get_device() == dev
            and page_table.is_contiguous()
        ):
            _check_page_table(page_table, batch, dev)
        if len(ks) != 4 or len(vs) != 4:
            raise _fail(
                f"paged k/v must be (num_pages, page_size, kv_heads, head_dim), got {tuple(ks)}"
            )
        num_pages, page_size, hk, _ = ks
        if vs[:3] != ks[:3]:
            raise _fail(f"k {tuple(k.shape)} and v {tuple(v.shape)} page layouts differ")
        if seqused_k is None:
            raise _fail("paged KV needs seqused_k (batch,) int32: the KV length of each sequence")
        seqlen_k = num_pages * page_size
    else:
        page_size = None
        if cu_seqlens_k is not None:
            if len(ks) != 3 or len(vs) != 3:
                raise _fail(
                    f"with cu_seqlens_k, k/v must be (total_k, kv_heads, head_dim), got {tuple(ks)}"
                )
            if not _vec_ok(cu_seqlens_k, batch + 1, dev):
                _int_vec(cu_seqlens_k, "cu_seqlens_k", batch + 1, dev)
        elif len(ks) != 4 or len(vs) != 4 or ks[0] != batch:
            raise _fail(
                f"without cu_seqlens_k or page_table, k/v must be (batch={batch}, seqlen, heads, dim), got {tuple(k.shape)}"
            )
        if ks[:-1] != vs[:-1]:
            raise _fail(f"k {tuple(ks)} and v {tuple(vs)} differ")
        hk = ks[-2]
        seqlen_k = ks[-3]
    if seqused_k is not None and not _vec_ok(seqused_k, batch, dev):
        _int_vec(seqused_k, "seqused_k", batch, dev)
    dv = vs[-1]
    if window_size == (None, None):
        wl = wr = None
    else:
        wl, wr = _window(window_size)
    sink_dt = None if learnable_sink is None else _sink(learnable_sink, hq, dev)
    cap = None if type(softcap) is float and softcap == 0.0 else _softcap(softcap)
    if pack_gqa is not None and type(pack_gqa) is not bool:
        raise _fail(f"pack_gqa must be True, False or None, got {pack_gqa!r}")
    return_lse = bool(return_lse) or lse is not None
    if out is not None or lse is not None:
        lse_shape = (hq, total_q) if cu_seqlens_q is not None else (batch, hq, sq_dense)
        _check_outputs(q, out, lse, (*qs[:-1], dv), lse_shape, dev)
    return (
        dev, batch, total_q, sq_dense, seqlen_k, hq, hk, d, dv, page_size, wl, wr, sink_dt, cap,
        return_lse, aligned,
    )
