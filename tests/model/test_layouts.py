"""Every forward layout FA4 accepts on sm90 closes the miss loop (issue 13).

For each call, FA4's real entry point is traced under FakeTensorMode (cute.compile stubbed:
~10 ms a call, nothing compiled); its compile key is mapped back to a Variant
(`keys.variant_from_fa4_key`, what install() logs) and must equal `features()` of the call
(what the runtime logs); then that variant's `representative_call` (what `fa4aot build
--from-misses` compiles) must trace to the same forward key and the same helper kernels. A
miss logged for any of these calls is therefore built in one round.

The grid: every q form x every K/V form (page size == tile_n and not), causal / window / none,
LSE or not, no sink or fp32 / bf16 / fp16 sinks, decode and prefill, batch 1 and > 256 (the
tile_cumsum / blocks_to_batch helpers), rotating head dims, ratios, dtypes, softcap and explicit
pack_gqa over the structural product so each value meets each layout.
"""

from __future__ import annotations

import itertools

import pytest

from fa4aot.model import constraints as C
from fa4aot.model.specs import KV_FORMS, LAYOUTS, Q_FORMS, layout_forms, parse_spec
from fa4aot.build.enumerate import enumerate_variants
from fa4aot.model.compile_keys import Call, call_layout, representative_call

ARCH = "sm90"

_MASKS = [(True, None, None), (True, 128, 0), (False, None, None), (False, 64, 64)]
_HDS = [(64, 64), (128, 128), (256, 256), (192, 128), (96, 96)]
_SINKS = [None, "float32", "bfloat16", "float16"]
_RATIOS = [1, 4, 6, 8]
_SOFTCAP_PACK = [(None, None), (30.0, None), (None, False), (None, True), (50.0, False)]


def _calls() -> list[Call]:
    """The structural product, with the per-kernel axes rotated through it (deterministic)."""
    rest = itertools.cycle(
        itertools.product(_SINKS, (False, True), _HDS, _RATIOS, ("bfloat16", "float16"))
    )
    extras = itertools.cycle(_SOFTCAP_PACK)
    out = []
    for qf, kvf in itertools.product(Q_FORMS, KV_FORMS):
        form = call_layout(qf, kvf)
        varlen_q = qf != "batch"
        for (causal, wl, wr), decode, big, page in itertools.product(
            _MASKS, (True, False), (False, True) if varlen_q else (False,), ("tile", 16)
        ):
            if page == 16 and form["layout"] != "paged":
                continue
            sink, lse, (d, dv), r, dtype = next(rest)
            softcap, pack = next(extras)
            tile = C.fwd_tile(ARCH, d, dv, *C.resolve_window(causal, wl, wr)[:2])
            out.append(
                Call(
                    batch=C.BIN_BATCH_SEARCH_THRESH + 1 if big else 2,
                    seqlen_q=1 if decode else 200,
                    seqlen_k=300,
                    num_heads=2 * r,
                    num_heads_kv=2,
                    head_dim=d,
                    head_dim_v=dv,
                    dtype=dtype,
                    causal=causal,
                    window_left=wl,
                    window_right=wr,
                    return_lse=lse,
                    sink_dtype=sink,
                    page_size=(tile.n if page == "tile" else page)
                    if form["layout"] == "paged"
                    else None,
                    softcap=softcap,
                    pack_gqa=pack,
                    **form,
                )
            )
    return out


def test_every_layout_name_maps_to_a_call_layout():
    assert len(LAYOUTS) == len(Q_FORMS) * len(KV_FORMS)
    for name in LAYOUTS:
        form = call_layout(*layout_forms(name))
        assert form["layout"] in ("dense", "varlen", "padded", "paged")
    assert call_layout(*layout_forms("dense"))["layout"] == "dense"
    assert call_layout(*layout_forms("padded")) == dict(
        layout="padded", batch_q=False, seqused_q=False, seqused_k=None
    )


def test_grid_covers_every_axis():
    calls = _calls()
    vs = [c.variant(ARCH) for c in calls]
    assert len(calls) > 300
    assert {v.layout for v in vs} == {"dense", "varlen", "padded", "paged"}
    assert {v.sink_dtype for v in vs} == set(_SINKS)
    assert {v.mask for v in vs} == {"causal", "window", "full"}
    assert {v.phase for v in vs} == {"decode", "prefill", "any"}
    assert {v.cu_hint for v in vs} == {False, True}
    assert {v.paged_tma for v in vs if v.paged} == {False, True}
    assert {v.softcap for v in vs} == {None, 30.0, 50.0}
    assert {v.pack_gqa for v in vs} == {None, False, True}
    assert {(v.cu_seqlens_q, v.seqused_q, v.cu_seqlens_k, v.seqused_k, v.paged) for v in vs} == {
        (cq, sq, ck, sk, pg)
        for cq, sq in itertools.product((False, True), repeat=2)
        for ck, sk, pg in [
            (False, False, False),
            (False, True, False),
            (True, False, False),
            (True, True, False),
            (False, False, True),
            (False, True, True),
        ]
    }


def test_representative_call_for_every_grid_variant():
    """Pure (no FA4): every variant of the grid has a representative call with its features."""
    for c in _calls():
        v = c.variant(ARCH)
        assert representative_call(v).variant(ARCH) == v, v.describe()


@pytest.fixture(scope="module")
def traced():
    from fa4aot.fa4 import driver

    driver.configure(ARCH, 132)
    calls = _calls()
    reps = {}
    for c in calls:
        v = c.variant(ARCH)
        reps.setdefault(v.id, representative_call(v))
    got = driver.trace_raw_keys(calls + list(reps.values()))
    return calls, got[: len(calls)], dict(zip(reps, got[len(calls) :]))


def test_fa4_key_maps_to_the_calls_features_and_back(traced):
    """FA4 key -> Variant == features(call); the variant's representative call traces to the
    same forward key and the same helper kernels (tile_cumsum / blocks_to_batch at batch > 256)."""
    from fa4aot.fa4 import keys as K

    calls, fa4_keys, rep_keys = traced
    for c, k in zip(calls, fa4_keys):
        want = c.variant(ARCH)
        assert len(k["fwd"]) == 1, want.describe()
        assert K.variant_from_fa4_key(k["fwd"][0], ARCH) == want, (c, want.describe())
        assert bool(k["tile_cumsum"]) == bool(k["blocks_to_batch"]) == want.cu_hint
        r = rep_keys[want.id]
        assert len(r["fwd"]) == 1
        assert K.key_repr(r["fwd"][0]) == K.key_repr(k["fwd"][0]), want.describe()
        for helper in ("tile_cumsum", "blocks_to_batch"):
            assert [K.key_repr(x) for x in r[helper]] == [
                K.key_repr(x) for x in k[helper]
            ], (helper, want.describe())


def test_softcap_hash_is_the_one_in_fa4s_key(traced):
    from fa4aot.fa4 import driver

    calls, fa4_keys, _ = traced
    for c, k in zip(calls, fa4_keys):
        if c.softcap is not None:
            assert k["fwd"][0][9] == driver.softcap_hash(c.softcap)
            return
    raise AssertionError("no softcap call in the grid")


SPEC = """
name = "parity"
[[attention]]
name = "full"
num_q_heads = 8
num_kv_heads = 2
head_dim = 128
sinks = true
sink_dtype = "bfloat16"
softcap = 30.0
[serving]
layouts = ["padded", "batch+seqused/packed", "batch+seqused/batch+seqused",
           "packed+seqused/paged"]
max_batch = 300
return_lse = "both"
"""


def test_spec_layouts_sink_dtype_and_softcap_reach_the_variants():
    plan = enumerate_variants(parse_spec(SPEC), ARCH)
    vs = [n.variant for n in plan.needs]
    assert not plan.unsupported
    main = [v for v in vs if v.sink_dtype is not None]
    assert {v.sink_dtype for v in main} == {"bfloat16"}
    assert {v.softcap for v in vs} == {30.0}
    assert {(v.layout, v.cu_seqlens_q, v.seqused_q, v.seqused_k) for v in main} == {
        ("padded", True, False, True),
        ("varlen", False, True, False),
        ("padded", False, True, True),
        ("paged", True, True, False),
    }
    assert any(v.cu_hint for v in main)
    for n in plan.needs:
        assert n.call.variant(ARCH) == n.variant


SMALL = """
name = "parity-small"
[[attention]]
name = "capped"
num_q_heads = 2
num_kv_heads = 1
head_dim = 64
sinks = true
sink_dtype = "bfloat16"
softcap = 30.0
[[attention]]
name = "fp16-sinks"
num_q_heads = 2
num_kv_heads = 1
head_dim = 64
sinks = true
sink_dtype = "float16"
[serving]
layouts = ["padded"]
phases = ["decode"]
max_batch = 1
decode_fold = false
split_kv = false
"""


@pytest.mark.slow
def test_padded_layout_bf16_fp16_sinks_and_softcap_cross_compile(tmp_path):
    """Real cross-compiles (CPU): a padded KV cache (cu_seqlens_q + batch-form K/V + seqused_k)
    with bf16 sinks and a softcap, and with fp16 sinks; each record holds FA4's own key."""
    from fa4aot.build.builder import build

    spec = parse_spec(SMALL)
    store, plan, results = build([spec], arch=ARCH, root=tmp_path / "store", jobs=1)
    # each with its 64-row twin (constraints.small_m_tile: the fold does not take sinks)
    assert [r.status for r in results] == ["built"] * 4, results
    got = {}
    for r in results:
        rec = store.get(r.id).record
        v = plan.variants()[r.id].variant
        assert rec["variant"] == v.to_dict() and v.layout == "padded" and v.seqused_k
        assert Call(**rec["representative_call"]).variant(ARCH) == v
        got.setdefault((v.sink_dtype, v.softcap), set()).add(v.tile_m)
    assert got == {("bfloat16", 30.0): {None, 64}, ("float16", None): {None, 64}}
