"""GPU checks of padding (marker `gpu`): calls with no exact variant, served by padding the
query heads per KV head and/or the head dims up to a cached variant and cropping O and LSE.

Stores: the default build plus tests/specs/padding.toml (32:1, 16:1, hd256 full). Fresh random
inputs, fp32 reference on the unpadded inputs, NaN-free outputs required. Decode steps
(s_q == 1) are served by the decode fold, and by padding with the fold off. Also: non-contiguous
hd256 inputs, and a padded or folded decode call captured in a CUDA graph replays
bit-identically.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_gpu_runtime import run_dense, run_varlen  # noqa: E402

from reference import attention_ref, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _no_split():
    """These tests check how the fold and padding serve a call; a long decode step would be
    split-KV'd instead (its output is as exact: test_gpu_split.py), so splitting is off here."""
    import fa4aot.runtime as R

    rt = R.default_runtime()
    saved, rt.split = rt.split, 0
    yield
    rt.split = saved


# (q heads, kv heads, head_dim, lse): ratios 20, 10, 5 (GLM at TP1/2/4), 3, 6; head dims
# 80/96/112 (-> 128) and 200 (-> 256)
RATIO_CASES = [
    (20, 1, 128, True),
    (40, 2, 128, True),
    (10, 1, 128, True),
    (5, 1, 128, False),
    (3, 1, 128, False),
    (6, 1, 128, False),
    (12, 2, 128, False),
]
HD_CASES = [
    (8, 2, 80, False),
    (8, 2, 96, False),
    (8, 2, 112, False),
    (4, 2, 200, True),
    (8, 4, 200, False),
]


def _padded_plans():
    import fa4aot.runtime as R

    return [p for p in R.default_runtime()._plans.values() if p.pad is not None]


def _assert_padded(layout, hq, hk, d):
    """The runtime resolved these calls to a padded plan (fkey: layout, dtype, d, dv, ratio...)."""
    import fa4aot.runtime as R

    plans = R.default_runtime()._plans
    hits = [p for k, p in plans.items() if k[0] == layout and k[2] == d and k[4] == hq // hk]
    assert hits and all(p.pad is not None for p in hits), (
        f"{layout} {hq}:{hk} hd{d} not served by padding"
    )


@pytest.mark.parametrize("hq,hk,d,lse", RATIO_CASES + HD_CASES)
def test_padded_dense(hq, hk, d, lse):
    for b, sq, sk in [(2, 1, 300), (2, 4, 257), (1, 200, 200), (2, 33, 1000)]:
        run_dense(hq, hk, d, b, sq, sk, None, False, lse)
    _assert_padded("dense", hq, hk, d)


@pytest.mark.parametrize("hq,hk,d,lse", RATIO_CASES + HD_CASES)
@pytest.mark.parametrize("page", [64, 128])
def test_padded_paged(hq, hk, d, lse, page):
    run_varlen(hq, hk, d, [1, 1, 4, 2], [1, 300, 77, 513], None, False, lse, page=page)
    run_varlen(hq, hk, d, [90, 1, 0], [200, 64, 3], None, False, lse, page=page)
    _assert_padded("varlen", hq, hk, d)


@pytest.fixture
def no_fold():
    """Serve decode steps by padding (the decode fold off), then restore the runtime."""
    import fa4aot.runtime as R

    rt = R.default_runtime()
    rt.fold = False
    rt._plans.clear()
    yield
    rt.fold = True
    rt._plans.clear()


def _plans_for(layout, hq, hk, d):
    import fa4aot.runtime as R

    plans = R.default_runtime()._plans
    return [p for k, p in plans.items() if k[0] == layout and k[2] == d and k[4] == hq // hk]


DECODE_LAYOUTS = ["dense", "varlen", "paged64", "paged128"]


def _decode(layout, hq, hk, d, lse, lk):
    if layout == "dense":
        for sk in sorted(set(lk)):
            run_dense(hq, hk, d, 3, 1, max(sk, 1), None, False, lse)
        return
    page = int(layout[5:]) if layout.startswith("paged") else None
    run_varlen(hq, hk, d, [1] * len(lk), lk, None, False, lse, page=page)


@pytest.mark.parametrize("hq,hk,d,lse", RATIO_CASES)
@pytest.mark.parametrize("layout", DECODE_LAYOUTS)
def test_fold_decode(hq, hk, d, lse, layout):
    """s_q == 1 decode at a ratio with no exact variant: served by the decode fold (heads as
    query rows of the non-causal 1:1 kernel), no padding. KV lengths include 1, a partial
    page and several pages (0: a sequence with no keys, varlen/paged only)."""
    import fa4aot.runtime as R

    R.default_runtime()._plans.clear()
    lk = [1, 300, 77, 513, 4096] + ([] if layout == "dense" else [0])
    _decode(layout, hq, hk, d, lse, lk)
    key = "dense" if layout == "dense" else "varlen"
    plans = _plans_for(key, hq, hk, d)
    folded = [
        p.pad is not None and p.pad.fold > 1 and p.pad.ratio * p.pad.fold == hq // hk for p in plans
    ]
    assert plans and all(folded), (
        f"{layout} {hq}:{hk} not served by the decode fold: {[p.pad for p in plans]}"
    )


@pytest.mark.parametrize("hq,hk,d,lse", RATIO_CASES)
@pytest.mark.parametrize("layout", ["dense", "paged64", "paged128"])
def test_padded_decode_without_fold(hq, hk, d, lse, layout, no_fold):
    """The same decode steps with the fold turned off: padded to 32:1 / 16:1 and cropped."""
    assert not _plans_for("dense", hq, hk, d) and not _plans_for("varlen", hq, hk, d)
    _decode(layout, hq, hk, d, lse, [1, 300, 513])
    key = "dense" if layout == "dense" else "varlen"
    plans = _plans_for(key, hq, hk, d)
    assert plans and all(p.pad is not None and p.pad.fold == 1 for p in plans)


def test_padding_denied_raises():
    import fa4aot

    q = torch.randn(1, 1, 20, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 64, 1, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(fa4aot.ArtifactMissing, match="padding is denied"):
        fa4aot.flash_attn_func(q, k, k, causal=True, return_lse=True, padding=False)


@pytest.mark.parametrize("kind", ["transposed", "sliced", "strided_last"])
def test_noncontiguous_hd256(kind):
    """Gemma-4 sliding hd256 with inputs that are views, as engines hand them over."""
    import fa4aot

    b, s, hq, hk, d = 2, 300, 32, 16, 256
    dt = torch.bfloat16
    if kind == "transposed":
        q = torch.randn(b, hq, s, d, device="cuda", dtype=dt).transpose(1, 2)
        k = torch.randn(b, hk, s, d, device="cuda", dtype=dt).transpose(1, 2)
        v = torch.randn(b, hk, s, d, device="cuda", dtype=dt).transpose(1, 2)
    elif kind == "sliced":
        q = torch.randn(b, s, hq, d + 64, device="cuda", dtype=dt)[..., :d]
        k = torch.randn(b, s, hk, d + 64, device="cuda", dtype=dt)[..., 64:]
        v = torch.randn(b, s, hk, d + 64, device="cuda", dtype=dt)[..., :d]
    else:
        q = torch.randn(b, s, hq, 2 * d, device="cuda", dtype=dt)[..., ::2]
        k = torch.randn(b, s, hk, 2 * d, device="cuda", dtype=dt)[..., ::2]
        v = torch.randn(b, s, hk, 2 * d, device="cuda", dtype=dt)[..., 1::2]
    assert not q.is_contiguous()
    out, _ = fa4aot.flash_attn_func(q, k, v, causal=True, window_size=(1024, 0))
    lens = torch.full((b,), s, device="cuda")
    ref, _ = attention_ref(q, k, v, lens, lens, causal=True, window_left=1024)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref.to(dt)) < 1e-2


@pytest.mark.parametrize("fold", [True, False])
def test_cuda_graph_padded_decode_bitwise(fold, request):
    """A 20:1 paged decode call with LSE, served by the decode fold or (fold off) padded to
    32:1, captured in a CUDA graph and replayed, matches eager execution bit for bit, output and
    LSE (SGLang's padding regression test)."""
    import fa4aot

    if not fold:
        request.getfixturevalue("no_fold")
    dt = torch.bfloat16
    b, hq, hk, d, page = 8, 20, 1, 128, 128
    q = torch.randn(b, hq, d, device="cuda", dtype=dt)
    kc = torch.randn(64, page, hk, d, device="cuda", dtype=dt)
    vc = torch.randn_like(kc)
    table = torch.randperm(64, device="cuda", dtype=torch.int32)[: b * 4].reshape(b, 4)
    seqused = torch.randint(1, 4 * page, (b,), device="cuda", dtype=torch.int32)
    cu_q = torch.arange(b + 1, device="cuda", dtype=torch.int32)
    kw = dict(
        cu_seqlens_q=cu_q,
        max_seqlen_q=1,
        page_table=table,
        seqused_k=seqused,
        causal=True,
        return_lse=True,
    )
    eager_o, eager_l = fa4aot.flash_attn_varlen_func(q, kc, vc, **kw)
    want = (1, 20) if fold else (32, 1)
    assert any(p.pad is not None and (p.pad.ratio, p.pad.fold) == want for p in _padded_plans())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up on the capture stream
        fa4aot.flash_attn_varlen_func(q, kc, vc, **kw)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        go, gl = fa4aot.flash_attn_varlen_func(q, kc, vc, **kw)
    go.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(go, eager_o) and torch.equal(gl, eager_l)
    # new inputs in the same buffers: the replay follows them
    q.copy_(torch.randn_like(q))
    g.replay()
    o2, l2 = fa4aot.flash_attn_varlen_func(q, kc, vc, **kw)
    torch.cuda.synchronize()
    assert torch.equal(go, o2) and torch.equal(gl, l2)
