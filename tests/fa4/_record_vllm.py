"""Subprocess of test_vllm_abi.py: run vLLM's FA4 copy (`_flash_attn_fwd`, sm90, under
FakeTensorMode) for each case with `cute.compile` replaced by a recording stand-in and the
copy's `is_fake_mode` answered False, so it goes on to call what it "compiled"; lay out the same
call with fa4aot.runtime.vllm_abi; print, as _record_copy.py does, the two call sequences and
the keys per case.

    python _record_vllm.py VLLM_ROOT [case ...]
"""

from __future__ import annotations

import os
import warnings

os.environ.update(FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="0", FLASH_ATTENTION_ARCH="sm_90",
                  CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from _record_copy import BF16, dense, record  # noqa: E402

from fa4aot.runtime import vllm_abi as VA  # noqa: E402

FP8, I32 = torch.float8_e4m3fn, torch.int32


def paged(b, sq, sk, hq, hk, d, page, kv=BF16, splits=1, lse=False):
    """vLLM's call (flash_attn_interface.py, fa_version 4): packed q, seqused_k, its cache
    views (blocks, page, hk, d) with token stride 2d, out given; FP8 K/V -> fp8_kv_dequant."""
    npp = -(-sk // page)
    cache = torch.empty(b * npp, hk, page, 2 * d, dtype=kv, device="cuda")
    k, v = cache.transpose(1, 2).split(d, dim=-1)
    inp = dict(q=torch.empty(b * sq, hq, d, dtype=BF16, device="cuda"), k=k, v=v,
               cu_seqlens_q=torch.empty(b + 1, dtype=I32, device="cuda"),
               seqused_k=torch.empty(b, dtype=I32, device="cuda"),
               page_table=torch.empty(b, npp, dtype=I32, device="cuda"),
               out=torch.empty(b * sq, hq, d, dtype=BF16, device="cuda"))
    kw = dict(max_seqlen_q=sq, max_seqlen_k=sk, softmax_scale=d ** -0.5, causal=True,
              num_splits=splits, return_lse=lse)
    if kv == FP8:
        inp.update(k_descale=torch.empty(b, hk, dtype=torch.float32, device="cuda"),
                   v_descale=torch.empty(b, hk, dtype=torch.float32, device="cuda"))
        kw["fp8_kv_dequant"] = True
    return inp, kw


def varlen(b, s, hq, hk, d, lse=False, splits=1):
    t = b * s
    inp = dict(q=torch.empty(t, hq, d, dtype=BF16, device="cuda"),
               k=torch.empty(t, hk, d, dtype=BF16, device="cuda"),
               v=torch.empty(t, hk, d, dtype=BF16, device="cuda"),
               cu_seqlens_q=torch.empty(b + 1, dtype=I32, device="cuda"),
               cu_seqlens_k=torch.empty(b + 1, dtype=I32, device="cuda"))
    return inp, dict(max_seqlen_q=s, max_seqlen_k=s, softmax_scale=d ** -0.5, causal=True,
                     return_lse=lse, num_splits=splits)


CASES = {
    "bf16_p64_decode": lambda: paged(4, 1, 4096, 32, 4, 512, 64),
    "bf16_p64_prefill": lambda: paged(2, 256, 1024, 32, 4, 512, 64),
    "bf16_p64_decode_tp8": lambda: paged(4, 1, 4096, 4, 1, 512, 64),
    "bf16_p16_decode": lambda: paged(4, 1, 4096, 32, 4, 512, 16),
    "fp8_p64_decode": lambda: paged(4, 1, 4096, 32, 4, 512, 64, FP8),
    "fp8_p64_prefill": lambda: paged(2, 256, 1024, 32, 4, 512, 64, FP8),
    "bf16_varlen_prefill": lambda: varlen(2, 512, 32, 4, 512),
    "bf16_varlen_lse_split": lambda: varlen(2, 64, 32, 4, 512, lse=True, splits=4),
    "bf16_dense_prefill": lambda: dense(2, 512, 32, 4, 512),
    "bf16_p64_split32": lambda: paged(4, 1, 16384, 32, 4, 512, 64, splits=32),
    "fp8_p64_split32": lambda: paged(4, 1, 16384, 32, 4, 512, 64, FP8, splits=32),
    # the runtime's own split step (vllm_abi.SplitKv.run) at counts of the 64 and 128 buckets
    "bf16_p64_split48": lambda: paged(2, 1, 16384, 32, 4, 512, 64, splits=48),
    "fp8_p64_split100_tp8": lambda: paged(2, 1, 16384, 4, 1, 512, 64, FP8, splits=100),
    "hd128_p128_decode": lambda: paged(4, 1, 4096, 32, 8, 128, 128),
    # varlen batch > 256: the tile cumsum and blocks-to-batch helpers before the forward
    "bf16_varlen_b300": lambda: varlen(300, 4, 32, 4, 512),
}
KINDS = {"FlashAttentionForwardSm90": "fwd", "FlashAttentionForwardCombine": "combine",
         "CuSeqlensToBlocksKernel": "tile_cumsum", "CuBlocksToBatchKernel": "blocks_to_batch"}


def ours(inp, kw):
    """The runtime's calls for the case: vllm_abi's buffers and argument lists."""
    q, k, v = inp["q"], inp["k"], inp["v"]
    varlen_q = "cu_seqlens_q" in inp
    p = VA.prepare(q, v.shape[-1], varlen_q=varlen_q, out=inp.get("out"),
                   return_lse=kw["return_lse"], num_splits=kw.get("num_splits", 1))
    descales = None
    if kw.get("fp8_kv_dequant"):
        k, v, descales = VA.fp8_kv_prepare(q, k, v, inp["k_descale"], inp["v_descale"])
    calls, cu_total = [], None
    if p.num_splits > 1 and "page_table" in inp:  # the runtime's split step, as served
        from fa4aot.runtime import launch as L

        def rec(kind):
            return lambda *a: calls.append((kind, a))

        bucket = VA.combine_bucket(p.num_splits)
        sk = VA.SplitKv(rec("fwd"), {(q.shape[-2], bucket): rec("combine")}, 64, L.SM90_VLLM.fwd,
                        paged_tma=False)  # (no page-table guard: fake tensors have no address)
        sk.run(p.num_splits, q, k, v, inp["out"], kw["softmax_scale"], inp["cu_seqlens_q"],
               inp["seqused_k"], inp["page_table"], None, None, descales)
        return calls
    b = inp["cu_seqlens_q"].shape[0] - 1 if varlen_q else q.shape[0]
    if varlen_q and b > 256:  # the batch > 256 helpers: upstream's slots (runtime/abi.py)
        from fa4aot.runtime import launch as UA

        ratio = q.shape[-2] // v.shape[-2]
        h = UA.cu_hint_prepare(b, q.shape[0], 64, ratio, ratio > 1, q.device)
        calls += [("tile_cumsum", h.tile_cumsum_args(inp["cu_seqlens_q"], None)),
                  ("blocks_to_batch", h.blocks_to_batch_args())]
        cu_total = h.cu_total_m_blocks
    fwd = VA.launch_sm90(lambda *a: a, q, k, v, p.kernel_out, p.kernel_lse, kw["softmax_scale"],
                         inp.get("cu_seqlens_q"), inp.get("cu_seqlens_k"), None,
                         inp.get("seqused_k"), inp.get("page_table"), None, None, None, cu_total,
                         descales)
    assert fwd == VA.fwd_args(q, k, v, p.kernel_out, p.kernel_lse, kw["softmax_scale"],
                              inp.get("cu_seqlens_q"), inp.get("cu_seqlens_k"), None,
                              inp.get("seqused_k"), inp.get("page_table"), descales=descales,
                              cu_total_m_blocks=cu_total)
    calls.append(("fwd", fwd))
    if p.num_splits > 1:
        calls.append(("combine", p.combine(inp.get("cu_seqlens_q"), None)))
    return calls


def setup(I):
    return {"fwd": I._flash_attn_fwd.compile_cache,
            "combine": I._flash_attn_fwd_combine.compile_cache,
            "tile_cumsum": I._compute_tile_cumsum.compile_cache,
            "blocks_to_batch": I._compute_blocks_to_batch.compile_cache}


if __name__ == "__main__":
    record("vllm", CASES, KINDS, ours, setup)
