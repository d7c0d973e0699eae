"""Padding arithmetic on a CPU: `runtime.pad.padded` pads q per KV group and the head dims, runs an
entry point on the padded call, and crops O and LSE back. Here the entry point is an fp32
reference attention, so the test checks the pad/crop bookkeeping (grouping of heads, the
caller's softmax scale, sinks, LSE layout) exactly, with no GPU."""

from __future__ import annotations

import math

import pytest
import torch
from fakes import dense_ref_kernel
from reference import attention_ref

from fa4aot.runtime.launch import SM90
from fa4aot.runtime.pad import folded as _folded
from fa4aot.runtime.pad import pad_last2 as _pad_last2
from fa4aot.runtime.pad import padded as _padded
from fa4aot.policy.select import Choice


def _ref_dense(
    q,
    k,
    v,
    *,
    softmax_scale,
    learnable_sink=None,
    padding=None,
    causal=True,
    window_size=(None, None),
    return_lse=False,
):
    """fp32 attention in FA4's dense layout: q (b, sq, hq, d) -> (out (b, sq, hq, dv), lse (b, hq, sq))."""
    assert padding is False  # the padded call must not pad again
    b, sq = q.shape[:2]
    sk = k.shape[1]
    lq = torch.full((b,), sq)
    lk = torch.full((b,), sk)
    out, lse = attention_ref(
        q,
        k,
        v,
        lq,
        lk,
        causal=causal,
        window_left=window_size[0],
        sink=learnable_sink,
        scale=softmax_scale,
    )
    return out, (lse if return_lse else None)


def _choice(ratio, d, dv):
    return Choice(variant=None, ratio=ratio, head_dim=d, head_dim_v=dv, cost=1.0, exact=False)


def _pad_causal(q, k, v, hk, choice, sink=None, out=None, lse=None):
    """`_padded` of a causal dense call with LSE, run by the fp32 reference entry point."""
    kw = dict(causal=True, window_size=(None, None), return_lse=True)
    return _padded(_ref_dense, choice, q, k, v, hk, sink, None, kw, varlen=False, out=out, lse=lse)


@pytest.mark.parametrize(
    "hq,hk,d,r2,d2",
    [
        (20, 1, 128, 32, 128),
        (10, 2, 64, 16, 64),
        (6, 2, 80, 4, 128),
        (12, 4, 96, 8, 128),
        (4, 2, 200, 2, 256),
    ],
)
@pytest.mark.parametrize("sink", [False, True])
def test_padded_equals_unpadded_reference(hq, hk, d, r2, d2, sink):
    torch.manual_seed(hq * 1000 + d)
    b, sq, sk = 2, 5, 37
    q = torch.randn(b, sq, hq, d)
    k = torch.randn(b, sk, hk, d)
    v = torch.randn(b, sk, hk, d)
    s = torch.randn(hq) if sink else None
    out, lse = _pad_causal(q, k, v, hk, _choice(r2, d2, d2), sink=s)
    lens_q, lens_k = torch.full((b,), sq), torch.full((b,), sk)
    ref_o, ref_l = attention_ref(
        q, k, v, lens_q, lens_k, causal=True, sink=s, scale=1 / math.sqrt(d)
    )
    assert out.shape == (b, sq, hq, d) and lse.shape == (b, hq, sq)
    torch.testing.assert_close(out, ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_l, rtol=1e-5, atol=1e-5)


def test_padded_writes_into_caller_buffers():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 3, 5, 64), torch.randn(1, 9, 1, 64), torch.randn(1, 9, 1, 64)
    out = torch.full((1, 3, 5, 64), float("nan"))
    lse = torch.full((1, 5, 3), float("nan"))
    o, l = _pad_causal(q, k, v, 1, _choice(8, 64, 64), out=out, lse=lse)
    assert o is out and l is lse and not out.isnan().any() and not lse.isnan().any()


def test_pad_last2_layout():
    """Each KV group keeps its heads first, padded heads after them; padded columns are zero."""
    x = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)  # (tokens, hk*r=2*3, d)
    y = _pad_last2(x, hk=2, r=3, r2=4, d2=5)
    assert y.shape == (2, 8, 5)
    g = y.reshape(2, 2, 4, 5)
    torch.testing.assert_close(g[:, :, :3, :3], x.reshape(2, 2, 3, 3))
    assert (g[..., 3:] == 0).all()
    assert _pad_last2(x, 2, 3, 3, 3) is x


@pytest.mark.parametrize("hq,hk,ratio", [(20, 1, 1), (40, 2, 1), (12, 2, 2), (24, 4, 3)])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("given", [False, True])
def test_folded_decode_equals_reference(hq, hk, ratio, varlen, given):
    """The decode fold: one causal query row per sequence, run as r/ratio rows of `ratio` heads
    per KV head on a non-causal kernel, equals the causal reference of the unfolded call, O and
    LSE in the caller's layout (dense (b, hq, 1), varlen (hq, b)), into the caller's buffers."""
    from types import SimpleNamespace

    torch.manual_seed(hq + ratio)
    b, sk, d, dv = 3, 37, 64, 32
    m = (hq // hk) // ratio
    q = torch.randn(b, hq, d) if varlen else torch.randn(b, 1, hq, d)
    k, v = torch.randn(b, sk, hk, d), torch.randn(b, sk, hk, dv)
    out = torch.full((*q.shape[:-1], dv), float("nan")) if given else None
    lse = torch.full((hq, b) if varlen else (b, hq, 1), float("nan")) if given else None
    plan = SimpleNamespace(
        pad=Choice(None, ratio, d, dv, 1.0, False, fold=m), launch=SM90.fwd(dense_ref_kernel(False))
    )
    o, l = _folded(plan, q, k, v, out, lse, None, True, varlen, sk, (None, None, None))
    q4 = q[:, None] if varlen else q
    ones = torch.ones(b, dtype=torch.long)
    ref_o, ref_l = attention_ref(q4, k, v, ones, torch.full((b,), sk), causal=True)
    if varlen:
        ref_o, ref_l = ref_o[:, 0], ref_l[:, :, 0].t()
    assert o.shape == ref_o.shape and l.shape == ref_l.shape
    torch.testing.assert_close(o, ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l, ref_l, rtol=1e-5, atol=1e-5)
    if given:
        assert o is out and l is lse
    # no keys: zeros and -inf, nothing called
    plan.launch = None
    o, l = _folded(plan, q, k[:, :0], v[:, :0], None, None, None, True, varlen, 0, (None,) * 3)
    assert (o == 0).all() and (l == float("-inf")).all() and l.shape == ref_l.shape


@pytest.mark.parametrize("given", [False, True])
def test_padded_call_with_no_query_rows(given):
    """Zero query tokens: the crop views hold no elements and must still take their shapes."""
    q, k, v = torch.randn(2, 0, 5, 64), torch.randn(2, 9, 1, 64), torch.randn(2, 9, 1, 64)
    out = torch.empty(2, 0, 5, 64) if given else None
    lse = torch.empty(2, 5, 0) if given else None
    o, l = _pad_causal(q, k, v, 1, _choice(8, 64, 64), out=out, lse=lse)
    assert o.shape == (2, 0, 5, 64) and l.shape == (2, 5, 0)


def test_folded_decode_into_strided_caller_buffers():
    """out is a slice of a wider buffer and q a slice of a fused qkv tensor (engines pass such
    views): the fold's views of them still address the right elements."""
    from types import SimpleNamespace

    torch.manual_seed(7)
    b, hq, hk, d, sk = 2, 12, 2, 64, 19
    qkv = torch.randn(b, 1, hq + 2 * hk, d)
    q = qkv[:, :, :hq]
    k, v = torch.randn(b, sk, hk, d), torch.randn(b, sk, hk, d)
    wide = torch.full((b, 1, hq, 2 * d), float("nan"))
    out = wide[..., d:]
    plan = SimpleNamespace(
        pad=Choice(None, 1, d, d, 1.0, False, fold=6), launch=SM90.fwd(dense_ref_kernel(False))
    )
    o, _ = _folded(plan, q, k, v, out, None, None, False, False, sk, (None, None, None))
    ref, _ = attention_ref(
        q, k, v, torch.ones(b, dtype=torch.long), torch.full((b,), sk), causal=True
    )
    assert o is out
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert wide[..., :d].isnan().all()  # nothing written outside the slice
