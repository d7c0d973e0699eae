"""Split-KV plans on the CPU: the cost model, and the runtime's split path (chunk bounds,
per-chunk lengths, page-table views, GQA fold, sink slot, LSE layouts) run end to end with
torch stand-ins for the two kernels, checked against an fp32 reference attention."""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import pytest
import torch

from fa4aot import runtime as R
from fa4aot.runtime import splitkv as SK
from fa4aot.policy import split as S
from fakes import fake_chunk_meta, fake_combine, fake_fwd, fake_packed_meta
from reference import attention_ref, paged_kv, rel_err


# -- the cost model --------------------------------------------------------------------------


def _n(b, hk, sk, rows=1, sms=132, d=128):
    return S.choose_splits(
        batch=b, kv_heads=hk, rows=rows, seqlen_k=sk, bytes_per_key=2 * d * 2, num_sms=sms
    )


def test_full_chip_or_short_context_never_splits():
    assert _n(32, 8, 4096) == 1  # 256 CTAs already fill 132 SMs
    assert _n(1, 8, 256) == 1
    assert _n(1, 8, 512) == 1  # the split's launches cost more than it saves


@pytest.mark.parametrize(
    "b,hk,sk", [(1, 8, 65536), (1, 1, 131072), (2, 8, 32768), (4, 8, 32768), (1, 8, 8192)]
)
def test_long_context_low_batch_fills_the_sms(b, hk, sk):
    n = _n(b, hk, sk)
    assert n > 1
    assert b * hk * n <= 132  # one wave
    assert b * hk * n >= 132 // 2
    kw = dict(ctas=b * hk, seqlen_k=sk, bytes_per_key=512, num_sms=132, align=128)
    assert S.step_time(n, **kw) < S.step_time(1, **kw)


def test_splits_only_where_the_model_says_it_wins():
    for b in (1, 2, 4, 8, 16, 32, 64, 128):
        for sk in (1024, 4096, 16384, 65536, 131072):
            n = _n(b, 8, sk)
            kw = dict(ctas=b * 8, seqlen_k=sk, bytes_per_key=512, num_sms=132, align=128)
            t1 = S.step_time(1, **kw)
            assert S.step_time(n, **kw) <= t1
            if n > 1:
                assert S.step_time(n, **kw) < t1


def test_short_contexts_split_into_single_block_chunks():
    """Short contexts split into chunks of one 128-key tile, several decode rows alike (q is
    read in place, no copy over the chunks); the measurements behind it: docs/design.md, Tuned
    thresholds."""
    assert _n(1, 8, 1024) == 8
    assert S.make_split(8, 1024, page_size=None, sink=False).chunk == 128
    assert _n(1, 8, 2048) == 16
    assert _n(2, 8, 1024) == 8 and _n(4, 8, 1024) == 4
    assert _n(1, 2, 1024, rows=2) == 8  # unrolled rows split as sequences do
    assert _n(2, 8, 2048) == 8 and _n(4, 8, 2048) == 4
    assert _n(8, 8, 1024) == 1 and _n(16, 8, 1024) == 1  # the fold: faster eager
    # b8/4K runs unsplit as the fold; where the fold cannot serve it, FA4's slower kernel
    # would, and it splits in 2
    assert _n(8, 8, 4096) == 1
    assert S.choose_splits(batch=8, kv_heads=8, rows=1, seqlen_k=4096, bytes_per_key=512,
                           num_sms=132, fold=False) == 2
    # plan_split (the runtime's and explain's) takes the decode rows apart from the CTAs
    one = dict(seqlen_k=1024, bytes_per_key=512, page_size=None, sink=False, num_sms=132,
               setting=-1)
    assert S.plan_split(ctas=8, decode_rows=1, **one).n == 8
    assert S.plan_split(ctas=16, decode_rows=2, **one).n == 8
    assert S.plan_split(ctas=64, decode_rows=8, **one) is None


def test_chunks_cover_the_kv_and_align():
    for sk in (257, 1000, 4096, 65537):
        for n in (2, 3, 16, 127):
            for page in (None, 16, 64, 128, 256):
                sp = S.make_split(n, sk, page_size=page, sink=False)
                a = 128 if page is None else math.lcm(128, page)
                assert sp.chunk % a == 0
                assert sp.n * sp.chunk >= sk > (sp.n - 1) * sp.chunk
                assert sp.n <= n


def test_refusals_name_the_reason():
    assert "window" in S.split_refusal(
        causal=True, window=True, seqlen_q=1, paged=True, max_seqlen_q_known=True
    )
    # several rows over a packed K: the bounds mode gives each row its keys; a store built
    # before it took several rows refuses, and says why
    assert S.split_refusal(causal=True, window=False, seqlen_q=4, paged=False,
                           max_seqlen_q_known=True) is None
    assert "rebuilds" in S.split_refusal(causal=True, window=False, seqlen_q=4, paged=False,
                                         max_seqlen_q_known=True, row_bounds=False)
    assert S.split_refusal(causal=True, window=False, seqlen_q=4, paged=True,
                           max_seqlen_q_known=True) is None
    assert S.split_refusal(causal=True, window=False, seqlen_q=1, paged=False,
                           max_seqlen_q_known=True) is None


# -- the runtime's split path with stand-in kernels ---------------------------------------------










@pytest.fixture(autouse=True, params=[(False, False), (True, False), (True, True)],
                ids=["torch-metadata", "metadata-kernel", "chunk-modes"])
def split_kernels(request, monkeypatch):
    """Every split here runs three times, with the kernels of the stores built over time: its
    chunk metadata from torch's element-wise kernels and q copied over the chunks (a store
    built before the metadata kernel), then from the artifact's kernel (part `chunk_meta`, its
    stand-in above), then with a forward that reads q, and a paged K's lengths, through chunk
    modes as well (forwards.trace_chunk_modes)."""
    monkeypatch.setattr(_FakeRuntime, "meta", request.param[0])
    monkeypatch.setattr(_FakeRuntime, "chunk_modes", request.param[1])


class _FakeRuntime:
    """Runtime.split_for's plan for a forced count n (of the exact KV bound), with stand-in
    kernels."""

    meta = chunk_modes = False  # (the split_kernels fixture)
    packed_meta = True  # with chunk_modes, for a paged K: the part packed_meta
    ragged = False  # (the uniform plan's paths: tests/runtime/test_ragged_cpu.py has the other)

    def __init__(self, n):
        self.n = self.split = n
        self._split_consts = {}
        self._split_runs = {}
        self._split_scratch = 0

    def split_kernel(self, dev, dtype, d, dv, page_size):
        meta = fake_chunk_meta(page_size is not None) if self.meta else None
        chunked = self.chunk_modes and page_size is not None
        bounds = self.chunk_modes and page_size is None
        fwd = partial(fake_fwd, chunk_lengths=chunked)
        return R.plan.SplitKernel(fwd, fake_combine, S.MAX_SLOTS, None, meta=meta,
                                  q_broadcast=self.chunk_modes, chunk_lengths=chunked,
                                  fwd_bounds=fwd if bounds else None,
                                  packed_meta=fake_packed_meta if (
                                      chunked and self.packed_meta) else None)

    def plan(self, seqlen_k, page_size, sink):
        return S.make_split(self.n, seqlen_k, page_size=page_size, sink=sink)

    def split_for(self, dev, dtype, ctas, seqlen_k, d, dv, page_size, sink, decode_rows=1,
                  fold=True, one_row=False):
        return self.plan(seqlen_k, page_size, sink)

    def device(self, dev):
        return "sm90", 132

    def cost_model(self, dev):
        return S.DEFAULT_MODEL


class _PageSeeingRuntime(_FakeRuntime):
    """The same, recording the page size of every split kernel asked for (None: packed K)."""

    def __init__(self, n):
        super().__init__(n)
        self.seen = []

    def split_kernel(self, dev, dtype, d, dv, page_size):
        self.seen.append(page_size)
        return super().split_kernel(dev, dtype, d, dv, page_size)


def _split(rt, q, k, v, kind, kv, seqlen_k, page, causal, sink, out, lse, want_lse, varlen_q):
    """splitkv.split_step on q (b, rows, hq, d), passed packed when varlen_q, as the entry
    points pass the caller's q."""
    b, rows, hq, d = q.shape
    cu_k, used_k, pt = kv
    qq = q.reshape(b * rows, hq, d) if varlen_q else q
    step = SK.Step(kind, b, rows, hq, k.shape[-2], d, v.shape[-1], seqlen_k, page, causal,
                   varlen_q)
    return SK.split_step(rt, 0, qq, k, v, step, cu_k, used_k, pt, sink, None, out, lse, want_lse)


def _inputs(b, sq, hq, hk, d, lens, seed):
    g = torch.Generator().manual_seed(seed)
    sk = max(max(lens), 1)
    q = torch.randn(b, sq, hq, d, generator=g).bfloat16()
    k = torch.randn(b, sk, hk, d, generator=g).bfloat16()
    v = torch.randn(b, sk, hk, d, generator=g).bfloat16()
    return q, k, v


def _page_pool(k, v, lens, page):
    """K/V (b, sk, hk, d) of ragged `lens` as a page pool in sequence order: (k pool, v pool,
    the (b, pages) table)."""
    return paged_kv(k, v, lens, page, extra_cols=0)


def _ref(q, k, v, lens, causal, sink):
    b, sq = q.shape[:2]
    return attention_ref(
        q, k, v, torch.full((b,), sq), torch.tensor(lens), causal=causal, sink=sink
    )


@pytest.mark.parametrize("n", [2, 5, 16])
@pytest.mark.parametrize("hq,hk", [(8, 2), (4, 4), (20, 1)])
@pytest.mark.parametrize("sink", [False, True])
def test_dense_decode_split_matches_reference(n, hq, hk, sink):
    b, d, sk = 3, 16, 700
    q, k, v = _inputs(b, 1, hq, hk, d, [sk] * b, seed=n * 7 + hq)
    s = torch.randn(hq) if sink else None
    out = torch.full((b, 1, hq, d), float("nan")).bfloat16()
    lse = torch.full((b, hq, 1), float("nan"))
    got = _split(_FakeRuntime(n), q, k, v, "dense", (None, None, None), sk, None, True, s,
                 out, lse, True, False)
    assert got is not None and got[0] is out and got[1] is lse
    ro, rl = _ref(q, k, v, [sk] * b, True, s)
    assert rel_err(out, ro) < 1e-2
    assert torch.allclose(lse, rl, atol=1e-3)


@pytest.mark.parametrize("sq,causal", [(2, True), (4, True), (3, False)])
@pytest.mark.parametrize("sk", [1024, 1040])
def test_dense_speculative_rows_split_as_pages(sq, causal, sk):
    """A dense K of several query rows splits as its own page pool (split.dense_page_size: the
    largest cached page size dividing its length; 1040 keys: pages of 16) with every row's
    causal length; q, out and LSE in the caller's batch form."""
    b, hq, hk, d = 2, 8, 2, 16
    rt = _PageSeeingRuntime(3)
    seen = rt.seen
    for step in range(2):  # the second step reads the lengths and chunked table as constants
        q, k, v = _inputs(b, sq, hq, hk, d, [sk] * b, seed=sq * 5 + sk + step)
        out = torch.full((b, sq, hq, d), float("nan")).bfloat16()
        lse = torch.full((b, hq, sq), float("nan"))
        got = _split(rt, q, k, v, "dense", (None, None, None), sk, None, causal, None, out,
                     lse, True, False)
        assert got is not None and got[0] is out and got[1] is lse
        assert seen[0] == (128 if sk % 128 == 0 else 16)
        ro, rl = _ref(q, k, v, [sk] * b, causal, None)
        assert rel_err(out, ro) < 1e-2
        assert torch.allclose(lse, rl, atol=1e-3)
    assert any(key[0] in ("dense_meta", "packed_meta") for key in rt._split_consts)


@pytest.mark.parametrize("causal", [True, False])
def test_dense_speculative_rows_whose_length_no_page_divides_split_on_the_bounds_mode(causal):
    """No cached page size divides the length: the rows run unrolled on the packed K's bounds
    mode over the dense K's constant cu (a store built before the mode: unsplit)."""
    class Rt(_FakeRuntime):
        def split_kernel(self, dev, dtype, d, dv, page_size):  # packed K and pages of 128 only
            return None if page_size not in (None, 128) else super().split_kernel(
                dev, dtype, d, dv, page_size)

    q, k, v = _inputs(2, 2, 8, 2, 16, [1040, 1040], seed=1)  # 1040 = 8 * 130: not 128 * m
    out = torch.full((2, 2, 8, 16), float("nan")).bfloat16()
    got = _split(Rt(3), q, k, v, "dense", (None, None, None), 1040, None, causal, None, out,
                 None, True, False)
    if not Rt.chunk_modes:
        assert got is None
    else:
        assert got is not None and got[0] is out
        ro, rl = _ref(q, k, v, [1040, 1040], causal, None)
        assert rel_err(out, ro) < 1e-2
        assert torch.allclose(got[1], rl, atol=1e-3)
    # a K that is not contiguous across batch and sequence has neither view
    kk = torch.cat([k, k], dim=1)[:, :1024]
    assert _split(Rt(3), q, kk, kk, "dense", (None, None, None), 1024, None, True, None, None,
                  None, False, False) is None


@pytest.mark.parametrize("sq,causal", [(2, True), (4, True), (3, False)])
@pytest.mark.parametrize("varlen_q", [False, True])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("n", [3, 7])
@pytest.mark.parametrize("hq,hk", [(8, 2), (20, 1)])
def test_varlen_speculative_rows_split_on_the_bounds_mode(sq, causal, varlen_q, sink, n, hq,
                                                          hk):
    """Several rows a sequence over a packed K, on the chunk kernel's bounds mode: packed as
    rows of one chunk (4 query heads x sq rows fit its 64-row tile) with the causal tail
    anchored at each sequence's end, or unrolled (20 x 4 rows do not), each row's chunks cut
    from cu_seqlens_k (row t of a causal step sees len - sq + 1 + t keys, so a sequence
    shorter than its rows leaves its first rows empty); a store built before the mode took
    several rows runs the step unsplit."""
    lens = [0, 1, 2, 300, 1000, 129, 5]
    b, d = len(lens), 16
    s = torch.randn(hq) if sink else None
    q, k, v = _inputs(b, sq, hq, hk, d, lens, seed=n + sq)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    kp = torch.cat([k[i, :n_] for i, n_ in enumerate(lens)])
    vp = torch.cat([v[i, :n_] for i, n_ in enumerate(lens)])
    rt = _FakeRuntime(n)
    got = _split(rt, q, kp, vp, "varlen", (cu, None, None), max(lens), None, causal, s, None,
                 None, True, varlen_q)
    if not _FakeRuntime.chunk_modes:
        assert got is None
        return
    assert got is not None
    (run,) = [r for r in rt._split_runs.values() if r]
    assert run.packed is (hq // hk * sq <= 64)
    o, lse = got
    ro, rl = _ref(q, k, v, lens, causal, s)
    o4 = o.view(b, sq, hq, d)
    lse3 = lse.t().reshape(b, sq, hq).transpose(1, 2) if varlen_q else lse
    assert not o.isnan().any()
    assert rel_err(o4, ro) < 1e-2
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(lse3))
    assert torch.allclose(lse3[fin], rl[fin], atol=1e-3)


@pytest.mark.parametrize("n", [2, 7])
@pytest.mark.parametrize("lse_wanted", [False, True])
def test_varlen_decode_split_with_empty_and_one_token_sequences(n, lse_wanted):
    lens = [0, 1, 300, 1000, 129]
    b, hq, hk, d = len(lens), 8, 2, 16
    q, k, v = _inputs(b, 1, hq, hk, d, lens, seed=n)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    kp = torch.cat([k[i, :n_] for i, n_ in enumerate(lens)])
    vp = torch.cat([v[i, :n_] for i, n_ in enumerate(lens)])
    out = torch.full((b, hq, d), float("nan")).bfloat16()
    got = _split(_FakeRuntime(n), q, kp, vp, "varlen", (cu, None, None), max(lens), None, True,
                 None, out, None, lse_wanted, True)
    assert got is not None
    o, lse = got
    ro, rl = _ref(q, k, v, lens, True, None)
    assert not o.isnan().any()
    assert rel_err(o, ro[:, 0]) < 1e-2
    assert (lse is not None) == lse_wanted
    if lse_wanted:
        assert lse.shape == (hq, b)
        assert torch.allclose(lse.t(), rl[..., 0], atol=1e-3)


@pytest.mark.parametrize("page", [16, 64, 128])
@pytest.mark.parametrize("sq,causal", [(1, True), (2, True), (4, True), (3, False)])
@pytest.mark.parametrize("varlen_q", [False, True])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("packed_meta", [True, False])
def test_paged_split_with_speculative_rows(monkeypatch, page, sq, causal, varlen_q, sink,
                                           packed_meta):
    """Rows unrolled, or (with the chunk modes) packed with a causal tail, its metadata from
    the kernel (part packed_meta) or, in stores without it, torch's; lengths of 0, 2 (a
    causal row 0 of 4 sees none), a page and one key (the tail spans two pages), ragged."""
    monkeypatch.setattr(_FakeRuntime, "packed_meta", packed_meta)
    lens = [5, 1000, 0, 257, 640, 2, page + 1]
    b, hq, hk, d = len(lens), 8, 2, 16
    s = torch.randn(hq) if sink else None
    q, k, v = _inputs(b, sq, hq, hk, d, lens, seed=page + sq)
    maxp = -(-max(lens) // page) + 1  # one spare column
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(b * maxp, generator=g)
    table = perm.view(b, maxp).to(torch.int32)
    kpool = torch.zeros(b * maxp, page, hk, d).bfloat16()
    vpool = torch.zeros(b * maxp, page, hk, d).bfloat16()
    for i, n_ in enumerate(lens):
        for j in range(-(-n_ // page)):
            w = min(page, n_ - j * page)
            kpool[table[i, j], :w] = k[i, j * page : j * page + w]
            vpool[table[i, j], :w] = v[i, j * page : j * page + w]
    used = torch.tensor(lens, dtype=torch.int32)
    qq = q.reshape(b * sq, hq, d) if varlen_q else q
    got = _split(_FakeRuntime(6), q, kpool, vpool, "paged", (None, used, table), maxp * page,
                 page, causal, s, None, None, True, varlen_q)
    assert got is not None
    assert got[0].shape == (*qq.shape[:-1], d)
    _check_rows(got, q, k, v, lens, causal, s, varlen_q)


def _check_rows(got, q, k, v, lens, causal, sink, varlen_q):
    """A split step's (out, lse) of q (b, rows, hq, d), passed packed when varlen_q, against
    the reference over `lens` keys a sequence (LSE: the same -inf pattern)."""
    b, sq, hq, d = q.shape
    o, lse = got
    ro, rl = _ref(q, k, v, lens, causal, sink)
    lse3 = lse.t().reshape(b, sq, hq).transpose(1, 2) if varlen_q else lse
    assert rel_err(o.view(b, sq, hq, d), ro) < 1e-2
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(lse3))
    assert torch.allclose(lse3[fin], rl[fin], atol=1e-3)


@pytest.mark.parametrize("sq", [1, 2])
@pytest.mark.parametrize("sk", [1024, 1040])
def test_packed_q_over_a_dense_k_splits(sq, sk):
    """The varlen entry point's q packed (cu_seqlens_q) over a K in batch form without
    seqused_k: the dense kind, q, out and LSE in packed form."""
    b, hq, hk, d = 3, 8, 2, 16
    q, k, v = _inputs(b, sq, hq, hk, d, [sk] * b, seed=sq + sk)
    out = torch.full((b * sq, hq, d), float("nan")).bfloat16()
    lse = torch.full((hq, b * sq), float("nan"))
    got = _split(_FakeRuntime(3), q, k, v, "dense", (None, None, None), sk, None, True, None,
                 out, lse, True, True)
    assert got is not None and got[0] is out and got[1] is lse
    ro, rl = _ref(q, k, v, [sk] * b, True, None)
    assert rel_err(out.view(b, sq, hq, d), ro) < 1e-2
    assert torch.allclose(lse.t().reshape(b, sq, hq).transpose(1, 2), rl, atol=1e-3)


@pytest.mark.parametrize("cap", [1024, 1040])
@pytest.mark.parametrize("sq,causal", [(1, True), (2, True), (4, True), (3, False)])
@pytest.mark.parametrize("varlen_q", [False, True])
@pytest.mark.parametrize("sink", [False, True])
def test_padded_kv_cache_splits_as_its_own_page_pool(cap, sq, causal, varlen_q, sink):
    """A KV cache in batch form, (b, capacity, hk, d), with seqused_k (FA2's
    flash_attn_with_kvcache layout): split as a page pool of the first cached page size that
    divides the capacity (128; 1040: 16), the table an arange (its chunked form a constant),
    the caller's lengths read each step (ragged, 0, one key, the full capacity)."""
    lens = [5, cap, 0, 257, 640, 1, 129]
    b, hq, hk, d = len(lens), 8, 2, 16
    rt = _PageSeeingRuntime(4)
    seen, tables = rt.seen, []
    for step in range(2):  # the second step: the same run, the table a cached constant
        q, k, v = _inputs(b, sq, hq, hk, d, lens, seed=cap + sq * 3 + step)
        k[2:, -3:] = float("nan")  # keys past a sequence's length: never read
        s = torch.randn(hq) if sink else None
        used = torch.tensor(lens, dtype=torch.int32)
        got = _split(rt, q, k, v, "padded", (None, used, None), cap, None, causal, s, None,
                     None, True, varlen_q)
        assert got is not None
        assert seen[0] == (128 if cap % 128 == 0 else 16)
        _check_rows(got, q, k, v, lens, causal, s, varlen_q)
        tables += [r.padded_pt[1] for r in rt._split_runs.values()
                   if getattr(r, "padded_pt", None) is not None]
    # (a split run: the chunked table made by the first step, kept by the run for the second)
    assert sq > 1 and rt.chunk_modes or len(tables) == 2 and tables[0] is tables[1]
    if tables:
        # a step that keeps nothing (as while a CUDA graph is captured) makes a run of its own,
        # which finds the eager steps' table: nothing computed for it, so a graph replays none
        made = []
        real = R.splitkv.S.chunk_page_table
        R.splitkv.S.chunk_page_table = lambda *a: made.append(1) or real(*a)
        try:
            with R.splitruns.fresh_scratch():
                got = _split(rt, q, k, v, "padded", (None, used, None), cap, None, causal, s,
                             None, None, True, varlen_q)
        finally:
            R.splitkv.S.chunk_page_table = real
        _check_rows(got, q, k, v, lens, causal, s, varlen_q)
        assert not made


def test_padded_kv_cache_whose_capacity_no_page_divides_is_not_split():
    """No cached page size divides 1000: the step runs unsplit (FA4's kernel for the layout)."""
    b, hq, hk, d = 2, 8, 2, 16
    q, k, v = _inputs(b, 1, hq, hk, d, [1000, 1000], seed=3)
    used = torch.tensor([1000, 7], dtype=torch.int32)
    assert _split(_FakeRuntime(4), q, k, v, "padded", (None, used, None), 1000, None, True,
                  None, None, None, False, False) is None


class _NoSplitRuntime(_FakeRuntime):
    """The cost model says no split: a one-row step then runs on the chunk kernel as one chunk
    per sequence (splitruns.FoldRun), which records what it was given."""

    def __init__(self, arch="sm90"):
        super().__init__(1)
        self.arch, self.seen = arch, []

    def device(self, dev):
        return self.arch, 132

    def split_kernel(self, dev, dtype, d, dv, page_size):
        def fwd(q, *a):
            self.seen.append(q)
            fake_fwd(q, *a)

        return R.plan.SplitKernel(fwd, fake_combine, S.MAX_SLOTS, None)

    def split_for(self, *a, **kw):
        return None


@pytest.mark.parametrize("kind", ["dense", "varlen", "paged", "padded"])
@pytest.mark.parametrize("lse_mode", ["none", "new", "given"])
def test_unsplit_one_row_step_runs_as_one_chunk_per_sequence(kind, lse_mode):
    """q and out reach the kernel as views (no copy); LSE too for q in batch form, through
    scratch and one copy for a packed q's (hq, b) layout; empty sequences give 0 and -inf."""
    lens = [0, 1, 300, 1000, 129] if kind != "dense" else [700] * 3
    b, hq, hk, d = len(lens), 8, 2, 16
    q, k, v = _inputs(b, 1, hq, hk, d, lens, seed=len(kind))
    varlen_q = kind != "dense"
    qq = q.reshape(b, hq, d) if varlen_q else q
    if kind == "dense":
        kv, kk, vv, bound, page = (None, None, None), k, v, 700, None
    elif kind == "varlen":
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
        kk = torch.cat([k[i, :n_] for i, n_ in enumerate(lens)])
        vv = torch.cat([v[i, :n_] for i, n_ in enumerate(lens)])
        kv, bound, page = (cu, None, None), max(lens), None
    elif kind == "paged":
        page = 64
        kk, vv, table = _page_pool(k, v, lens, page)
        kv, bound = (None, torch.tensor(lens, dtype=torch.int32), table), table.shape[1] * page
    else:  # a batch-form KV cache of 1024 keys a sequence, seqused_k: as pages of 128
        k = torch.cat([k, torch.randn(b, 1024 - k.shape[1], hk, d).bfloat16()], 1)
        v = torch.cat([v, torch.randn(b, 1024 - v.shape[1], hk, d).bfloat16()], 1)
        kk, vv, kv, bound, page = k, v, (None, torch.tensor(lens, dtype=torch.int32), None), \
            1024, None
    out = torch.full((*qq.shape[:-1], d), float("nan")).bfloat16()
    lse = None
    if lse_mode == "given":
        lse = torch.full((hq, b) if varlen_q else (b, hq, 1), float("nan"))
    rt = _NoSplitRuntime()
    got = SK.split_step(rt, 0, qq, kk, vv, SK.Step(kind, b, 1, hq, hk, d, d, bound, page, True,
                                                   varlen_q),
                        *kv, None, None, out, lse, lse_mode == "new")
    assert got is not None and got[0] is out
    assert len(rt.seen) == 1 and rt.seen[0].data_ptr() == qq.data_ptr()
    assert rt.seen[0].shape == (b, hq // hk, hk, d)  # r query heads as rows of a 1:1 kernel
    ro, rl = _ref(q, k, v, lens, True, None)
    assert not out.isnan().any()
    assert rel_err(out.view(b, 1, hq, d), ro) < 1e-2
    got_lse = got[1]
    assert (got_lse is None) == (lse_mode == "none")
    if got_lse is not None:
        if lse_mode == "given":
            assert got_lse is lse
        l3 = got_lse.t()[..., None] if varlen_q else got_lse
        fin = torch.isfinite(rl)
        assert torch.equal(fin, torch.isfinite(l3))
        assert torch.allclose(l3[fin], rl[fin], atol=1e-3)


class _WideRuntime(_NoSplitRuntime):
    """The same, with the chunk kernel's wide fold parts (launch_wide, and launch_wide1 unless
    `wide1` is False: a store built before it), on `sms` SMs: records which ran."""

    def __init__(self, wide1=True, sms=132):
        super().__init__()
        self.wide1, self.sms = wide1, sms

    def device(self, dev):
        return self.arch, self.sms

    def split_kernel(self, dev, dtype, d, dv, page_size):
        def fwd(name, q, *a):
            self.seen.append(name)
            fake_fwd(q, *a)

        return R.plan.SplitKernel(
            partial(fwd, "chunk"), fake_combine, S.MAX_SLOTS, None,
            fwd_wide=partial(fwd, "fwd_wide"),
            fwd_wide1=partial(fwd, "fwd_wide1") if self.wide1 else None,
        )


# (b, hk, keys, SMs) -> the fold's kernel; where that is fwd_wide1, also the kernel without it
# (a paged K, or a store built before it); constraints.fold_kernel, by the waves its CTAs fill
_FOLD_CASES = [
    (16, 8, 300, 132, "chunk"),      # 128 CTAs: one wave at one per SM
    (17, 8, 300, 132, "fwd_wide"),   # 136: one wave at two per SM (the chunk kernel: 132 + 4)
    (24, 8, 300, 132, "fwd_wide"),   # 192: the same
    (126, 2, 300, 132, "fwd_wide"),  # 252: the same
    (32, 8, 300, 132, "fwd_wide"),   # 256, a short context: fwd_wide1 from 8192 keys only
    (40, 8, 300, 132, "chunk"),      # 320: the last wave 42% full at one per SM, 21% at two
    (64, 8, 300, 132, "fwd_wide"),   # 512: at two per SM, 1.94 waves
    (8, 2, 8192, 8, "fwd_wide1/fwd_wide"),  # 16 CTAs on 8 SMs, two full waves at one per SM
    (7, 2, 8192, 8, "fwd_wide1/fwd_wide"),  # 14: the last wave 75% full; one wave at two
    (23, 1, 8192, 8, "fwd_wide1/chunk"),    # 23: 88% full at one per SM, 44% at two
    (5, 2, 8192, 8, "fwd_wide"),     # 10: 25% full; one wave at two per SM
    (10, 2, 8192, 8, "chunk"),       # 20: 50% full at one per SM, 25% at two
]


@pytest.mark.parametrize("wide1", [True, False])
@pytest.mark.parametrize("kind", ["dense", "varlen", "paged"])
@pytest.mark.parametrize("b,hk,sk,sms,want", _FOLD_CASES)
def test_a_fold_over_a_full_chip_runs_on_the_kernel_its_waves_fill(kind, b, hk, sk, sms, want,
                                                                    wide1):
    """constraints.fold_kernel: more (sequence, KV head) CTAs than SMs run on a wide fold kernel
    where its waves fill the chip (fwd_wide1 for a packed K's long context, where the store
    holds it; a paged K's on fwd_wide), else on the chunk kernel; the same results."""
    hq, d = 2 * hk, 16
    q, k, v = _inputs(b, 1, hq, hk, d, [sk] * b, seed=b + hk)
    if kind == "dense":
        kv, kk, vv, page, qq = (None, None, None), k, v, None, q
    elif kind == "varlen":
        cu = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32)
        kv, page, qq = (cu, None, None), None, q.reshape(b, hq, d)
        kk, vv = k.reshape(b * sk, hk, d), v.reshape(b * sk, hk, d)
    else:
        page = 64
        kk, vv, table = _page_pool(k, v, [sk] * b, page)
        kv = (None, torch.full((b,), sk, dtype=torch.int32), table)
        qq = q.reshape(b, hq, d)
    rt = _WideRuntime(wide1, sms)
    out = torch.full((*qq.shape[:-1], d), float("nan")).bfloat16()
    bound = sk if kind != "paged" else kv[2].shape[1] * page
    got = SK.split_step(rt, 0, qq, kk, vv,
                        SK.Step(kind, b, 1, hq, hk, d, d, bound, page, True, kind != "dense"),
                        *kv, None, None, out, None, False)
    assert got is not None and got[0] is out
    want, _, without = want.partition("/")
    if without and (kind == "paged" or not wide1):
        want = without
    assert rt.seen == [want]
    ro, _ = _ref(q, k, v, [sk] * b, True, None)
    assert rel_err(out.view(b, 1, hq, d), ro) < 1e-2


def test_wide_part_is_bound_where_the_rule_builds_it():
    """split.wide_part: fwd_wide_split for a packed (or dense) or paged K's hd128 split kernel
    that holds it; not for other head dims (a store built before the head-dim rule may hold
    one: unused), Blackwell, or an artifact without it. split.wide_path: which rule a paged
    step takes (none on the part fwd_tma, pages of 64)."""
    from fa4aot.model.compile_keys import split_kernel_variant as kv

    parts = {"fwd": {}, "fwd_wide_split": {}}
    assert S.wide_part(parts, kv("sm90", "bfloat16", 128, 128, None)) == "fwd_wide_split"
    assert S.wide_part(parts, kv("sm90", "bfloat16", 128, 128, 128)) == "fwd_wide_split"
    assert S.wide_path(None, False, False) is None
    assert S.wide_path(128, True, False) == "tma" and S.wide_path(16, False, False) == "cp.async"
    assert S.wide_path(64, False, True) is None
    assert S.wide_part(parts, kv("sm90", "bfloat16", 64, 64, None)) is None
    assert S.wide_part(parts, kv("sm100", "bfloat16", 128, 128, None)) is None
    assert S.wide_part({"fwd": {}}, kv("sm90", "bfloat16", 128, 128, None)) is None


class _PartsRuntime(_FakeRuntime):
    """_FakeRuntime's split kernels with the parts Runtime.split_kernel binds beside them: for
    pages of 64 the TMA page part (`fwd_tma`, constraints.tma_page), for a packed K the wide
    split part (`fwd_wide_split`, constraints.wide_split); records which kernel ran. Its plan
    is wide for a one-row step where `wide` (as split.wide_split may make it); fold: it leaves
    the step unsplit."""

    def __init__(self, n, fold=False, wide=False):
        super().__init__(n)
        self.seen, self.fold, self.wide = [], fold, wide

    def split_kernel(self, dev, dtype, d, dv, page_size):
        import dataclasses

        base = super().split_kernel(dev, dtype, d, dv, page_size)

        def named(name, fn):
            def run(*a, **kw):
                self.seen.append(name)
                return fn(*a, **kw)

            return run

        return dataclasses.replace(
            base, fwd=named("chunk", base.fwd),
            fwd_bounds=base.fwd_bounds and named("chunk", base.fwd_bounds),
            fwd_tma=named("fwd_tma", base.fwd) if page_size == 64 else None,
            fwd_wide_split=named("wide", base.fwd),
        )

    def split_for(self, *a, one_row=False, **kw):
        import dataclasses

        if self.fold:
            return None
        sp = super().split_for(*a, **kw)
        return dataclasses.replace(sp, wide=True) if self.wide and one_row else sp


@pytest.mark.parametrize("page,fold,want", [(64, False, "fwd_tma"), (16, False, "chunk"),
                                            (128, False, "chunk"), (64, True, "chunk")])
def test_a_split_over_pages_of_64_runs_on_the_tma_page_part(page, fold, want):
    """constraints.tma_page: a paged split step whose pages are the part's runs its chunks on
    fwd_tma (SplitKernel.launch_split); other page sizes, and the unsplit fold, on the chunk
    kernel; the same results."""
    b, hq, hk, d, lens = 2, 8, 2, 16, [700, 513]
    q, k, v = _inputs(b, 1, hq, hk, d, lens, seed=page)
    kk, vv, table = _page_pool(k, v, lens, page)
    rt = _PartsRuntime(4, fold)
    out = torch.full((b, hq, d), float("nan")).bfloat16()
    got = _split(rt, q, kk, vv, "paged", (None, torch.tensor(lens, dtype=torch.int32), table),
                 table.shape[1] * page, page, True, None, out, None, False, True)
    assert got is not None and got[0] is out
    assert rt.seen == [want]
    ro, _ = _ref(q, k, v, lens, True, None)
    assert rel_err(out.view(b, 1, hq, d), ro) < 1e-2


@pytest.mark.parametrize("b,sk,want", [
    # (batch at 32:8, keys, (chunks, keys a chunk) on the wide split kernel, or None)
    (16, 65536, (8, 8192)), (16, 131072, (8, 16384)),  # the fold over >= 64K keys
    (16, 16384, None),  # a fold of 16K: the merge would cost what the chunks gain
    # a split plan of one wave keeps the chunk kernel
    (8, 65536, None), (8, 131072, None), (4, 65536, None), (4, 131072, None),
    (2, 131072, None), (8, 32768, None), (8, 16384, None), (4, 32768, None), (2, 65536, None),
    (1, 65536, None), (1, 131072, None),
    # two waves or more of the fold: 16 wide chunks over >= 64K keys, else the fold's kernels
    (32, 131072, (16, 8192)), (32, 65536, (16, 4096)), (20, 65536, (16, 4096)),
    (128, 131072, (16, 8192)), (64, 16384, None), (32, 32768, None),
])
def test_wide_split_takes_long_folds(b, sk, want):
    """split.wide_split on the H200 (132 SMs, hd128, 32:8): the unsplit fold in one wave over
    >= 64K keys runs ~1024 CTAs of >= 4K keys on the wide split kernel, a fold of two waves or
    more over >= 64K keys 16 chunks; the rest, split plans among them, keep the plan.
    Only auto plans of a dense K with no sink, whose store has the part, go wide; a paged K
    by its chunk kernel's path (split.wide_path): the cp.async one takes the one-wave rule,
    FA4's TMA paged kernel (pages of 128) the two-wave rule."""
    kw = dict(ctas=b * 8, seqlen_k=sk, bytes_per_key=512, page_size=None, sink=False,
              num_sms=132, setting=-1)
    sp = S.plan_split(**kw, wide=True)
    plain = S.plan_split(**kw)
    assert plain is None or not plain.wide
    if want is None:
        assert sp == plain
    else:
        assert sp.wide and (sp.n, sp.chunk) == want and sp.n * sp.chunk >= sk
        assert S.plan_split(**{**kw, "setting": 5}, wide=True) == S.make_split(
            5, sk, page_size=None, sink=False)  # a forced count stays on the chunk kernel
        for other in ({"sink": True}, {"page_size": 128}):
            got = S.plan_split(**{**kw, **other}, wide=True)
            assert got is None or not got.wide
    for path, page in (("cp.async", 16), ("tma", 128)):
        got = S.plan_split(**{**kw, "page_size": page}, wide=True, wide_paged=path)
        two_waves = b * 8 > 132
        if want is None or two_waves != (path == "tma"):
            assert got is None or not got.wide, (path, got)
        else:
            assert got.wide and got.n * got.chunk >= sk and got.chunk % page == 0, (path, got)


@pytest.mark.parametrize("kind,want", [("dense", "wide"), ("varlen", "wide"),
                                       ("paged", "wide")])
def test_a_wide_plan_runs_its_chunks_on_the_wide_split_part(kind, want):
    """split.wide_split: a wide plan runs its chunks on fwd_wide_split (SplitRun.launch): a
    dense K's, a varlen one's (its chunk bounds written by the metadata kernel, or torch ops
    in stores without one, never the bounds mode of the chunk kernel, which the wide part
    lacks), a paged one's (its lengths cut by the kernel's chunk-length mode); the same
    results as the reference."""
    b, hq, hk, d, lens = 2, 8, 2, 16, [700, 700]
    q, k, v = _inputs(b, 1, hq, hk, d, lens, seed=5)
    rt = _PartsRuntime(4, wide=True)
    out = torch.full((b, hq, d), float("nan")).bfloat16()
    if kind == "dense":
        kv, kk, vv, sk, page = (None, None, None), k, v, 700, None
    elif kind == "varlen":
        cu = torch.tensor([0, 700, 1400], dtype=torch.int32)
        kv, kk, vv, sk, page = (cu, None, None), k.reshape(-1, hk, d), v.reshape(-1, hk, d), \
            700, None
    else:
        kk, vv, table = _page_pool(k, v, lens, 128)
        kv, sk, page = (None, torch.tensor(lens, dtype=torch.int32), table), \
            table.shape[1] * 128, 128
    got = _split(rt, q, kk, vv, kind, kv, sk, page, True, None, out, None, False, True)
    assert got is not None and got[0] is out
    assert rt.seen == [want]
    ro, _ = _ref(q, k, v, lens, True, None)
    assert rel_err(out.view(b, 1, hq, d), ro) < 1e-2


def test_unsplit_steps_the_chunk_kernel_does_not_take():
    q, k, v = _inputs(2, 1, 8, 2, 16, [700, 700], seed=3)

    def step(rt, q=q, hq=8, hk=2, sink=None):
        return SK.split_step(rt, 0, q, k, v, SK.Step("dense", 2, 1, hq, hk, 16, 16, 700, None,
                                                     True, False),
                             None, None, None, sink, None, None, None, False)

    assert step(_NoSplitRuntime()) is not None
    assert step(_NoSplitRuntime(), sink=torch.zeros(8)) is None  # no sink in the chunk kernel
    assert step(_NoSplitRuntime("sm100")) is None  # Blackwell: FA4's own tiles
    q128 = torch.randn(2, 1, 256, 16).bfloat16()  # 128 query heads per KV head: over 64 rows
    assert step(_NoSplitRuntime(), q=q128, hq=256, hk=2) is None


@pytest.mark.parametrize("b,sk,rows,want", [
    # (batch at 32:8, keys, query rows, the packed plan's (chunks, slots) or None: unrolled)
    (1, 65536, 4, (16, 17)), (1, 65536, 2, (16, 17)), (1, 131072, 4, (16, 17)),
    (2, 32768, 4, (8, 9)),  # the one-row step's count: the tail's slot is empty CTAs besides
    (1, 16384, 4, (16, 17)), (4, 16384, 2, (4, 5)),
    (4, 32768, 4, (4, 5)),  # the unrolled rows' 128 CTAs would not split: FA4's kernel
    (1, 8192, 4, None), (1, 4096, 2, None), (1, 32768, 2, None),  # the extra launches lose
    (8, 4096, 4, None), (16, 16384, 4, None),  # FA4's unsplit kernel packs the rows itself
])
def test_packed_rows_where_they_beat_unrolled_rows(b, sk, rows, want):
    """split.plan_packed on the H200 (132 SMs, hd128, 32:8, causal, pages of 128): packed
    where the one-row step's time plus the extra launches beats the unrolled rows'; a
    forced count always packs; a non-causal step has no tail slot, a sink one more slot."""
    kw = dict(batch=b, kv_heads=8, rows=rows, seqlen_k=S.plan_bucket(sk), bytes_per_key=512,
              page_size=128, num_sms=132)
    unrolled = S.plan_split(ctas=b * rows * 8, seqlen_k=S.plan_bucket(sk), bytes_per_key=512,
                            page_size=128, sink=False, num_sms=132, setting=-1,
                            decode_rows=b * rows, fold=False)
    sp = S.plan_packed(**kw, sink=False, causal=True, setting=-1, unrolled=unrolled)
    assert (sp and (sp.n, sp.slots)) == want, sp
    if sp:
        assert sp.packed and sp.tail and sp.n * sp.chunk >= sk and b * 8 * sp.n <= 132
    assert S.packed_refusal(ratio=4, rows=rows, tile_m=64, page_size=128) is None
    assert "two pages" in S.packed_refusal(ratio=4, rows=rows, tile_m=64, page_size=rows - 2)
    assert "64-row tile" in S.packed_refusal(ratio=20, rows=4, tile_m=64, page_size=128)
    forced = S.plan_packed(**kw, sink=True, causal=False, setting=5, unrolled=unrolled)
    assert forced.packed and not forced.tail and (forced.n, forced.slots) == (5, 6)
    assert S.plan_packed(**kw, sink=False, causal=True, setting=0) is None


def test_speculative_rows_over_a_packed_k_need_the_bounds_mode():
    """A store whose packed-K split kernel predates the bounds mode's several rows (the
    earlier one-row form, or none: SplitKernel.fwd_bounds None) runs such a step unsplit."""
    q, k, v = _inputs(2, 2, 4, 2, 16, [600, 600], seed=0)
    cu = torch.tensor([0, 600, 1200], dtype=torch.int32)

    class Rt(_FakeRuntime):
        def split_kernel(self, dev, dtype, d, dv, page_size):
            kern = super().split_kernel(dev, dtype, d, dv, page_size)
            return dataclasses.replace(kern, fwd_bounds=None)

    got = _split(Rt(4), q, k.reshape(-1, 2, 16), v.reshape(-1, 2, 16), "varlen",
                 (cu, None, None), 600, None, True, None, None, None, False, False)
    assert got is None
    # the record of that earlier form: the runtime loads no bounds part from it
    assert S.bounds_part({"fwd": {}, "fwd_bounds": {}}) is None
    assert S.bounds_part({"fwd": {}, "fwd_bounds": {"rows": 1}}) is None
    assert S.bounds_part({"fwd": {}, "fwd_bounds": {"rows": 2}}) == "fwd_bounds"


def test_page_table_view_is_free_when_it_fits():
    sp = S.make_split(4, 4096, page_size=128, sink=False)
    t = torch.arange(2 * 32, dtype=torch.int32).view(2, 32)
    v = S.chunk_page_table(torch, t, sp, 128)
    assert v.data_ptr() == t.data_ptr() and v.shape == (8, 8)
    assert torch.equal(v[5], t[1, 8:16])


def test_split_setting():
    from fa4aot import settings
    from fa4aot.errors import SettingError

    for raw, want in (("auto", -1), ("0", 0), ("16", 16)):
        with settings.scope(split_kv=raw):
            assert R.Runtime(roots=["/nonexistent"]).split == want
    for bad in ("yes", "-1", "2.5"):
        with settings.scope(split_kv=bad), pytest.raises(SettingError, match="FA4AOT_SPLIT_KV"):
            R.Runtime(roots=["/nonexistent"])


def test_dense_kv_lengths_in_one_plan_bucket_keep_their_own_chunk_bounds():
    """Two dense K lengths with the same split (same chunk size) must not share chunk bounds:
    the cached scratch is keyed by the exact length (found by review: 700 then 650 keys)."""
    rt = _FakeRuntime(2)
    for sk in (700, 650, 700):
        q, k, v = _inputs(2, 1, 4, 2, 16, [sk, sk], seed=sk)
        assert rt.plan(700, None, False) == rt.plan(650, None, False)
        o, _ = _split(rt, q, k, v, "dense", (None, None, None), sk, None, True, None, None,
                      None, False, False)
        ro, _ = _ref(q, k, v, [sk, sk], True, None)
        assert rel_err(o, ro) < 1e-2, sk


def test_one_row_split_reads_q_and_writes_lse_through_offset_views():
    """One decode row: the chunks read q through a stride-0 view of the caller's tensor (here
    a slice of a fused qkv, at a storage offset) and the combine writes a caller's LSE that
    starts mid-buffer; nothing outside either is touched."""
    q, k, v = _inputs(1, 1, 8, 2, 16, [900], seed=3)
    qkv = torch.cat([torch.full((1, 1, 4, 16), float("nan")).bfloat16(), q], dim=2)
    wide = torch.full((2, 8), float("nan"))
    lse = wide[1].view(1, 8, 1)
    got = _split(_FakeRuntime(3), qkv[:, :, 4:], k, v, "dense", (None, None, None), 900, None,
                 True, None, None, lse, True, False)
    assert got is not None and got[1] is lse
    ro, rl = _ref(q, k, v, [900], True, None)
    assert rel_err(got[0], ro) < 1e-2
    assert torch.allclose(lse, rl, atol=1e-3) and wide[0].isnan().all()


def test_merge_kernel_thread_layouts():
    """constraints.merge_threads: (dv / 8) lanes of 16-byte loads times chunk groups, whole
    warps, at most 256 threads and one per chunk's LSE; None (FA4's combine) where no such
    count exists."""
    from fa4aot.model.constraints import MERGE_MAX_THREADS, merge_threads

    for dv in range(8, 1025, 8):
        t = merge_threads(dv, S.MAX_SLOTS)
        if t is None:
            continue
        assert t % 32 == 0 and S.MAX_SLOTS <= t <= MERGE_MAX_THREADS and t % (dv // 8) == 0
    assert {dv: merge_threads(dv, S.MAX_SLOTS) for dv in (64, 96, 128, 256, 512)} == {
        64: 256, 96: 192, 128: 256, 256: 256, 512: 256}
    assert merge_threads(100, S.MAX_SLOTS) is None  # not whole 16-byte loads
    assert merge_threads(8 * 33, S.MAX_SLOTS) is None  # 33 lanes: no whole warps within 256


@pytest.mark.parametrize("form,pack", [("batch", False), ("packed", False), ("rows", False),
                                       ("rows-unmerged", False), ("rows", True),
                                       ("rows-unmerged", True)])
def test_chunk_mode_kernel_reads_the_callers_q_and_lengths_in_place(monkeypatch, form, pack):
    """With a forward that reads q and a paged K's lengths through chunk modes
    (forwards.trace_chunk_modes), the kernel gets the caller's q itself, (decode rows, r, hk,
    d): no copy over the chunks, for q in batch form, packed, and with speculative rows
    unrolled (whose rows merge into one stride); a q whose rows do not merge (here
    batch-strided through a wider buffer) goes as one copy. At one decode row it gets the
    caller's seqused_k too (no metadata launch); at several, each unrolled row's length.
    Speculative rows packed (split.plan_packed): the body's chunks read q copied into packed
    rows (b, r * rows, hk, d) and cut each sequence's page-rounded length themselves; the
    causal tail reads the caller's q as unrolled rows, with each row's tail length."""
    sq = 1 if form in ("batch", "packed") else 2
    if not pack:
        monkeypatch.setattr(S, "plan_packed", lambda **kw: None)
    lens = [300, 1000, 5]
    b, hq, hk, d, page = len(lens), 8, 2, 16, 64
    q, k, v = _inputs(b, sq, hq, hk, d, lens, seed=11)
    if form == "rows-unmerged":
        wide = torch.full((b, sq + 1, hq, d), float("nan")).bfloat16()
        wide[:, :sq] = q
        q_in = wide[:, :sq]
    else:
        q_in = q.reshape(b * sq, hq, d) if form == "packed" else q.clone()
    seen = []

    class Rt(_FakeRuntime):
        def split_kernel(self, dev, dtype, d_, dv, page_size):
            def fwd(qk, *a):
                seen.append((qk, a[8]))
                fake_fwd(qk, *a, chunk_lengths=True)

            return R.plan.SplitKernel(fwd, fake_combine, S.MAX_SLOTS, None,
                                      meta=fake_chunk_meta(True), q_broadcast=True,
                                      chunk_lengths=True)

    kpool, vpool, table = _page_pool(k, v, lens, page)
    used = torch.tensor(lens, dtype=torch.int32)
    got = SK.split_step(
        Rt(4), 0, q_in, kpool, vpool,
        SK.Step("paged", b, sq, hq, hk, d, d, table.shape[1] * page, page, True,
                form == "packed"),
        None, used, table, None, None, None, None, False,
    )
    assert got is not None and len(seen) == 1 + pack
    if pack:
        body_q, body_used = seen.pop(0)
        assert body_q.shape == (b, hq // hk * sq, hk, d) and body_used.shape == (b,)
        assert body_used.tolist() == [(n - sq + 1) // page * page for n in lens]
    qk, used_k = seen[0]
    # the caller's lengths at one row (no metadata launch), each unrolled row's at several
    assert (used_k is used) == (sq == 1) and used_k.shape == (b * sq,)
    assert qk.shape == (b * sq, hq // hk, hk, d)
    same = qk.untyped_storage().data_ptr() == q_in.untyped_storage().data_ptr()
    assert same == (form != "rows-unmerged")
    ro, _ = _ref(q, k, v, lens, True, None)
    assert rel_err(got[0].view(b, sq, hq, d), ro) < 1e-2


def test_a_split_keeps_its_virtual_sequences_within_the_chunk_grid():
    """split.MAX_VIRTUAL_SEQS: the chunk kernel's grid holds one (sequence, row, slot) per z
    index (FA4's SingleTileScheduler), so a forced or automatic count is cut to fit 65535 of
    them, a sink slot included; where no two chunks fit, the step is not split."""
    kw = dict(seqlen_k=8192, bytes_per_key=512, page_size=None, num_sms=132)
    sp = S.plan_split(ctas=4096 * 8, decode_rows=4096, sink=False, setting=64, **kw)
    assert sp.slots * 4096 <= S.MAX_VIRTUAL_SEQS and (sp.n, sp.chunk) == (13, 640)  # 15 asked
    sp = S.plan_split(ctas=4096 * 8, decode_rows=4096, sink=True, setting=64, **kw)
    assert sp.slots * 4096 <= S.MAX_VIRTUAL_SEQS and sp.slots == sp.n + 1 >= 13
    assert S.plan_split(ctas=40000 * 8, decode_rows=40000, sink=False, setting=8, **kw) is None
    assert S.plan_split(ctas=8, decode_rows=1, sink=False, setting=64, **kw).n == 64


def test_the_cost_model_follows_the_cards_hbm(monkeypatch):
    """split.model_for: the H200's figures on an H200 (its peak within 5%) or an unknown card;
    an H100 SXM's chip streams at 3.35 / 4.8 of them, so the packed plan leaves b8/16K s_q 4
    to FA4's unsplit kernel there (faster on the H100 than 2 chunks) and keeps b1/64K's 16
    chunks; short steps plan as on the H200.
    runtime.plan.hbm_peak: 2 x the memory clock
    x the bus width, else the card's name, else None."""
    import types

    from fa4aot.runtime import plan as P

    assert S.model_for(None) is S.DEFAULT_MODEL and S.model_for(4.92e12) is S.DEFAULT_MODEL
    h100 = S.model_for(3.35e12)
    assert h100.hbm_bytes_per_s == pytest.approx(S.DEFAULT_MODEL.hbm_bytes_per_s * 3.35 / 4.8)
    assert h100.cta_bytes_per_s == S.DEFAULT_MODEL.cta_bytes_per_s

    def packed(b, sk, rows, model):
        kw = dict(seqlen_k=S.plan_bucket(sk), bytes_per_key=512, page_size=128, num_sms=132,
                  setting=-1, model=model)
        un = S.plan_split(ctas=b * rows * 8, sink=False, decode_rows=b * rows, fold=False, **kw)
        sp = S.plan_packed(batch=b, kv_heads=8, rows=rows, sink=False, causal=True,
                           unrolled=un, **kw)
        return sp and sp.n

    assert packed(8, 16384, 4, S.DEFAULT_MODEL) == 2 and packed(8, 16384, 4, h100) is None
    assert packed(1, 65536, 4, S.DEFAULT_MODEL) == packed(1, 65536, 4, h100) == 16

    def one_row(b, sk, model):
        sp = S.plan_split(ctas=b * 8, seqlen_k=S.plan_bucket(sk), bytes_per_key=512,
                          page_size=None, sink=False, num_sms=132, setting=-1, decode_rows=b,
                          model=model)
        return sp and sp.n

    # a step of fewer than short_bytes (b4/1K: 16 MB) plans as on the H200: it reaches
    # neither card's peak (H100: 4 chunks 8.3 us in a graph, the fold 11.1)
    assert one_row(4, 1024, h100) == one_row(4, 1024, S.DEFAULT_MODEL) == 4
    assert one_row(8, 16384, S.DEFAULT_MODEL) == 2 and one_row(8, 16384, h100) is None

    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", memory_clock_rate=2619000,
                                  memory_bus_width=5120)
    monkeypatch.setattr(P.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(P.torch.cuda, "get_device_properties", lambda d: props)
    assert P.hbm_peak("cuda:0") == pytest.approx(3.352e12, rel=1e-3)
    props.memory_clock_rate = 0
    assert P.hbm_peak("cuda:0") == 3.35e12
    props.name = "NVIDIA H200"
    assert P.hbm_peak("cuda:0") == 4.8e12
    props.name = "NVIDIA A100-SXM4-80GB"
    assert P.hbm_peak("cuda:0") is None
