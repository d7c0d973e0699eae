"""Selection with padding (`fa4aot.policy.select`): pure functions, checked on the CPU."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace

import pytest
import torch
from stub_store import serve_variants

from fa4aot.policy.select import choose, foldable, nearest, padded_target_for_unsupported
from fakes import call, fold_kernel

ARCH = "sm90"




def test_exact_first():
    c = call(hq=32)
    avail = [c.variant(ARCH), call(hq=64).variant(ARCH)]
    (best,) = choose(ARCH, c.features(), avail)
    assert best.exact and best.cost == 1.0 and best.variant == c.variant(ARCH)


def test_cheapest_padding_first_and_scale_by_work():
    c = call(hq=20)
    avail = [call(hq=64).variant(ARCH), call(hq=32).variant(ARCH), call(hq=16).variant(ARCH)]
    got = choose(ARCH, c.features(), avail)
    assert [x.ratio for x in got] == [32, 64]  # 16 < 20 can never serve it
    assert got[0].cost == 32 / 20 and not got[0].exact


def test_head_dim_padding_cost_counts_both_dims():
    c = call(hq=4, d=80)
    got = choose(ARCH, c.features(), [call(hq=4, d=128).variant(ARCH)])
    assert got[0].head_dim == 128 and abs(got[0].cost - 256 / 160) < 1e-9


def test_padding_recomputes_the_variant_of_the_padded_call():
    """The padded call's regime and paged path are derived again, never copied: hd96 non-causal
    has tile_n 144, hd128 has 128, so a 144-token page is TMA at hd96 but must go to the non-TMA
    kernel at hd128; and 20:1 decode (20 rows <= tile_m 128) stays decode at 32:1, while 5 query
    tokens (100 rows) become prefill at 32:1 (160 rows > 128)."""
    c = call(hq=2, d=96, layout="paged", page=144, causal=False)
    assert c.variant(ARCH).paged_tma is True
    tma128 = call(hq=2, d=128, layout="paged", page=128, causal=False).variant(ARCH)
    non_tma128 = call(hq=2, d=128, layout="paged", page=144, causal=False).variant(ARCH)
    assert tma128.paged_tma and not non_tma128.paged_tma
    assert choose(ARCH, c.features(), [tma128]) == []
    (got,) = choose(ARCH, c.features(), [tma128, non_tma128])
    assert got.variant == non_tma128

    five = call(hq=20, sq=5)
    assert five.variant(ARCH).phase == "decode"
    decode32, prefill32 = call(hq=32, sq=1).variant(ARCH), call(hq=32, sq=5).variant(ARCH)
    assert prefill32.phase == "prefill"
    assert choose(ARCH, five.features(), [decode32]) == []
    assert choose(ARCH, five.features(), [decode32, prefill32])[0].variant == prefill32


def test_padding_denied_and_no_lse_mixing():
    c = call(hq=20, lse=True)
    avail = [call(hq=32, lse=False).variant(ARCH)]
    assert choose(ARCH, c.features(), avail) == []  # LSE is part of the variant
    assert choose(ARCH, call(hq=20).features(), avail, allow_padding=False) == []
    assert choose(ARCH, call(hq=20).features(), avail)[0].ratio == 32


def test_nearest_orders_by_differing_fields():
    want = call(hq=20).variant(ARCH)
    near = nearest(
        want,
        [
            call(hq=32, d=64).variant(ARCH),
            call(hq=32).variant(ARCH),
            call(hq=32, layout="paged", page=16).variant(ARCH),
        ],
    )
    assert near[0] == call(hq=32).variant(ARCH)


def test_unsupported_head_dims_pad_to_the_nearest_supported():
    assert padded_target_for_unsupported("sm100", "bfloat16", 200, 200) == (256, 256, 512 / 400)
    assert padded_target_for_unsupported("sm90", "bfloat16", 512, 512) is None


# -- the decode fold ---------------------------------------------------------------------------




@pytest.mark.parametrize(
    "layout,page", [("dense", None), ("varlen", None), ("paged", 128), ("paged", 64)]
)
def test_decode_fold_before_padding(layout, page):
    c = call(hq=20, layout=layout, page=page)  # batch 4, one query row each
    fold = fold_kernel(layout, page=page)
    avail = [call(hq=32, layout=layout, page=page).variant(ARCH), fold]
    got = choose(ARCH, c.features(), avail)
    assert [(x.ratio, x.fold, x.cost) for x in got] == [(1, 20, 1.0), (32, 1, 32 / 20)]
    assert got[0].variant == fold and "decode fold" in got[0].describe(c.variant(ARCH))
    # off: padding only; padding denied: nothing
    off = choose(ARCH, c.features(), avail, allow_fold=False)
    assert [x.ratio for x in off] == [32]
    assert choose(ARCH, c.features(), avail, allow_padding=False) == []


def test_decode_fold_prefers_the_widest_packing_that_divides():
    c = call(hq=20)
    avail = [fold_kernel(ratio=r) for r in (1, 3, 4)]
    got = choose(ARCH, c.features(), avail)
    assert [(x.ratio, x.fold) for x in got] == [(4, 5), (1, 20)]  # 3 does not divide 20


def _feat(**over):
    return replace(call(hq=20, layout="paged", page=128).features(), **over)


@pytest.mark.parametrize(
    "why,feat",
    [
        ("speculative decode: 4 rows see different keys", call(hq=20, sq=4).features()),
        ("a window", replace(call(hq=20).features(), window_left=128, window_right=0)),
        (
            "sinks are per head, not per row",
            replace(call(hq=20).features(), sink_dtype="float32"),
        ),
        ("an empty sequence: cu_seqlens_q is not arange", _feat(total_q=3)),
        ("seqused_q", _feat(seqused_q=True)),
        ("no max_seqlen_q hint", _feat(max_seqlen_q=None)),
        ("MHA: nothing to fold", call(hq=1).features()),
    ],
)
def test_decode_fold_applies_only_where_it_is_exact(why, feat):
    assert not foldable(feat), why
    avail = [fold_kernel(l, page=p) for l, p in [("dense", None), ("paged", 128)]]
    assert all(x.fold == 1 for x in choose(ARCH, feat, avail)), why


def test_decode_fold_needs_the_same_head_dims():
    c = call(hq=20, d=96)
    assert choose(ARCH, c.features(), [fold_kernel(d=128)]) == []


# -- one CallFeatures for the runtime and explain ----------------------------------------------


def test_call_features_are_frozen_and_slotted():
    f = call(hq=20).features()
    with pytest.raises(FrozenInstanceError):
        f.num_heads = 32
    assert not hasattr(f, "__dict__")
    assert replace(f, num_heads=32).ratio == 32 and f.ratio == 20


def _runtime_features(monkeypatch, tmp_path, avail, entry, args, kw):
    """(the CallFeatures the runtime's entry point builds for the call, the variant its plan
    serves it with), from a stand-in store holding `avail` (kernels that write nothing)."""
    import fa4aot.runtime as R
    from fa4aot.runtime import plan as P

    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    seen = []
    resolve = P.resolve
    monkeypatch.setattr(
        P, "resolve", lambda rt, key, dev, pad, feat: seen.append((feat, resolve(
            rt, key, dev, pad, feat))) or seen[-1][1])
    serve_variants(monkeypatch, tmp_path, avail, lambda self, art, *names: [
        None if n == "tile_cumsum" else (lambda *a: None) for n in names
    ], ARCH, 132, lambda v: {"fwd": {}})
    try:
        getattr(R, entry)(*args, **kw)
    finally:
        R.reset(roots=[tmp_path])
    feat, plan = seen[0]  # the outer call's (a padded call re-enters for the padded one)
    return feat, plan.variant if plan.pad is None else plan.pad.variant


def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


def _i32(x):
    return torch.tensor(x, dtype=torch.int32)


@pytest.mark.parametrize("kind", ["exact", "padded", "fold", "paged fold"])
def test_explain_and_the_runtime_select_the_same_variant_from_the_same_features(
    monkeypatch, tmp_path, kind
):
    """The CallFeatures `fa4aot explain` builds (compile_keys.Call.features) equal the ones the
    runtime's entry point builds for the same call, and select.choose, which both call, picks
    the variant the runtime's plan serves it with."""
    hq, sq, layout, page = {"exact": (32, 1, "dense", None), "padded": (20, 128, "dense", None),
                            "fold": (20, 1, "dense", None),
                            "paged fold": (20, 1, "paged", 128)}[kind]
    c = call(hq=hq, sq=sq, layout=layout, page=page)
    avail = [call(hq=32, sq=sq, layout=layout, page=page).variant(ARCH),
             fold_kernel(layout, page=page)]
    if layout == "dense":
        entry, args, kw = "flash_attn_func", (
            _bf16(4, sq, hq, 128), _bf16(4, 256, 1, 128), _bf16(4, 256, 1, 128)), {}
    else:
        entry, args, kw = "flash_attn_varlen_func", (
            _bf16(4, hq, 128), _bf16(8, page, 1, 128), _bf16(8, page, 1, 128)), dict(
            cu_seqlens_q=_i32([0, 1, 2, 3, 4]), max_seqlen_q=1,
            page_table=_i32(list(range(8))).view(4, 2), seqused_k=_i32([256] * 4))
    feat, served = _runtime_features(monkeypatch, tmp_path, avail, entry, args,
                                     dict(kw, causal=True))
    explained = c.features()
    assert explained == feat
    (best, *_) = choose(ARCH, explained, avail)
    assert best.variant == served
    assert (best.exact, best.fold > 1) == {"exact": (True, False), "padded": (False, False),
                                           "fold": (False, True),
                                           "paged fold": (False, True)}[kind]
