"""The ragged split (policy/ragged.py, runtime/ragged.py) on a CPU through the public entry
points: stand-in kernels (tests/fakes.py) compute what the chunk kernel, the metadata kernel
and the ragged merge compute, so the runtime's views, scratch and launches are checked end to
end against fp32 attention, sequence by sequence, on batches with empty, one-key and long
sequences."""

from __future__ import annotations

import pytest
import torch
from fakes import fake_combine, fake_fwd, fake_ragged_merge, fake_ragged_meta
from reference import attention_ref, paged_kv, rel_err
from stub_store import serve_variants

import fa4aot.runtime as R
from fa4aot.model import constraints as C
from fa4aot.model.compile_keys import split_kernel_variant
from fa4aot.policy import ragged as RG
from fa4aot.runtime import ragged as RR

BF16 = torch.bfloat16
UNIFORM_SPLITS = RG.uniform_splits
LENS = [0, 1, 700, 5000, 77, 1024, 129, 3000]


def _parts(variant):
    got = {"fwd": {}, "merge": {"partial_dtype": "bfloat16", "max_splits": 128, "threads": 256},
           "ragged_meta": {"version": C.RAGGED_VERSION}, "ragged_merge": {"max_splits": 128}}
    if not variant.paged:  # (a packed K's entries with seqused_k)
        got.update(fwd_used={}, ragged_meta_used={})
    return got


@pytest.fixture
def serve(monkeypatch, tmp_path, knobs):
    knobs(cache_dir=str(tmp_path / "cache"), padding=None)
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(RG, "RAGGED_MIN_BYTES", 0)  # (CPU-sized batches)
    monkeypatch.setattr(RG, "RAGGED_MIN_CHUNK_BYTES", 1)
    monkeypatch.setattr(RG, "uniform_splits", lambda **kw: None)  # (the ragged plan)
    calls = []

    def load(self, art, *names):
        got = {"fwd": fake_fwd, "merge": fake_combine, "ragged_meta": fake_ragged_meta,
               "ragged_merge": fake_ragged_merge, "fwd_used": fake_fwd,
               "ragged_meta_used": fake_ragged_meta}

        def counted(name):
            fn = got[name]
            return lambda *a: calls.append(name) or fn(*a)

        return [counted(n) if n in got else None for n in names]

    def make(page, parts=_parts):
        v = split_kernel_variant("sm90", "bfloat16", 64, 64, page)
        rt = serve_variants(monkeypatch, tmp_path / "cache", [v], load, "sm90", 132, parts)
        rt.calls = calls
        return rt

    yield make
    R.reset(roots=[tmp_path / "cache"])


def _batch(lens, hq, hk, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, mx = len(lens), max(lens)
    q = torch.randn(b, hq, d, generator=g).to(BF16)
    k = torch.randn(b, mx, hk, d, generator=g).to(BF16)
    v = torch.randn(b, mx, hk, d, generator=g).to(BF16)
    return q, k, v


def _reference(q, k, v, lens, sink=None):
    b = len(lens)
    o, lse = attention_ref(q[:, None], k, v, torch.ones(b), torch.tensor(lens), causal=True,
                           sink=sink)
    return o[:, 0], lse


@pytest.mark.parametrize("page", [16, 64, None])
@pytest.mark.parametrize("sink", [False, True])
def test_a_ragged_batch_is_split_by_its_real_lengths(serve, page, sink):
    """A one-row step over a paged (pages of 16 and 64) or packed K with an empty, a one-key
    and long sequences: served by the ragged plan (metadata, chunk kernel, ragged merge: three
    launches), out and LSE the reference's, a learnable sink counted once."""
    rt = serve(page)
    hq, hk = 8, 2
    q, k, v = _batch(LENS, hq, hk)
    s = torch.randn(hq) if sink else None
    b = len(LENS)
    cu_q = torch.arange(b + 1, dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu_q, max_seqlen_q=1, max_seqlen_k=max(LENS), causal=True,
              learnable_sink=s, return_lse=True)
    if page is None:
        cu_k = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
        kk = torch.cat([k[i, :n] for i, n in enumerate(LENS)])
        vv = torch.cat([v[i, :n] for i, n in enumerate(LENS)])
        o, lse = R.flash_attn_varlen_func(q, kk, vv, cu_seqlens_k=cu_k, **kw)
    else:
        kp, vp, table = paged_kv(k, v, LENS, page, shuffle=True, extra_cols=3)
        used = torch.tensor(LENS, dtype=torch.int32)
        o, lse = R.flash_attn_varlen_func(q, kp, vp, seqused_k=used, page_table=table, **kw)
    ro, rl = _reference(q, k, v, LENS, s)
    assert rel_err(o, ro) < 1e-2
    assert torch.allclose(lse, rl.reshape(b, hq).t(), atol=1e-3)
    assert o[0].abs().max() == 0  # the empty sequence: out 0
    runs = [r for r in rt._split_runs.values() if r]
    assert len(runs) == 1 and isinstance(runs[0], RR.RaggedRun)
    assert rt.calls == ["ragged_meta", "fwd", "ragged_merge"]
    assert runs[0].rg.entries == runs[0].rg.n + b


@pytest.mark.parametrize("page", [16, None])
def test_a_ragged_step_writes_every_scratch_value_it_reads(serve, page):
    """The entries' q rows, bounds, first entries and partials are left uninitialized (a fill
    made while a graph is captured would replay with every step): poisoned between two calls,
    they give the same out and LSE."""
    rt = serve(page)
    hq, hk = 8, 2
    q, k, v = _batch(LENS, hq, hk)
    b = len(LENS)
    kw = dict(cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32), max_seqlen_q=1,
              max_seqlen_k=max(LENS), causal=True, return_lse=True)
    if page is None:
        cu_k = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
        args = (q, torch.cat([k[i, :n] for i, n in enumerate(LENS)]),
                torch.cat([v[i, :n] for i, n in enumerate(LENS)]))
        kw["cu_seqlens_k"] = cu_k
    else:
        kp, vp, table = paged_kv(k, v, LENS, page, shuffle=True, extra_cols=3)
        args = (q, kp, vp)
        kw.update(seqused_k=torch.tensor(LENS, dtype=torch.int32), page_table=table)
    o1, l1 = (x.clone() for x in R.flash_attn_varlen_func(*args, **kw))
    (run,) = [r for r in rt._split_runs.values() if r]
    for t in (run.kq, run.ko, run.kl):
        t.fill_(float("nan"))
    run.first.fill_(-7)
    run.out_v.fill_(1 << 20)
    o2, l2 = R.flash_attn_varlen_func(*args, **kw)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


@pytest.mark.parametrize("sink", [False, True])
def test_a_packed_k_with_seqused_k_is_split_by_its_used_lengths(serve, sink):
    """A packed K whose sequences hold more keys than they use (cu_seqlens_k over their
    capacity, seqused_k): the ragged plan on its own parts (the entries' first keys and keys),
    the gaps, large keys and values, unread; out and LSE the reference's."""
    rt = serve(None)
    hq, hk = 8, 2
    q, k, v = _batch(LENS, hq, hk)
    s = torch.randn(hq) if sink else None
    b = len(LENS)
    gaps = [3, 0, 129, 7, 1000, 0, 64, 5]

    def with_gaps(x):
        return torch.cat([torch.cat([x[i, :n], 100 * torch.randn(gaps[i], hk, x.shape[-1]).to(
            BF16)]) for i, n in enumerate(LENS)])

    cap = [n + g for n, g in zip(LENS, gaps)]
    cu_k = torch.tensor([0, *torch.tensor(cap).cumsum(0).tolist()], dtype=torch.int32)
    o, lse = R.flash_attn_varlen_func(
        q, with_gaps(k), with_gaps(v), cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32),
        cu_seqlens_k=cu_k, seqused_k=torch.tensor(LENS, dtype=torch.int32), max_seqlen_q=1,
        max_seqlen_k=max(cap), causal=True, learnable_sink=s, return_lse=True)
    ro, rl = _reference(q, k, v, LENS, s)
    assert rel_err(o, ro) < 1e-2
    assert torch.allclose(lse, rl.reshape(b, hq).t(), atol=1e-3)
    runs = [r for r in rt._split_runs.values() if r]
    assert len(runs) == 1 and isinstance(runs[0], RR.RaggedRun) and runs[0].used
    assert rt.calls == ["ragged_meta_used", "fwd_used", "ragged_merge"]


def test_a_forced_split_count_one_sequence_or_an_old_store_keep_the_uniform_plan(serve):
    """FA4AOT_SPLIT_KV=N means N chunks a sequence (the uniform plan); one sequence has no
    raggedness; an artifact without the ragged parts splits as before."""
    q, k, v = _batch(LENS, 8, 2)
    kp, vp, table = paged_kv(k, v, LENS, 64)
    used = torch.tensor(LENS, dtype=torch.int32)
    b = len(LENS)

    def step(rt, n):
        rt._split_runs.clear()
        R.flash_attn_varlen_func(q[:n], kp, vp, cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
                                 max_seqlen_q=1, max_seqlen_k=max(LENS), seqused_k=used[:n],
                                 page_table=table[:n], causal=True)
        return [type(r).__name__ for r in rt._split_runs.values() if r]

    rt = serve(64)
    assert step(rt, b) == ["RaggedRun"]
    rt.split = 3
    assert step(rt, b) == ["SplitRun"]
    rt.split = -1
    assert "RaggedRun" not in step(rt, 1)
    old = serve(64, lambda v: {k: p for k, p in _parts(v).items() if not k.startswith("ragged")})
    assert "RaggedRun" not in step(old, b)


def test_a_step_in_short_uniform_chunks_keeps_the_uniform_plan(serve, monkeypatch):
    """Where the uniform plan's chunks hold at most RAGGED_MIN_CHUNK_BYTES, or can be cut to
    that within RAGGED_UNIFORM_CTAS_PER_SM CTAs an SM (policy/ragged.uniform_splits), the
    ragged plan's extra launches buy nothing: the uniform plan serves the step in such chunks,
    and the answer is the reference's."""
    rt = serve(64)
    monkeypatch.setattr(RG, "uniform_splits", UNIFORM_SPLITS)  # (not the fixture's)
    q, k, v = _batch(LENS, 8, 2)
    kp, vp, table = paged_kv(k, v, LENS, 64)
    used = torch.tensor(LENS, dtype=torch.int32)
    b = len(LENS)
    kw = dict(cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32), max_seqlen_q=1,
              max_seqlen_k=max(LENS), seqused_k=used, page_table=table, causal=True)
    monkeypatch.setattr(RG, "RAGGED_MIN_CHUNK_BYTES", 1024 * 256)  # (1024 keys at hd64)
    o = R.flash_attn_varlen_func(q, kp, vp, **kw)[0]
    runs = [r for r in rt._split_runs.values() if r]
    assert [type(r).__name__ for r in runs] == ["SplitRun"] and "ragged_meta" not in rt.calls
    assert runs[0].sp.chunk <= 1024  # (5120 keys at the bound: 5 chunks of 1024)
    assert rel_err(o, _reference(q, k, v, LENS)[0]) < 1e-2
    rt._split_runs.clear()
    monkeypatch.setattr(RG, "RAGGED_MIN_CHUNK_BYTES", 1)
    R.flash_attn_varlen_func(q, kp, vp, **kw)
    assert [type(r).__name__ for r in rt._split_runs.values() if r] == ["RaggedRun"]


def test_a_packed_k_with_seqused_k_is_never_cut_into_uniform_chunks(serve, monkeypatch):
    """No uniform split reads a packed K through seqused_k: where uniform_splits cuts the
    step into several chunks, the ragged plan serves it."""
    rt = serve(None)
    monkeypatch.setattr(RG, "uniform_splits", UNIFORM_SPLITS)
    monkeypatch.setattr(RG, "RAGGED_MIN_CHUNK_BYTES", 1024 * 256)  # (5 chunks of 1024 keys)
    q, k, v = _batch(LENS, 8, 2)
    b = len(LENS)
    cu_k = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    o = R.flash_attn_varlen_func(
        q, torch.cat([k[i, :n] for i, n in enumerate(LENS)]),
        torch.cat([v[i, :n] for i, n in enumerate(LENS)]),
        cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32), cu_seqlens_k=cu_k,
        seqused_k=torch.tensor(LENS, dtype=torch.int32), max_seqlen_q=1,
        max_seqlen_k=max(LENS), causal=True)[0]
    runs = [r for r in rt._split_runs.values() if r]
    assert len(runs) == 1 and isinstance(runs[0], RR.RaggedRun) and runs[0].used
    assert rel_err(o, _reference(q, k, v, LENS)[0]) < 1e-2


@pytest.mark.parametrize("varlen_q", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_speculative_rows_over_pages_are_packed_into_the_entries(serve, monkeypatch, varlen_q,
                                                                 causal):
    """A step of 3 query rows a sequence over pages: the rows packed into each body entry,
    a causal step's rows seeing their own keys through a tail entry a row (sequences shorter
    than the rows included); q packed (b * rows, hq, d) or in batch form (b, rows, hq, d),
    out and LSE in the caller's layout, equal to the reference."""
    monkeypatch.setattr(RG, "RAGGED_ROWS_MIN_KEYS", 0)  # (CPU-sized lengths)
    rt = serve(16)
    hq, hk, rows = 8, 2, 3
    lens = [0, 2, 700, 5000, 77, 1024]
    b = len(lens)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(b, rows, hq, 64, generator=g).to(BF16)
    _, k, v = _batch(lens, hq, hk, seed=6)
    kp, vp, table = paged_kv(k, v, lens, 16, shuffle=True)
    kw = dict(max_seqlen_k=max(lens), seqused_k=torch.tensor(lens, dtype=torch.int32),
              page_table=table, causal=causal, return_lse=True)
    if varlen_q:
        o, lse = R.flash_attn_varlen_func(
            q.reshape(b * rows, hq, 64), kp, vp, max_seqlen_q=rows,
            cu_seqlens_q=torch.arange(0, b * rows + 1, rows, dtype=torch.int32), **kw)
        o, lse = o.view(b, rows, hq, 64), lse.view(hq, b, rows).permute(1, 0, 2)
    else:
        o, lse = R.flash_attn_varlen_func(q, kp, vp, max_seqlen_q=rows, **kw)
    ro, rl = attention_ref(q, k, v, torch.full((b,), rows), torch.tensor(lens), causal=causal)
    live = torch.tensor(lens) > 0  # (an empty sequence's rows: out 0, lse -inf)
    assert rel_err(o[live], ro[live]) < 1e-2
    assert torch.allclose(lse[live], rl[live], atol=1e-3)
    runs = [r for r in rt._split_runs.values() if r]
    assert len(runs) == 1 and isinstance(runs[0], RR.RaggedRun) and runs[0].rg.rows == rows
    assert rt.calls == ["ragged_meta", "fwd", "ragged_merge"]
