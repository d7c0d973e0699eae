"""GPU correctness of the ragged split (policy/ragged.py; marker `gpu`; H200, a store from
`fa4aot build`).

Ragged decode batches (an empty and a one-key sequence beside long ones) over a paged K at
pages of 16, 64 and 128, a packed K (with and without seqused_k), and a batch-form KV cache
with seqused_k; GQA ratios 1 to 8
(the fold), head dims 64 to 256, learnable sinks; speculative steps of 2 to 16 query rows over
pages, causal and not (sequences shorter than the rows included). Each case draws fresh inputs, runs
the ragged plan and the unsplit kernel (FA4AOT_SPLIT_KV=0) into NaN-poisoned buffers and
compares both with an fp32 reference; the metadata kernel is checked field by field against
policy/ragged.entry_map; a captured CUDA graph replays at new lengths bit for bit as eager.
A one-row batch the uniform plan keeps in short chunks (policy/ragged.uniform_splits) is
checked against fp32 the same way.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from reference import attention_ref, paged_kv, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu
ERR_SLACK = 1.5  # bf16 partials round once more than the unsplit kernel's output
ERR_MAX = 2e-2  # beyond this a result is wrong outright (bf16 rounding: ~4e-3)
LENS = [0, 1, 37, 3000, 70000, 128, 20000, 513]


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")


@pytest.fixture
def spy(monkeypatch):
    """Counts the steps the ragged plan served, which takes every step it applies to (not
    only those the uniform plan would leave a long tail: policy/ragged.uniform_splits)."""
    from fa4aot.policy import ragged as RG
    from fa4aot.runtime import ragged as RR
    from fa4aot.runtime import splitkv as SK

    monkeypatch.setattr(RG, "uniform_splits", lambda **kw: None)

    seen = {"ragged": 0}
    inner = RR.ragged_step

    def counted(*a, **k):
        got = inner(*a, **k)
        seen["ragged"] += got is not None
        return got

    monkeypatch.setattr(SK.RR, "ragged_step", counted)
    return seen


def _rt(split):
    import fa4aot.runtime as R

    rt = R.default_runtime()
    rt.split = split
    rt.ragged = True
    rt._split_runs.clear()
    return rt


def _batch(lens, hq, hk, d, layout, page, seed, rows=1):
    """Fresh inputs: q (b * rows, hq, d), K/V as `layout` ("paged", "packed", "packed_used",
    "cache"), the call's keywords, and the batch-form K/V the reference reads."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, mx = len(lens), max(lens)
    q = torch.randn(b * rows, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, mx, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, mx, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    used = torch.tensor(lens, device="cuda", dtype=torch.int32)
    kw = dict(cu_seqlens_q=torch.arange(0, b * rows + 1, rows, device="cuda",
                                        dtype=torch.int32),
              max_seqlen_q=rows, max_seqlen_k=mx, causal=True)
    if layout == "paged":
        kk, vv, table = paged_kv(k, v, lens, page, shuffle=True, extra_cols=2)
        kw.update(seqused_k=used, page_table=table)
    elif layout == "packed":
        kk = torch.cat([k[i, :n] for i, n in enumerate(lens)])
        vv = torch.cat([v[i, :n] for i, n in enumerate(lens)])
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        kw.update(cu_seqlens_k=cu.cuda())
    elif layout == "packed_used":
        # a packed K whose sequences hold more keys than they use (seqused_k): the gaps hold
        # large keys and values, which a step reading them would not survive
        gap = [int(x) for x in torch.randint(0, 300, (b,), generator=g, device="cuda")]

        def with_gaps(x):
            return torch.cat([torch.cat([x[i, :n], 100 * torch.randn(
                gap[i], hk, d, device="cuda", dtype=x.dtype, generator=g)])
                for i, n in enumerate(lens)])

        kk, vv = with_gaps(k), with_gaps(v)
        cap = [n + x for n, x in zip(lens, gap)]
        cu = torch.tensor([0, *torch.tensor(cap).cumsum(0).tolist()], dtype=torch.int32)
        kw.update(cu_seqlens_k=cu.cuda(), seqused_k=used, max_seqlen_k=max(cap))
    else:  # a batch-form cache with seqused_k (flash_attn_with_kvcache's layout)
        kk, vv = k, v
        kw.update(seqused_k=used)
    return q, kk, vv, kw, k, v


def _ref(q, k, v, lens, sink, causal=True):
    """fp32 attention: (b * rows, hq, dv), lse (b * rows, hq)."""
    b = len(lens)
    rows = q.shape[0] // b
    o, lse = attention_ref(q.view(b, rows, *q.shape[1:]), k, v,
                           torch.full((b,), rows, device="cuda"),
                           torch.tensor(lens, device="cuda"), causal=causal, sink=sink)
    return o.reshape(b * rows, *o.shape[2:]), lse.permute(0, 2, 1).reshape(b * rows, -1)


def _run(q, kk, vv, kw, sink):
    import fa4aot

    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device="cuda")
    fa4aot.flash_attn_varlen_func(q, kk, vv, out=out, lse=lse, learnable_sink=sink,
                                  return_lse=True, **kw)
    return out, lse.t()


def _check(q, kk, vv, kw, k, v, lens, sink, spy, served=None):
    """Ragged (it must serve the step; spy None: served(runtime) checks the plan that did),
    then unsplit where the store has its kernel: each against fp32; the split error within
    ERR_SLACK of the unsplit one."""
    from fa4aot.errors import ArtifactMissing

    rt = _rt(-1)
    before = spy and spy["ragged"]
    o, lse = _run(q, kk, vv, kw, sink)
    if spy is None:
        served(rt)
    else:
        assert spy["ragged"] == before + 1, "the ragged plan did not serve the step"
    ro, rl = _ref(q, k, v, lens, sink, kw["causal"])
    assert not o.isnan().any() and not lse.isnan().any()
    err = rel_err(o, ro)
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse[fin] - rl[fin]).abs().max() < 1e-2
    try:
        _rt(0)
        ou, _ = _run(q, kk, vv, kw, sink)
        unsplit = rel_err(ou, ro)
    except ArtifactMissing:
        unsplit = None
    finally:
        _rt(-1)
    assert err < ERR_MAX, (err, unsplit)
    if unsplit is not None:
        assert err <= ERR_SLACK * unsplit + 1e-4, (err, unsplit)
    return err, unsplit


@pytest.mark.parametrize("layout,page", [("paged", 16), ("paged", 64), ("paged", 128),
                                         ("packed", None), ("packed_used", None),
                                         ("cache", None)])
@pytest.mark.parametrize("hq,hk,d", [(32, 8, 128), (8, 1, 128), (16, 2, 64), (8, 2, 256),
                                     (8, 8, 128)])
@pytest.mark.parametrize("sink", [False, True])
def test_a_ragged_batch_against_fp32(spy, layout, page, hq, hk, d, sink):
    kern = _rt(-1).split_kernel(0, torch.bfloat16, d, d, 16 if layout == "cache" else page)
    if kern is None or kern.ragged_meta is None:
        pytest.skip(f"the store has no split kernel with the ragged parts at hd{d} (for hd256: "
                    "fa4aot build --spec tests/specs/hd256-decode.toml beside the defaults)")
    lens = list(LENS)
    q, kk, vv, kw, k, v = _batch(lens, hq, hk, d, layout, page, seed=random.randrange(1 << 30))
    if layout == "cache":
        kw["max_seqlen_k"] = k.shape[1]
    s = torch.randn(hq, device="cuda") if sink else None
    err, unsplit = _check(q, kk, vv, kw, k, v, lens, s, spy)
    print(f"\n{layout} p{page} {hq}:{hk} hd{d} sink={sink}: ragged {err:.2e} unsplit "
          f"{unsplit if unsplit is None else f'{unsplit:.2e}'}")


@pytest.mark.parametrize("page", [16, 64, 128])
@pytest.mark.parametrize("rows,causal", [(2, True), (4, True), (4, False), (16, True)])
@pytest.mark.parametrize("hq,hk,d", [(32, 8, 128), (16, 2, 64), (8, 8, 128)])
@pytest.mark.parametrize("sink", [False, True])
def test_speculative_rows_against_fp32(spy, page, rows, causal, hq, hk, d, sink):
    """Several query rows a sequence over pages, packed into each entry (a causal step's rows
    seeing their own keys through a tail entry a row), with sequences shorter than the
    rows."""
    lens = [2, 0, 1, 3000, 70000, 128, 20000, 513]
    q, kk, vv, kw, k, v = _batch(lens, hq, hk, d, "paged", page, random.randrange(1 << 30),
                                 rows)
    kw["causal"] = causal
    s = torch.randn(hq, device="cuda") if sink else None
    err, unsplit = _check(q, kk, vv, kw, k, v, lens, s, spy)
    print(f"\nrows {rows} causal={causal} sink={sink} p{page} {hq}:{hk} hd{d}: ragged "
          f"{err:.2e} unsplit "
          f"{unsplit if unsplit is None else f'{unsplit:.2e}'}")


@pytest.mark.parametrize("page", [16, 64])
def test_short_uniform_chunks_serve_a_batch_the_ragged_plan_would_take(page):
    """Two sequences at 32K keys beside an empty and a one-key one, one row each (over
    RAGGED_MIN_BYTES at the bound): the uniform plan cut into chunks of at most
    RAGGED_MIN_CHUNK_BYTES serves it (policy/ragged.uniform_splits), against fp32 within
    ERR_SLACK of the unsplit kernel."""
    from fa4aot.policy import ragged as RG

    kern = _rt(-1).split_kernel(0, torch.bfloat16, 128, 128, page)
    if kern is None or kern.ragged_meta is None:  # (uniform_splits weighs only ragged steps)
        pytest.skip("the store has no split kernel with the ragged parts at hd128")

    def served(rt):
        runs = [r for r in rt._split_runs.values() if r]
        assert [type(r).__name__ for r in runs] == ["SplitRun"]
        assert runs[0].sp.chunk * (128 + 128) * 2 <= RG.RAGGED_MIN_CHUNK_BYTES, runs[0].sp

    lens = [32768, 1, 32700, 0]
    q, kk, vv, kw, k, v = _batch(lens, 32, 8, 128, "paged", page, random.randrange(1 << 30))
    _check(q, kk, vv, kw, k, v, lens, None, None, served)


@pytest.mark.parametrize("page", [16, 64, 128, None])
@pytest.mark.parametrize("rows", [1, 4])
def test_the_metadata_kernel_writes_the_entry_map(monkeypatch, page, rows):
    """The metadata kernel's outputs, field by field, against policy/ragged.entry_map: first,
    each entry's keys (paged) or bounds (packed), its page-table columns, its q rows (every
    row for a body entry, its own for a tail entry, in the (row, KV head, group) slots)."""
    from fa4aot.policy import ragged as RG

    if rows > 1 and page is None:
        pytest.skip("a packed K's entries tile it: one row a sequence")
    rng = random.Random()
    b = rng.choice([3, 8, 33, 300])
    lens = [rng.choice([0, 1, rng.randint(1, 300), int(10 ** rng.uniform(2, 5))])
            for _ in range(b)]
    hq, hk, d = 16, 2, 128
    rt = _rt(-1)
    kern = rt.split_kernel(0, torch.bfloat16, d, d, page)
    assert kern is not None and kern.ragged_meta is not None
    monkeypatch.setattr(RG, "RAGGED_MIN_BYTES", 0)  # (any batch size and length)
    monkeypatch.setattr(RG, "RAGGED_ROWS_MIN_KEYS", 0)
    monkeypatch.setattr(RG, "RAGGED_MIN_CHUNK_BYTES", 1)
    rg = RG.plan_ragged(batch=b, rows=rows, kv_heads=hk, seqlen_k=max(lens) + 1, bytes_per_key=512,
                        page_size=page, sink=False, num_sms=132, setting=-1,
                        max_slots=kern.max_slots)
    q = torch.randn(b * rows, hq, d, device="cuda", dtype=torch.bfloat16)
    w = rg.entries
    r = hq // hk
    qv = torch.full((w, rows, hk, r, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    first = torch.full((b + 1,), -7, device="cuda", dtype=torch.int32)
    if page:
        npg = max(-(-n // page) for n in lens) + 1
        table = torch.randint(0, 1 << 20, (b, npg), device="cuda", dtype=torch.int32)
        used = torch.tensor(lens, device="cuda", dtype=torch.int32)
        out_v = torch.full((w,), -7, device="cuda", dtype=torch.int32)
        table_v = torch.full((w, max(rg.pages, 1)), -7, device="cuda", dtype=torch.int32)
        kern.ragged_meta(used, table, q, qv, out_v, table_v, first, rg.n, rg.align, page,
                         rows, 1)
    else:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).cuda()
        out_v = torch.full((w + 1,), -7, device="cuda", dtype=torch.int32)
        kern.ragged_meta(cu, None, q, qv, out_v, None, first, rg.n, rg.align, 0, 1, 1)
    torch.cuda.synchronize()
    want_first, entries, chunk = RG.entry_map(lens, rg, page, causal=True)
    assert first.tolist() == want_first
    for e, (i, t, start, keys) in enumerate(entries):
        if i < 0:
            assert int(out_v[e]) == (0 if page else int(cu[-1]))
            continue
        for tt in range(rows) if t < 0 else [t]:
            assert torch.equal(qv[e, tt], q[i * rows + tt].view(hk, r, d))
        if page:
            assert int(out_v[e]) == keys
            cols = min(-(-keys // 128) * 128 // page, table_v.shape[1])
            src = [min(start // page + x, table.shape[1] - 1) for x in range(cols)]
            assert table_v[e, :cols].tolist() == table[i, src].tolist()
        else:
            assert int(out_v[e]) == int(cu[i]) + start
    if not page:
        assert int(out_v[w]) == int(cu[-1])


@pytest.mark.parametrize("layout,page,rows", [("paged", 64, 1), ("paged", 16, 1),
                                              ("packed", None, 1), ("paged", 64, 4),
                                              ("paged", 128, 4)])
def test_a_captured_graph_replays_at_new_lengths_bit_for_bit(spy, layout, page, rows):
    """Captured once for the bounds, replayed with new lengths under them (zeros and one-key
    sequences among them, and for a paged K a new page table): the eager call's bits, each
    replay exact against fp32."""
    import fa4aot

    lens = list(LENS)
    hq, hk, d = 32, 8, 128
    q, kk, vv, kw, k, v = _batch(lens, hq, hk, d, layout, page, random.randrange(1 << 30),
                                 rows)
    out = torch.full_like(q, float("nan"))
    _rt(-1)

    def step():
        fa4aot.flash_attn_varlen_func(q, kk, vv, out=out, **kw)

    step()  # (eager warm-up: the run's constants)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    rng = random.Random()
    for _ in range(3):
        # (at most the old lengths: the pool holds only their keys)
        new = [rng.choice([0, min(1, n), rng.randint(0, n)]) for n in lens]
        q.normal_()
        if layout == "packed":
            kw["cu_seqlens_k"].copy_(torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()],
                                                  dtype=torch.int32))
            kk[: sum(new)].copy_(torch.cat([k[i, :n] for i, n in enumerate(new)]))
            vv[: sum(new)].copy_(torch.cat([v[i, :n] for i, n in enumerate(new)]))
        else:
            kw["seqused_k"].copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        out.fill_(float("nan"))
        step()
        torch.cuda.synchronize()
        assert torch.equal(replayed, out)
        ro, _ = _ref(q, k, v, new, None)
        assert rel_err(out, ro) < ERR_MAX
    assert spy["ragged"] >= 5
