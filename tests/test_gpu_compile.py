"""fa4aot.ops under torch.compile on the GPU (marker `gpu`; a store from `fa4aot build`).
Written 2026-11-30 after that session's device time was spent: not yet run on a GPU."""

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


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_equals_eager(mode):
    import fa4aot.ops as ops

    def f(q, k, v):
        out, lse = ops.flash_attn_func(q, k, v, causal=True, return_lse=True)
        return out.float() * 2, lse

    torch._dynamo.reset()
    g = torch.compile(f, fullgraph=True, mode=mode)
    q, k, v = _inputs()
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
