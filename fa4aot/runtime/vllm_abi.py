"""The argument lists of kernels built from vLLM 0.33.0's FA4 copy (`fa4aot build --fa4 vllm`) on
sm90: what `vllm/vllm_flash_attn/cute/interface.py` prepares and passes its compiled forward
(21 slots) and combine (10 slots), spelled for the compiler-free runtime.

Differences from upstream's (runtime/abi.py): `dynamic_causal` at slot 10 (the page table moves
to 11); the FP8-KV descales (`DescaleTensors(q, k, v)`, a plain tuple here: tvm-ffi converts
both to one Array) at 17 and the fused output scale at 18, before the two cu_total slots; the
combine takes an output scale last. `tests/fa4/test_vllm_abi.py` checks every list against the
copy's own calls, slot by slot. Imports torch only.

FP8-KV dequant (`fp8_kv_prepare`): bf16/fp16 Q, e4m3 K/V given to the kernel as uint8 views,
fp32 (batch, kv_heads) K/V descales with a ones q descale; O in Q's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fa4aot.model.abis import VLLM_COMBINE, VLLM_SM90_FWD  # noqa: F401 (the tables these spell)

AUX_NONE = (None, None)  # AuxData(tensors=None, scalars=None): a compile-time value
FP8_KV = (torch.float8_e4m3fn,)


def fwd_args(
    q, k, v, out, lse, softmax_scale: float, cu_seqlens_q=None, cu_seqlens_k=None,
    seqused_q=None, seqused_k=None, page_table=None, window_left=None, window_right=None,
    learnable_sink=None, *, dynamic_causal=None, descales: tuple | None = None,
    output_scale=None, cu_total_m_blocks=None, cu_total_splits_m_blocks=None,
) -> tuple:  # fmt: skip
    """The 21 positional arguments of the copy's compiled sm90 forward (VLLM_SM90_FWD):
    block sparsity None and empty aux data, as the runtime serves neither."""
    return (
        q, k, v, out, lse, softmax_scale,
        cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, dynamic_causal, page_table,
        window_left, window_right, learnable_sink,
        None, AUX_NONE,
        descales, output_scale,
        cu_total_m_blocks, cu_total_splits_m_blocks,
    )  # fmt: skip


def launch_sm90(
    fwd, q, k, v, out, lse, softmax_scale, cu_seqlens_q=None, cu_seqlens_k=None,
    seqused_q=None, seqused_k=None, page_table=None, window_left=None, window_right=None,
    learnable_sink=None, cu_total_m_blocks=None, descales=None,
):  # fmt: skip
    """fwd(*fwd_args(...)) without building the tuple; the first 16 parameters are the
    runtime's bound launchers' (runtime/launch.py), as abi.launch_sm90's are."""
    return fwd(
        q, k, v, out, lse, softmax_scale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        None, page_table, window_left, window_right, learnable_sink, None, AUX_NONE,
        descales, None, cu_total_m_blocks, None,
    )  # fmt: skip


def combine_args(out_partial, lse_partial, out, lse, cu_seqlens=None, seqused=None,
                 num_splits_dynamic=None, virtual_batch_idx=None, semaphore_to_reset=None,
                 output_scale=None) -> tuple:  # fmt: skip
    """The copy's compiled combine's 10 slots (VLLM_COMBINE)."""
    return (out_partial, lse_partial, out, lse, cu_seqlens, seqused, num_splits_dynamic,
            virtual_batch_idx, semaphore_to_reset, output_scale)


def fp8_kv_prepare(q, k, v, k_descale, v_descale) -> tuple:
    """(k, v, descales) as the copy passes them under fp8_kv_dequant: K/V viewed as uint8, and
    (ones like k_descale, k_descale, v_descale). ValueError unless Q is bf16/fp16, K/V e4m3 and
    both descales fp32 (batch, kv_heads) with the head stride 1 (the kernel's leading dim)."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"FP8-KV dequant takes bf16/fp16 q, not {q.dtype}")
    if k.dtype not in FP8_KV or v.dtype != k.dtype:
        raise ValueError(f"FP8-KV dequant takes e4m3 k and v, not {k.dtype}/{v.dtype}")
    for name, d in (("k_descale", k_descale), ("v_descale", v_descale)):
        if d is None or d.dtype != torch.float32 or d.dim() != 2 or d.stride(1) != 1:
            got = None if d is None else (d.dtype, tuple(d.shape), d.stride())
            raise ValueError(f"FP8-KV dequant needs {name}: float32 (batch, kv_heads) with "
                             f"stride 1 over heads (got {got})")
    return k.view(torch.uint8), v.view(torch.uint8), (torch.ones_like(k_descale), k_descale,
                                                       v_descale)


@dataclass
class Prep:
    """A call's kernel-side buffers: `kernel_out` / `kernel_lse` go to the forward (the
    partials when split), `out` / `lse` are the call's results."""

    out: torch.Tensor
    lse: torch.Tensor | None
    kernel_out: torch.Tensor
    kernel_lse: torch.Tensor | None
    num_splits: int

    def combine(self, cu_seqlens_q=None, seqused_q=None) -> tuple:
        """The combine's arguments after a split forward: partial LSE and LSE seqlen-major
        (the copy's `lse_partial.transpose(-1, -2)`)."""
        return combine_args(self.kernel_out, self.kernel_lse.transpose(-1, -2), self.out,
                            None if self.lse is None else self.lse.transpose(-1, -2),
                            cu_seqlens_q, seqused_q)


def prepare(q, head_dim_v: int, *, varlen_q: bool, out=None, return_lse: bool = False,
            num_splits: int = 1) -> Prep:
    """The copy's output buffers for q (packed (total_q, h, d) when varlen_q, else (b, s, h,
    d)): O in q's dtype; LSE fp32 (h, total_q) / (b, h, s) when asked for; with num_splits > 1
    fp32 partials (n, *q's rows, h, dv) and (n, *LSE's shape)."""
    rows = q.shape[:1] if varlen_q else q.shape[:2]
    h = q.shape[-2]
    if out is None:
        out = q.new_empty(*rows, h, head_dim_v)
    lse_shape = (h, rows[0]) if varlen_q else (rows[0], h, rows[1])
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device) if return_lse else None
    if num_splits <= 1:
        return Prep(out, lse, out, lse, 1)
    op = torch.empty(num_splits, *rows, h, head_dim_v, dtype=torch.float32, device=q.device)
    lp = torch.empty(num_splits, *lse_shape, dtype=torch.float32, device=q.device)
    return Prep(out, lse, op, lp, num_splits)
