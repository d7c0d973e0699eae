"""The ragged plan's bounds and its entry map (policy/ragged.py): the map is the metadata
kernel's arithmetic, which the GPU test checks the kernel against."""

from __future__ import annotations

import random

import pytest

from fa4aot.policy import ragged as RG


def _plan(b=8, hk=8, sk=131072, page=64, sink=False, **kw):
    args = dict(batch=b, rows=1, kv_heads=hk, seqlen_k=sk, bytes_per_key=512, page_size=page,
                sink=sink, num_sms=132, setting=-1, max_slots=128)
    return RG.plan_ragged(**{**args, **kw})


def test_the_plan_fixes_only_bounds():
    rg = _plan()
    assert rg.n == 66 and rg.entries == 66 + 8  # 4 CTAs an SM over 8 KV heads
    assert rg.align == 128 and rg.pages * 64 == RG.chunk_bound(8 * 131072, 66, 128)
    assert _plan(hk=1).n == _plan(hk=1, sink=True).n == 127  # the merge's 128 slots, one LSE
    # for the sink
    assert _plan(page=None).pages == 0 and _plan(page=256).align == 256


def test_a_batch_at_the_bound_keeps_chunks_of_the_floor():
    """Two sequences of 32K at 64:8, hd128: 16 chunks of 4096 keys (2 MiB a KV head, the
    uniform plan's 8 a sequence), not 66 of 1024; at hd256 2048 keys hold as many bytes; a
    long bound keeps 4 CTAs an SM."""
    rg = _plan(b=2, sk=32768)
    assert rg.n == 16 and RG.entry_map([32768, 32768], rg, 64)[2] == 4096
    assert _plan(b=2, sk=32768, bytes_per_key=1024).n == 32
    assert _plan(b=32, sk=4096).n == 32 and _plan(b=32, sk=131072).n == 66


def test_a_step_in_short_uniform_chunks_keeps_the_uniform_plan():
    """Chunks of at most 2 MiB a KV head (4096 keys at hd128 bf16) keep the uniform plan as it
    is; longer ones are cut to that where it takes at most 2 CTAs an SM at the bound, else
    the ragged plan serves the step."""
    kw = dict(bytes_per_key=512, num_sms=132, max_slots=128, sink=False)
    assert RG.uniform_splits(batch=32, kv_heads=8, seqlen_k=4096, chunk=4096, **kw) == 1
    assert RG.uniform_splits(batch=64, kv_heads=8, seqlen_k=4096, chunk=4096, **kw) == 1
    # 4 x 32768 at 8 KV heads: 8 chunks of 4096, 256 CTAs
    assert RG.uniform_splits(batch=4, kv_heads=8, seqlen_k=32768, chunk=8192, **kw) == 8
    assert RG.uniform_splits(batch=16, kv_heads=8, seqlen_k=16384, chunk=16384, **kw) is None
    assert RG.uniform_splits(batch=8, kv_heads=8, seqlen_k=131072, chunk=8192, **kw) is None
    # hd256: 2048 keys hold 2 MiB
    assert RG.uniform_splits(batch=2, kv_heads=8, seqlen_k=16384, chunk=4096,
                             **{**kw, "bytes_per_key": 1024}) == 8
    # the merge's slots bound the count
    assert RG.uniform_splits(batch=2, kv_heads=1, seqlen_k=1 << 20, chunk=1 << 20, **kw) is None


def test_the_uniform_plan_kept_instead_is_cut_to_short_chunks():
    """uniform_instead: the uniform plan as it is where its chunks are short, cut to
    uniform_splits' count where they are not; a packed K with seqused_k only unsplit."""
    from fa4aot.policy import split as S

    kw = dict(bytes_per_key=512, num_sms=132, max_slots=128, sink=False, page_size=64)
    four = S.make_split(4, 32768, page_size=64, sink=False)
    assert RG.uniform_instead(four, batch=4, kv_heads=8, seqlen_k=32768, **kw) == (
        True, S.make_split(8, 32768, page_size=64, sink=False))
    assert RG.uniform_instead(None, batch=32, kv_heads=8, seqlen_k=4096, **kw) == (True, None)
    assert RG.uniform_instead(None, batch=32, kv_heads=8, seqlen_k=4096, used=True,
                              **kw) == (True, None)
    assert RG.uniform_instead(four, batch=4, kv_heads=8, seqlen_k=32768, used=True,
                              **kw) == (False, four)
    assert RG.uniform_instead(None, batch=8, kv_heads=8, seqlen_k=131072, **kw) == (False, None)


@pytest.mark.parametrize("kw", [dict(b=1), dict(rows=2, page=None), dict(setting=4),
                                dict(setting=0), dict(sk=1024)])
def test_the_plan_leaves_the_uniform_cases_to_the_uniform_plan(kw):
    assert _plan(**kw) is None


def test_several_rows_over_pages_are_packed_with_a_tail_entry_a_row(monkeypatch):
    monkeypatch.setattr(RG, "RAGGED_MIN_BYTES", 0)
    assert _plan(rows=4, sk=RG.RAGGED_ROWS_MIN_KEYS - 1) is None  # all short: the uniform plan
    assert _plan(rows=1, sk=RG.RAGGED_ROWS_MIN_KEYS - 1) is not None
    rg = _plan(rows=4)
    # the rows share each entry's CTAs: n as for one row; rows * batch tail entries
    assert rg.rows == 4 and rg.n == 66 and rg.entries == 66 + 8 + 4 * 8
    # a non-causal step has no tail: every row sees every key of the body entries
    assert _plan(rows=4, causal=False).entries == 66 + 8
    assert _plan(rows=17) is None  # (RAGGED_ROWS)
    # a page of 128 keys: a tail entry's keys (under a page plus the rows) need two columns
    monkeypatch.setattr(RG, "RAGGED_ROWS_MIN_KEYS", 0)
    monkeypatch.setattr(RG, "RAGGED_MIN_CHUNK_BYTES", 1)
    assert _plan(rows=4, page=128, b=2, sk=64).pages == 2
    assert _plan(rows=1, page=128, b=2, sk=64).pages == 1
    assert _plan(rows=4, hk=1).n == 126  # the merge's 128 slots: the tail's and the sink's


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("page,rows", [(16, 1), (64, 1), (128, 1), (None, 1), (16, 3),
                                       (64, 4), (128, 16)])
@pytest.mark.parametrize("causal", [True, False])
def test_the_entries_tile_every_sequence_once_within_the_bounds(monkeypatch, seed, page, rows,
                                                                causal):
    """Each sequence's body entries cover the keys every row sees once, in order, from
    page-aligned starts, at most n of them; a causal step of several rows follows them with
    one tail entry a row, from the body's end to the row's last key; the rest unused."""
    monkeypatch.setattr(RG, "RAGGED_ROWS_MIN_KEYS", 0)
    rng = random.Random(seed)
    b = rng.choice([2, 8, 32, 100])
    sk = 131072
    lens = [rng.choice([0, 1, rng.randint(1, 200), int(10 ** rng.uniform(2, 5.1))])
            for _ in range(b)]
    lens = [min(x, sk) for x in lens]
    rg = _plan(b=b, sk=sk, page=page, rows=rows)
    first, entries, chunk = RG.entry_map(lens, rg, page, causal)
    assert chunk % rg.align == 0 and chunk >= -(-sum(lens) // rg.n)
    if page:
        assert chunk <= rg.pages * page
    used = first[-1]
    assert used <= rg.entries and all(e[0] == -1 for e in entries[used:])
    tail = rows if rows > 1 and causal else 0
    for i, n in enumerate(lens):
        mine = entries[first[i]:first[i + 1]]
        body, tails = mine[:len(mine) - tail], mine[len(mine) - tail:]
        assert all(e[:2] == (i, -1) and 0 < e[3] <= chunk for e in body)
        assert [e[2] for e in body] == list(range(0, len(body) * chunk, chunk))
        assert len(body) <= rg.n  # the merge's slots suffice
        end = sum(e[3] for e in body)
        assert end == (max(n - rows + 1, 0) // page * page if tail else n)
        for t, e in enumerate(tails):
            assert e[:3] == (i, t, end) and end + e[3] == max(n - rows + 1 + t, 0)
            assert e[3] < page + rows and -(-e[3] // 128) * 128 <= rg.pages * page


def test_lengths_over_the_bound_stay_inside_the_scratch():
    """Lengths over the host's bound (a caller breaking max_seqlen_k) cannot write past the
    entries or the page-table rows: the chunk is capped and first[] clamped."""
    rg = RG.Ragged(n=4, entries=6, align=128, pages=2)  # (planned for lengths <= 256)
    first, entries, chunk = RG.entry_map([10000, 10000], rg, 64)
    assert chunk == 128 and len(entries) == 6 and first == [0, 6, 6]
    assert entries[-1] == (0, -1, 5 * 128, 128)
