"""The FP8 call contract of FA4's Blackwell forward (4.0.0b36), checked before a kernel runs.

Pure functions over tensors' metadata (torch only; no cutlass, no FA4): what an FP8 call must
satisfy, as FA4's `interface._flash_attn_fwd` states it (line numbers of 4.0.0b36):

- q, k and v (and qv) share one dtype (805-807: "q, k, v, and qv must have the same dtype"):
  an FP8 KV cache needs an FP8 q, quantized by the caller with its own q_descale;
- FP8 runs on compute capability 10.x only (925; sm100 and sm103 in fa4aot);
- the output is bfloat16 whatever the FP8 input (862), and LSE float32 as always;
- each descale is a float32 tensor of shape (batch, num_kv_heads) on the inputs' device
  (908-917, `_validate_tensor`); descales with non-FP8 inputs are refused (919-921);
- which descales are passed, and any stride-0 (broadcast) mode of one, are part of FA4's
  compile key (`q_descale is not None`...; `tensor_broadcast_patterns`): a kernel built with
  all three takes exactly all three, each with real strides;
- FP8 has no backward (860): forward-only.

The fa4aot runtime on Blackwell (runtime/blackwell.py) calls `check_fp8_dtypes` where it checks
dtypes (runtime/validate.py), `fp8_mismatch_reason` when it plans, `check_descales` with the
selected variant's `descales` before the launch, and allocates O as `fp8_out_dtype` says.
"""

from __future__ import annotations

from typing import Any

from fa4aot.errors import ContractViolation, UnsupportedVariant
from fa4aot.model import constraints as C

FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# FA4 4.0.0b36 interface.py:862: `out_torch_dtype = torch.bfloat16 if is_fp8 else q_dtype`
FP8_OUT_DTYPE = "bfloat16"


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def is_fp8(dtype: Any) -> bool:
    return _name(dtype) in FP8_DTYPES


def fp8_out_dtype(dtype: Any) -> str:
    """The dtype of FA4's output for inputs of `dtype` (FP8 in, bfloat16 out)."""
    name = _name(dtype)
    return FP8_OUT_DTYPE if name in FP8_DTYPES else name


def fp8_mismatch_reason(arch: str, q_dtype: Any, kv_dtype: Any) -> str | None:
    """Why FA4 cannot run a call with this q dtype over this K/V dtype on `arch` when either is
    FP8 (None when both are one FP8 dtype on Blackwell, or neither is FP8).

    The vLLM case: an FP8 KV cache (`--kv-cache-dtype fp8`) read by a bfloat16 q. On sm90 FA4
    has no FP8 forward at all (constraints.fp8_reason names the alternatives); on Blackwell it
    has one, but only with q in the same FP8 dtype."""
    q, kv = _name(q_dtype), _name(kv_dtype)
    if q not in FP8_DTYPES and kv not in FP8_DTYPES:
        return None
    if not C.is_blackwell(arch):
        fp8 = kv if kv in FP8_DTYPES else q
        which = "q/k/v" if q == kv else ("k/v" if kv in FP8_DTYPES else "q")
        return C.fp8_reason(arch, fp8, which)
    if q == kv:
        return None
    if q in FP8_DTYPES and kv in FP8_DTYPES:
        return (
            f"q dtype {q} with k/v dtype {kv} on {arch}: FA4 (4.0.0b36) runs FP8 only with q, k "
            "and v in one FP8 dtype; quantize them to one"
        )
    if kv in FP8_DTYPES:
        return (
            f"k/v dtype {kv} with q dtype {q} on {arch}: FA4 (4.0.0b36) runs FP8 only with q, k "
            f"and v in one dtype (it asserts 'q, k, v, and qv must have the same dtype'). "
            f"Quantize q to {kv} and pass its scale as q_descale, with k_descale and v_descale "
            "(float32, shape (batch, num_kv_heads), on the GPU); the output is bfloat16. "
            "Or keep a bfloat16 K/V cache (dequantize it) to run the bfloat16 kernel"
        )
    return (
        f"q dtype {q} with k/v dtype {kv} on {arch}: FA4 (4.0.0b36) runs FP8 only with q, k "
        f"and v in one FP8 dtype; quantize K/V to {q} with k_descale/v_descale, or pass a "
        f"{kv} q"
    )


def check_fp8_dtypes(arch: str, q: Any, k: Any, v: Any) -> None:
    """Raise UnsupportedVariant (with fp8_mismatch_reason's message) for an FP8 call FA4 cannot
    run on `arch`: FP8 off Blackwell, or q, k, v not one FP8 dtype."""
    if k.dtype != v.dtype:
        if is_fp8(k.dtype) or is_fp8(v.dtype):
            raise UnsupportedVariant(
                f"k dtype {_name(k.dtype)} and v dtype {_name(v.dtype)} on {arch}: FA4 needs "
                "q, k and v in one dtype"
            )
        return
    why = fp8_mismatch_reason(arch, q.dtype, k.dtype)
    if why:
        raise UnsupportedVariant(why)


def check_descales(
    expected: str | None,
    *,
    dtype: Any,
    batch: int,
    num_heads_kv: int,
    device: Any,
    q_descale: Any = None,
    k_descale: Any = None,
    v_descale: Any = None,
) -> None:
    """Check the descales of a call to a kernel built with `expected` (Variant.descales: a
    subset of "qkv", None for none) on inputs of `dtype`. Raises ContractViolation naming the
    tensor and the rule; never reads tensor data (no device sync).

    batch: the call's batch (FA4's batch_size: sequences, cu_seqlens_q's length - 1 for a
    packed q); num_heads_kv: K/V heads of the call as the kernel sees them."""
    import torch

    given = {"q": q_descale, "k": k_descale, "v": v_descale}
    passed = "".join(n for n, t in given.items() if t is not None)
    if passed and not is_fp8(dtype):
        raise ContractViolation(
            f"{'/'.join(passed)}_descale given with {_name(dtype)} inputs: descales scale FP8 "
            "q/k/v only (FA4 asserts the same)"
        )
    if passed != (expected or ""):
        raise ContractViolation(
            f"the kernel takes descales {expected or 'none'!r}, the call passes "
            f"{passed or 'none'!r}: which descales are passed is part of FA4's compile key "
            "(pass the same set, e.g. torch.ones for an unscaled tensor, or build that variant)"
        )
    want = (batch, num_heads_kv)
    for n, t in given.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ContractViolation(f"{n}_descale must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != want:
            raise ContractViolation(
                f"{n}_descale shape {tuple(t.shape)}, expected (batch, num_kv_heads) = {want}"
            )
        if t.dtype != torch.float32:
            raise ContractViolation(f"{n}_descale dtype {_name(t.dtype)}, expected float32")
        if t.device != torch.device(device):
            raise ContractViolation(
                f"{n}_descale is on {t.device}, the inputs on {torch.device(device)}"
            )
        if 0 in t.stride():
            # a broadcast (expand) descale keeps its stride-0 mode static in FA4's kernel: it is
            # another compile key, which fa4aot never builds
            raise ContractViolation(
                f"{n}_descale has a stride-0 (broadcast) mode, stride {tuple(t.stride())}: pass "
                f"{n}_descale.contiguous()"
            )
        if t.stride(-1) != 1:
            raise ContractViolation(
                f"{n}_descale must be contiguous in its last dim, stride {tuple(t.stride())}"
            )
