"""Subprocess of test_sglang_abi.py: run SGLang's FA4 copy (`_flash_attn_fwd`, sm90, under
FakeTensorMode) for each case with `cute.compile` replaced by a recording stand-in and the
copy's `is_fake_mode` answered False, so it goes on to call what it "compiled"; make the same
call through fa4aot's runtime launcher for such a store (launch.abi_for("sm90", "sglang")) and
sglang_abi's lists; print, as _record_copy.py does, the two call sequences and the keys per
case, and the canonical variant read back.

    python _record_sglang.py SGLANG_ROOT [case ...]
"""

from __future__ import annotations

import os
import warnings

os.environ.update(FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a",
                  FLASH_ATTENTION_NUM_SMS="132")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from _record_copy import BF16, dense, record  # noqa: E402

from fa4aot.fa4 import sglang_copy  # noqa: E402
from fa4aot.runtime import launch as L  # noqa: E402
from fa4aot.runtime import sglang_abi as SA  # noqa: E402

I32 = torch.int32


def i32(*n):
    return torch.empty(*n, dtype=I32, device="cuda")


def paged(b, sq, sk, hq, hk, d, page, window=None, splits=1, lse=False):
    """SGLang's paged call (flash_attention_v4.py): packed q, cu_seqlens_q, seqused_k, the
    cache (pages, page, hk, d), out given."""
    npp = -(-sk // page)
    inp = dict(q=torch.empty(b * sq, hq, d, dtype=BF16, device="cuda"),
               k=torch.empty(b * npp, page, hk, d, dtype=BF16, device="cuda"),
               v=torch.empty(b * npp, page, hk, d, dtype=BF16, device="cuda"),
               cu_seqlens_q=i32(b + 1), seqused_k=i32(b), page_table=i32(b, npp),
               out=torch.empty(b * sq, hq, d, dtype=BF16, device="cuda"))
    kw = dict(max_seqlen_q=sq, max_seqlen_k=sk, softmax_scale=d ** -0.5, causal=True,
              num_splits=splits, return_lse=lse)
    if window is not None:
        kw.update(window_size_left=window, window_size_right=0)
    return inp, kw


def varlen(b, s, hq, hk, d, lse=False, sink=False, window=None):
    t = b * s
    inp = dict(q=torch.empty(t, hq, d, dtype=BF16, device="cuda"),
               k=torch.empty(t, hk, d, dtype=BF16, device="cuda"),
               v=torch.empty(t, hk, d, dtype=BF16, device="cuda"),
               cu_seqlens_q=i32(b + 1), cu_seqlens_k=i32(b + 1))
    if sink:
        inp["learnable_sink"] = torch.empty(hq, dtype=BF16, device="cuda")
    kw = dict(max_seqlen_q=s, max_seqlen_k=s, softmax_scale=d ** -0.5, causal=True,
              return_lse=lse)
    if window is not None:
        kw.update(window_size_left=window, window_size_right=0)
    return inp, kw


CASES = {
    "hd128_p128_decode": lambda: paged(4, 1, 4096, 32, 8, 128, 128),
    "hd128_p16_decode": lambda: paged(4, 1, 4096, 32, 8, 128, 16),
    "hd128_p64_prefill": lambda: paged(2, 256, 1024, 32, 8, 128, 64),
    "hd128_varlen_lse": lambda: varlen(2, 512, 32, 8, 128, lse=True),
    "hd128_varlen_b300": lambda: varlen(300, 4, 32, 8, 128),
    "hd128_dense_prefill": lambda: dense(2, 512, 32, 8, 128),
    "hd128_dense_mha_noncausal": lambda: dense(2, 256, 16, 16, 128, causal=False),
    "hd64_varlen_sink_window": lambda: varlen(3, 300, 64, 8, 64, sink=True, window=128),
    "hd256_p64_window_decode": lambda: paged(4, 1, 4096, 32, 16, 256, 64, window=1023),
    "hd128_p128_split4": lambda: paged(4, 1, 8192, 32, 8, 128, 128, splits=4, lse=True),
}
KINDS = {"FlashAttentionForwardSm90": "fwd", "FlashAttentionForwardCombine": "combine"}


def ours(inp, kw):
    """The runtime's calls for the case: the store's launcher (launch.SM90_SGLANG) over
    buffers laid out as the copy's, and (split) sglang_abi's combine list."""
    q, k, v = inp["q"], inp["k"], inp["v"]
    varlen_q = "cu_seqlens_q" in inp
    rows = q.shape[:1] if varlen_q else q.shape[:2]
    h, dv = q.shape[-2], v.shape[-1]
    out = inp.get("out")
    if out is None:
        out = q.new_empty(*rows, h, dv)
    lse_shape = (h, rows[0]) if varlen_q else (rows[0], h, rows[1])
    lse = torch.empty(lse_shape, dtype=torch.float32, device="cuda") if kw["return_lse"] else None
    n = kw.get("num_splits", 1)
    kout, klse = out, lse
    if n > 1:
        kout = torch.empty(n, *rows, h, dv, dtype=torch.float32, device="cuda")
        klse = torch.empty(n, *lse_shape, dtype=torch.float32, device="cuda")
    calls = []
    wl = kw.get("window_size_left")
    wr = kw.get("window_size_right")
    if kw["causal"] and wl is not None:
        wr = 0
    launch = L.abi_for("sm90", "sglang").fwd(lambda *a: calls.append(("fwd", a)))
    args = (q, k, v, kout, klse, kw["softmax_scale"], inp.get("cu_seqlens_q"),
            inp.get("cu_seqlens_k"), None, inp.get("seqused_k"), inp.get("page_table"), wl, wr,
            inp.get("learnable_sink"))
    launch(*args, i32(5))  # (a cu_total the runtime may hold: the copy has no slot for it)
    assert calls[-1][1] == SA.fwd_args(*args)
    if n > 1:
        calls.append(("combine", SA.combine_args(
            kout, klse.transpose(-1, -2), out, None if lse is None else lse.transpose(-1, -2),
            inp.get("cu_seqlens_q"), None)))
    return calls


def setup(I):
    I._get_device_num_sms = lambda device: 132
    torch.cuda.is_current_stream_capturing = lambda: False  # (a CPU torch has no CUDA to ask)
    return sglang_copy.caches(I)


def variants(caches):
    back = [sglang_copy.variant_from_key(key, "sm90") for key in caches["fwd"].cache]
    return {"variants": [b.describe() if b else None for b in back]}


if __name__ == "__main__":
    record("sglang", CASES, KINDS, ours, setup, variants)
