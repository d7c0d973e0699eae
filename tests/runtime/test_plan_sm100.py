"""The runtime's Blackwell plans on a CPU, through the public entry points: a stand-in store serves
chosen sm100 variants with reference kernels in FA4's sm100 argument order (25 forward slots,
the 9-slot combine; CPU tensors report device 0, the device reports sm100 with 148 SMs), so
validate -> plan -> launch runs end to end and the outputs are checked against the fp32
reference of the unpadded call: the exact plan (max_seqlen_q slot, descales), padding (hd 72 on
the hd-128 kernel), the decode fold (4 query heads as rows of the 1:1 kernel), FA4's native
split-KV (the heuristic's count, float32 partials kept as scratch, the combine), padding then
split, and the typed refusals (FP8 on sm90, descales, qv in batch form, a too-small max_seqlen_q)."""

from __future__ import annotations


import pytest
import torch
from fakes import write_ref
from reference import attention_ref, rel_err

import fa4aot.runtime as R
from fa4aot.model import constraints as C
from fa4aot.errors import ArtifactMissing, ContractViolation, UnsupportedVariant
from fa4aot.runtime import plan as P
from fa4aot.policy.select import folded_features
from fa4aot.model.compile_keys import CallFeatures, features

BF16 = torch.bfloat16
SMS = 148


def _parts(variant):
    parts = {"fwd": {}}
    if variant.split_kv:
        parts["combine"] = {"partial_dtype": "float32", "tile_m": 8, "max_splits": 128}
    return parts


def _scores(q, k, scale, causal):
    """q (b, sq, hq, d), k (b, sk, hk, d) -> masked fp32 scores (b, hq, sq, sk) (bottom-right
    causal, as FA4)."""
    b, sq, hq, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kf = k.float().repeat_interleave(hq // hk, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * scale
    if causal:
        i = torch.arange(sq)[:, None] + (sk - sq)
        s = s.masked_fill(torch.arange(sk)[None, :] > i, float("-inf"))
    return s


def _fwd(causal, log):
    """A dense forward in FA4's sm100 order; with float32 partials (out 5-D) it computes split
    i over key blocks [i * per, (i + 1) * per) of 128 keys, as FA4's split kernel does."""

    def fwd(*a):
        assert len(a) == 25, len(a)
        q, k, v, out, lse, scale = a[:6]
        assert all(x is None for x in a[6:11]) and a[15] is None and a[16] == (None, None)
        sink, msq = a[13], a[24]
        assert type(msq) is int and msq == q.shape[1]  # the dense q's s_q, as FA4 passes it
        log.append(("fwd", tuple(out.shape), msq))
        if out.dim() == 4:
            write_ref(q, k, v, out, lse, causal=causal, scale=scale, sink=sink)
            return
        assert out.dtype == lse.dtype == torch.float32 and sink is None
        n, sk = out.shape[0], k.shape[1]
        per = -(-(-(-sk // 128)) // n) * 128
        s = _scores(q, k, scale, causal)
        vf = v.float().repeat_interleave(q.shape[2] // v.shape[2], 2)
        for i in range(n):
            m = torch.full_like(s, float("-inf"))
            m[..., i * per : (i + 1) * per] = 0
            si = s + m
            li = torch.logsumexp(si, -1)
            p = torch.exp(si - li[..., None]).nan_to_num(0.0)
            out[i] = torch.einsum("bhqk,bkhd->bqhd", p, vf)
            lse[i] = li

    return fwd


def _combine(log):
    def combine(op, lp, out, lse, *rest):
        """FA4's combine (9 slots): op (n, b, s, h, dv), lp (n, b, s, h) -> out, lse."""
        assert len(rest) == 5 and all(x is None for x in rest)
        log.append(("combine", tuple(op.shape), tuple(lp.shape)))
        m = lp.max(0).values
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        w = torch.exp(lp - m)
        tot = w.sum(0)
        if lse is not None:
            lse.copy_(torch.log(tot) + m)
        out.copy_(((w[..., None] * op).sum(0) / tot[..., None]).to(out.dtype))

    return combine


@pytest.fixture
def store(stand_in_store):
    """serve(variants, arch) -> the default runtime, its stores holding exactly `variants`."""
    return stand_in_store(
        lambda v, log: {"fwd": _fwd(v.causal, log), "combine": _combine(log)}, _parts, SMS)


def _feat(b, sq, hq, hk, d, causal=True, lse=False, dtype="bfloat16", **kw):
    return dict(dtype=dtype, head_dim=d, head_dim_v=d, num_heads=hq, num_heads_kv=hk,
                causal=causal, window_left=None, window_right=None, return_lse=lse,
                sink_dtype=None, batch=b, seqlen_q=sq, total_q=b * sq, max_seqlen_q=None, **kw)  # fmt: skip


def _v(*a, arch="sm100", **kw):
    return features(arch=arch, **_feat(*a, **kw))


def _qkv(b, sq, sk, hq, hk, d, seed=0, dtype=BF16):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=g).to(dtype)
                 for s in ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d)))  # fmt: skip


def _ref(q, k, v, causal=True, scale=None):
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    return attention_ref(q, k, v, torch.full((b,), sq), torch.full((b,), sk), causal=causal,
                         scale=scale)  # fmt: skip


def test_exact_plan_calls_the_sm100_abi(store):
    rt = store([_v(2, 200, 8, 2, 64, lse=True)])
    q, k, v = _qkv(2, 200, 300, 8, 2, 64)
    for _ in range(2):
        o, lse = R.flash_attn_func(q, k, v, causal=True, return_lse=True)
    (plan,) = rt._plans.values()
    assert plan.special and plan.pad is None and plan.abi.blackwell
    assert rt.log == [("fwd", (2, 200, 8, 64), 200)] * 2
    ro, rl = _ref(q, k, v)
    assert rel_err(o, ro) < 1e-2 and torch.allclose(lse, rl, atol=1e-3)


def test_padding_serves_hd72_on_the_hd128_kernel(store):
    rt = store([_v(1, 200, 8, 2, 128, lse=True)])
    q, k, v = _qkv(1, 200, 300, 8, 2, 72, seed=1)
    o, lse = R.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert o.shape == (1, 200, 8, 72) and lse.shape == (1, 8, 200)
    ro, rl = _ref(q, k, v)  # the caller's scale, 1/sqrt(72)
    assert rel_err(o, ro) < 1e-2 and torch.allclose(lse, rl, atol=1e-3)
    padded = [p for p in rt._plans.values() if p.pad is not None]
    assert len(padded) == 1 and (padded[0].pad.head_dim, padded[0].pad.fold) == (128, 1)
    assert rt.log == [("fwd", (1, 200, 8, 128), 200)]


def test_decode_fold_runs_query_heads_as_rows_of_the_one_to_one_kernel(store):
    feat = CallFeatures("bfloat16", 64, 64, 8, 2, True, None, None, True, None, 3, 1, 3, None)
    fv = folded_features(feat, 1).variant("sm100")
    assert fv.qhead_per_kvhead == 1 and not fv.causal
    rt = store([fv])
    q, k, v = _qkv(3, 1, 500, 8, 2, 64, seed=2)
    o, lse = R.flash_attn_func(q, k, v, causal=True, return_lse=True)
    (plan,) = rt._plans.values()
    assert plan.pad.fold == 4
    # the kernel saw q as (b, 4 rows, 2 heads, d): FA4's max_seqlen_q for that call is 4
    assert rt.log == [("fwd", (3, 4, 2, 64), 4)]
    ro, rl = _ref(q, k, v)
    assert rel_err(o, ro) < 1e-2 and torch.allclose(lse, rl, atol=1e-3)


@pytest.mark.parametrize("lse_wanted", [False, True])
def test_native_split_uses_fa4s_heuristic_and_the_stored_combine(store, lse_wanted):
    b, hq, hk, d, sk = 1, 8, 2, 64, 5000
    n = C.native_num_splits("sm100", batch=b, num_heads_kv=hk, qhead_per_kvhead=4, seqlen_q=1,
                            max_seqlen_k=sk, head_dim=d, num_sms=SMS)  # fmt: skip
    assert n == 40  # min(148 // 2 tiles, 128, 40 key blocks)
    split = _v(b, 1, hq, hk, d, lse=lse_wanted, num_splits=n, max_seqlen_k=sk)
    assert split.split_kv
    rt = store([_v(b, 1, hq, hk, d, lse=lse_wanted), split])
    q, k, v = _qkv(b, 1, sk, hq, hk, d, seed=3)
    for _ in range(2):
        o, lse = R.flash_attn_func(q, k, v, causal=True, return_lse=lse_wanted)
    assert rt.log == [("fwd", (n, b, 1, hq, d), 1), ("combine", (n, b, 1, hq, d), (n, b, 1, hq))] * 2
    assert len(rt._native_scratch) == 1  # the partials are kept per (device, stream, shape)
    ro, rl = _ref(q, k, v)
    assert rel_err(o, ro) < 1e-2
    if lse_wanted:
        assert torch.allclose(lse, rl, atol=1e-3)
    # FA4AOT_SPLIT_KV=0: never split (the unsplit kernel runs)
    rt.log.clear()
    rt.split = 0
    R.flash_attn_func(q, k, v, causal=True, return_lse=lse_wanted)
    assert rt.log == [("fwd", (b, 1, hq, d), 1)]


@pytest.mark.parametrize("lse_mode", ["none", "new", "given"])
@pytest.mark.parametrize("s", [1, 3])
def test_packed_even_rows_split_in_batch_form(store, lse_mode, s):
    """A packed q whose sequences all hold max_seqlen_q rows (total_q == batch * max_seqlen_q:
    a decode or speculative step) is q in batch form viewed: FA4's split kernel for the batch
    form serves it, and the LSE comes back in the packed layout (h, total_q). Here over a
    batch-form K (the varlen entry's "padded" layout), whose split kernel is the dense one."""
    b, hq, hk, d, sk = 2, 8, 2, 64, 5000
    n = C.native_num_splits("sm100", batch=b, num_heads_kv=hk, qhead_per_kvhead=4, seqlen_q=s,
                            max_seqlen_k=sk, head_dim=d, num_sms=SMS)  # fmt: skip
    assert n > 1
    lse_on = lse_mode != "none"
    packed = features(arch="sm100", **{**_feat(b, s, hq, hk, d, lse=lse_on), "seqlen_q": None,
                                        "max_seqlen_q": s, "cu_seqlens_q": True})  # fmt: skip
    split = _v(b, s, hq, hk, d, lse=lse_on, num_splits=n, max_seqlen_k=sk)
    rt = store([packed, split])
    q, k, v = _qkv(b, s, sk, hq, hk, d, seed=6)
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)
    out = torch.full((b * s, hq, d), float("nan")).to(BF16)
    lse = torch.full((hq, b * s), float("nan")) if lse_mode == "given" else None
    o, l_ = R.flash_attn_varlen_func(q.reshape(b * s, hq, d), k, v, cu_seqlens_q=cu,
                                     max_seqlen_q=s, causal=True, out=out, lse=lse,
                                     return_lse=lse_mode == "new")  # fmt: skip
    assert o is out and (l_ is lse if lse_mode == "given" else (l_ is None) != lse_on)
    assert rt.log == [("fwd", (n, b, s, hq, d), s), ("combine", (n, b, s, hq, d), (n, b, s, hq))]
    ro, rl = _ref(q, k, v)
    assert rel_err(o.view(b, s, hq, d), ro) < 1e-2
    if lse_on:
        assert l_.shape == (hq, b * s) and l_.is_contiguous()
        assert torch.allclose(l_.view(hq, b, s).transpose(0, 1), rl, atol=1e-3)


def test_split_is_skipped_when_the_store_lacks_the_split_kernel(store):
    rt = store([_v(1, 1, 8, 2, 64)])
    q, k, v = _qkv(1, 1, 5000, 8, 2, 64, seed=4)
    o, _ = R.flash_attn_func(q, k, v, causal=True)
    assert rt.log == [("fwd", (1, 1, 8, 64), 1)]
    assert rel_err(o, _ref(q, k, v)[0]) < 1e-2


def test_pad_then_native_split(store):
    n = C.native_num_splits("sm100", batch=1, num_heads_kv=2, qhead_per_kvhead=4, seqlen_q=1,
                            max_seqlen_k=5000, head_dim=128, num_sms=SMS)  # fmt: skip
    rt = store([_v(1, 1, 8, 2, 128, lse=True),
                _v(1, 1, 8, 2, 128, lse=True, num_splits=n, max_seqlen_k=5000)])  # fmt: skip
    q, k, v = _qkv(1, 1, 5000, 8, 2, 72, seed=5)
    o, lse = R.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert [e[0] for e in rt.log] == ["fwd", "combine"] and rt.log[0][1] == (n, 1, 1, 8, 128)
    ro, rl = _ref(q, k, v)
    assert o.shape == (1, 1, 8, 72) and rel_err(o, ro) < 1e-2
    assert torch.allclose(lse, rl, atol=1e-3)


# -- refusals ---------------------------------------------------------------------------------


def test_fp8_on_sm90_is_refused_with_fa4s_reason(store):
    store([], arch="sm90")
    q, k, v = (t.to(torch.float8_e4m3fn) for t in _qkv(1, 4, 64, 4, 2, 64))
    with pytest.raises(UnsupportedVariant, match="sm100-only in upstream FA4"):
        R.flash_attn_func(q, k, v)
    with pytest.raises(UnsupportedVariant, match="k/v dtype float8_e4m3fn on sm90: fp8 is"):
        R.flash_attn_func(q.to(BF16), k, v)
    # on Blackwell the same mismatch names what FA4 needs there (an FP8 q with q_descale)
    store([], arch="sm100")
    with pytest.raises(UnsupportedVariant, match="Quantize q to float8_e4m3fn and pass"):
        R.flash_attn_func(q.to(BF16), k, v)


def test_fp8_exact_with_descales_and_its_refusals(store):
    fv = _v(2, 4, 4, 2, 64, dtype="float8_e4m3fn", descales="qkv")
    seen = []
    rt = store([fv])
    q, k, v = (t.to(torch.float8_e4m3fn) for t in _qkv(2, 4, 64, 4, 2, 64))
    d = {n: torch.ones(2, 2) for n in ("q_descale", "k_descale", "v_descale")}

    def fwd(*a):
        seen.append(a)
        a[3].zero_()

    P.Runtime._load = lambda self, art, *names: [fwd if n == "fwd" else None for n in names]
    o, _ = R.flash_attn_func(q, k, v, causal=True, **d)
    (a,) = seen
    assert o.dtype == BF16 and a[3] is o  # FA4: FP8 in, bfloat16 out
    assert a[0].dtype == a[1].dtype == a[2].dtype == torch.uint8  # FA4's uint8 views
    assert a[14] == (d["q_descale"], d["k_descale"], d["v_descale"]) and a[24] == 4
    with pytest.raises(ContractViolation, match=r"expected \(batch, num_kv_heads\)"):
        R.flash_attn_func(q, k, v, causal=True, **dict(d, k_descale=torch.ones(2, 3)))
    with pytest.raises(ContractViolation, match="stride-0"):
        R.flash_attn_func(q, k, v, causal=True,
                          **dict(d, v_descale=torch.ones(1, 2).expand(2, 2)))  # fmt: skip
    # another descale set is another kernel (FA4's key): a miss here, never padded
    with pytest.raises(ArtifactMissing):
        R.flash_attn_func(q, k, v, causal=True, k_descale=d["k_descale"])
    with pytest.raises(ContractViolation, match="descales scale FP8"):
        R.flash_attn_func(*_qkv(2, 4, 64, 4, 2, 64), **d)
    assert len(rt._plans) == 1


def test_batch_form_qv_and_a_short_max_seqlen_q_are_refused(store):
    store([_v(2, 4, 4, 2, 64, seqused_k=True, cu_seqlens_k=False)])
    q, k, v = _qkv(2, 4, 64, 4, 2, 64)
    # the stored MLA kernels take q packed: the refusal names the varlen form and the reshape
    for f in (R.flash_attn_func, R.flash_attn_varlen_func):
        with pytest.raises(UnsupportedVariant, match="through flash_attn_varlen_func with cu_seq"):
            f(q, k, v, qv=torch.zeros(2, 4, 4, 512, dtype=BF16))
    used = torch.tensor([64, 30], dtype=torch.int32)
    with pytest.raises(ContractViolation, match="would skip rows"):
        R.flash_attn_varlen_func(q, k, v, max_seqlen_q=3, seqused_k=used, causal=True)


# -- FP8: padding and the decode fold (the descales pass on: both keep batch and KV heads) ---------

F8 = torch.float8_e4m3fn


def _fp8_fwd(variant, log):
    """An FP8 forward in FA4's sm100 order: q/k/v arrive as uint8 views (FA4's export
    workaround), the descales as the (q, k, v) tuple in slot 14; it dequantizes (each descale
    (batch, kv_heads) scales its KV group) and writes the fp32 reference as bfloat16 O."""

    def fwd(*a):
        assert len(a) == 25, len(a)
        q, k, v, out, lse, scale = a[:6]
        assert q.dtype == k.dtype == v.dtype == torch.uint8 and out.dtype == BF16
        qd, kd, vd = a[14]
        r = q.shape[2] // k.shape[2]
        qf, kf, vf = (_deq(x, ds, rep) for x, ds, rep in ((q, qd, r), (k, kd, 1), (v, vd, 1)))
        write_ref(qf, kf, vf, out, lse, causal=variant.causal, scale=scale)
        log.append(("fwd", tuple(out.shape), variant.qhead_per_kvhead, variant.head_dim))

    return fwd


def _deq(x, descale, heads_per_scale):
    """FP8 (or its uint8 view) (b, s, h, d) times its (b, kv_heads) descale, fp32."""
    x = x.view(F8).float() if x.dtype == torch.uint8 else x.float()
    return x * descale.repeat_interleave(heads_per_scale, 1)[:, None, :, None]


def _fp8_call(b, sq, sk, hq, hk, d, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (t.to(F8) for t in _qkv(b, sq, sk, hq, hk, d, seed=seed))
    ds = {n: torch.rand(b, hk, generator=g) + 0.5 for n in ("q_descale", "k_descale", "v_descale")}
    return q, k, v, ds


def _fp8_ref(q, k, v, ds, causal=True):
    r = q.shape[2] // k.shape[2]
    return _ref(_deq(q, ds["q_descale"], r), _deq(k, ds["k_descale"], 1),
                _deq(v, ds["v_descale"], 1), causal=causal, scale=1 / q.shape[-1] ** 0.5)  # fmt: skip


@pytest.fixture
def fp8_store(store, monkeypatch):
    def serve(variants):
        rt = store(variants)
        monkeypatch.setattr(P.Runtime, "_load", lambda self, art, *names: [
            _fp8_fwd(art.variant, rt.log) if n == "fwd" else None for n in names])  # fmt: skip
        return rt

    return serve


def test_fp8_ratio_padding_passes_the_descales_on(fp8_store):
    """6:2 heads (ratio 3), no ratio-3 FP8 kernel: the ratio-4 one runs on q padded with zero
    heads per KV group; the (batch, kv_heads) descales are the caller's, O and LSE cropped into
    NaN-poisoned buffers."""
    rt = fp8_store([_v(2, 200, 8, 2, 64, lse=True, dtype="float8_e4m3fn", descales="qkv")])
    q, k, v, ds = _fp8_call(2, 200, 300, 6, 2, 64, seed=11)
    out = torch.full((2, 200, 6, 64), float("nan"), dtype=BF16)
    lse = torch.full((2, 6, 200), float("nan"))
    o, l_ = R.flash_attn_func(q, k, v, causal=True, out=out, lse=lse, **ds)
    assert o is out and l_ is lse
    ro, rl = _fp8_ref(q, k, v, ds)
    assert rel_err(o, ro) < 1e-2 and torch.allclose(l_, rl, atol=1e-3)
    (padded,) = [p for p in rt._plans.values() if p.pad is not None]
    assert (padded.pad.ratio, padded.pad.fold) == (4, 1)
    assert rt.log == [("fwd", (2, 200, 8, 64), 4, 64)]


def test_fp8_head_dim_padding(fp8_store):
    """hd 72 is no FP8 head dim (16-byte rows: multiples of 16): served by the hd128 kernel,
    zero columns (exact in FP8), the caller's softmax scale 1/sqrt(72)."""
    rt = fp8_store([_v(1, 130, 4, 2, 128, dtype="float8_e4m3fn", descales="qkv")])
    q, k, v, ds = _fp8_call(1, 130, 150, 4, 2, 72, seed=12)
    o, _ = R.flash_attn_func(q, k, v, causal=True, **ds)
    assert o.dtype == BF16 and o.shape == (1, 130, 4, 72)
    assert rel_err(o, _fp8_ref(q, k, v, ds)[0]) < 1e-2
    assert rt.log == [("fwd", (1, 130, 4, 128), 2, 128)]


def test_fp8_decode_fold_on_the_one_to_one_kernel(fp8_store):
    feat = CallFeatures("float8_e4m3fn", 64, 64, 8, 2, True, None, None, True, None, 3, 1, 3,
                        None, descales="qkv")
    fv = folded_features(feat, 1).variant("sm100")
    assert fv.qhead_per_kvhead == 1 and not fv.causal and fv.descales == "qkv"
    rt = fp8_store([fv])
    q, k, v, ds = _fp8_call(3, 1, 500, 8, 2, 64, seed=13)
    o, l_ = R.flash_attn_func(q, k, v, causal=True, return_lse=True, **ds)
    (plan,) = rt._plans.values()
    assert plan.pad.fold == 4 and o.dtype == BF16
    assert rt.log == [("fwd", (3, 4, 2, 64), 1, 64)]  # 4 query heads per KV head as 4 rows
    ro, rl = _fp8_ref(q, k, v, ds)
    assert rel_err(o, ro) < 1e-2 and torch.allclose(l_, rl, atol=1e-3)
    # another descale set is another kernel (FA4's key), folded or not: a miss
    with pytest.raises(ArtifactMissing, match="descale:qk "):
        R.flash_attn_func(q, k, v, causal=True, return_lse=True,
                          q_descale=ds["q_descale"], k_descale=ds["k_descale"])  # fmt: skip


@pytest.mark.parametrize("kind", ["transposed", "sliced", "strided_last"])
def test_noncontiguous_hd256_inputs(store, monkeypatch, kind):
    """hd256 inputs that are views, as engines hand them over (SGLang copies them for FA4):
    views with a contiguous last dim and 16-byte aligned strides reach the sm100 kernel as they
    are (FA4 takes any such strides, as on sm90: tests/test_gpu_padding.py's GPU case); a
    strided last dim is copied first; the result is the reference's either way."""
    b, s, hq, hk, d = 2, 130, 8, 2, 256
    rt = store([_v(b, s, hq, hk, d, lse=True)])
    g = torch.Generator().manual_seed(len(kind))

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(BF16)

    if kind == "transposed":
        q, k, v = (rnd(b, h, s, d).transpose(1, 2) for h in (hq, hk, hk))
    elif kind == "sliced":
        q, k, v = rnd(b, s, hq, d + 64)[..., :d], rnd(b, s, hk, d + 64)[..., 64:], rnd(
            b, s, hk, d + 64)[..., :d]
    else:
        q, k, v = (rnd(b, s, h, 2 * d)[..., ::2] for h in (hq, hk, hk))
    assert not q.is_contiguous()
    seen = []  # what the forward got: q, k, v's data pointers and q's last stride
    inner = rt._load

    def load(art, *names):
        got = inner(art, *names)

        def spy(fwd):
            def call(*a):
                seen.append(tuple(t.data_ptr() for t in a[:3]) + tuple(a[0].stride()[-1:]))
                return fwd(*a)
            return call

        return [spy(f) if n == "fwd" and f is not None else f for n, f in zip(names, got)]

    monkeypatch.setattr(rt, "_load", load)
    o, lse = R.flash_attn_func(q, k, v, causal=True, return_lse=True)
    (got,) = seen
    passed_as_is = got[:3] == (q.data_ptr(), k.data_ptr(), v.data_ptr())
    assert passed_as_is == (kind != "strided_last") and got[3] == 1
    ro, rl = _ref(q, k, v)
    assert rel_err(o, ro) < 1e-2 and torch.allclose(lse, rl, atol=1e-3)


def test_hd256_decode_kernel_follows_the_batch(store):
    """hd256 on Blackwell: FA4 runs a decode step on its 2CTA kernel while 2 x batch x KV heads
    fit the SMs, else on the 1CTA persistent one, and at a head ratio not dividing 128 it
    unpacks GQA while 2 x batch x query heads fit (variants.features, Variant.two_cta). The
    runtime serves each batch with the kernel FA4 would pick (its plans keyed by the batch's
    class, plan.hd256_class); each against the fp32 reference."""
    d, hq, hk = 256, 8, 2
    small, large = _v(1, 1, hq, hk, d, num_sms=SMS), _v(64, 1, hq, hk, d, num_sms=SMS)
    assert small.two_cta and not large.two_cta and small.id != large.id
    assert not small.static_persistent and large.static_persistent  # FA4's key, as it labels it
    # ratio 3: unpacked while 2 x batch x 6 query heads fit, then packed (and not 2CTA: 128 % 3)
    r3_small, r3_large = _v(1, 1, 6, 2, d, num_sms=SMS), _v(64, 1, 6, 2, d, num_sms=SMS)
    assert r3_small.pack_gqa is False and r3_small.two_cta
    assert r3_large.pack_gqa is None and not r3_large.two_cta
    rt = store([small, large, r3_small, r3_large])
    for b, hq_ in ((1, hq), (64, hq), (1, 6), (64, 6)):
        q, k, v = _qkv(b, 1, 300, hq_, hk, d, seed=b + hq_)
        o, _ = R.flash_attn_func(q, k, v, causal=True)
        assert rel_err(o, _ref(q, k, v)[0]) < 1e-2, (b, hq_)
    served = sorted((p.variant.qhead_per_kvhead, p.variant.two_cta) for p in rt._plans.values())
    assert served == [(3, False), (3, True), (4, False), (4, True)], served
    # a store holding only the small batch's kernel misses the large batch (no wrong kernel)
    rt = store([small])
    q, k, v = _qkv(64, 1, 300, hq, hk, d)
    with pytest.raises(ArtifactMissing, match="1cta"):
        R.flash_attn_func(q, k, v, causal=True)
