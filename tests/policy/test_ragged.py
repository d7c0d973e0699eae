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


@pytest.mark.parametrize("kw", [dict(b=1), dict(rows=2, page=None), dict(setting=4),
                                dict(setting=0), dict(sk=1024)])
def test_the_plan_leaves_the_uniform_cases_to_the_uniform_plan(kw):
    assert _plan(**kw) is None


def test_several_rows_over_pages_are_entries_of_their_own(monkeypatch):
    assert _plan(rows=2) is None  # (RAGGED_ROWS: the uniform plan packs them)
    monkeypatch.setattr(RG, "RAGGED_ROWS", 4)
    rg = _plan(rows=4)
    assert rg.steps == 4 and rg.n == 17 and rg.entries == 4 * (17 + 8)  # the same CTAs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("page,rows", [(16, 1), (64, 1), (128, 1), (None, 1), (16, 3),
                                       (64, 4)])
@pytest.mark.parametrize("causal", [True, False])
def test_the_entries_tile_every_sequence_once_within_the_bounds(monkeypatch, seed, page, rows,
                                                                causal):
    """Each decode row's entries (first[i] + t, + steps, ...) cover the keys it sees once,
    in order, from page-aligned starts; at most n a row, the rest unused."""
    monkeypatch.setattr(RG, "RAGGED_ROWS", 4)
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
    assert used <= rows * (rg.n + b) == rg.entries and all(e[0] == -1 for e in entries[used:])
    for i, n in enumerate(lens):
        assert (first[i + 1] - first[i]) % rows == 0
        for t in range(rows):
            mine = entries[first[i] + t:first[i + 1]:rows]
            seen = max(n - (rows - 1 - t if causal else 0), 0)
            assert all(e[:2] == (i, t) and 0 <= e[3] <= chunk for e in mine)
            assert [e[2] for e in mine] == list(range(0, len(mine) * chunk, chunk))
            assert sum(e[3] for e in mine) == seen
            assert len(mine) <= rg.n  # the merge's slots suffice


def test_lengths_over_the_bound_stay_inside_the_scratch():
    """Lengths over the host's bound (a caller breaking max_seqlen_k) cannot write past the
    entries or the page-table rows: the chunk is capped and first[] clamped."""
    rg = RG.Ragged(n=4, entries=6, align=128, pages=2)  # (planned for lengths <= 256)
    first, entries, chunk = RG.entry_map([10000, 10000], rg, 64)
    assert chunk == 128 and len(entries) == 6 and first == [0, 6, 6]
    assert entries[-1] == (0, 0, 5 * 128, 128)
