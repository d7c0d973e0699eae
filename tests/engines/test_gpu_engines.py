"""The plugins on a GPU against the engine's own FA4 copy (marker gpu). Needs CUDA and the copy
importable: vLLM installed, or FA4AOT_ENGINE_SRC naming a directory that holds the extracted
`vllm/` package (e.g. /work/engines/vllm); a store in FA4AOT_CACHE_DIR serving bf16 hd128 8:2
paged decode (page 16) makes the call a hit, else it must come back as a miss, same result."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture
def vllm_fa4():
    src = os.environ.get("FA4AOT_ENGINE_SRC")
    try:
        if not src:
            return importlib.import_module("vllm.vllm_flash_attn.cute.interface")
        from fa4aot.fa4 import sources

        # the copy alone, under its own module name, without vllm_flash_attn's __init__
        # (which needs vLLM's compiled FA2/FA3 extensions)
        return sources.load(sources.resolve("vllm", root=os.path.join(src, "vllm")))
    except Exception as e:  # noqa: BLE001 (any import failure: the copy is not usable here)
        pytest.skip(f"vLLM's FA4 copy not importable: {e!r}")


def test_vllm_paged_decode_matches_the_engine(vllm_fa4):
    from fa4aot.engines import vllm as P

    torch.manual_seed(0)
    b, hq, hk, d, page = 4, 8, 2, 128, 16
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(64, page, hk, d, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(64, device="cuda", dtype=torch.int32)[: b * 8].view(b, 8)
    seqused = torch.tensor([1, 40, 77, 128], device="cuda", dtype=torch.int32)
    cu = torch.arange(b + 1, device="cuda", dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu, seqused_k=seqused, max_seqlen_q=1, max_seqlen_k=128,
              page_table=table, causal=True, return_lse=True)
    ref, ref_lse, *_ = vllm_fa4._flash_attn_fwd(q, kv, kv, **kw)
    P.install()
    try:
        out, lse, p, rm = vllm_fa4._flash_attn_fwd(q, kv, kv, **kw)
    finally:
        P.uninstall()
    c = P.counters
    assert c.hits + sum(c.misses.values()) == 1 and not c.handbacks, c.as_dict()
    assert p is None and rm is None
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=0)
