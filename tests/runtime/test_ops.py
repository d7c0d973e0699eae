"""fa4aot.ops (torch.library custom ops) on the CPU: fake shapes, one node under make_fx, and
torch.compile(fullgraph=True) tracing through it (the real op then refuses the CPU tensors,
which is how the test knows the graph did not break). GPU checks: test_gpu_compile.py."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fa4aot.ops as ops
from fa4aot.errors import ContractViolation

BF16 = torch.bfloat16


def test_fake_shapes():
    with FakeTensorMode():
        q = torch.empty(2, 3, 8, 64, dtype=BF16)
        k = torch.empty(2, 5, 2, 64, dtype=BF16)
        v = torch.empty(2, 5, 2, 32, dtype=BF16)
        out, lse = ops.flash_attn_func(q, k, v, causal=True, return_lse=True)
        assert out.shape == (2, 3, 8, 32) and lse.shape == (2, 8, 3) and lse.dtype == torch.float32
        out, lse = ops.flash_attn_func(q, k, v)
        assert lse is None
        qp = torch.empty(7, 8, 64, dtype=BF16)
        cu = torch.empty(3, dtype=torch.int32)
        kp = torch.empty(11, 2, 64, dtype=BF16)
        out, lse = ops.flash_attn_varlen_func(qp, kp, kp, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                              max_seqlen_q=4, return_lse=True)
        assert out.shape == (7, 8, 64) and lse.shape == (8, 7)


def test_one_node_under_make_fx():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(q, k, v):
        return ops.flash_attn_func(q, k, v, causal=True)[0] * 2

    q = torch.randn(1, 4, 8, 64, dtype=BF16)
    k = torch.randn(1, 4, 2, 64, dtype=BF16)
    g = make_fx(f, tracing_mode="fake")(q, k, k)
    targets = [str(n.target) for n in g.graph.nodes if n.op == "call_function"]
    assert sum("fa4aot.flash_attn_func" in t for t in targets) == 1, targets


def test_torch_compile_fullgraph_traces_through():
    @torch.compile(fullgraph=True, backend="eager")
    def f(q, k, v):
        out, _ = ops.flash_attn_func(q, k, v, causal=True)
        return out + 1

    q = torch.randn(1, 4, 8, 64, dtype=BF16)
    k = torch.randn(1, 4, 2, 64, dtype=BF16)
    torch._dynamo.reset()
    # traced as one graph (a break would raise torch._dynamo's Unsupported here), then the
    # real op refuses CPU tensors, as fa4aot.flash_attn_func does
    with pytest.raises(ContractViolation, match="CUDA"):
        f(q, k, k)


def test_the_ops_pass_every_argument_through(monkeypatch):
    """softcap and pack_gqa reach the runtime (the op's schema carries them)."""
    import fa4aot.runtime as R

    seen = {}

    def fake(*a, **kw):
        seen.update(kw)
        q = a[0]
        return q.new_zeros(q.shape), None

    monkeypatch.setattr(R, "flash_attn_func", fake)
    monkeypatch.setattr(R, "flash_attn_varlen_func", fake)
    q = torch.randn(1, 4, 8, 64, dtype=BF16)
    k = torch.randn(1, 4, 2, 64, dtype=BF16)
    ops.flash_attn_func(q, k, k, causal=True, softcap=30.0, pack_gqa=False)
    assert seen == {"softcap": 30.0, "pack_gqa": False}
    seen.clear()
    ops.flash_attn_varlen_func(q[0], k[0], k[0], softcap=0.0, pack_gqa=True)
    assert seen == {"softcap": 0.0, "pack_gqa": True}
