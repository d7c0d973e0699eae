"""FP8-KV dequant calls (bf16/fp16 Q, e4m3 paged K/V, fp32 (batch, kv_heads) K/V descales):
served from a store built from vLLM's FA4 copy on sm90 (`fa4aot build --fa4 vllm`, variants
with `kv_dtype`), whose kernel dequantizes K/V itself and computes in fp16.

The call is vLLM's: q packed (total_q, hq, d) with cu_seqlens_q (or (b, s, hq, d)), K/V
(num_pages, page_size, hk, d) with page_table and seqused_k, page_size == the kernel's tile_n
(64 at hd512). The kernel takes K/V as uint8 views and the descales as (ones, k, v)
(runtime/vllm_abi.fp8_kv_prepare). A long decode step runs the copy's split forward and combine
where the store has them (vllm_abi.split_step: the count from the batch, the KV heads and
max_seqlen_k). Plans are cached per static key, as the other entry points' are.
"""

from __future__ import annotations

import math

import torch

from fa4aot.errors import ContractViolation, UnsupportedVariant
from fa4aot.model import constraints as C
from fa4aot.model.compile_keys import features
from fa4aot.runtime import vllm_abi as VA
from fa4aot.runtime.validate import _aligned

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def is_fp8_kv(q, k, v, fp8_kv_dequant: bool | None) -> bool:
    """Whether a call is FP8-KV dequant: e4m3 K/V under a bf16/fp16 q (fp8_kv_dequant None:
    inferred; True: required, refused otherwise; False: never)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and isinstance(v, torch.Tensor)):
        if fp8_kv_dequant:
            raise ContractViolation("fp8_kv_dequant=True takes q, k and v tensors")
        return False  # (the entry point's own checks refuse it)
    mixed = q.dtype in DTYPES and k.dtype in VA.FP8_KV
    if fp8_kv_dequant and not (mixed and v.dtype == k.dtype):
        raise ContractViolation(
            f"fp8_kv_dequant=True takes a bf16/fp16 q and e4m3 k/v (got {q.dtype}, {k.dtype}, "
            f"{v.dtype})")
    return mixed if fp8_kv_dequant is None else bool(fp8_kv_dequant)


def varlen(rt, q, k, v, cu_seqlens_q, max_seqlen_q, seqused_k, page_table, softmax_scale,
           causal, window_size, learnable_sink, return_lse, out, lse, k_descale, v_descale,
           max_seqlen_k=None):
    """flash_attn_varlen_func for an FP8-KV dequant call (see the module doc). -> (out, lse)."""
    if page_table is None or seqused_k is None:
        raise ContractViolation("FP8-KV dequant takes paged K/V: page_table and seqused_k")
    if learnable_sink is not None:
        raise UnsupportedVariant("FP8-KV dequant with a learnable sink is not built")
    if k.dim() != 4 or v.shape != k.shape:
        raise ContractViolation(f"paged k/v must be (num_pages, page_size, kv_heads, d) alike, "
                                f"got {tuple(k.shape)} and {tuple(v.shape)}")
    varlen_q = cu_seqlens_q is not None
    if varlen_q:
        if q.dim() != 3:
            raise ContractViolation("q with cu_seqlens_q is (total_q, heads, d)")
        batch, total_q = cu_seqlens_q.shape[0] - 1, q.shape[0]
        sq = None
    else:
        if q.dim() != 4:
            raise ContractViolation("q without cu_seqlens_q is (batch, seqlen_q, heads, d)")
        batch, sq = q.shape[0], q.shape[1]
        total_q = batch * sq
    hq, d = q.shape[-2], q.shape[-1]
    _, page, hk, dk = k.shape
    if dk != d or hq % hk:
        raise ContractViolation(f"q (.., {hq}, {d}) and k (.., {hk}, {dk}): head dims must match "
                                "and kv heads divide q heads")
    if page_table.shape[0] != batch or seqused_k.shape[0] != batch:
        raise ContractViolation(f"page_table and seqused_k need {batch} rows")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not _aligned(t):
            raise ContractViolation(
                f"{name} must have a 16-byte aligned base, a contiguous last dim and 16-byte "
                f"aligned strides (got strides {tuple(t.stride())})")
    kd, vd = k_descale, v_descale
    for name, t in (("k_descale", kd), ("v_descale", vd)):
        if t is None or tuple(t.shape) != (batch, hk) or t.dtype != torch.float32:
            raise ContractViolation(
                f"FP8-KV dequant needs {name}: float32 ({batch}, {hk}) (per sequence and KV "
                f"head; vLLM's layer scale expanded and made contiguous)")
    if kd.stride(1) != 1:
        kd = kd.contiguous()
    if vd.stride(1) != 1:
        vd = vd.contiguous()
    wl, wr = window_size
    dev = q.device.index if q.is_cuda else q.get_device()  # (-1 off CUDA)
    key = ("fp8kv", q.dtype, d, hq // hk, bool(causal), wl, wr, return_lse, varlen_q, page,
           batch > C.BIN_BATCH_SEARCH_THRESH,
           min(max_seqlen_q if max_seqlen_q is not None else (total_q if varlen_q else sq), 193),
           max_seqlen_q is None, dev)
    plan = rt._plans.get(key)
    if plan is None:
        if dev < 0:
            raise ContractViolation("FP8-KV dequant runs on a CUDA device")
        arch, sms = rt.device(dev)
        why = C.kv_dtype_reason(arch, rt.fa4_abi(arch, sms), DTYPES[q.dtype], C.FP8_KV, d, d)
        if why:
            raise UnsupportedVariant(why)
        variant = features(
            arch=arch, dtype=DTYPES[q.dtype], head_dim=d, head_dim_v=d, num_heads=hq,
            num_heads_kv=hk, causal=bool(causal), window_left=wl, window_right=wr,
            return_lse=bool(return_lse), sink_dtype=None, batch=batch, seqlen_q=sq,
            total_q=total_q, max_seqlen_q=max_seqlen_q if varlen_q else None,
            cu_seqlens_q=varlen_q, seqused_k=True, page_size=page, kv_dtype=C.FP8_KV,
        )
        if not variant.paged_tma:
            raise UnsupportedVariant(
                f"{variant.describe()}: FP8-KV dequant loads K/V by TMA only: pages of "
                f"{variant.tile.n} tokens (got {page}; vLLM reports that block size for it)")
        plan = rt.plan(variant, sms)
        if plan is None:
            rt.miss(variant, sms, False)  # (raises ArtifactMissing naming the build)
        _, _, plan.window_left, plan.window_right = C.resolve_window(causal, wl, wr)
        rt._plans[key] = plan
    if out is None:
        out = q.new_empty(q.shape)
    if lse is None and return_lse:
        lse = q.new_empty(*((hq, total_q) if varlen_q else (batch, hq, sq)), dtype=torch.float32)
    if total_q == 0:
        return out, lse
    k8, v8, descales = VA.fp8_kv_prepare(q, k, v, kd, vd)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if rt.split and not return_lse:
        got = VA.split_step(rt, plan, dev, q, k8, v8, out, batch, hk, max_seqlen_k, page_table,
                            seqused_k, cu_seqlens_q, scale, descales)
        if got is not None:
            return got, lse
    cu_total = None
    if plan.tile is not None:  # varlen batch > 256: the tile cumsum helper
        if max_seqlen_q == 1 and plan.helper_cu and plan.decode_blocks:
            cu_total = cu_seqlens_q
        else:
            cu_total = cu_seqlens_q.new_empty(batch + 1)
            plan.tile(cu_total, cu_seqlens_q if plan.helper_cu else None, None)
    plan.launch(q, k8, v8, out, lse, scale, cu_seqlens_q, None, None, seqused_k, page_table,
                plan.window_left, plan.window_right, None, cu_total, descales=descales)
    return out, lse
