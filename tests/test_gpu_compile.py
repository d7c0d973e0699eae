"""fa4aot.ops under torch.compile on the GPU (marker `gpu`; a store from `fa4aot build`):
fullgraph=True traces through the custom ops with no graph break, and mode="reduce-overhead"
(cudagraph trees) replays them bit-identically to eager, for a decode step the runtime serves
unsplit (512 keys) and one it splits (4096 keys at batch 2 on an H200)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")


def _inputs(sk=4096):
    q = torch.randn(2, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, sk, 8, 128, device="cuda", dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


@pytest.mark.parametrize("sk", [512, 4096])
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_equals_eager(mode, sk):
    import fa4aot.ops as ops

    def f(q, k, v):
        out, lse = ops.flash_attn_func(q, k, v, causal=True, return_lse=True)
        return out.float() * 2, lse

    torch._dynamo.reset()
    g = torch.compile(f, fullgraph=True, mode=mode)
    q, k, v = _inputs(sk)
    want = f(q, k, v)
    for _ in range(3):  # reduce-overhead records, then replays its CUDA graph
        got = g(q, k, v)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_opcheck():
    import fa4aot.ops as ops

    q, k, v = _inputs(512)
    torch.library.opcheck(
        ops._dense, (q, k, v, None, True, None, None, None, True, 0.0),
        test_utils=("test_schema", "test_faketensor"),
    )
