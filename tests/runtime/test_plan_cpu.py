"""The runtime's plan step on a CPU, through the public entry points: a stand-in store serves
chosen variants with reference kernels (CPU tensors report device 0), so validate -> plan ->
launch runs end to end: plans are cached per key (the call's description is built once),
split-KV composes with the GQA fold and falls back to the unsplit plan when the store lacks the
split kernel, and kernels are called through their arch's ABI."""

from __future__ import annotations


import pytest
import torch
from reference import attention_ref, rel_err
from stub_store import serve_variants
from fakes import dense_ref_kernel, fake_combine, fake_fwd

import fa4aot.runtime as R
from fa4aot.errors import UnsupportedVariant
from fa4aot.runtime import abi as A
from fa4aot.runtime import launch as L
from fa4aot.runtime import plan as P
from fa4aot.runtime import splitkv as SK
from fa4aot.runtime import splitruns as SR
from fa4aot.model.compile_keys import features, split_kernel_variant

BF16 = torch.bfloat16


def _parts(variant):
    """A record's parts as `fa4aot build` writes them: a split chunk kernel merges its chunks
    with fa4aot's merge kernel (part `merge`)."""
    return {"fwd": {}, "merge": {"partial_dtype": "bfloat16", "max_splits": 128, "threads": 256}}


def _parts_before_merge(variant):
    """A split chunk kernel's parts as builds before fa4aot's merge kernel wrote them: FA4's
    combine (part `combine`)."""
    return {"fwd": {}, "combine": {"partial_dtype": "bfloat16", "tile_m": 16, "max_splits": 128}}


def fake_merge(op, lp, out, lse):
    """fa4aot's merge kernel: FA4's combine's four tensors, and nothing else (abi.bind_fa4aot_merge)."""
    fake_combine(op, lp, out, lse)


def fake_fa4_combine(*args):
    """FA4's combine in its own ABI: the four tensors, then five Nones (abi.bind_combine)."""
    assert len(args) == 9
    fake_combine(*args)


@pytest.fixture
def store(monkeypatch, tmp_path, knobs):
    """serve(variants) -> the default runtime, its stores holding exactly `variants`."""
    knobs(cache_dir=str(tmp_path / "cache"), padding=None)
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    calls = {"fwd": 0, "combine": 0}

    def load(self, art, *names):
        def counted(name, fn):
            def k(*a):
                calls[name] += 1
                return fn(*a)

            return k

        v = art.variant
        split = v == split_kernel_variant("sm90", "bfloat16", v.head_dim, v.head_dim_v, None)
        fwd = fake_fwd if split else dense_ref_kernel(v.causal)
        got = {"fwd": counted("fwd", fwd), "merge": counted("combine", fake_merge),
               "combine": counted("combine", fake_fa4_combine)}
        return [got.get(n) for n in names]

    def serve(variants, parts=_parts):
        rt = serve_variants(monkeypatch, tmp_path / "cache", variants, load, "sm90", 132, parts)
        rt.calls = calls
        return rt

    yield serve
    R.reset(roots=[tmp_path / "cache"])


def _dense_variant(b, sq, hq, hk, d, causal=True, lse=False, tile_m=None):
    return features(arch="sm90", dtype="bfloat16", head_dim=d, head_dim_v=d, num_heads=hq,
                    num_heads_kv=hk, causal=causal, window_left=None, window_right=None,
                    return_lse=lse, sink_dtype=None, batch=b, seqlen_q=sq, total_q=b * sq,
                    max_seqlen_q=None, tile_m=tile_m)


def _qkv(b, sq, sk, hq, hk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, sq, hq, d, generator=g).to(BF16),
            torch.randn(b, sk, hk, d, generator=g).to(BF16),
            torch.randn(b, sk, hk, d, generator=g).to(BF16))


def test_plan_is_cached_per_key_and_the_description_built_once(store, monkeypatch):
    rt = store([_dense_variant(2, 200, 8, 2, 64)])
    built = []
    real = R.CallFeatures
    monkeypatch.setattr(R, "CallFeatures", lambda *a, **kw: built.append(a) or real(*a, **kw))
    q, k, v = _qkv(2, 200, 40, 8, 2, 64)
    for _ in range(3):
        o, _ = R.flash_attn_func(q, k, v, causal=True)
    assert len(built) == 1 and len(rt._plans) == 1 and rt.calls["fwd"] == 3
    (plan,) = rt._plans.values()
    assert plan.pad is None and plan.abi is L.SM90
    ro, _ = attention_ref(q, k, v, torch.full((2,), 200), torch.full((2,), 40), causal=True)
    assert rel_err(o, ro) < 1e-2
    # another prefill length shares the plan (the key clamps the query length at 193)
    R.flash_attn_func(*_qkv(2, 300, 40, 8, 2, 64), causal=True)
    assert len(built) == 1


@pytest.mark.parametrize("sink", [False, True])
def test_split_composes_with_the_gqa_fold_through_the_entry_point(store, sink):
    """A 4:1 decode step over 1500 keys split in 3: the split kernel is the 1:1 non-causal
    fold kernel (4 query heads as 4 rows); the call's own variant is never planned."""
    rt = store([split_kernel_variant("sm90", "bfloat16", 64, 64, None)])
    rt.split = 3
    q, k, v = _qkv(2, 1, 1500, 8, 2, 64, seed=1)
    s = torch.randn(8) if sink else None
    for _ in range(2):
        o, lse = R.flash_attn_func(q, k, v, causal=True, learnable_sink=s, return_lse=True)
    ro, rl = attention_ref(q, k, v, torch.ones(2), torch.full((2,), 1500), causal=True, sink=s)
    assert rel_err(o, ro) < 1e-2 and torch.allclose(lse, rl, atol=1e-3)
    assert rt._plans == {}  # served by the split alone
    runs = [r for r in rt._split_runs.values() if r]
    assert len(runs) == 1 and runs[0].sp.slots == 3 + sink
    assert rt.calls == {"fwd": 2, "combine": 2}


@pytest.mark.parametrize("parts", [_parts, _parts_before_merge])
def test_split_merges_with_the_artifacts_merge_part(store, parts):
    """A split chunk kernel's artifact names its merge kernel: fa4aot's (`merge`, 4 arguments)
    or, built before it, FA4's combine (`combine`, FA4's 9): the runtime binds each by its ABI,
    and both give the reference."""
    rt = store([split_kernel_variant("sm90", "bfloat16", 64, 64, None)], parts)
    rt.split = 3
    q, k, v = _qkv(2, 1, 1500, 8, 2, 64, seed=3)
    o, lse = R.flash_attn_func(q, k, v, causal=True, return_lse=True)
    ro, rl = attention_ref(q, k, v, torch.ones(2), torch.full((2,), 1500), causal=True)
    assert rel_err(o, ro) < 1e-2 and torch.allclose(lse, rl, atol=1e-3)
    (kern,) = [x for x in rt._split_kernels.values() if x]
    assert kern.fa4aot_merge == (parts is _parts) and rt.calls == {"fwd": 1, "combine": 1}


def test_no_split_kernel_runs_the_unsplit_plan(store):
    """The store lacks the split kernel: the decision (unsplit) is cached, the exact plan runs."""
    rt = store([_dense_variant(1, 1, 8, 2, 64)])
    rt.split = 4
    q, k, v = _qkv(1, 1, 1500, 8, 2, 64, seed=2)
    for _ in range(2):
        o, _ = R.flash_attn_func(q, k, v, causal=True)
    assert list(rt._split_runs.values()) == [False]
    assert len(rt._plans) == 1 and rt.calls == {"fwd": 2, "combine": 0}
    ro, _ = attention_ref(q, k, v, torch.ones(1), torch.full((1,), 1500), causal=True)
    assert rel_err(o, ro) < 1e-2


def test_pad_then_split_compose(store):
    """hd 72 with no kernel of its own: the split finds no hd-72 split kernel and declines; the
    plan pads to hd 128, and the padded re-entry splits on the hd-128 split kernel (the
    softmax scale stays the caller's 1/sqrt(72); O is cropped back)."""
    rt = store([split_kernel_variant("sm90", "bfloat16", 128, 128, None),
                _dense_variant(1, 1, 8, 2, 128, lse=True)])
    rt.split = 3
    q, k, v = _qkv(1, 1, 1500, 8, 2, 72, seed=4)
    o, lse = R.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert o.shape == (1, 1, 8, 72) and lse.shape == (1, 8, 1)
    ro, rl = attention_ref(q, k, v, torch.ones(1), torch.full((1,), 1500), causal=True)
    assert rel_err(o, ro) < 1e-2 and torch.allclose(lse, rl, atol=1e-3)
    (plan,) = rt._plans.values()
    assert plan.pad is not None and (plan.pad.head_dim, plan.pad.fold) == (128, 1)
    assert rt.calls == {"fwd": 1, "combine": 1}  # the split ran, not the padded exact kernel
    assert sorted(bool(r) for r in rt._split_runs.values()) == [False, True]


def test_split_scratch_is_bounded(store, monkeypatch):
    rt = store([split_kernel_variant("sm90", "bfloat16", 64, 64, None)])
    rt.split = 2
    made = []
    real = SK.SplitRun
    monkeypatch.setattr(SK, "SplitRun", lambda *a, **kw: made.append(1) or real(*a, **kw))
    for b in range(1, 20):
        R.flash_attn_func(*_qkv(b, 1, 1100, 2, 1, 64), causal=True)
    assert len(made) == 19
    assert sum(1 for r in rt._split_runs.values() if r) <= 16 and rt._split_scratch <= 16


def test_fresh_scratch_keeps_nothing(store):
    """Inside splitruns.fresh_scratch (what fa4aot.ops enters: torch.compile's cudagraph trees
    warm up in the graph's pool and refuse tensors there that outlive the call) a split step
    caches no SplitRun and no constant, and still computes the same answer."""
    rt = store([split_kernel_variant("sm90", "bfloat16", 64, 64, None)])
    rt.split = 3
    q, k, v = _qkv(2, 1, 1500, 8, 2, 64, seed=5)
    with SR.fresh_scratch():
        o, lse = R.flash_attn_func(q, k, v, causal=True, return_lse=True)
        o2, _ = R.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert rt._split_runs == {} and rt._split_consts == {}
    assert rt.calls == {"fwd": 2, "combine": 2} and torch.equal(o, o2)
    ro, rl = attention_ref(q, k, v, torch.ones(2), torch.full((2,), 1500), causal=True)
    assert rel_err(o, ro) < 1e-2 and torch.allclose(lse, rl, atol=1e-3)
    o3, _ = R.flash_attn_func(q, k, v, causal=True, return_lse=True)  # outside: cached again
    assert torch.equal(o3, o) and len([r for r in rt._split_runs.values() if r]) == 1


def test_a_page_table_at_a_mapping_boundary_goes_behind_a_guard():
    """FA4's TMA-paged sm90 kernel reads page_table[0, -1] for an empty first sequence: a table
    starting at a 64 KiB boundary (where a GPU mapping may start) is passed as a copy with 16
    readable bytes before it; any other table as it is (abi.GUARD_ALIGN)."""
    seen = []
    fwd = L.SM90.fwd(lambda *a: seen.append(a[10]))
    buf = torch.empty(2 * A.GUARD_ALIGN // 4 + 64, dtype=torch.int32)
    at = (-buf.data_ptr() % A.GUARD_ALIGN) // 4
    aligned = buf[at : at + 12].view(3, 4)
    aligned.copy_(torch.arange(12, dtype=torch.int32).view(3, 4))
    inner = buf[at + 4 : at + 16].view(3, 4)  # 16 bytes past a boundary: mapped before it
    for table in (aligned, inner):
        fwd(None, None, None, None, None, 1.0, page_table=table)
    got, same = seen
    assert aligned.data_ptr() % A.GUARD_ALIGN == 0
    assert got.data_ptr() != aligned.data_ptr() and torch.equal(got, aligned)
    assert got.storage_offset() == 4 and got.data_ptr() % 16 == 0
    assert same is inner


def test_the_guard_is_bound_only_where_the_kernel_may_take_fa4s_tma_paged_path():
    """FA4's cp.async paged path (page size != tile_n) clamps the block it reads the table at
    and checks each row, so its launcher passes even a table at a 64 KiB boundary as it is (a
    serving engine's persistent block table, no copy per call); a kernel on the TMA paged path
    (page == tile_n, the part fwd_tma) and one whose variant is unknown keep the guard."""
    from fa4aot.model import compile_keys as variants

    buf = torch.empty(2 * A.GUARD_ALIGN // 4 + 64, dtype=torch.int32)
    at = (-buf.data_ptr() % A.GUARD_ALIGN) // 4
    table = buf[at : at + 12].view(3, 4)
    assert table.data_ptr() % A.GUARD_ALIGN == 0

    def passed(launch, seen):
        launch(None, None, None, None, None, 1.0, page_table=table)
        return seen.pop()

    seen = []
    kernel = lambda *a: seen.append(a[10])  # noqa: E731
    assert passed(L.SM90.fwd(kernel, guard=False), seen) is table
    assert passed(L.SM90.fwd(kernel), seen) is not table
    for page, guarded in ((16, False), (64, False), (128, True), (None, True)):
        v = variants.split_kernel_variant("sm90", "bfloat16", 128, 128, page)
        assert v.paged_tma is (None if page is None else guarded)
        plan = P.Plan(v, kernel, None, False, False, None)
        assert (passed(plan.launch, seen) is not table) is guarded, page
        split = P.SplitKernel(kernel, None, 8, None, paged_tma=v.paged_tma is not False,
                              fwd_tma=kernel, fwd_wide=kernel)
        assert (passed(split.launch, seen) is not table) is guarded, page
        assert passed(split.launch_split, seen) is not table  # fwd_tma: the TMA path
        assert passed(split.launch_wide, seen) is table  # fwd_wide: cp.async when paged
    assert passed(P.Plan(None, kernel, None, False, False, None).launch, seen) is not table


def test_launch_is_dispatched_by_arch():
    with pytest.raises(UnsupportedVariant, match="no kernel ABI for sm80"):
        L.abi_for("sm80")
    assert L.abi_for("sm100") is L.abi_for("sm103") is L.SM100 and L.SM100.blackwell
    assert not L.SM90.blackwell
    seen = []
    abi = L.Abi(lambda k, guard=True: (lambda *a: seen.append(("fwd", a))),
                L.SM90.tile_cumsum, L.SM90.combine)
    L.register("sm_test", abi)
    try:
        plan = P.Plan(None, object(), None, False, False, None, abi=L.abi_for("sm_test"))
        plan.launch(1, 2, 3)
        assert seen == [("fwd", (1, 2, 3))]
    finally:
        L._ABIS.pop("sm_test")
    raw = []
    L.SM90.fwd(lambda *a: raw.append(a))("q", "k", "v", "o", None, 0.5)
    assert len(raw[0]) == 18 and raw[0][:6] == ("q", "k", "v", "o", None, 0.5)
    assert raw[0][15] == (None, None)  # FA4's empty aux data


@pytest.mark.parametrize("page,part_page,bound", [(64, 64, True), (16, 64, False),
                                                  (64, None, False)])
def test_split_kernel_binds_the_tma_page_part_for_its_pages_only(monkeypatch, tmp_path, knobs,
                                                                 page, part_page, bound):
    """Runtime.split_kernel: the paged chunk kernel of FA4's cp.async path serves every page
    size, one artifact; its part fwd_tma (constraints.tma_page) is bound, and a split step's
    chunks run on it (SplitKernel.launch_split), only where the step's pages are the size its
    record names; an artifact built before it splits on fwd."""
    knobs(cache_dir=str(tmp_path / "cache"), padding=None)
    v = split_kernel_variant("sm90", "bfloat16", 128, 128, page)
    loaded = {}

    def load(self, art, *names):
        loaded[art.id] = names
        return [f"<{n}>" if n else None for n in names]

    def parts(variant):
        got = _parts(variant)
        if part_page:
            got["fwd_tma"] = {"page_size": part_page}
        return got

    rt = serve_variants(monkeypatch, tmp_path / "cache", [v], load, "sm90", 132, parts)
    monkeypatch.setattr(P.SplitKernel, "__post_init__", lambda self: None)  # (names, not kernels)
    kern = rt.split_kernel(0, torch.bfloat16, 128, 128, page)
    assert kern is not None and kern.fwd == "<fwd>"
    assert kern.fwd_tma == ("<fwd_tma>" if bound else None)
    assert ("fwd_tma" in loaded[v.id]) == bound
    R.reset(roots=[tmp_path / "cache"])


def test_an_exact_call_whose_rows_fit_64_runs_on_the_twin(store):
    """A causal 4:1 step of 4 query rows (16 packed rows) runs on the cached twin on a 64-row M
    tile (constraints.small_m_tile); without the twin cached, or with set_small_tile(False), on
    FA4's tile; both settings keep their plans (20 rows a sequence: the next test)."""
    base = _dense_variant(2, 4, 8, 2, 64)
    twin = _dense_variant(2, 4, 8, 2, 64, tile_m=64)
    assert twin.tile.m == 64 and base.tile.m == 192 and twin.static_persistent
    rt = store([base, twin])
    rt.split = 0
    q, k, v = _qkv(2, 4, 300, 8, 2, 64, seed=4)
    o, _ = R.flash_attn_func(q, k, v, causal=True)
    ro, _ = attention_ref(q, k, v, torch.full((2,), 4), torch.full((2,), 300), causal=True)
    assert rel_err(o, ro) < 1e-2
    assert [p.variant for p in rt._plans.values()] == [twin]
    rt.set_small_tile(False)
    R.flash_attn_func(q, k, v, causal=True)
    assert [p.variant for p in rt._plans.values()] == [base]
    rt.set_small_tile(True)
    assert [p.variant for p in rt._plans.values()] == [twin]
    rt = store([base])  # no twin cached
    rt.split = 0
    R.flash_attn_func(q, k, v, causal=True)
    assert [p.variant for p in rt._plans.values()] == [base]


def test_rows_past_64_stay_on_fa4s_tile(store):
    """20 rows a sequence at 4:1 (80 packed rows) run on FA4's tile, even with a 64-row kernel
    of the same features cached."""
    long_q = _dense_variant(2, 20, 8, 2, 64)
    tiled = _dense_variant(2, 20, 8, 2, 64, tile_m=64)
    rt = store([long_q, tiled])
    rt.split = 0
    q, k, v = _qkv(2, 20, 300, 8, 2, 64, seed=5)
    R.flash_attn_func(q, k, v, causal=True)
    assert [p.variant.tile_m for p in rt._plans.values()] == [None]
