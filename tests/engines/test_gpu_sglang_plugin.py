"""The SGLang 0.5.23 plugin under SGLang's own FA4 call path, served from a store built from
SGLang's FA4 copy (marker `gpu` for the GPU half).

SGLang's real modules run: the dispatcher (kernels/ops/attention/flash_attention.py, `ver=4`) and
its FA4 wrapper (flash_attention_v4.py), loaded from FA4AOT_ENGINE_SRC (a directory holding
`sglang/`, e.g. the extracted wheel) with SGLang's package `__init__`s never run: the parents are
bare packages (fa4aot.fa4.sources.stub_parents), the FA3 wrapper the dispatcher imports (which
pulls in sglang.srt) is a stand-in that refuses ver=3. Each case is a call SGLang's
FlashAttentionBackend (srt/layers/attention/flashattention_backend.py) makes on Hopper with
`--attention-backend fa4`, with its keyword arguments: paged decode (:2286) at page 1 (SGLang's
default page size on Hopper), 16 and 128 (the TMA page), paged extend (:1789), varlen prefill of
embedding mode (:1770, the wrapper the backend binds at :302) causal and not (encoder-only
layers), the chunked-prefix MHA step (:1888, no mask, LSE), the cascade's expand step (:1840, a
page-size-one view, no mask, LSE), GQA 32:8 and TP8's 4:1.

CPU: the same calls, through the same real modules, over a recording stand-in for the FA4 copy
and one for fa4aot's runtime: each is a hit, mapped onto fa4aot's arguments as SGLang's wrapper
left them; the hand-back calls reach SGLang's function unchanged.

GPU: the copy itself (cutlass; FA4AOT_ENGINE_SRC) under the dispatcher, fa4aot's runtime serving
stores built from it (FA4AOT_KERNEL_SOURCE=sglang). Each case draws fresh random inputs and
NaN-filled output buffers; the plugin's call must be a hit, leave no NaN, be within TOL of an fp32
reference (LSE within LSE_TOL), and equal bit for bit the same dispatcher call with the plugin off
(SGLang's copy by JIT, which runs each case unsplit: checked). A masked call (SGLang's image mask),
an fp32 sink and an unknown argument go back to SGLang's function, counted.

    fa4aot build --fa4 <dir>/sglang/kernels/ops/attention/flash_attn/cute --arch sm90 \\
        --spec llama-3.1-8b --spec tests/engines/sglang_plugin.toml --cache <store>
    FA4AOT_CACHE_DIR=<store> FA4AOT_ENGINE_SRC=<dir> pytest -m gpu \\
        tests/engines/test_gpu_sglang_plugin.py
"""

from __future__ import annotations

import importlib
import importlib.machinery
import math
import os
import sys
import types
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import wheels

from fa4aot.engines import _common
from fa4aot.engines import sglang as P

ATT = "sglang.kernels.ops.attention"
TOL = 1e-2  # bf16 against fp32: ~3e-3 expected
LSE_TOL = 2e-2
SEEDS = (0, 1)
# the SGLang files the CPU half runs (besides the FA4 copy, stood in there)
FILES = ("kernels/kernel_api_logging.py", "kernels/ops/attention/flash_attention.py",
         "kernels/ops/attention/flash_attention_v4.py")


@dataclass(frozen=True)
class Case:
    """One FlashAttentionBackend call. kind: decode | extend (flash_attn_with_kvcache through the
    dispatcher), varlen (the backend's bound flash_attention_v4.flash_attn_varlen_func),
    chunked (the dispatcher's flash_attn_varlen_func); max_q: query rows per sequence (drawn
    from [max_q // 2, max_q]); max_k: KV length (extend, chunked: the prefix before the rows)."""

    name: str
    kind: str
    batch: int
    max_q: int
    max_k: int
    causal: bool = True
    page: int | None = None
    lse: bool = False
    hq: int = 32
    hk: int = 8
    d: int = 128


# batches fill the GPU so that SGLang's copy, asked for num_splits=0, runs unsplit as fa4aot does
# (its heuristics: interface.py num_splits_heuristic(_sm90_decode)); the test checks it did
CASES = [
    Case("decode_p1", "decode", 16, 1, 2000, page=1),
    Case("decode_p16", "decode", 16, 1, 2000, page=16),
    Case("decode_p128", "decode", 16, 1, 2000, page=128),
    Case("decode_p1_tp8", "decode", 72, 1, 512, page=1, hq=4, hk=1),
    Case("extend_p1", "extend", 4, 300, 600, page=1),
    Case("extend_p128", "extend", 4, 300, 600, page=128),
    Case("varlen_prefill", "varlen", 3, 700, 0),
    Case("varlen_bidirectional", "varlen", 3, 700, 0, causal=False),
    Case("chunked_prefix_lse", "chunked", 3, 300, 900, causal=False, lse=True),
    Case("cascade_expand_p1_lse", "extend", 12, 4, 500, causal=False, page=1, lse=True),
]


# -- SGLang's modules ---------------------------------------------------------------------------


def _bare(name: str, path: Path | None) -> None:
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)] if path else []
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__spec__.submodule_search_locations = mod.__path__
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, mod)


def _fa3(*args, **kwargs):
    raise NotImplementedError("SGLang's FA3 wrapper is not loaded in this test (ver=3)")


def load_sglang(root: Path, copy_fn=None):
    """SGLang's dispatcher and FA4 wrapper from `root` (a directory holding sglang/): ->
    (the FA4 copy's interface module or None, flash_attention_v4, flash_attention). copy_fn:
    a stand-in for the copy's flash_attn_varlen_func (CPU); None: the copy itself, imported as
    fa4aot's builder imports it (sources.load: bare parents, SGLang's three outside modules
    stood in)."""
    interface = None
    if copy_fn is None:
        from fa4aot.fa4 import sources

        interface = sources.load(sources.resolve("sglang", root=root / "sglang"))
    else:
        for i, name in enumerate(ATT.split(".")):
            full = ".".join(ATT.split(".")[: i + 1])
            _bare(full, root.joinpath(*full.split(".")))
        _bare(f"{ATT}.flash_attn", None)
        _bare(f"{ATT}.flash_attn.cute", None)
        sys.modules[f"{ATT}.flash_attn.cute"].flash_attn_varlen_func = copy_fn
    if f"{ATT}.flash_attention_v3" not in sys.modules:  # (the real one imports sglang.srt)
        fa3 = types.ModuleType(f"{ATT}.flash_attention_v3")
        fa3.flash_attn_varlen_func = fa3.flash_attn_with_kvcache = _fa3
        sys.modules[fa3.__name__] = fa3
    m4 = importlib.import_module(f"{ATT}.flash_attention_v4")
    disp = importlib.import_module(f"{ATT}.flash_attention")
    assert Path(m4.__file__).resolve() == (root / "sglang" / FILES[2]).resolve()
    return interface, m4, disp


def _engine_src() -> Path | None:
    src = os.environ.get("FA4AOT_ENGINE_SRC")
    return Path(src) if src and (Path(src) / "sglang" / FILES[1]).is_file() else None


def _cpu_root(tmp: Path) -> Path | None:
    """FA4AOT_ENGINE_SRC, else FILES read out of the SGLang wheel into `tmp`; None: neither."""
    src = _engine_src()
    if src is not None:
        return src
    for f in FILES:
        text = wheels.source("sglang", f"sglang/{f}")
        if text is None:
            return None
        (tmp / "sglang" / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp / "sglang" / f).write_text(text)
    return tmp


@pytest.fixture
def sgl_cpu(tmp_path, engine_fn, monkeypatch):
    """The CPU half's SGLang: real dispatcher and wrapper, a recording copy; plugin installed."""
    root = _cpu_root(tmp_path)
    if root is None:
        pytest.skip(f"no SGLang source: set FA4AOT_ENGINE_SRC; {wheels.skip_reason('sglang')}")
    for name in [n for n in sys.modules if n.split(".")[0] == "sglang"]:
        monkeypatch.delitem(sys.modules, name)
    copy = engine_fn(("engine-out", "engine-lse"))
    try:
        _, m4, disp = load_sglang(root, copy)
        P.install()
        yield copy, m4, disp
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] == "sglang"]:
            del sys.modules[name]


# -- the calls ----------------------------------------------------------------------------------


def make(case: Case, gen: torch.Generator, dev: str) -> dict:
    """Fresh random inputs for `case` in SGLang's layouts: q (tokens, hq, d); the KV pool viewed
    as (pages, page, hk, d) per K and V with a shuffled page table (int32, pages of the pool)
    and cache_seqlens; packed K/V with cu_seqlens (int32) for varlen."""
    b, hq, hk, d = case.batch, case.hq, case.hk, case.d

    def lens(lo, hi):
        return torch.randint(lo, hi + 1, (b,), generator=gen).tolist()

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dev, torch.bfloat16)

    def cu(x):
        return torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32,
                            device=dev)

    lq = [1] * b if case.max_q == 1 else lens(max(1, case.max_q // 2), case.max_q)
    if case.kind == "varlen":
        lk = lq
    elif case.kind == "decode":
        lk = lens(max(1, case.max_k // 2), case.max_k)
    else:  # extend, chunked: a prefix, then the rows
        lk = [p + n for p, n in zip(lens(1, case.max_k), lq)]
    inp = dict(case=case, lq=lq, lk=lk, q=randn(sum(lq), hq, d), cu_seqlens_q=cu(lq),
               max_seqlen_q=max(lq))
    if case.kind in ("varlen", "chunked"):
        if case.kind == "chunked":  # the rows attend to a prefix chunk only
            lk = inp["lk"] = [k - n for k, n in zip(lk, lq)]
        inp.update(k=randn(sum(lk), hk, d), v=randn(sum(lk), hk, d), cu_seqlens_k=cu(lk),
                   max_seqlen_k=max(lk))
        return inp
    npp = -(-max(lk) // case.page)
    pages = b * npp + 5
    perm = torch.randperm(pages, generator=gen)[: b * npp].view(b, npp)
    inp.update(k=randn(pages, case.page, hk, d), v=randn(pages, case.page, hk, d),
               page_table=perm.to(dev, torch.int32).contiguous(),
               cache_seqlens=torch.tensor(lk, dtype=torch.int32, device=dev))
    return inp


def sglang_call(inp: dict, m4, disp, out, **extra):
    """The call FlashAttentionBackend makes for inp's case (its keyword arguments, ver=4)."""
    case = inp["case"]
    scale = 1 / math.sqrt(case.d)
    if case.kind in ("decode", "extend"):
        kw = dict(
            q=inp["q"], k_cache=inp["k"], v_cache=inp["v"], page_table=inp["page_table"],
            cache_seqlens=inp["cache_seqlens"], cu_seqlens_q=inp["cu_seqlens_q"],
            max_seqlen_q=inp["max_seqlen_q"], softmax_scale=scale, causal=case.causal,
            window_size=(-1, -1), softcap=0.0, return_softmax_lse=case.lse, num_splits=0,
            out=out, ver=4,
        )
        if case.kind == "decode":
            kw["scheduler_metadata"] = None
        else:
            kw["cu_seqlens_k_new"] = inp["cu_seqlens_q"]
        kw.update(extra)
        return disp.flash_attn_with_kvcache(**kw)
    kw = dict(
        q=inp["q"], k=inp["k"], v=inp["v"], cu_seqlens_q=inp["cu_seqlens_q"],
        cu_seqlens_k=inp["cu_seqlens_k"], max_seqlen_q=inp["max_seqlen_q"],
        max_seqlen_k=inp["max_seqlen_k"], softmax_scale=scale, causal=case.causal, out=out,
    )
    if case.kind == "varlen":  # embedding mode: the backend's bound wrapper, num_splits 0
        kw.update(window_size=(-1, -1), softcap=0.0, num_splits=0)
        kw.update(extra)
        return m4.flash_attn_varlen_func(**kw)
    kw.update(return_softmax_lse=case.lse, ver=4)
    kw.update(extra)
    return disp.flash_attn_varlen_func(**kw)


def split_result(case: Case, res):
    """SGLang's return value -> (out, lse or None)."""
    if case.lse:
        out, lse = res[0], res[1]
        return out, lse
    assert isinstance(res, torch.Tensor)
    return res, None


# -- CPU: the calls mapped onto fa4aot ----------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_call_is_served_as_sglang_left_it(sgl_cpu, runtime, case):
    copy, m4, disp = sgl_cpu
    inp = make(case, torch.Generator().manual_seed(0), "cpu")
    out = torch.empty_like(inp["q"])
    res = sglang_call(inp, m4, disp, out)
    assert copy.calls == [] and P.counters.hits == 1 and P.counters.calls == 1
    got, lse = split_result(case, res)
    assert got is out and (lse is not None) == case.lse
    [(name, kw)] = runtime.calls
    assert name == "flash_attn_varlen_func"
    assert kw["q"] is inp["q"] and kw["k"] is inp["k"] and kw["v"] is inp["v"]
    assert kw["out"] is out and kw["causal"] is case.causal
    assert kw["window_size"] == (None, None) and kw["softcap"] == 0.0
    assert kw["learnable_sink"] is None and kw["pack_gqa"] is None
    assert kw["softmax_scale"] == 1 / math.sqrt(case.d)
    assert kw["cu_seqlens_q"] is inp["cu_seqlens_q"]
    assert kw["max_seqlen_q"] == inp["max_seqlen_q"]
    paged = case.kind in ("decode", "extend")
    # SGLang's kvcache wrapper always asks for the LSE (flash_attention_v4.py:403)
    assert kw["return_lse"] is (True if paged else case.lse)
    if paged:
        assert kw["page_table"] is inp["page_table"] and kw["seqused_k"] is inp["cache_seqlens"]
        assert kw["cu_seqlens_k"] is None and kw["max_seqlen_k"] is None  # (not passed on)
    else:
        assert kw["cu_seqlens_k"] is inp["cu_seqlens_k"] and kw["page_table"] is None
        assert kw["max_seqlen_k"] == inp["max_seqlen_k"] and kw["seqused_k"] is None


def _image_mask(inp):
    """SGLang's image-mask arguments (flashattention_backend.py:1622): every token text."""
    ranges = torch.full((inp["q"].shape[0], 2), -1, dtype=torch.int32, device=inp["q"].device)
    return [ranges, inp["cu_seqlens_q"]]


def test_hand_backs_reach_sglang_unchanged(sgl_cpu, runtime, miss_log):
    copy, m4, disp = sgl_cpu
    case = CASES[5]  # extend, page 128
    inp = make(case, torch.Generator().manual_seed(0), "cpu")
    out = torch.empty_like(inp["q"])

    def mask(*a):
        return None

    sink = torch.zeros(case.hq, dtype=torch.float32)
    assert sglang_call(inp, m4, disp, out, mask_mod=mask, aux_tensors=_image_mask(inp),
                       causal=False) == "engine-out"
    assert sglang_call(inp, m4, disp, out, sinks=sink) == "engine-out"
    assert runtime.calls == [] and P.counters.hits == 0
    assert dict(P.counters.handbacks) == {"mask_mod": 1,
                                          "learnable_sink dtype float32 (SGLang: bf16)": 1}
    (a1, k1), (a2, k2) = copy.calls
    assert a1 == a2 == () and k1["mask_mod"] is mask and k1["q"] is inp["q"]
    assert k1["out"] is out and k2["learnable_sink"] is sink and k1["return_lse"] is True
    assert {r["reason"] for r in _common.read_handbacks(miss_log)} == set(P.counters.handbacks)


def test_fa3_stays_sglangs(sgl_cpu, runtime):
    copy, m4, disp = sgl_cpu
    inp = make(CASES[0], torch.Generator().manual_seed(0), "cpu")
    with pytest.raises(NotImplementedError, match="ver=3"):
        sglang_call(inp, m4, disp, None, ver=3)
    assert P.counters.calls == 0 and runtime.calls == [] and copy.calls == []


# -- GPU: against fp32 and against SGLang's copy --------------------------------------------------


@pytest.fixture(scope="module")
def sgl_gpu():
    """SGLang's dispatcher over its FA4 copy (JIT) and fa4aot serving the stores built from that
    copy; skips without an sm90 GPU, FA4AOT_ENGINE_SRC, the copy's imports or such a store."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    root = _engine_src()
    if root is None:
        pytest.skip("FA4AOT_ENGINE_SRC must name a directory holding sglang/ (the wheel, "
                    "extracted)")
    from fa4aot import settings
    from fa4aot.errors import FingerprintMismatch
    from fa4aot.runtime import reset

    before = set(sys.modules)
    try:
        iface, m4, disp = load_sglang(root)
    except Exception as e:  # noqa: BLE001 (the reason is the skip's message)
        pytest.skip(f"SGLang's FA4 copy does not import here: {e!r}")
    with settings.scope(kernel_source="sglang"):
        rt = reset()
        arch, sms = rt.device(torch.cuda.current_device())
        try:
            stores = rt.stores_for(arch, sms)
        except FingerprintMismatch as e:
            pytest.skip(f"no store built from SGLang's copy for this GPU: {e}")
        if not stores:
            pytest.skip("no store built from SGLang's copy (see this module's docstring)")
        yield iface, m4, disp
    reset()
    for name in (f"{ATT}.flash_attention", f"{ATT}.flash_attention_v4",
                 f"{ATT}.flash_attention_v3", "sglang.kernels.kernel_api_logging"):
        if name not in before:
            sys.modules.pop(name, None)


def _combines(iface) -> int:
    cache = iface._flash_attn_fwd_combine.compile_cache
    return len(getattr(cache, "cache", cache))


def engine_off(iface, inp, m4, disp, **extra):
    """The dispatcher call with the plugin off: SGLang's copy by JIT, on a NaN buffer."""
    P.uninstall()
    out = torch.full_like(inp["q"], float("nan"))
    splits = _combines(iface)
    res = split_result(inp["case"], sglang_call(inp, m4, disp, out, **extra))
    torch.cuda.synchronize()
    assert _combines(iface) == splits == 0, (
        f"{inp['case'].name}: SGLang's copy split this call (num_splits=0), fa4aot runs it "
        "unsplit: the results cannot be bit-identical; give the case a larger batch")
    return res


def plugin_on(inp, m4, disp, **extra):
    P.install()
    P.counters.reset()
    out = torch.full_like(inp["q"], float("nan"))
    res = split_result(inp["case"], sglang_call(inp, m4, disp, out, **extra))
    torch.cuda.synchronize()
    return out, res


def reference(inp: dict, causal: bool):
    """fp32 (out (total_q, hq, d), lse (hq, total_q)): the rows of each sequence at the end of
    its keys (bottom-right causal)."""
    from reference import attention_ref

    case, lq, lk = inp["case"], inp["lq"], inp["lk"]
    b, hq, hk, d = case.batch, case.hq, case.hk, case.d
    dev = inp["q"].device
    q = torch.zeros(b, max(lq), hq, d, device=dev, dtype=inp["q"].dtype)
    k = torch.zeros(b, max(lk), hk, d, device=dev)
    v = torch.zeros_like(k)
    for i, (m, n) in enumerate(zip(lq, lk)):
        s = int(inp["cu_seqlens_q"][i])
        q[i, :m] = inp["q"][s:s + m]
        if "cu_seqlens_k" in inp:
            s = int(inp["cu_seqlens_k"][i])
            k[i, :n], v[i, :n] = inp["k"][s:s + n].float(), inp["v"][s:s + n].float()
        else:
            pages = inp["page_table"][i, : -(-n // case.page)].long()
            k[i, :n] = inp["k"][pages].reshape(-1, hk, d)[:n].float()
            v[i, :n] = inp["v"][pages].reshape(-1, hk, d)[:n].float()
    o, lse = attention_ref(q, k, v, torch.tensor(lq, device=dev), torch.tensor(lk, device=dev),
                           causal=causal, scale=1 / math.sqrt(d))
    return (torch.cat([o[i, :m] for i, m in enumerate(lq)]),
            torch.cat([lse[i, :, :m] for i, m in enumerate(lq)], dim=1))


@pytest.mark.gpu
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_served_against_fp32_and_bit_identical_to_sglang(sgl_gpu, case, seed):
    from reference import rel_err

    iface, m4, disp = sgl_gpu
    gen = torch.Generator().manual_seed(1000 * seed + zlib.crc32(case.name.encode()) % 997)
    inp = make(case, gen, "cuda")
    theirs, theirs_lse = engine_off(iface, inp, m4, disp)
    buf, (ours, ours_lse) = plugin_on(inp, m4, disp)
    c = P.counters.as_dict()
    assert c["hits"] == 1 and c["calls"] == 1, (
        f"{case.name}: not served from the store ({c}); build it as this module's docstring "
        "says")
    assert ours.data_ptr() == buf.data_ptr() and not torch.isnan(ours).any()
    ref, ref_lse = reference(inp, case.causal)
    err = rel_err(ours, ref)
    assert err < TOL, f"{case.name}: rel err {err:.2e} against fp32"
    assert torch.equal(ours, theirs), (
        f"{case.name}: max |diff| to SGLang's copy "
        f"{(ours.float() - theirs.float()).abs().max().item():.3e}")
    if case.lse:
        assert torch.equal(ours_lse, theirs_lse)
        assert (ours_lse - ref_lse).abs().max().item() < LSE_TOL


@pytest.mark.gpu
def test_a_masked_call_is_sglangs(sgl_gpu, miss_log):
    """SGLang's image mask (mask_mod + aux_tensors, causal off): handed back, SGLang's result
    exactly; every token text here, so that result is causal attention (not the unmasked
    attention a dropped mask would give)."""
    from reference import rel_err

    iface, m4, disp = sgl_gpu
    case = CASES[5]  # extend, page 128
    inp = make(case, torch.Generator().manual_seed(3), "cuda")
    extra = dict(mask_mod=m4.make_image_mask_mod(-1), aux_tensors=_image_mask(inp),
                 causal=False)
    theirs, _ = engine_off(iface, inp, m4, disp, **extra)
    _, (ours, _) = plugin_on(inp, m4, disp, **extra)
    assert P.counters.as_dict()["handbacks"] == {"mask_mod": 1} and P.counters.hits == 0
    assert torch.equal(ours, theirs)
    assert rel_err(ours, reference(inp, True)[0]) < TOL
    assert rel_err(ours, reference(inp, False)[0]) > 10 * TOL
    assert [r["reason"] for r in _common.read_handbacks(miss_log)] == ["mask_mod"]


@pytest.mark.gpu
def test_what_sglang_refuses_it_still_refuses(sgl_gpu):
    """An fp32 sink and an unknown argument go back to SGLang's copy, which raises its own
    error, as without the plugin."""
    _, m4, disp = sgl_gpu
    inp = make(CASES[0], torch.Generator().manual_seed(4), "cuda")
    P.install()
    sink = torch.zeros(CASES[0].hq, dtype=torch.float32, device="cuda")
    with pytest.raises(AssertionError, match="bfloat16"):
        sglang_call(inp, m4, disp, None, sinks=sink)
    with pytest.raises(TypeError, match="not_an_fa4_argument"):
        m4._flash_attn_varlen_func(q=inp["q"], k=inp["k"], v=inp["v"],
                                   not_an_fa4_argument=True)
    assert dict(P.counters.handbacks) == {
        "learnable_sink dtype float32 (SGLang: bf16)": 1,
        "unknown argument not_an_fa4_argument": 1,
    }
    assert P.counters.hits == 0


@pytest.mark.gpu
def test_a_step_the_copy_splits_is_sglangs(sgl_gpu, miss_log):
    """Batch 1 over SGLang's whole pool: SGLang's copy splits it (num_splits=0, its sm90
    heuristic), fa4aot has no split kernel from the copy: handed back, SGLang's split result
    exactly, and right against fp32."""
    from reference import rel_err

    iface, m4, disp = sgl_gpu
    case = Case("decode_b1_split", "decode", 1, 1, 3000, page=16)
    inp = make(case, torch.Generator().manual_seed(5), "cuda")
    P.uninstall()
    nan = torch.full_like(inp["q"], float("nan"))
    theirs = split_result(case, sglang_call(inp, m4, disp, nan))[0]
    assert _combines(iface) > 0, "SGLang's copy did not split batch 1 (its heuristic changed?)"
    _, (ours, _) = plugin_on(inp, m4, disp)
    assert dict(P.counters.handbacks) == {P.SPLIT_HANDBACK: 1} and P.counters.hits == 0
    assert torch.equal(ours, theirs)
    assert rel_err(ours, reference(inp, True)[0]) < TOL
