"""fa4aot's entry points as torch.library custom ops, for torch.compile.

`torch.compile(fullgraph=True)` cannot trace into a tvm-ffi call ("Failed to trace builtin
operator"), and the default mode breaks the graph there. Through these ops it traces the call
as one node, with shapes from the fake implementations below, and `mode="reduce-overhead"`
captures the kernels in its CUDA graph like any other op.

They are a separate entry point, not what `fa4aot.flash_attn_func` calls: the custom-op
dispatcher costs host time per eager call that the plain functions must not pay. Same
arguments as `fa4aot.flash_attn_func` / `flash_attn_varlen_func` (FA4's), less the caller's
`out=` / `lse=` buffers (a custom op returns fresh tensors) and `padding=`.

    import fa4aot.ops
    out, lse = fa4aot.ops.flash_attn_func(q, k, v, causal=True)  # inside torch.compile too
"""

from __future__ import annotations

import torch

from fa4aot import runtime as R
from fa4aot.runtime.splitruns import fresh_scratch

_F32 = torch.float32


def _no_lse(q: torch.Tensor) -> torch.Tensor:
    # a custom op cannot return None: an empty tensor stands for "no LSE"
    return q.new_empty((0,), dtype=_F32)


@torch.library.custom_op("fa4aot::flash_attn_func", mutates_args=())
def _dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None,
    causal: bool,
    window_left: int | None,
    window_right: int | None,
    learnable_sink: torch.Tensor | None,
    return_lse: bool,
    softcap: float,
    pack_gqa: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    with fresh_scratch():  # nothing kept that a cudagraph-trees warm-up allocated
        out, lse = R.flash_attn_func(
            q, k, v, softmax_scale, causal, (window_left, window_right), learnable_sink,
            return_lse, softcap=softcap, pack_gqa=pack_gqa,
        )
    return out, _no_lse(q) if lse is None else lse


@_dense.register_fake
def _dense_fake(q, k, v, softmax_scale, causal, window_left, window_right, learnable_sink,
                return_lse, softcap, pack_gqa=None):
    b, sq, hq, _ = q.shape
    out = q.new_empty((b, sq, hq, v.shape[-1]))
    return out, q.new_empty((b, hq, sq), dtype=_F32) if return_lse else _no_lse(q)


@torch.library.custom_op("fa4aot::flash_attn_varlen_func", mutates_args=())
def _varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    seqused_q: torch.Tensor | None,
    seqused_k: torch.Tensor | None,
    page_table: torch.Tensor | None,
    softmax_scale: float | None,
    causal: bool,
    window_left: int | None,
    window_right: int | None,
    learnable_sink: torch.Tensor | None,
    return_lse: bool,
    softcap: float,
    pack_gqa: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    with fresh_scratch():
        out, lse = R.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
            seqused_k, page_table, softmax_scale, causal, (window_left, window_right),
            learnable_sink, return_lse, softcap=softcap, pack_gqa=pack_gqa,
        )
    return out, _no_lse(q) if lse is None else lse


@_varlen.register_fake
def _varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                 seqused_k, page_table, softmax_scale, causal, window_left, window_right,
                 learnable_sink, return_lse, softcap, pack_gqa=None):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if not return_lse:
        return out, _no_lse(q)
    if cu_seqlens_q is not None:  # q (total_q, hq, d): lse (hq, total_q)
        return out, q.new_empty((q.shape[1], q.shape[0]), dtype=_F32)
    b, sq, hq, _ = q.shape
    return out, q.new_empty((b, hq, sq), dtype=_F32)


def flash_attn_func(
    q, k, v, softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None,
    return_lse=False, *, softcap=0.0, pack_gqa=None,
):
    """fa4aot.flash_attn_func through the custom op `fa4aot::flash_attn_func`."""
    out, lse = _dense(q, k, v, softmax_scale, causal, window_size[0], window_size[1],
                      learnable_sink, bool(return_lse), float(softcap), pack_gqa)
    return out, lse if return_lse else None


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    seqused_q=None, seqused_k=None, page_table=None, softmax_scale=None, causal=False,
    window_size=(None, None), learnable_sink=None, return_lse=False, *, softcap=0.0,
    pack_gqa=None,
):
    """fa4aot.flash_attn_varlen_func through the custom op `fa4aot::flash_attn_varlen_func`."""
    out, lse = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       seqused_q, seqused_k, page_table, softmax_scale, causal, window_size[0],
                       window_size[1], learnable_sink, bool(return_lse), float(softcap),
                       pack_gqa)
    return out, lse if return_lse else None


__all__ = ["flash_attn_func", "flash_attn_varlen_func"]
