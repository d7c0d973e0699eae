"""Variants: enumeration of the default specs, stable ids, the regime boundaries of `features`,
and the cross-check that `features` partitions calls exactly as FA4's own compile key does."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import subprocess
import sys
from dataclasses import asdict, fields, replace
from pathlib import Path

import pytest

from fa4aot.model import constraints as C
from fa4aot.build.builder import plan_for
from fa4aot.model.specs import parse_spec, resolve_specs
from fa4aot.model.variants import NEW_FIELD_DEFAULTS, SCHEMA, Variant
from fa4aot.build.enumerate import enumerate_variants
from fa4aot.model.compile_keys import Call, features, representative_call

ARCH = "sm90"


@pytest.fixture(scope="module")
def plan():
    return plan_for(resolve_specs(None), ARCH)


# -- enumeration of the default specs ----------------------------------------------------------


def test_default_specs_enumerate_154_distinct_variants(plan):
    vs = plan.variants()
    # 106 + the split-KV kernels of hd128 (3), + 3 when their M tile became 64
    # (constraints.split_tile_m: no longer the fold kernels), + 42 twins on a 64-row M tile
    assert len(vs) == 154
    assert all(n.variant.arch == ARCH and vid == n.variant.id for vid, n in vs.items())
    per_spec = {}
    for n in vs.values():
        per_spec[n.spec] = per_spec.get(n.spec, 0) + 1
    assert set(per_spec) == {
        "gemma-4",
        "gpt-oss-20b",
        "llama-3.1-70b",
        "llama-3.1-8b",
        "mistral-7b",
    }
    # qwen3-32b needs exactly llama-3.1-70b's kernels (hd128, ratio 8, causal): first asker wins
    qwen = {n.variant.id for n in enumerate_variants(resolve_specs(["qwen3-32b"])[0], ARCH).needs}
    llama70 = {
        n.variant.id for n in enumerate_variants(resolve_specs(["llama-3.1-70b"])[0], ARCH).needs
    }
    assert qwen == llama70


def test_gemma_hd512_full_layer_reported_unsupported(plan):
    # the MLA specs' layers are the other unsupported ones on sm90 (tests/build/test_mla.py)
    (u,) = [u for u in plan.unsupported if u.spec == "gemma-4"]
    assert {u.spec for u in plan.unsupported} == {"gemma-4", "glm-4.7-flash", "deepseek-v3"}
    assert (u.spec, u.layer) == ("gemma-4", "full")
    assert "512" in u.reason and "sm90" in u.reason
    # its other layer still builds
    assert {n.layer for n in plan.needs if n.spec == "gemma-4"} == {"sliding"}


def test_gemma_hd512_full_layer_unsupported_on_sm100_too():
    # FA4's sm100 forward asserts hd512 fits tensor memory (found cross-compiling: it does not)
    p = enumerate_variants(resolve_specs(["gemma-4"])[0], "sm100")
    (u,) = p.unsupported
    assert (u.spec, u.layer) == ("gemma-4", "full")
    assert "512" in u.reason and "sm100" in u.reason and "tensor memory" in u.reason
    assert {n.layer for n in p.needs} == {"sliding"}


def test_default_variants_cover_every_regime(plan):
    vs = [n.variant for n in plan.variants().values()]
    assert {v.layout for v in vs} == {"dense", "varlen", "paged"}
    assert {v.phase for v in vs} == {"decode", "prefill", "any"}
    assert {v.mask for v in vs} == {"causal", "window", "full"}
    assert any(v.cu_hint for v in vs) and any(not v.cu_hint for v in vs if v.layout != "dense")
    assert {v.paged_tma for v in vs if v.paged} == {True, False}
    assert {v.sink_dtype for v in vs} == {None, "float32"}
    assert {v.return_lse for v in vs} == {False, True}


def test_representative_call_compiles_its_variant(plan):
    for n in plan.variants().values():
        assert representative_call(n.variant).variant(ARCH) == n.variant, n.variant.describe()
        assert n.call.variant(ARCH) == n.variant


def test_representative_call_drives_every_layout_and_refuses_only_impossible_variants():
    v = _some_variant()
    # seqused_q without cu_seqlens_q (q in batch form, a padded KV cache): issue 13 logged such
    # variants that --from-misses could not build
    odd = replace(
        v, paged=False, paged_tma=None, seqused_k=False, cu_seqlens_q=False, seqused_q=True
    )
    assert representative_call(odd).variant(ARCH) == odd
    # FA4 always runs a dense non-causal call on the persistent scheduler
    dense = replace(odd, seqused_q=False, causal=False, static_persistent=False)
    with pytest.raises(ValueError, match="FA4 never compiles these features together"):
        representative_call(dense)


def test_enumeration_is_pure_and_deterministic():
    a = [n.variant.id for n in plan_for(resolve_specs(None), ARCH).needs]
    b = [n.variant.id for n in plan_for(resolve_specs(None), ARCH).needs]
    assert a == b


def test_small_spec_enumeration():
    s = parse_spec((Path(__file__).parents[1] / "specs" / "tiny.toml").read_text())
    p = enumerate_variants(s, ARCH)
    vs = list(p.variants().values())
    assert len(vs) == 2
    assert {n.variant.return_lse for n in vs} == {False, True}
    for n in vs:
        v = n.variant
        assert (v.layout, v.phase, v.qhead_per_kvhead, v.head_dim, v.mask) == (
            "dense",
            "decode",
            2,
            64,
            "causal",
        )
        assert n.call.batch == 1 and n.call.seqlen_q == 1


def test_decode_fold_variants(plan):
    """Every causal, window-free, sink-free layer with a decode phase also gets the non-causal
    1:1 kernels the decode fold runs on: one per K layout (dense, varlen K, paged per TMA path)
    and LSE choice, q in batch form. Windowed and sink layers get none."""
    # (hd64's unmasked kernels are gpt-oss's split-KV kernels: test_split_kv_variants)
    folds = [
        n for n in plan.variants().values() if n.variant.mask == "full" and n.variant.head_dim == 128
    ]
    got = {
        (n.variant.head_dim, n.variant.layout, n.variant.paged_tma, n.variant.return_lse)
        for n in folds
    }
    assert got == {
        (128, layout, tma, lse)
        for layout, tma in [("dense", None), ("varlen", None), ("paged", True), ("paged", False)]
        for lse in (False, True)
    }
    for n in folds:
        v = n.variant
        assert v.qhead_per_kvhead == 1 and not v.causal and not v.cu_seqlens_q and not v.cu_hint
        assert n.call.batch_q == (v.layout != "dense")
        assert n.layer == "full" and n.spec in ("llama-3.1-70b", "llama-3.1-8b")
        assert "q:batch" in v.describe() or v.layout == "dense"


def test_split_kv_variants(plan):
    """Every window-free layer with a decode phase gets the split-KV kernels (split.py): the
    1:1 unmasked kernel returning LSE, q in batch form, on a packed K and on each paged path,
    sinks or not; windowed layers get none."""
    got = {
        (n.variant.head_dim, n.variant.layout, n.variant.paged_tma)
        for n in plan.variants().values()
        if n.variant.split_kernel
    }
    assert got == {
        (d, layout, tma)
        for d in (64, 128)  # gpt-oss (sinks); llama, qwen
        for layout, tma in [("varlen", None), ("paged", True), ("paged", False)]
    }
    base = (Path(__file__).parents[1] / "specs" / "tiny.toml").read_text()
    on = base.replace("split_kv = false", "split_kv = true")
    split = [n.variant for n in enumerate_variants(parse_spec(on), ARCH).needs]
    assert sum(v.split_kernel for v in split) == 1  # dense K is served packed: one kernel
    windowed = on.replace("head_dim = 64", "head_dim = 64\nwindow = 128")
    assert not any(v.split_kernel for v in
                   (n.variant for n in enumerate_variants(parse_spec(windowed), ARCH).needs))


def test_decode_fold_off_prefill_only_and_mha_specs_build_no_fold_kernels():
    base = (Path(__file__).parents[1] / "specs" / "tiny.toml").read_text()
    on = base.replace("decode_fold = false", "decode_fold = true")
    assert len(enumerate_variants(parse_spec(base), ARCH).variants()) == 2
    folds = [
        n.variant
        for n in enumerate_variants(parse_spec(on), ARCH).variants().values()
        if not n.variant.causal
    ]
    assert len(folds) == 2 and {v.mask for v in folds} == {"full"}
    prefill = on.replace('phases = ["decode"]', 'phases = ["prefill"]')
    assert all(n.variant.causal for n in enumerate_variants(parse_spec(prefill), ARCH).needs)
    # MHA (ratio 1 at every TP degree): no call of this layer ever folds
    mha = on.replace("num_kv_heads = 1", "num_kv_heads = 2")
    assert all(n.variant.causal for n in enumerate_variants(parse_spec(mha), ARCH).needs)


# -- ids ---------------------------------------------------------------------------------------


def _some_variant() -> Variant:
    return Call(
        layout="paged",
        batch=1,
        seqlen_q=1,
        seqlen_k=256,
        num_heads=4,
        num_heads_kv=1,
        head_dim=128,
        head_dim_v=128,
        dtype="bfloat16",
        causal=True,
        window_left=None,
        window_right=None,
        return_lse=False,
        sink_dtype=None,
        page_size=128,
    ).variant(ARCH)


def test_variant_id_is_sha256_of_canonical_json():
    v = _some_variant()
    # fields added after schema 1 (softcap, pack_gqa) are left out at their defaults, so every
    # variant that existed before them keeps its id
    d = {k: x for k, x in asdict(v).items() if k not in NEW_FIELD_DEFAULTS}
    blob = json.dumps({"schema": SCHEMA, **d}, sort_keys=True, separators=(",", ":"))
    assert v.id == hashlib.sha256(blob.encode()).hexdigest()[:16]
    assert len(v.id) == 16 and int(v.id, 16) >= 0
    w = replace(v, softcap=30.0)
    blob = json.dumps(
        {"schema": SCHEMA, **d, "softcap": 30.0}, sort_keys=True, separators=(",", ":")
    )
    assert w.id == hashlib.sha256(blob.encode()).hexdigest()[:16]
    # records and miss logs written before the new fields still load, to the same variant
    assert Variant.from_dict(d) == v


def test_variant_id_is_stable_across_processes():
    v = _some_variant()
    code = (
        "from fa4aot.model.variants import Variant; import json, sys; "
        "print(Variant.from_dict(json.loads(sys.argv[1])).id)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(v.to_dict())],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "123"},
    )
    assert out.stdout.strip() == v.id


def _other(value):
    """A different value of the same kind (what a real change of that field looks like)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value * 2
    if value is None:
        return "float32"
    if isinstance(value, str):
        return {"sm90": "sm100", "bfloat16": "float16", "float32": "bfloat16"}.get(
            value, value + "x"
        )
    raise AssertionError(value)


@pytest.mark.parametrize("name", [f.name for f in fields(Variant)])
def test_changing_any_one_field_changes_the_id(name):
    """As FlashInfer tests its artifact names: every compile parameter is part of the id."""
    v = _some_variant()
    for value in {_other(getattr(v, name)), None} - {getattr(v, name)}:
        assert replace(v, **{name: value}).id != v.id, (name, value)


def test_schema_is_part_of_the_id(monkeypatch):
    import fa4aot.model.variants as V

    v = _some_variant()
    before = v.id
    monkeypatch.setattr(V, "SCHEMA", SCHEMA + 1)
    assert v.id != before


def test_variant_dict_round_trip_and_strictness():
    v = _some_variant()
    assert Variant.from_dict(json.loads(json.dumps(v.to_dict()))) == v
    d = v.to_dict()
    with pytest.raises(ValueError, match="missing.*paged"):
        Variant.from_dict({k: x for k, x in d.items() if k != "paged"})
    with pytest.raises(ValueError, match="extra.*tile"):
        Variant.from_dict({**d, "tile": 1})


def test_describe():
    v = _some_variant()
    assert v.describe() == "sm90 bfloat16 hd128 ratio4 causal paged decode page=tile_n(TMA)"
    w = replace(
        v, head_dim=192, paged_tma=False, return_lse=True, sink_dtype="float32", cu_hint=True
    )
    assert w.describe() == (
        "sm90 bfloat16 hd192/128 ratio4 causal paged decode page!=tile_n batch>256 lse sink:float32"
    )


# -- features(): regime boundaries ------------------------------------------------------------


# a call's features by default: 8:2, hd128, causal, one dense query row
_BASE = dict(dtype="bfloat16", head_dim=128, head_dim_v=128, num_heads=8, num_heads_kv=2,
             causal=True, window_left=None, window_right=None, return_lse=False,
             sink_dtype=None, batch=1, seqlen_q=1, total_q=1, max_seqlen_q=None)


def _feat(**kw) -> Variant:
    return features(**{"arch": ARCH, **_BASE, **kw})


def _varlen(**kw) -> Variant:
    b, sq = kw.pop("batch", 1), kw.pop("seqlen_q", 1)
    base = dict(
        batch=b,
        seqlen_q=None,
        total_q=b * sq,
        max_seqlen_q=sq,
        cu_seqlens_q=True,
        cu_seqlens_k=True,
    )
    base.update(kw)
    return _feat(**base)


@pytest.mark.parametrize(
    "head_dim,ratio", [(64, 1), (64, 8), (128, 4), (128, 16), (256, 2), (96, 3)]
)
def test_decode_prefill_boundary_is_seqlen_q_times_ratio_vs_tile_m(head_dim, ratio):
    tm = C.fwd_tile(ARCH, head_dim, head_dim, True, False).m
    last = tm // ratio  # the longest query that still fits one m-block with packed GQA
    kw = dict(head_dim=head_dim, head_dim_v=head_dim, num_heads=ratio * 2, num_heads_kv=2)
    assert _feat(seqlen_q=last, total_q=last, **kw).phase == "decode"
    assert _feat(seqlen_q=last + 1, total_q=last + 1, **kw).phase == "prefill"
    assert _varlen(seqlen_q=last, batch=3, **kw).phase == "decode"
    assert _varlen(seqlen_q=last + 1, batch=3, **kw).phase == "prefill"


def _call_feat(**kw):
    """A call's CallFeatures, _feat's defaults."""
    from fa4aot.model.compile_keys import CallFeatures

    return CallFeatures(**{**_BASE, **kw})


@pytest.mark.parametrize("head_dim,ratio", [(128, 4), (64, 8), (96, 1), (128, 16)])
def test_small_tile_twin_iff_the_packed_rows_fit_64(head_dim, ratio):
    """constraints.small_m_tile: a call whose packed query rows fit 64 has a twin, equal to its
    FA4 variant but for the M tile (and so its id); one row more has none."""
    last = 64 // ratio
    kw = dict(head_dim=head_dim, head_dim_v=head_dim, num_heads=2 * ratio, num_heads_kv=2)
    fit = _call_feat(seqlen_q=last, total_q=last, **kw)
    twin = fit.small_tile_variant(ARCH)
    assert replace(twin, tile_m=None) == fit.variant(ARCH) and twin.tile.m == 64
    assert twin.id != fit.variant(ARCH).id and twin.phase == "decode"
    assert _call_feat(seqlen_q=last + 1, total_q=last + 1, **kw).small_tile_variant(ARCH) is None
    # a varlen q is bounded by max_seqlen_q, else by its total
    packed = dict(seqlen_q=None, cu_seqlens_q=True, cu_seqlens_k=True, batch=3, **kw)
    assert _call_feat(total_q=3 * last, max_seqlen_q=last, **packed).small_tile_variant(ARCH)
    assert _call_feat(total_q=last, **packed).small_tile_variant(ARCH)
    assert not _call_feat(total_q=last + 1, **packed).small_tile_variant(ARCH)


def test_no_twin_off_sm90_fa4_forwards():
    assert _call_feat(head_dim=256, head_dim_v=256).small_tile_variant(ARCH) is None
    assert _call_feat().small_tile_variant("sm100") is None
    assert _call_feat(tile_m=64).small_tile_variant(ARCH) is None


def test_twins_are_built_for_the_unsplit_decode_steps():
    """Twins of the decode probes at s_q = speculative (> 1), and at s_q = 1 only for layers
    the decode fold does not take (sinks); none from an engine's FA4 copy."""
    def twins(text, fa4="upstream"):
        plan = enumerate_variants(parse_spec(text), ARCH, fa4=fa4)
        return [n.variant for n in plan.needs if n.variant.tile_m == 64
                and not n.variant.split_kernel]

    layer = ('name = "t"\n[[attention]]\nname = "full"\nnum_q_heads = 8\nnum_kv_heads = 2\n'
             'head_dim = 128\n{extra}[serving]\nlayouts = ["paged"]\npage_sizes = [64]\n'
             'max_batch = 8\nsplit_kv = false\n{serving}')
    assert twins(layer.format(extra="", serving="")) == []
    spec4 = layer.format(extra="", serving="speculative = 4\n")
    got = twins(spec4)
    assert got and all(v.causal and v.paged and v.qhead_per_kvhead == 4 for v in got)
    assert twins(spec4, fa4="vllm") == []
    sinks = twins(layer.format(extra="sinks = true\n", serving=""))
    assert sinks and all(v.sink_dtype for v in sinks)


def test_dense_non_causal_is_one_kernel_for_every_length():
    a = _feat(causal=False, seqlen_q=1, total_q=1)
    b = _feat(causal=False, seqlen_q=5000, total_q=5000)
    assert a == b and a.phase == "any" and a.static_persistent


def test_varlen_batch_256_vs_257_needs_the_cumsum_helper():
    assert not _varlen(batch=256).cu_hint
    assert _varlen(batch=257).cu_hint
    assert _varlen(batch=257, cu_seqlens_k=False, seqused_k=True, page_size=16).cu_hint
    # only varlen q is scheduled through the helper
    assert not _feat(batch=257, seqlen_q=1, total_q=257).cu_hint
    assert not _feat(batch=257, seqlen_q=1, total_q=257, cu_seqlens_k=True).cu_hint
    assert _feat(batch=257, seqlen_q=1, total_q=257, seqused_q=True).cu_hint


@pytest.mark.parametrize(
    "head_dim,window,tile_n",
    [
        (64, None, 128),
        (128, None, 128),
        (128, 512, 128),
        (96, None, 128),
        (256, None, 80),
        (256, 1024, 64),
        (192, 100, 96),
    ],
)
def test_paged_tma_iff_page_size_is_tile_n(head_dim, window, tile_n):
    kw = dict(
        head_dim=head_dim,
        head_dim_v=head_dim,
        window_left=window,
        window_right=0 if window is not None else None,
        cu_seqlens_k=False,
        seqused_k=True,
    )
    assert _varlen(page_size=tile_n, **kw).paged_tma is True
    for p in {16, 64, 128, 256} - {tile_n}:
        v = _varlen(page_size=p, **kw)
        assert v.paged and v.paged_tma is False, p
    assert _varlen(**{**kw, "cu_seqlens_k": True, "seqused_k": False}).paged_tma is None


def test_window_makes_a_local_kernel():
    v = _feat(window_left=128, window_right=0)
    assert (v.local, v.causal, v.has_window_left, v.has_window_right, v.mask) == (
        True,
        False,
        True,
        True,
        "window",
    )
    # a causal call with a left window is the same kernel
    assert _feat(causal=True, window_left=128) == v
    # (None, 0) is causal, (-1, -1) is no window at all
    assert _feat(causal=False, window_left=None, window_right=0) == _feat(causal=True)
    assert _feat(causal=False, window_left=-1, window_right=-1) == _feat(causal=False)
    right_only = _feat(causal=False, window_left=None, window_right=32)
    assert right_only.local and not right_only.has_window_left and right_only.has_window_right


def test_varlen_without_max_seqlen_q_is_never_static_persistent():
    with_hint = _varlen(batch=2, seqlen_q=1)
    no_hint = _varlen(batch=2, seqlen_q=1, max_seqlen_q=None)
    assert with_hint.static_persistent and not no_hint.static_persistent
    # even non-causal: varlen q never takes the dense non-causal persistent path
    assert not _varlen(batch=2, seqlen_q=1, max_seqlen_q=None, causal=False).static_persistent


def test_head_counts_are_dynamic_only_the_ratio_is_static():
    assert _feat(num_heads=8, num_heads_kv=2) == _feat(num_heads=64, num_heads_kv=16)
    assert _feat(num_heads=8, num_heads_kv=2) != _feat(num_heads=8, num_heads_kv=1)


# -- cross-check against FA4's compile key -----------------------------------------------------

# Runs in a fresh interpreter: it imports flash_attn (seconds) and stubs the DSL compiler out, so
# FA4 computes its compile key for each call and compiles nothing.
_DRIVER = r"""
import json, sys
from fa4aot.fa4 import driver, keys
from fa4aot.model.compile_keys import Call
driver.configure("sm90", 132)
fa, I = driver._fa4()
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

caches = {"fwd": I._flash_attn_fwd.compile_cache,
          "tile_cumsum": I._compute_tile_cumsum.compile_cache,
          "blocks_to_batch": I._compute_blocks_to_batch.compile_cache}


class NotCompiled:
    pass


I.cute.compile = lambda *a, **k: NotCompiled()


def run(c):
    for x in caches.values():
        x.clear()
    dt = getattr(torch, c["dtype"])
    names = ("batch", "seqlen_q", "seqlen_k", "hq", "hk", "d", "dv")
    b, sq, sk, hq, hk, d, dv = (c[k] for k in names)
    e = lambda *shape, dtype=dt: torch.empty(*shape, dtype=dtype, device="cuda")
    with FakeTensorMode():
        kw = dict(causal=c["causal"], window_size=tuple(c["window"]), return_lse=c["lse"])
        if c["sink"]:
            kw["learnable_sink"] = e(hq, dtype=getattr(torch, c["sink"]))
        L = c["layout"]
        if L == "dense":
            fa.flash_attn_func(e(b, sq, hq, d), e(b, sk, hk, d), e(b, sk, hk, dv), **kw)
        else:
            if c["q"] == "cu":
                q = e(b * sq, hq, d)
                kw.update(cu_seqlens_q=e(b + 1, dtype=torch.int32),
                          max_seqlen_q=sq if c["hint"] else None)
            else:
                q = e(b, sq, hq, d)
                if c["q"] == "seqused":
                    kw["seqused_q"] = e(b, dtype=torch.int32)
            if L == "varlen":
                k, v = e(b * sk, hk, d), e(b * sk, hk, dv)
                kw.update(cu_seqlens_k=e(b + 1, dtype=torch.int32), max_seqlen_k=sk)
            elif L == "kdense":
                k, v = e(b, sk, hk, d), e(b, sk, hk, dv)
            else:
                p = c["page"]
                n = -(-sk // p)
                k, v = e(b * n, p, hk, d), e(b * n, p, hk, dv)
                kw.update(page_table=e(b, n, dtype=torch.int32), seqused_k=e(b, dtype=torch.int32))
            fa.flash_attn_varlen_func(q, k, v, **kw)
    return {n: [keys.key_repr(k) for k in x.cache] for n, x in caches.items()}


def builder(call):  # the builder's own driver, for the representative calls
    got = driver.trace(Call(**call))
    return {n: [keys.key_repr(k) for k, _ in v] for n, v in got.items()}


doc = json.load(sys.stdin)
json.dump({"grid": [run(c) for c in doc["grid"]], "builder": [builder(c) for c in doc["builder"]]},
          sys.stdout)
"""

_HDS = [(64, 64), (128, 128), (256, 256)]
_HDS_MORE = [(96, 96), (192, 128), (192, 192), (64, 64), (128, 128), (256, 256)]
_MASKS = [  # (causal, window): plain causal, full, sliding, two-sided, and aliases FA4 resolves
    (True, (None, None)),
    (False, (None, None)),
    (True, (128, None)),
    (False, (64, 64)),
    (False, (None, 0)),
    (False, (-1, -1)),
]
_MASKS_MORE = _MASKS + [(False, (None, 32)), (False, (100, -1)), (True, (0, None))]
# (kv layout, q form, max_seqlen_q given, page size): every input form the runtime accepts
_FORMS = (
    [
        ("dense", "dense", False, None),
        ("varlen", "cu", True, None),
        ("varlen", "cu", False, None),
        ("kdense", "cu", True, None),
        ("kdense", "seqused", False, None),
        ("kdense", "dense", False, None),
    ]
    + [("paged", "cu", True, p) for p in (16, 64, "tile", 128)]
    + [("paged", "cu", False, p) for p in (64, "tile")]
    + [("paged", "dense", False, p) for p in (16, "tile")]
)


def _case(hd, r, mask, form, sq, b, dtype, lse, sink):
    (d, dv), (causal, win), (layout, qf, hint, page) = hd, mask, form
    causal_r, local, _, _ = C.resolve_window(causal, *win)
    tile = C.fwd_tile(ARCH, d, dv, causal_r, local)
    return dict(
        layout=layout,
        q=qf,
        hint=hint,
        batch=b,
        seqlen_q=sq,
        seqlen_k=max(sq, 256),
        hq=2 * r,
        hk=2,
        d=d,
        dv=dv,
        dtype=dtype,
        causal=causal,
        window=list(win),
        lse=lse,
        sink=sink,
        page=tile.n if page == "tile" else page,
    )


def _grid() -> list[dict]:
    """A full product over the structural axes at three head dims and two ratios (with one
    lse/sink/dtype choice per layer type, so calls of one regime share a variant), plus a
    seeded sample of the wider space with every flag varied."""
    rng = random.Random(1234)
    out = []
    for hd, r, mask in itertools.product(_HDS, (1, 8), _MASKS):
        dtype, lse, sink = (
            rng.choice(["bfloat16", "float16"]),
            rng.random() < 0.5,
            rng.choice([None, "float32"]),
        )
        tm = C.fwd_tile(ARCH, *hd, True, False).m
        for form in _FORMS:
            for sq in sorted({1, max(1, tm // r), tm // r + 1, 1000}):
                for b in (2,) if form[0] == "dense" else (1, 257):
                    out.append(_case(hd, r, mask, form, sq, b, dtype, lse, sink))
    for _ in range(1000):
        hd, r, mask, form = (
            rng.choice(_HDS_MORE),
            rng.choice((1, 2, 3, 4, 8, 16)),
            rng.choice(_MASKS_MORE),
            rng.choice(_FORMS),
        )
        sq, b = (
            rng.choice([1, 2, 5, 16, 24, 25, 48, 64, 65, 129, 700]),
            rng.choice([1, 3, 256, 257, 600]),
        )
        out.append(
            _case(
                hd,
                r,
                mask,
                form,
                sq,
                b if form[0] != "dense" else min(b, 3),
                rng.choice(["bfloat16", "float16"]),
                rng.random() < 0.5,
                rng.choice([None, "float32", "bfloat16", "float16"]),
            )
        )
    return out


def _expected(c: dict) -> Variant:
    """The variant the runtime derives for this call (as fa4aot.runtime computes its features)."""
    layout, b, sq = c["layout"], c["batch"], c["seqlen_q"]
    cu = layout != "dense" and c["q"] == "cu"
    return features(
        arch=ARCH,
        dtype=c["dtype"],
        head_dim=c["d"],
        head_dim_v=c["dv"],
        num_heads=c["hq"],
        num_heads_kv=c["hk"],
        causal=c["causal"],
        window_left=c["window"][0],
        window_right=c["window"][1],
        return_lse=c["lse"],
        sink_dtype=c["sink"],
        batch=b,
        seqlen_q=None if cu else sq,
        total_q=b * sq,
        max_seqlen_q=sq if cu and c["hint"] else None,
        cu_seqlens_q=cu,
        cu_seqlens_k=layout == "varlen",
        seqused_q=layout != "dense" and c["q"] == "seqused",
        seqused_k=layout == "paged",
        page_size=c["page"] if layout == "paged" else None,
    )


def test_every_public_call_form_has_a_representative_call():
    """Each variant a call through the public layouts produces (dense; cu_seqlens_q with
    cu_seqlens_k or a page table) can be compiled from a representative call: a miss logged for
    it can be built with --from-misses."""
    n = 0
    for c in _grid():
        if c["layout"] == "kdense" or (c["layout"] != "dense" and c["q"] != "cu"):
            continue
        v = _expected(c)
        assert representative_call(v).variant(ARCH) == v, c
        n += 1
    assert n > 2000


@pytest.fixture(scope="module")
def fa4_keys(plan):
    grid = _grid()
    builder = [n.call.to_dict() for n in plan.variants().values()]
    env = {**os.environ, "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "0"}
    r = subprocess.run(
        [sys.executable, "-c", _DRIVER],
        input=json.dumps({"grid": grid, "builder": builder}),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout)
    return grid, out["grid"], builder, out["builder"]


def test_features_partition_calls_exactly_like_fa4_compile_key(fa4_keys):
    grid, keys, _, _ = fa4_keys
    by_variant: dict[str, set] = {}
    by_key: dict[str, set] = {}
    example: dict[str, dict] = {}
    calls: dict[str, int] = {}
    for c, k in zip(grid, keys):
        assert len(k["fwd"]) == 1, c
        v = _expected(c)
        assert bool(k["tile_cumsum"]) == v.cu_hint, (c, v.describe())
        by_variant.setdefault(v.id, set()).add(k["fwd"][0])
        by_key.setdefault(k["fwd"][0], set()).add(v.id)
        example.setdefault(v.id, c)
        calls[v.id] = calls.get(v.id, 0) + 1
    split = {vid: ks for vid, ks in by_variant.items() if len(ks) > 1}
    merged = {k: vids for k, vids in by_key.items() if len(vids) > 1}
    assert not split, f"one variant, several FA4 kernels: {example[next(iter(split))]}"
    assert not merged, (
        f"one FA4 kernel, several variants: {[example[i] for i in next(iter(merged.values()))]}"
    )
    # not trivial: many variants, and most calls share theirs with other calls
    assert len(by_variant) > 1000
    assert sum(n for n in calls.values() if n > 1) > len(grid) // 2


def test_call_variant_agrees_with_runtime_features(fa4_keys):
    grid = fa4_keys[0]
    n = 0
    for c in grid:
        if c["layout"] in ("dense", "varlen", "paged") and (
            c["layout"] == "dense" or (c["q"] == "cu" and c["hint"])
        ):
            call = Call(
                layout=c["layout"],
                batch=c["batch"],
                seqlen_q=c["seqlen_q"],
                seqlen_k=c["seqlen_k"],
                num_heads=c["hq"],
                num_heads_kv=c["hk"],
                head_dim=c["d"],
                head_dim_v=c["dv"],
                dtype=c["dtype"],
                causal=c["causal"],
                window_left=c["window"][0],
                window_right=c["window"][1],
                return_lse=c["lse"],
                sink_dtype=c["sink"],
                page_size=c["page"],
            )
            assert call.variant(ARCH) == _expected(c), c
            n += 1
    assert n > 1000


def test_builder_calls_land_in_the_same_partition(fa4_keys, plan):
    """The representative calls the builder compiles (through driver.trace) produce the FA4
    key the runtime's calls of that variant produce: the artifact is the kernel it serves."""
    grid, keys, _, built = fa4_keys
    variant_of_key = {k["fwd"][0]: _expected(c).id for c, k in zip(grid, keys)}
    needs = list(plan.variants().values())
    assert len(built) == len(needs)
    seen = set()
    for n, k in zip(needs, built):
        assert len(k["fwd"]) == 1 and bool(k["tile_cumsum"]) == n.variant.cu_hint
        key = k["fwd"][0]
        assert key not in seen, (
            f"two default variants compile one FA4 kernel: {n.variant.describe()}"
        )
        seen.add(key)
        if key in variant_of_key:
            assert variant_of_key[key] == n.variant.id, n.variant.describe()
