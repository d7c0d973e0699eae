"""The runtime's absorbed-MLA (qv) path end to end on a CPU: `fa4aot.flash_attn_varlen_func(q, k,
v, qv=...)` validates, plans and launches against a stand-in store holding exactly the MLA
kernels `fa4aot build --arch sm100` plans for the default specs (GLM-4.7-Flash, DeepSeek-V3).
Each stored kernel is a stand-in in FA4's MLA argument order (20 slots, abi.SM100_MLA_FWD) that
computes the fp32 reference attention of whatever (padded) tensors it is given; CPU tensors
report device 0, the device reports sm100 with 148 SMs.

Checked against the fp32 reference of the caller's unpadded call, with NaN-poisoned out / lse
buffers: the exact kernel (ratio 16; ratio 20 where FA4's 1CTA kernel takes it), the head-ratio
padding FA4's 2CTA kernel needs (20 -> 32, 10 -> 16, 5 -> 8; varlen and paged, LSE or not),
inputs the kernel cannot take as they are (copied), FA4AOT_SPLIT_KV never splitting MLA, and
the typed refusals. (That the launcher passes FA4's exact argument list: test_runtime_sm100.)
"""

from __future__ import annotations


import pytest
import torch
from reference import mla_ref, rel_err

import fa4aot.runtime as R
from fa4aot.build.builder import plan_for
from fa4aot.errors import ArtifactMissing, ContractViolation, UnsupportedVariant
from fa4aot.runtime import validate as V
from fa4aot.model.specs import load_default

BF16 = torch.bfloat16
SMS = 148


def _stored_mla() -> list:
    specs = [load_default(n) for n in ("glm-4.7-flash", "deepseek-v3")]
    return [n.variant for n in plan_for(specs, "sm100").variants().values() if n.variant.mla]


def _mla_kernel(variant, log):
    """A stored MLA kernel: FA4's 20 slots in order; the fp32 reference of its inputs."""

    def fwd(*a):
        assert len(a) == 20, len(a)
        q, qv, k, v, out, lse, scale, p, row_max, cu_q, cu_k, used_q, used_k = a[:13]
        gather, pages, descales, wl, wr, sink, o_lo = a[13:]
        assert all(x is None for x in (p, row_max, used_q, gather, descales, wl, wr, sink, o_lo))
        # never a layout the kernel cannot take: 16-byte aligned, unit last stride; O 32-byte
        assert all(V._aligned(t) for t in (q, qv, k, v)) and out.data_ptr() % 32 == 0
        assert q.shape[1] == qv.shape[1] == variant.qhead_per_kvhead  # one latent head
        assert (lse is not None) == variant.return_lse and (pages is not None) == variant.paged
        b = cu_q.numel() - 1
        if pages is None:
            kb = cu_k.tolist()
            ks = [k[kb[i] : kb[i + 1], 0] for i in range(b)]
            vs = [v[kb[i] : kb[i + 1], 0] for i in range(b)]
        else:
            n = used_k.tolist()
            ks = [k[pages[i].long()].reshape(-1, k.shape[-1])[: n[i]] for i in range(b)]
            vs = [v[pages[i].long()].reshape(-1, v.shape[-1])[: n[i]] for i in range(b)]
        o, l_ = mla_ref(q, qv, ks, vs, cu_q.tolist(), causal=variant.causal, scale=scale)
        out.copy_(o)
        if lse is not None:
            lse.copy_(l_)
        log.append((variant.qhead_per_kvhead, variant.mla, tuple(out.shape)))

    return fwd


@pytest.fixture
def store(stand_in_store):
    """serve(variants) -> the default runtime, its stores holding exactly `variants`."""
    return stand_in_store(lambda v, log: {"fwd": _mla_kernel(v, log)}, lambda v: {"fwd": {}}, SMS)


def _call(heads, lens_q, lens_k, page=None, seed=0):
    """Inputs of an MLA call: q/qv packed over `lens_q`, one latent K/V head packed over
    `lens_k` or in pages of `page` (shuffled), and the per-sequence K/V the reference reads."""
    g = torch.Generator().manual_seed(seed)
    tq, b = sum(lens_q), len(lens_q)

    def rnd(*s):
        return torch.randn(*s, generator=g).to(BF16)

    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    kw = dict(q=rnd(tq, heads, 64), qv=rnd(tq, heads, 512), cu_seqlens_q=cu(lens_q),
              max_seqlen_q=max(lens_q))  # fmt: skip
    ks = [rnd(n, 64) for n in lens_k]
    vs = [rnd(n, 512) for n in lens_k]
    if page is None:
        kw.update(k=torch.cat(ks)[:, None], v=torch.cat(vs)[:, None], cu_seqlens_k=cu(lens_k),
                  max_seqlen_k=max(lens_k))  # fmt: skip
    else:
        per = [-(-n // page) for n in lens_k]
        order = torch.randperm(sum(per), generator=g)
        kp = torch.zeros(sum(per), page, 1, 64, dtype=BF16)
        vp = torch.zeros(sum(per), page, 1, 512, dtype=BF16)
        table = torch.zeros(b, max(per), dtype=torch.int32)
        at = 0
        for i, n in enumerate(lens_k):
            for j in range(per[i]):
                pg = int(order[at])
                at += 1
                table[i, j] = pg
                rows = slice(j * page, min(n, (j + 1) * page))
                kp[pg, : rows.stop - rows.start, 0] = ks[i][rows]
                vp[pg, : rows.stop - rows.start, 0] = vs[i][rows]
        kw.update(k=kp, v=vp, page_table=table,
                  seqused_k=torch.tensor(lens_k, dtype=torch.int32))  # fmt: skip
    return kw, ks, vs


def _check(kw, ks, vs, out, lse, causal=True):
    ro, rl = mla_ref(kw["q"], kw["qv"], ks, vs, kw["cu_seqlens_q"].tolist(), causal=causal)
    assert out.shape == ro.shape and not out.isnan().any()
    assert rel_err(out, ro) < 1e-2
    if lse is not None:
        assert lse.shape == rl.shape and torch.allclose(lse, rl, atol=1e-4)


def _poisoned(kw, heads):
    tq = kw["q"].shape[0]
    return (torch.full((tq, heads, 512), float("nan"), dtype=BF16),
            torch.full((tq, heads), float("nan")))  # fmt: skip


def _run(kw, **extra):
    kw = dict(kw)
    return R.flash_attn_varlen_func(kw.pop("q"), kw.pop("k"), kw.pop("v"), causal=True,
                                    **kw, **extra)  # fmt: skip


def test_exact_ratio16_varlen_into_poisoned_buffers(store):
    rt = store(_stored_mla())
    kw, ks, vs = _call(16, [3, 1, 7], [40, 9, 130])
    out, lse = _poisoned(kw, 16)
    o, l_ = _run(kw, out=out, lse=lse)
    assert o is out and l_ is lse
    _check(kw, ks, vs, out, lse)
    (plan,) = rt._plans.values()
    assert plan.pad is None and rt.log == [(16, "2cta", (11, 16, 512))]


@pytest.mark.parametrize("ratio, padded", [(20, 32), (10, 16), (5, 8)])
@pytest.mark.parametrize("layout", ["varlen", "paged64", "paged128"])
def test_ratio_padding_crops_back_to_the_reference(store, ratio, padded, layout):
    """GLM-4.7-Flash at TP 1/2/4: FA4's 2CTA kernel refuses ratios 20/10/5; the call runs on
    the padded ratio's exact kernel and O, LSE are cropped into the caller's (NaN) buffers."""
    rt = store(_stored_mla())
    page = None if layout == "varlen" else int(layout[5:])
    kw, ks, vs = _call(ratio, [2, 5, 1], [70, 200, 3], page=page, seed=ratio)
    out, lse = _poisoned(kw, ratio)
    o, l_ = _run(kw, out=out, lse=lse)
    assert o is out and l_ is lse
    _check(kw, ks, vs, out, lse)
    (outer,) = [p for p in rt._plans.values() if p.pad is not None]
    assert outer.pad.ratio == padded and abs(outer.pad.cost - padded / ratio) < 1e-9
    assert rt.log == [(padded, "2cta", (8, padded, 512))]
    # fresh buffers, no LSE: the padded kernel without LSE
    rt.log.clear()
    o2, l2 = _run(kw)
    assert l2 is None and rt.log == [(padded, "2cta", (8, padded, 512))]
    _check(kw, ks, vs, o2, None)


def test_ratio20_decode_at_large_batch_runs_fa4s_1cta_kernel_unpadded(store):
    """Past one wave of 2CTA clusters FA4 routes one-row decode to its 1CTA kb64 kernel, which
    takes ratio 20: the cost-ranked selection serves it exactly (no padding)."""
    rt = store(_stored_mla())
    b = SMS // 2 + 1
    kw, ks, vs = _call(20, [1] * b, [5 + i % 17 for i in range(b)], page=128, seed=3)
    o, l_ = _run(kw, return_lse=True)
    _check(kw, ks, vs, o, l_)
    (plan,) = rt._plans.values()
    assert plan.pad is None and rt.log == [(20, "1cta-kb64", (b, 20, 512))]


def test_inputs_the_kernel_cannot_take_are_copied(store):
    rt = store(_stored_mla())
    kw, ks, vs = _call(16, [4, 2], [33, 64], seed=5)
    wide = torch.zeros(6, 16, 513, dtype=BF16)
    wide[..., 1:] = kw["qv"]
    kw2 = dict(kw, qv=wide[..., 1:])  # a 2-byte offset base: not 16-byte aligned
    assert not V._aligned(kw2["qv"])
    o, l_ = _run(kw2, return_lse=True)  # (the stand-in asserts what it is given is aligned)
    _check(kw, ks, vs, o, l_)
    assert len(rt.log) == 1
    with pytest.raises(ContractViolation, match="qv must have a 16-byte aligned base"):
        _run(kw2, padding=False)


def test_split_kv_setting_never_splits_mla(store):
    """FA4AOT_SPLIT_KV=N splits other decode steps; MLA runs unsplit (FA4 splits MLA only on
    its 1CTA kernel, with a plan fa4aot does not build)."""
    rt = store(_stored_mla())
    rt.split = 8
    kw, ks, vs = _call(16, [1, 1], [6000, 5000], seed=6)
    o, l_ = _run(kw, return_lse=True)
    _check(kw, ks, vs, o, l_)
    assert rt.log == [(16, "2cta", (2, 16, 512))]  # one forward into O itself: no partials
    assert rt._native_scratch == {} and rt._split_runs == {}


def test_empty_call_zeroes_out_and_fills_lse(store):
    store(_stored_mla())
    kw, _, _ = _call(16, [0, 0], [5, 5])
    out, lse = _poisoned(kw, 16)
    o, l_ = _run(kw, out=out, lse=lse)
    assert o.numel() == 0 and l_.numel() == 0
    kw, _, _ = _call(16, [2, 1], [0, 0], seed=1)
    o, l_ = _run(kw, return_lse=True)
    assert torch.equal(o, torch.zeros_like(o)) and bool((l_ == float("-inf")).all())


# -- refusals ---------------------------------------------------------------------------------


def test_argument_checks_are_typed(store):
    store(_stored_mla())
    kw, _, _ = _call(16, [2, 3], [10, 20], seed=7)
    bad = {
        "qv must be \\(total_q, heads, head_dim_v\\)": dict(qv=kw["qv"][:, :8]),
        "qv must have q's dtype": dict(qv=kw["qv"].float()),
        "out must be a": dict(out=torch.empty(5, 16, 256, dtype=BF16)),
        "out must have a 32-byte aligned base": dict(
            out=torch.empty(5 * 16 * 512 + 8, dtype=BF16)[8:].view(5, 16, 512)),
        "lse must be a float32 tensor of shape \\(5, 16\\)": dict(lse=torch.empty(16, 5)),
    }  # fmt: skip
    for msg, change in bad.items():
        with pytest.raises(ContractViolation, match=msg):
            _run({**kw, **{k: x for k, x in change.items() if k in kw}},
                 **{k: x for k, x in change.items() if k not in kw})  # fmt: skip
    unsupported = {
        "head dims 128/512": dict(q=torch.zeros(5, 16, 128, dtype=BF16),
                                  k=torch.zeros(30, 1, 128, dtype=BF16)),
        "2 latent KV heads": dict(k=torch.zeros(30, 2, 64, dtype=BF16),
                                  v=torch.zeros(30, 2, 512, dtype=BF16)),
        "a window, softcap or sink": dict(window_size=(16, 0)),
    }  # fmt: skip
    for msg, change in unsupported.items():
        with pytest.raises(UnsupportedVariant, match=msg):
            _run({**kw, **{k: x for k, x in change.items() if k in kw}},
                 **{k: x for k, x in change.items() if k not in kw})  # fmt: skip
    f8 = {n: kw[n].to(torch.float8_e4m3fn) for n in ("q", "qv", "k", "v")}
    with pytest.raises(UnsupportedVariant, match="FP8 MLA"):
        _run({**kw, **f8})


def test_refused_ratio_without_padding_or_its_kernel(store):
    kw, _, _ = _call(20, [2, 1], [10, 20], seed=8)
    store(_stored_mla())
    with pytest.raises(UnsupportedVariant, match="padding 20 -> 32 .* padding is denied"):
        _run(kw, padding=False)
    # a store without the ratio-32 kernels: the miss names the padded kernel to build
    store([v for v in _stored_mla() if v.qhead_per_kvhead != 32])
    with pytest.raises(ArtifactMissing, match="ratio32 causal varlen decode .*mla:2cta"):
        _run(kw)
