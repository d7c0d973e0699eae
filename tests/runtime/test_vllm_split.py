"""Split-KV from a store built from vLLM's FA4 copy, on a CPU: a stand-in store serves Gemma-4's
hd512 paged decode variant, its split twin (fa4/vllm_copy.split_twin) with combines by (query
heads, split bucket), and the FP8-KV ones; the kernels are stand-ins in the copy's ABI
(runtime/vllm_abi: 21 forward slots, 10 combine slots) that compute what the copy computes (the
split forward cuts each sequence's key blocks into `num_splits` runs, as its tile scheduler
does, and writes fp32 partials; the combine merges them by LSE) and record their calls.
Checked: the count the runtime picks is policy/split.choose_splits's for the host-known sizes
(FA4AOT_SPLIT_KV forces or disables it; the combines built cap it), the partials and combine
slots are the copy's, a short step or a store without the twin runs unsplit, and the output
matches an fp32 reference; vLLM's compile-only warm-up (vllm_abi.warm) loads the kernels a call
runs and launches nothing."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from reference import attention_ref, rel_err
from stub_store import serve_variants

import fa4aot.runtime as R
from fa4aot.errors import ArtifactMissing
from fa4aot.fa4 import vllm_copy
from fa4aot.model.compile_keys import Call
from fa4aot.policy import split as S
from fa4aot.runtime import plan as P
from fa4aot.runtime import vllm_abi as VA

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
SMS, PAGE, D = 132, 64, 512


def _decode_variant(hq=32, hk=4, kv=None):
    return Call(layout="paged", batch=4, seqlen_q=1, seqlen_k=4096, num_heads=hq,
                num_heads_kv=hk, head_dim=D, head_dim_v=D, dtype="bfloat16", causal=True,
                window_left=None, window_right=None, return_lse=False, sink_dtype=None,
                page_size=PAGE, kv_dtype=kv).variant("sm90", SMS)


def _parts(v):
    """A record's parts as `fa4aot build --fa4 vllm` writes them (vllm_copy.part_record)."""
    parts = {"fwd": {"tile_m": 64, "tile_n": 64, "split_kv": v.split_kv, "fa4_abi": "vllm"}}
    if v.split_kv:
        for hk in vllm_copy.COMBINE_KV_HEADS:
            for n in vllm_copy.COMBINE_SPLITS:
                h = hk * v.qhead_per_kvhead
                parts[vllm_copy.combine_part(h, n)] = {"num_head": h, "max_splits": n,
                                                        "partial_dtype": "float32"}
    return parts


def _dequant(k, descale):
    """K/V as the kernel reads them: e4m3 (given as uint8) times the (batch, head) descale."""
    if k.dtype == torch.uint8:
        return k.view(FP8).float(), descale
    return k.float(), None


def _copy_fwd(log, split: bool):
    """The copy's sm90 forward (21 slots) over packed q and paged K/V: with split, sequence b's
    ceil(len / 64) key blocks go to `num_splits` runs of ceil(blocks / num_splits) blocks, each
    writing its fp32 partial output and LSE (-inf where a run is empty), as its scheduler does."""

    def fwd(*a):
        assert len(a) == 21, len(a)
        q, k, v, out, lse, scale, cu_q, cu_k, used_q, used_k, dyn, pt = a[:12]
        descales = a[17]
        assert cu_k is used_q is dyn is None and all(x is None for x in a[18:])
        log.append(("fwd", a))
        kf, kd = _dequant(k, None if descales is None else descales[1])
        vf, vd = _dequant(v, None if descales is None else descales[2])
        n = out.shape[0] if split else 1
        for b in range(pt.shape[0]):
            length = int(used_k[b])
            kk = kf[pt[b].long()].reshape(-1, *kf.shape[2:])[:length]
            vv = vf[pt[b].long()].reshape(-1, *vf.shape[2:])[:length]
            if kd is not None:
                kk, vv = kk * kd[b].view(1, -1, 1), vv * vd[b].view(1, -1, 1)
            rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
            qq = q[rows].float()
            per = -(-(-(-length // PAGE)) // n) * PAGE
            for j in range(n):
                lo, hi = j * per, min((j + 1) * per, length)
                r = qq.shape[0]
                if hi <= lo:
                    o = torch.zeros(r, q.shape[1], vv.shape[-1])
                    ls = torch.full((q.shape[1], r), -math.inf)
                else:
                    o, ls = attention_ref(qq[None], kk[None, lo:hi], vv[None, lo:hi],
                                          torch.tensor([r]), torch.tensor([hi - lo]),
                                          causal=False, scale=scale)
                    o, ls = o[0], ls[0]
                if split:
                    out[j, rows] = o
                    lse[j][:, rows] = ls
                else:
                    out[rows] = o.to(out.dtype)

    return fwd


def _copy_combine(log, num_head, max_splits):
    """The copy's combine (10 slots): partials (n, total_q, h, dv), their LSE seqlen-major."""

    def combine(*a):
        assert len(a) == 10, len(a)
        op, lp, out, lse, cu, used = a[:6]
        assert lse is used is None and all(x is None for x in a[6:])
        assert op.dtype == lp.dtype == torch.float32 and op.shape[0] <= max_splits
        assert op.shape[2] == num_head and lp.shape == op.shape[:3] and lp.stride(1) == 1
        log.append(("combine", a, num_head, max_splits))
        w = torch.softmax(lp, dim=0).nan_to_num(0.0)
        out.copy_((w.unsqueeze(-1) * op).sum(0).to(out.dtype))

    return combine


@pytest.fixture
def serve(monkeypatch, tmp_path, knobs):
    """serve(variants, **settings) -> the default runtime over a vLLM-source stand-in store."""
    knobs(cache_dir=str(tmp_path / "cache"), padding=None)
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(P.Runtime, "fa4_abi", lambda self, arch, sms: "vllm")
    monkeypatch.setattr(P.Runtime, "abi_of", lambda self, art: "vllm")
    log, loads = [], []

    def load(self, art, *names):
        parts = art.record["parts"]
        loads.append((art.id, names))
        got = []
        for n in names:
            if n == "fwd":
                got.append(_copy_fwd(log, art.variant.split_kv))
            elif n in parts and "max_splits" in parts[n]:
                got.append(_copy_combine(log, parts[n]["num_head"], parts[n]["max_splits"]))
            else:
                got.append(None)
        return got

    def make(variants, **values):
        if values:
            knobs(**values)
        rt = serve_variants(monkeypatch, tmp_path / "cache", variants, load, "sm90", SMS, _parts)
        rt.log, rt.loads = log, loads
        return rt

    yield make
    R.reset(roots=[tmp_path / "cache"])


def _call(b, lens, hq=32, hk=4, fp8=False, seed=0, max_k=None):
    """vLLM's paged decode call (packed q, cache views (blocks, page, hk, d), shuffled pages)."""
    g = torch.Generator().manual_seed(seed)
    npp = -(-max(lens) // PAGE)
    blocks = b * npp + 2
    cache = torch.randn(blocks, hk, PAGE, 2 * D, generator=g)
    cache = (cache * 2).clamp(-448, 448).to(FP8) if fp8 else cache.to(BF16)
    k, v = cache.transpose(1, 2).split(D, dim=-1)
    kw = dict(cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32), max_seqlen_q=1,
              seqused_k=torch.tensor(lens, dtype=torch.int32),
              page_table=torch.randperm(blocks, generator=g)[: b * npp].view(b, npp).int(),
              max_seqlen_k=max_k or max(lens), causal=True)
    if fp8:
        kw.update(k_descale=torch.rand(b, hk, generator=g) * 0.05 + 0.01,
                  v_descale=torch.rand(b, hk, generator=g) * 0.05 + 0.01)
    q = torch.randn(b, hq, D, generator=g).to(BF16)
    return q, k, v, kw


def _reference(q, k, v, kw):
    b, hk = q.shape[0], k.shape[2]
    lens = kw["seqused_k"].tolist()
    kk = torch.zeros(b, max(lens), hk, D)
    vv = torch.zeros(b, max(lens), hk, D)
    for i, n in enumerate(lens):
        pages = kw["page_table"][i].long()
        ki, vi = k[pages].reshape(-1, hk, D)[:n].float(), v[pages].reshape(-1, hk, D)[:n].float()
        if "k_descale" in kw:
            ki, vi = ki * kw["k_descale"][i].view(1, -1, 1), vi * kw["v_descale"][i].view(1, -1, 1)
        kk[i, :n], vv[i, :n] = ki, vi
    o, _ = attention_ref(q[:, None], kk, vv, torch.ones(b, dtype=torch.long),
                         torch.tensor(lens), causal=True, scale=D ** -0.5)
    return o[:, 0]


def _expected(b, hk, max_k, kv_bytes=2):
    return S.choose_splits(batch=b, kv_heads=hk, rows=1, seqlen_k=S.plan_bucket(max_k),
                           bytes_per_key=2 * D * kv_bytes, num_sms=SMS, align=PAGE,
                           max_splits=128, model=S.DEFAULT_MODEL, fold=False)


def _split_of(log):
    fwds = [e for e in log if e[0] == "fwd"]
    combines = [e for e in log if e[0] == "combine"]
    assert len(fwds) == 1
    out = fwds[0][1][3]
    return (out.shape[0] if out.dtype == torch.float32 else 1), combines


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_long_decode_splits_by_the_cost_model(serve, fp8):
    v = _decode_variant(kv=vllm_copy.FP8_KV if fp8 else None)
    rt = serve([v, vllm_copy.split_twin(v)])
    lens = [3000, 4500]
    q, k, vv, kw = _call(2, lens, fp8=fp8)
    out = torch.full_like(q, float("nan"))
    got, lse = R.flash_attn_varlen_func(q, k, vv, out=out, **kw)
    assert got is out and lse is None and not out.isnan().any()
    want = _expected(2, 4, max(lens), 1 if fp8 else 2)
    assert want > 1
    n, combines = _split_of(rt.log)
    assert n == want
    (c,) = combines
    assert (c[2], c[3]) == (32, VA.combine_bucket(n))  # hq 32's combine, n's bucket
    fwd = next(e[1] for e in rt.log if e[0] == "fwd")
    assert fwd[3].shape == (n, 2, 32, D) and fwd[4].shape == (n, 32, 2)  # the copy's partials
    assert c[1][0] is fwd[3] and c[1][2] is out and c[1][4] is kw["cu_seqlens_q"]
    if fp8:
        assert fwd[1].dtype == torch.uint8 and len(fwd[17]) == 3
    assert rel_err(out, _reference(q, k, vv, kw)) < 1e-2


def test_short_steps_a_full_chip_and_no_twin_run_unsplit(serve):
    v = _decode_variant()
    rt = serve([v, vllm_copy.split_twin(v)])
    q, k, vv, kw = _call(2, [600, 700])  # a few key blocks: choose_splits says 1
    R.flash_attn_varlen_func(q, k, vv, **kw)
    assert _split_of(rt.log) == (1, [])
    rt.log.clear()
    q, k, vv, kw = _call(34, [1100] * 34)  # 136 (sequence, KV head) CTAs fill 132 SMs
    R.flash_attn_varlen_func(q, k, vv, **kw)
    assert _split_of(rt.log) == (1, [])
    rt.log.clear()
    rt = serve([v])  # a store built before split twins
    q, k, vv, kw = _call(1, [4000])
    out, _ = R.flash_attn_varlen_func(q, k, vv, **kw)
    assert _split_of(rt.log) == (1, []) and rel_err(out, _reference(q, k, vv, kw)) < 1e-2


def test_the_setting_forces_or_disables_and_the_combines_cap_it(serve):
    v = _decode_variant()
    q, k, vv, kw = _call(1, [8000])  # 125 key blocks: 128 splits leave 3 empty
    rt = serve([v, vllm_copy.split_twin(v)], split_kv="48")
    out, _ = R.flash_attn_varlen_func(q, k, vv, **kw)
    n, (c,) = _split_of(rt.log)
    assert n == 48 and (c[2], c[3]) == (32, 64)
    assert rel_err(out, _reference(q, k, vv, kw)) < 1e-2
    rt = serve([v, vllm_copy.split_twin(v)], split_kv="300")  # past the largest combine: 128
    rt.log.clear()
    R.flash_attn_varlen_func(q, k, vv, **kw)
    assert _split_of(rt.log)[0] == 128
    rt = serve([v, vllm_copy.split_twin(v)], split_kv="0")
    rt.log.clear()
    R.flash_attn_varlen_func(q, k, vv, **kw)
    assert _split_of(rt.log) == (1, [])


def test_heads_without_a_combine_run_unsplit(serve):
    v = _decode_variant(hq=96, hk=12)  # 12 KV heads per rank: no combine for 96 query heads
    rt = serve([v, vllm_copy.split_twin(v)])
    q, k, vv, kw = _call(1, [2000], hq=96, hk=12)
    R.flash_attn_varlen_func(q, k, vv, **kw)
    assert _split_of(rt.log) == (1, []) and _expected(1, 12, 2000) > 1


def test_the_count_follows_max_seqlen_k_not_the_page_tables_capacity(serve):
    """vLLM's page table spans the model's context; max_seqlen_k bounds this step's."""
    v = _decode_variant()
    rt = serve([v, vllm_copy.split_twin(v)])
    q, k, vv, kw = _call(1, [3000])
    R.flash_attn_varlen_func(q, k, vv, **kw)
    n_short = _split_of(rt.log)[0]
    assert n_short == _expected(1, 4, 3000)
    rt.log.clear()
    R.flash_attn_varlen_func(q, k, vv, **{**kw, "max_seqlen_k": 60000})
    assert _split_of(rt.log)[0] == _expected(1, 4, 60000) != n_short


def test_split_twins_of_the_gemma4_build():
    """What `fa4aot build --fa4 vllm --spec gemma-4` adds: one split forward per paged decode
    kernel without LSE (bf16 pages 64 and 16, FP8-KV page 64; ratios 8 and 4), none upstream."""
    from fa4aot.build.enumerate import enumerate_variants
    from fa4aot.model.specs import load_default

    spec = load_default("gemma-4")
    plan = enumerate_variants(spec, "sm90", None, "vllm")
    twins = [n for n in plan.needs if n.variant.split_kv]
    plain = {n.variant.id: n.variant for n in plan.needs if not n.variant.split_kv}
    assert len(twins) == 6
    for n in twins:
        base = replace(n.variant, split_kv=False)
        assert base.id in plain and vllm_copy.split_twin(base) == n.variant
        assert n.call.num_splits == vllm_copy.TRACE_SPLITS and n.call.page_size in (16, 64)
        assert n.variant.head_dim == 512 and not n.variant.return_lse
    assert {n.variant.kv_dtype for n in twins} == {None, vllm_copy.FP8_KV}
    assert not any(n.variant.split_kv for n in enumerate_variants(spec, "sm90").needs)
    prefill = next(v for v in plain.values() if v.phase == "prefill")
    assert vllm_copy.split_twin(prefill) is None


def test_combine_bucket_is_the_copys():
    """interface.py: log_max_splits = max(ceil(log2 n), 4), raised to 5 at tile_m 8."""
    for n in range(2, 257):
        assert VA.combine_bucket(n) == 1 << max(math.ceil(math.log2(n)), 4, 5)


def _specs(b=2, hq=8, hk=1, page=PAGE, dtype=BF16, kv=BF16):
    """vLLM's compile-only warm-up arguments (flash_attn.py:222): shapes and dtypes, no data
    (meta tensors stand in for the copy's tensor specs)."""
    m = dict(device="meta")
    kv_ = torch.empty(256, page, hk, D, dtype=kv, **m)
    return dict(q=torch.empty(b, hq, D, dtype=dtype, **m), k=kv_, v=kv_,
                cu_seqlens_q=torch.empty(b + 1, dtype=torch.int32, **m),
                seqused_k=torch.empty(b, dtype=torch.int32, **m),
                page_table=torch.empty(b, 8192 // page, dtype=torch.int32, **m),
                max_seqlen_q=1, max_seqlen_k=8192, causal=True,
                out=torch.empty(b, hq, D, dtype=dtype, **m))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_warm_loads_the_kernel_and_its_twin_and_launches_nothing(serve, monkeypatch, fp8):
    """vLLM's compile-only call: the plan's kernel (and, for a split warm-up, the split twin's
    forward and combines) loaded once; no kernel runs; a later call loads nothing more."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    v = _decode_variant(hq=8, hk=1, kv=vllm_copy.FP8_KV if fp8 else None)
    twin = vllm_copy.split_twin(v)
    rt = serve([v, twin])
    spec = _specs(kv=FP8 if fp8 else BF16)
    out, lse = VA.warm(rt, num_splits=2, **spec)
    assert out is spec["out"] and lse is None and rt.log == []
    assert [i for i, _ in rt.loads] == [v.id, twin.id]
    assert set(rt.loads[1][1]) == set(_parts(twin))  # the split forward and every combine
    # vLLM's combine warm-up that follows: answered by the twin's combines, nothing loaded;
    # its own 1-head combine (flash_attn.py:254) is in no twin of 8 query heads per KV head
    part = torch.empty(64, 2, 8, D)
    VA.warm_combine(rt, part, torch.empty(64, 2, 8), torch.empty(2, 8, D, dtype=torch.bfloat16),
                    varlen=True)
    with pytest.raises(ArtifactMissing, match="no stored combine for 1 query heads"):
        VA.warm_combine(rt, part[:, :, :1], torch.empty(64, 2, 1),
                        torch.empty(2, 1, D, dtype=torch.bfloat16), varlen=True)
    assert len(rt.loads) == 2
    q, k, vv, kw = _call(4, [5000] * 4, fp8=fp8)  # Gemma-4 TP1: 32 query heads, 4 KV heads
    R.flash_attn_varlen_func(q, k, vv, **kw)
    assert len(rt.loads) == 2 and _split_of(rt.log)[0] > 1


def test_warm_misses_what_the_store_lacks(serve, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    rt = serve([_decode_variant(hq=8, hk=1)])
    with pytest.raises(ArtifactMissing):
        VA.warm(rt, **_specs(page=16))  # the page-16 (cp.async) kernel is not in the store
    assert rt.loads == []
    VA.warm(rt, num_splits=32, **_specs())  # no twin: the kernel alone, the steps unsplit
    assert len(rt.loads) == 1 and rt.log == []



def test_a_missing_bucket_falls_back_to_a_smaller_combine():
    """A split twin without the count's bucket (its combines from another build) runs the
    largest smaller count it has a combine for; no combine for the heads: unsplit."""
    sk = VA.SplitKv(None, {(32, 32): None, (32, 128): None}, PAGE, lambda f, guard=True: None)
    kw = dict(batch=1, hq=32, hk=4, bound=8000, bytes_per_key=2 * D * 2, num_sms=SMS,
              model=S.DEFAULT_MODEL)
    assert sk.count(setting=48, **kw) == 32  # (bucket 64 missing)
    assert sk.count(setting=100, **kw) == 100
    assert sk.count(setting=48, **{**kw, "hq": 16}) == 1


def test_warm_combine_answers_what_a_warmed_twin_holds(monkeypatch):
    """vllm_abi.warm_combine: a combine warm-up is answered where a split twin `warm` loaded
    for (arch, out dtype, head dim, varlen) holds its (query heads, split bucket) combine, and
    is a miss naming what the twins hold otherwise (vLLM's 1-head warm-up beside ratio-8 twins)."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    rt = SimpleNamespace(_modules={}, device=lambda dev: ("sm90", 132))
    held = {(8 * hk, n) for hk in (1, 2, 4, 8) for n in (32, 64, 128)}
    rt._modules[VA._warmed_key("sm90", torch.bfloat16, 512, True)] = held

    def ask(heads, splits, dtype=torch.bfloat16, varlen=True, partial=torch.float32):
        op = torch.empty(splits, 2, heads, 512, dtype=partial)
        VA.warm_combine(rt, op, torch.empty(splits, 2, heads, dtype=torch.float32),
                        torch.empty(2, heads, 512, dtype=dtype), varlen=varlen)

    ask(8, 32)
    ask(32, 33)  # (bucket 64)
    ask(64, 128)
    for bad in (dict(heads=1, splits=32), dict(heads=8, splits=256),
                dict(heads=8, splits=32, dtype=torch.float16),
                dict(heads=8, splits=32, varlen=False),
                dict(heads=8, splits=32, partial=torch.bfloat16)):
        with pytest.raises(ArtifactMissing, match="no stored combine"):
            ask(**bad)
