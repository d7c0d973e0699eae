"""The argument lists of kernels built from SGLang 0.5.23's FA4 copy (`fa4aot build --fa4
sglang`) on sm90: what `sglang/kernels/ops/attention/flash_attn/cute/interface.py` passes its
compiled forward (17 slots) and combine (9 slots), spelled for the compiler-free runtime.

Differences from upstream's (runtime/abi.py): after the aux data comes the relative-attention
bias (`mBias`, None here), and there are no cu_total slots (the copy's sm90 scheduler takes
none: it runs varlen batches over 256 without helper kernels). The combine takes upstream's
nine slots. launch.SM90_SGLANG is the runtime's launcher for these lists;
`tests/fa4/test_sglang_abi.py` checks both against the copy's own calls, slot by slot. Imports
nothing.
"""

from __future__ import annotations

from fa4aot.model.abis import SGLANG_COMBINE, SGLANG_SM90_FWD  # noqa: F401 (the tables spelled)

AUX_NONE = (None, None)  # AuxData(tensors=None, scalars=None): a compile-time value


def fwd_args(
    q, k, v, out, lse, softmax_scale: float, cu_seqlens_q=None, cu_seqlens_k=None,
    seqused_q=None, seqused_k=None, page_table=None, window_left=None, window_right=None,
    learnable_sink=None, *, bias=None,
) -> tuple:  # fmt: skip
    """The 17 positional arguments of the copy's compiled sm90 forward (SGLANG_SM90_FWD):
    block sparsity None and empty aux data, as the runtime serves neither."""
    return (
        q, k, v, out, lse, softmax_scale,
        cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
        window_left, window_right, learnable_sink,
        None, AUX_NONE,
        bias,
    )  # fmt: skip


def combine_args(out_partial, lse_partial, out, lse, cu_seqlens=None, seqused=None,
                 num_splits_dynamic=None, varlen_batch_idx=None,
                 semaphore_to_reset=None) -> tuple:  # fmt: skip
    """The copy's compiled combine's 9 slots (SGLANG_COMBINE)."""
    return (out_partial, lse_partial, out, lse, cu_seqlens, seqused, num_splits_dynamic,
            varlen_batch_idx, semaphore_to_reset)
