"""The SGLang 0.5.23 plugin against SGLang's real call path, on the CPU.

SGLang's FA4 calls go through the dispatcher (kernels/ops/attention/flash_attention.py, ver=4
branches :181 and :296) into kernels/ops/attention/flash_attention_v4.py, whose two functions
end in the module global `_flash_attn_varlen_func` (:282; flash_attn_with_kvcache reaches it
through flash_attn_varlen_func, :376). These tests run both real modules, read out of the
0.5.23 wheel, over a recording stand-in for the FA4 copy's `flash_attn_varlen_func` and one for
fa4aot's runtime; without the wheel, the replay test calls the patched global with the keyword
list of flash_attention_v4.py:282-306.
"""

from __future__ import annotations

import sys

import pytest
import torch

import fa4aot
import wheels
from fa4aot.engines import _common
from fa4aot.engines import sglang as P

ATT = "sglang.kernels.ops.attention"


@pytest.fixture
def cute(packages, engine_fn):
    """Stand-ins: the FA4 copy package (a recording flash_attn_varlen_func), SGLang's
    kernel_api_logging decorator and the FA3 wrapper the dispatcher imports."""
    packages("sglang", "sglang.kernels", "sglang.kernels.ops", ATT, f"{ATT}.flash_attn")
    (c,) = packages(f"{ATT}.flash_attn.cute")
    c.flash_attn_varlen_func = engine_fn(("engine-out", "engine-lse"))
    logging_mod = type(sys)("sglang.kernels.kernel_api_logging")

    def debug_kernel_api(func=None, **_):
        return func if func is not None else (lambda f: f)

    logging_mod.debug_kernel_api = debug_kernel_api
    sys.modules[logging_mod.__name__] = logging_mod
    fa3 = type(sys)(f"{ATT}.flash_attention_v3")
    fa3.flash_attn_varlen_func = fa3.flash_attn_with_kvcache = engine_fn("fa3")
    sys.modules[fa3.__name__] = fa3
    return c


@pytest.fixture
def sgl(cute):
    """SGLang's real flash_attention_v4.py and dispatcher flash_attention.py, plugin installed."""
    v4 = wheels.source("sglang", "sglang/kernels/ops/attention/flash_attention_v4.py")
    disp = wheels.source("sglang", "sglang/kernels/ops/attention/flash_attention.py")
    if v4 is None or disp is None:
        pytest.skip(wheels.skip_reason("sglang"))
    m4 = wheels.load_module(f"{ATT}.flash_attention_v4", v4, "flash_attention_v4.py")
    d = wheels.load_module(f"{ATT}.flash_attention", disp, "flash_attention.py")
    assert m4._flash_attn_varlen_func is cute.flash_attn_varlen_func
    P.install()
    return m4, d


def paged(batch=3, hq=8, hk=2, d=128, page=64, pages=12, dtype=torch.bfloat16):
    """As FlashAttentionBackend.forward_decode passes them: q (tokens, hq, d), the KV pool viewed
    as (-1, page_size, kv_heads, d), page_table and cache_seqlens int32."""
    return dict(
        q=torch.zeros(batch, hq, d, dtype=dtype),
        k_cache=torch.zeros(pages, page, hk, d, dtype=dtype),
        v_cache=torch.zeros(pages, page, hk, d, dtype=dtype),
        page_table=torch.zeros(batch, 2, dtype=torch.int32),
        cache_seqlens=torch.full((batch,), 70, dtype=torch.int32),
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32),
        out=torch.empty(batch, hq, d, dtype=dtype),
    )


def backend_call(t, **over):
    """flashattention_backend.py:1789-1806 (forward_extend's paged call), ver=4."""
    kw = dict(
        q=t["q"], k_cache=t["k_cache"], v_cache=t["v_cache"], page_table=t["page_table"],
        cache_seqlens=t["cache_seqlens"], cu_seqlens_q=t["cu_seqlens_q"],
        cu_seqlens_k_new=t["cu_seqlens_q"], max_seqlen_q=1, softmax_scale=0.088, causal=True,
        window_size=(-1, -1), softcap=0.0, return_softmax_lse=False, num_splits=0,
        out=t["out"], ver=4,
    )
    kw.update(over)
    return kw


def test_dispatcher_kvcache_reaches_the_plugin(sgl, cute, runtime):
    m4, d = sgl
    t = paged()
    res = d.flash_attn_with_kvcache(**backend_call(t))
    assert res is t["out"]  # return_softmax_lse=False: result[0] (flash_attention_v4.py:410)
    assert cute.flash_attn_varlen_func.calls == [] and P.counters.hits == 1
    [(name, kw)] = runtime.calls
    assert name == "flash_attn_varlen_func"
    assert kw["q"] is t["q"] and kw["k"] is t["k_cache"] and kw["v"] is t["v_cache"]
    assert kw["page_table"] is t["page_table"] and kw["seqused_k"] is t["cache_seqlens"]
    assert kw["out"] is t["out"] and kw["window_size"] == (None, None)
    assert kw["return_lse"] is True  # SGLang's kvcache wrapper always asks for it (:403)
    assert kw["softcap"] == 0.0 and kw["cu_seqlens_k"] is None


def test_dispatcher_varlen_reaches_the_plugin(sgl, runtime):
    m4, d = sgl
    q = torch.zeros(10, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(10, 2, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    out, lse = d.flash_attn_varlen_func(
        q, k, k, cu, cu, max_seqlen_q=6, max_seqlen_k=6, softmax_scale=0.1, causal=True,
        window_size=(255, 0), sinks=torch.zeros(8, dtype=torch.bfloat16),
        return_softmax_lse=True, ver=4,
    )
    assert lse.shape == (8, 10) and out.shape == q.shape
    kw = runtime.calls[0][1]
    assert kw["window_size"] == (255, 0) and kw["learnable_sink"].dtype == torch.bfloat16
    assert kw["cu_seqlens_k"] is cu and kw["max_seqlen_k"] == 6


def test_backend_bound_function_reaches_the_plugin(sgl, runtime):
    """The backend binds flash_attn_with_kvcache at construction (flashattention_backend.py:302):
    a binding made before install() still ends in the patched global."""
    m4, _ = sgl
    bound = m4.flash_attn_with_kvcache
    t = paged()
    kw = backend_call(t)
    kw.pop("ver")
    bound(**kw)
    assert P.counters.hits == 1


@pytest.mark.parametrize(
    "over, reason",
    [
        (dict(mask_mod=lambda *a: None, aux_tensors=[torch.zeros(1)]), "mask_mod"),
        (dict(score_mod=lambda *a: None), "score_mod"),
        (dict(sinks=torch.zeros(8, dtype=torch.float32)),
         "learnable_sink dtype float32 (SGLang: bf16)"),
        (dict(rel_bias=torch.zeros(1)), "rel_bias"),
        (dict(sfq=torch.zeros(1)), "sfq"),
    ],
)
def test_hands_back_to_sglang(sgl, cute, runtime, miss_log, over, reason):
    m4, d = sgl
    t = paged()
    res = d.flash_attn_with_kvcache(**backend_call(t, **over))
    assert res == "engine-out" and runtime.calls == []
    [(args, kw)] = cute.flash_attn_varlen_func.calls
    assert args == () and kw["q"] is t["q"] and kw["page_table"] is t["page_table"]
    assert kw["out"] is t["out"]
    assert dict(P.counters.handbacks) == {reason: 1}
    [rec] = _common.read_handbacks(miss_log)
    assert rec["engine"] == "sglang" and rec["reason"] == reason


def test_miss_hands_back(sgl, cute, runtime, miss_log):
    m4, d = sgl
    runtime.error = fa4aot.UnsupportedVariant("hd512 is unsupported on sm90")
    t = paged(d=512)
    res = d.flash_attn_with_kvcache(**backend_call(t, return_softmax_lse=True))
    assert res == ("engine-out", "engine-lse")
    assert len(cute.flash_attn_varlen_func.calls) == 1
    assert list(P.counters.misses) == ["UnsupportedVariant: hd512 is unsupported on sm90"]
    [rec] = _common.read_handbacks(miss_log)
    assert rec["kind"] == "miss" and rec["call"]["q"]["shape"] == [3, 8, 512]


def test_direct_replay_without_the_wheel(cute, runtime):
    """flash_attention_v4.py:282-306's keyword list, on the patched global."""
    m4 = type(sys)(f"{ATT}.flash_attention_v4")
    m4._flash_attn_varlen_func = cute.flash_attn_varlen_func
    sys.modules[m4.__name__] = m4
    P.install()
    t = paged()
    out, lse = m4._flash_attn_varlen_func(
        q=t["q"], k=t["k_cache"], v=t["v_cache"], qv=None, cu_seqlens_q=t["cu_seqlens_q"],
        cu_seqlens_k=None, seqused_q=None, seqused_k=t["cache_seqlens"], max_seqlen_q=1,
        max_seqlen_k=None, page_table=t["page_table"], softmax_scale=None, causal=True,
        softcap=None, window_size=(None, None), learnable_sink=None, num_splits=0,
        pack_gqa=None, mask_mod=None, score_mod=None, aux_tensors=None, return_lse=True,
        out=t["out"],
    )
    assert out is t["out"] and lse.shape == (8, 3) and P.counters.hits == 1


def test_register_and_uninstall(cute, monkeypatch):
    m4 = type(sys)(f"{ATT}.flash_attention_v4")
    m4._flash_attn_varlen_func = orig = cute.flash_attn_varlen_func
    sys.modules[m4.__name__] = m4
    monkeypatch.setenv("FA4AOT_ENGINE_PLUGIN", "0")
    P.register()
    assert m4._flash_attn_varlen_func is orig
    monkeypatch.setenv("FA4AOT_ENGINE_PLUGIN", "1")
    P.register()
    assert m4._flash_attn_varlen_func.__wrapped__ is orig
    P.uninstall()
    assert m4._flash_attn_varlen_func is orig


def test_fa4_unavailable_is_left_alone(cute):
    """SGLang sets _flash_attn_varlen_func = None when its FA4 copy fails to import (:16)."""
    m4 = type(sys)(f"{ATT}.flash_attention_v4")
    m4._flash_attn_varlen_func = None
    sys.modules[m4.__name__] = m4
    P.install()
    assert m4._flash_attn_varlen_func is None


def _copy_functions(*names):
    """Pure functions of the wheel's FA4 copy (interface.py), executed alone."""
    import ast

    text = wheels.source("sglang", "sglang/kernels/ops/attention/flash_attn/cute/interface.py")
    if text is None:
        pytest.skip(wheels.skip_reason("sglang"))
    tree = ast.parse(text)
    keep = [n for n in tree.body if getattr(n, "name", None) in names]
    assert {n.name for n in keep} == set(names)
    ns: dict = {"dataclass": __import__("dataclasses").dataclass}
    exec(compile(ast.Module(keep, []), "interface.py", "exec"), ns)
    return ns


def test_copy_tile_is_fa4aots():
    """copy_splits reads the copy's sm90 tile from constraints.fwd_tile: the copy's own
    _tile_size_fwd_sm90 gives the same (M, N) for every head dim fa4aot builds."""
    from fa4aot.model.constraints import fwd_tile

    ns = _copy_functions("FwdConfig", "_tile_size_fwd_sm90")
    for d, dv in ((64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256),
                  (512, 512)):
        for causal, local in ((False, False), (True, False), (False, True)):
            c = ns["_tile_size_fwd_sm90"](d, dv, causal, local)
            t = fwd_tile("sm90", d, dv, causal, local)
            assert (c.m_block_size, c.n_block_size) == (t.m, t.n), (d, dv, causal, local)


def _decode(batch, hq=32, hk=8, d=128, pages=8192, page=64, **over):
    # meta tensors: copy_splits reads shapes only (the pool would be 2 GB a case on the CPU)
    m = dict(device="meta")
    a = dict(q=torch.empty(batch, hq, d, **m), v=torch.empty(pages, page, hk, d, **m), qv=None,
             cu_seqlens_q=torch.empty(batch + 1, **m), max_seqlen_q=1, max_seqlen_k=None,
             page_table=torch.empty(batch, 4, **m), causal=True, window_size=(None, None),
             num_splits=0)
    a.update(over)
    return a


@pytest.mark.parametrize("a, want", [
    # a paged K's bound is its pool (8192 pages of 64): 512K keys, 4096 blocks of 128
    (_decode(1), 132 // 8),  # total_mblocks 8: num_splits_heuristic
    (_decode(8), 2),  # 64 blocks: 132 // 64
    (_decode(16), 1),  # 128 M blocks fill the GPU
    (_decode(1, max_seqlen_k=4096), 16),  # 32 blocks but 8 * 4 < 132: num_splits_heuristic
    (_decode(40, max_seqlen_k=4096), 1),  # 32 blocks and 320 * 4 >= 132 SMs
    (_decode(1, max_seqlen_k=512), 1),  # 4 blocks
    (_decode(1, num_splits=5), 5),  # asked
    (_decode(1, num_splits=1), 1),
    (_decode(1, window_size=(127, 0), max_seqlen_k=1 << 20), 1),  # 127+0+1+128 keys: 2 blocks
])
def test_copy_splits(a, want):
    """SGLang's copy's split count on 132 SMs (interface.py:794-891)."""
    assert P.copy_splits(a, 132) == want


def test_copy_splits_matches_the_copys_heuristics():
    """The counts above are the copy's own num_splits_heuristic(_sm90_decode) at the same
    total M blocks and N blocks."""
    ns = _copy_functions("num_splits_heuristic", "num_splits_heuristic_sm90_decode")
    dec = ns["num_splits_heuristic_sm90_decode"]
    for b in (1, 2, 4, 8, 16, 64):
        for msk in (512, 4096, 8192, 65536, None):
            a = _decode(b, max_seqlen_k=msk)
            blocks = -(-(msk or 8192 * 64) // 128)
            assert P.copy_splits(a, 132) == dec(b * 8, 132, blocks, 128), (b, msk)


def test_a_step_the_copy_splits_goes_back(sgl, cute, runtime, miss_log, monkeypatch):
    """On an sm90 GPU a decode step the copy would split (batch 1 over SGLang's whole pool) is
    SGLang's: fa4aot would run it unsplit."""
    monkeypatch.setattr(P, "_sm90_sms", lambda device: 132)
    m4, d = sgl
    t = paged(batch=1)
    assert d.flash_attn_with_kvcache(**backend_call(t)) == "engine-out"
    assert runtime.calls == [] and dict(P.counters.handbacks) == {P.SPLIT_HANDBACK: 1}
    t = paged(batch=64, hk=8, hq=32)  # 512 M blocks: the copy runs it unsplit
    d.flash_attn_with_kvcache(**backend_call(t))
    assert len(runtime.calls) == 1 and P.counters.hits == 1
