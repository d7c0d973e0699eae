"""The vLLM 0.33 plugin against vLLM's real call path, on the CPU.

vLLM's FA4 call path is `flash_attn_varlen_func(..., fa_version=4)` in
vllm/vllm_flash_attn/flash_attn_interface.py (:176), which imports `_flash_attn_fwd` from
vllm.vllm_flash_attn.cute.interface inside the call (:454) and calls it (:464). These tests run
that real module, read out of the 0.33.0 wheel, over a recording stand-in for the FA4 copy's
`_flash_attn_fwd` (the engine's original) and one for fa4aot's runtime; without the wheel, the
replay tests call the patched name directly with the argument list of :464-497.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

import fa4aot
import wheels
from fa4aot.engines import _common
from fa4aot.engines import vllm as P

MOD = "vllm.vllm_flash_attn.cute.interface"


@pytest.fixture
def fa4(packages, engine_fn):
    """The stand-in FA4 copy: vllm.vllm_flash_attn.cute.interface with a recording
    `_flash_attn_fwd` (with FA4's `compile_cache` attribute), and the plugin installed."""
    _, _, cute = packages("vllm", "vllm.vllm_flash_attn", "vllm.vllm_flash_attn.cute")
    iface = type(sys)(MOD)
    sys.modules[MOD] = iface
    cute.interface = iface
    orig = engine_fn(("engine-out", "engine-lse", None, None))
    orig.compile_cache = {}
    iface._flash_attn_fwd = orig
    P.install()
    return iface, orig


@pytest.fixture
def interface(fa4):
    """vLLM's real flash_attn_interface.py from the wheel, over the stand-in FA4 copy."""
    text = wheels.source("vllm", "vllm/vllm_flash_attn/flash_attn_interface.py")
    if text is None:
        pytest.skip(wheels.skip_reason("vllm"))
    return wheels.load_module(
        "vllm.vllm_flash_attn.flash_attn_interface", text, "flash_attn_interface.py"
    )


def paged(batch=3, hq=8, hk=2, d=128, page=16, pages=12, dtype=torch.bfloat16):
    """Tensors shaped as FlashAttentionImpl.forward passes them (flash_attn.py:1404-1428):
    q (num_tokens, hq, d); K/V views of the (blocks, kv_heads, block_size, 2*d) cache
    (flash_attn.py:1257)."""
    kv = torch.zeros(pages, hk, page, 2 * d, dtype=dtype)
    k, v = kv.transpose(1, 2).split(d, dim=-1)
    return dict(
        q=torch.zeros(batch, hq, d, dtype=dtype), k=k, v=v,
        out=torch.empty(batch, hq, d, dtype=dtype),
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32),
        seqused_k=torch.full((batch,), 20, dtype=torch.int32),
        block_table=torch.zeros(batch, 4, dtype=torch.int32),
    )


def backend_call(t, **over):
    """FlashAttentionImpl.forward's FA4 call (flash_attn.py:1404-1428), through
    FA4DenseAttentionKernel.kernel (:114): the keyword list as vLLM writes it."""
    kw = dict(
        q=t["q"], k=t["k"], v=t["v"], out=t["out"], cu_seqlens_q=t["cu_seqlens_q"],
        max_seqlen_q=1, seqused_k=t["seqused_k"], max_seqlen_k=20, softmax_scale=0.088,
        causal=True, alibi_slopes=None, window_size=None, block_table=t["block_table"],
        softcap=0.0, scheduler_metadata=None, fa_version=4, q_descale=None, k_descale=None,
        v_descale=None, dynamic_causal=None, num_splits=0, s_aux=None, mask_mod=None,
        aux_tensors=None,
    )
    kw.update(over)
    return kw


def test_real_interface_reaches_the_plugin(interface, fa4, runtime):
    iface, orig = fa4
    t = paged()
    res = interface.flash_attn_varlen_func(**backend_call(t))
    assert res is t["out"]  # return_softmax_lse=False: vLLM returns out alone (:499)
    assert orig.calls == [] and P.counters.hits == 1
    [(name, kw)] = runtime.calls
    assert name == "flash_attn_varlen_func"
    assert kw["q"] is t["q"] and kw["k"] is t["k"] and kw["v"] is t["v"]
    assert kw["page_table"] is t["block_table"] and kw["seqused_k"] is t["seqused_k"]
    assert kw["cu_seqlens_q"] is t["cu_seqlens_q"] and kw["out"] is t["out"]
    assert kw["cu_seqlens_k"] is None and kw["max_seqlen_q"] == 1 and kw["max_seqlen_k"] == 20
    assert kw["window_size"] == (None, None) and kw["causal"] is True
    assert kw["softmax_scale"] == 0.088 and kw["softcap"] == 0.0 and kw["lse"] is None
    assert "q_descale" not in kw  # vLLM drops descales for non-FP8 KV (:430)


def test_real_interface_lse_and_window(interface, fa4, runtime):
    t = paged()
    out, lse = interface.flash_attn_varlen_func(
        **backend_call(t, window_size=[127, 0], return_softmax_lse=True,
                       s_aux=torch.zeros(8, dtype=torch.float32))
    )
    assert out is t["out"] and lse.shape == (8, 3)
    kw = runtime.calls[0][1]
    assert kw["window_size"] == (127, 0) and kw["return_lse"] is True
    assert kw["learnable_sink"].dtype == torch.float32


@pytest.mark.parametrize(
    "over, reason",
    [
        (dict(mask_mod=lambda *a: None), "mask_mod"),
        (dict(aux_tensors=[torch.zeros(1)]), "aux_tensors"),
        (dict(dynamic_causal=torch.zeros(3, dtype=torch.int32)), "dynamic_causal"),
        (dict(output_scale=torch.ones(())), "output_scale"),
    ],
)
def test_real_interface_hands_back(interface, fa4, runtime, miss_log, over, reason):
    iface, orig = fa4
    t = paged()
    res = interface.flash_attn_varlen_func(**backend_call(t, **over))
    assert res == "engine-out" and runtime.calls == []
    [(args, kw)] = orig.calls  # vLLM's own call, as vLLM made it (:464)
    assert args[0] is t["q"] and kw["page_table"] is t["block_table"] and kw["out"] is t["out"]
    for name, val in over.items():
        assert kw[name] is val
    assert dict(P.counters.handbacks) == {reason: 1} and P.counters.hits == 0
    [rec] = _common.read_handbacks(miss_log)
    assert rec["engine"] == "vllm" and rec["kind"] == "handback" and rec["reason"] == reason
    assert rec["call"]["q"] == {"dtype": "bfloat16", "shape": [3, 8, 128]}


def test_real_interface_fp8_kv_dequant(interface, fa4, runtime, monkeypatch):
    # sm90 FP8 KV: vLLM sets fp8_kv_dequant (:458-461); fa4aot's runtime does not take it
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    iface, orig = fa4
    t = paged()
    t["k"] = t["k"].to(torch.float8_e4m3fn)
    t["v"] = t["v"].to(torch.float8_e4m3fn)
    ds = torch.ones(3, 2)
    interface.flash_attn_varlen_func(**backend_call(t, k_descale=ds, v_descale=ds))
    [(_, kw)] = orig.calls
    assert kw["fp8_kv_dequant"] is True and kw["k_descale"] is ds and kw["q_descale"] is None
    assert dict(P.counters.handbacks) == {"fp8_kv_dequant": 1} and runtime.calls == []


def test_fp8_kv_dequant_served_when_the_runtime_takes_it(fa4, runtime, monkeypatch):
    def flash_attn_varlen_func(q, k, v, fp8_kv_dequant=False, **kw):
        return runtime.varlen(q, k, v, fp8_kv_dequant=fp8_kv_dequant, **kw)

    monkeypatch.setattr(fa4aot, "flash_attn_varlen_func", flash_attn_varlen_func)
    iface, orig = fa4
    t = paged()
    ds = torch.ones(3, 2)
    iface._flash_attn_fwd(
        t["q"], t["k"], t["v"], cu_seqlens_q=t["cu_seqlens_q"], seqused_k=t["seqused_k"],
        page_table=t["block_table"], k_descale=ds, v_descale=ds, fp8_kv_dequant=True,
    )
    kw = runtime.calls[0][1]
    assert kw["fp8_kv_dequant"] is True and kw["k_descale"] is ds and orig.calls == []


def _direct(t, **over):
    """`_flash_attn_fwd` as flash_attn_interface.py:464-497 calls it (no wheel needed)."""
    kw = dict(
        qv=None, cu_seqlens_q=t["cu_seqlens_q"], cu_seqlens_k=None, seqused_k=t["seqused_k"],
        max_seqlen_q=1, max_seqlen_k=20, page_table=t["block_table"], gather_kv_indices=None,
        gather_kv_valid_length=None, softmax_scale=0.088, causal=True, dynamic_causal=None,
        softcap=0.0, window_size_left=None, window_size_right=None, num_splits=0,
        return_lse=False, out=t["out"], learnable_sink=None, mask_mod=None,
        block_sparse_tensors=None, aux_tensors=None, aux_tensor_leading_dims=None,
        q_descale=None, k_descale=None, v_descale=None, output_scale=None, fp8_kv_dequant=False,
    )
    kw.update(over)
    return (t["q"], t["k"], t["v"]), kw


def test_direct_call_contract(fa4, runtime):
    iface, orig = fa4
    t = paged()
    args, kw = _direct(t, return_lse=True, num_splits=32)
    res = iface._flash_attn_fwd(*args, **kw)
    assert isinstance(res, tuple) and len(res) == 4  # (out, lse, p, row_max), :2021
    assert res[0] is t["out"] and res[1].shape == (8, 3) and res[2:] == (None, None)
    assert P.counters.overridden["num_splits"] == 1 and P.counters.hits == 1


def test_dense_call_goes_to_flash_attn_func(fa4, runtime):
    iface, _ = fa4
    q = torch.zeros(2, 5, 4, 64, dtype=torch.float16)
    k = torch.zeros(2, 7, 4, 64, dtype=torch.float16)
    out, lse, p, rm = iface._flash_attn_fwd(q, k, k, causal=False, softcap=None)
    assert runtime.calls[0][0] == "flash_attn_func" and lse is None and out.shape == q.shape
    assert "page_table" not in runtime.calls[0][1] and runtime.calls[0][1]["softcap"] == 0.0


@pytest.mark.parametrize(
    "over, reason",
    [
        (dict(num_threads=128), "num_threads"),
        (dict(block_sparse_tensors=object()), "block_sparse_tensors"),
        (dict(gather_kv_indices=torch.zeros(1)), "gather_kv_indices"),
        (dict(window_size_left=100, window_size_right=-1), "window_size with a negative entry"),
        (dict(not_an_fa4_argument=1), "unknown argument not_an_fa4_argument"),
    ],
)
def test_direct_hand_backs(fa4, runtime, over, reason):
    iface, orig = fa4
    t = paged()
    args, kw = _direct(t, **over)
    assert iface._flash_attn_fwd(*args, **kw) == orig.result
    assert orig.calls == [(args, kw)] and runtime.calls == []
    assert dict(P.counters.handbacks) == {reason: 1}


def test_requires_grad_hands_back(fa4, runtime):
    iface, orig = fa4
    t = paged()
    t["q"] = t["q"].clone().requires_grad_()
    args, kw = _direct(t)
    iface._flash_attn_fwd(*args, **kw)
    assert dict(P.counters.handbacks) == {"requires_grad": 1} and runtime.calls == []


def test_miss_hands_back_once_then_from_cache(fa4, runtime, miss_log):
    iface, orig = fa4
    runtime.error = fa4aot.ArtifactMissing("no artifact serves bf16 hd128 8:2 paged")
    t = paged()
    args, kw = _direct(t)
    for _ in range(3):
        assert iface._flash_attn_fwd(*args, **kw) == orig.result
    assert len(runtime.calls) == 1  # the refusal is remembered for this call's key
    assert len(orig.calls) == 3 and all(c == (args, kw) for c in orig.calls)
    [(reason, n)] = P.counters.misses.items()
    assert n == 3 and reason.startswith("ArtifactMissing: no artifact serves")
    [rec] = _common.read_handbacks(miss_log)
    assert rec["kind"] == "miss" and rec["call"]["page_table"]["dtype"] == "int32"
    assert rec["call"]["causal"] is True and rec["call"]["max_seqlen_q"] == 1


def test_contract_violation_is_not_remembered(fa4, runtime):
    iface, orig = fa4
    runtime.error = fa4aot.ContractViolation("out must have a 16-byte aligned base")
    t = paged()
    args, kw = _direct(t)
    iface._flash_attn_fwd(*args, **kw)
    iface._flash_attn_fwd(*args, **kw)
    assert len(runtime.calls) == 2 and len(orig.calls) == 2


def test_other_errors_propagate(fa4, runtime):
    iface, orig = fa4
    runtime.error = RuntimeError("a kernel launch failed")
    args, kw = _direct(paged())
    with pytest.raises(RuntimeError, match="launch failed"):
        iface._flash_attn_fwd(*args, **kw)
    assert orig.calls == []


def test_patch_keeps_compile_cache_and_is_idempotent(fa4):
    iface, orig = fa4
    w = iface._flash_attn_fwd
    assert w is not orig and w.compile_cache is orig.compile_cache and w.__wrapped__ is orig
    P.install()
    assert iface._flash_attn_fwd is w
    P.uninstall()
    assert iface._flash_attn_fwd is orig


def test_patches_on_first_import(tmp_path, monkeypatch, packages, runtime):
    """install() before vLLM's FA4 module is imported: the import hook patches it on load."""
    root = tmp_path / "vllm" / "vllm_flash_attn" / "cute"
    root.mkdir(parents=True)
    for d in (root, root.parent, root.parent.parent):
        (d / "__init__.py").write_text("")
    (root / "interface.py").write_text(
        "def _flash_attn_fwd(q, k, v, **kw):\n    return 'engine'\n"
        "_flash_attn_fwd.compile_cache = {}\n"
    )
    for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, k)
    monkeypatch.syspath_prepend(str(tmp_path))
    P.install()
    assert MOD not in sys.modules
    import importlib

    iface = importlib.import_module(MOD)
    assert iface._flash_attn_fwd.__fa4aot_plugin__ is P.plugin
    q = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    iface._flash_attn_fwd(q, q, q, cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
                          cu_seqlens_k=torch.tensor([0, 1, 2], dtype=torch.int32))
    assert P.counters.hits == 1


def test_register_honours_the_off_switch(fa4, monkeypatch):
    iface, orig = fa4
    P.uninstall()
    monkeypatch.setenv("FA4AOT_ENGINE_PLUGIN", "0")
    P.register()
    assert iface._flash_attn_fwd is orig
    monkeypatch.delenv("FA4AOT_ENGINE_PLUGIN")
    P.register()
    assert iface._flash_attn_fwd.__wrapped__ is orig


def test_miss_log_lines_do_not_disturb_variant_readers(fa4, runtime, miss_log):
    from fa4aot.store.misses import read_misses

    iface, _ = fa4
    args, kw = _direct(paged(), mask_mod=lambda *a: None)
    iface._flash_attn_fwd(*args, **kw)
    assert read_misses(miss_log) == []  # `fa4aot build --from-misses` skips hand-back lines
    assert json.loads(miss_log.read_text())["handback"]["reason"] == "mask_mod"


class Spec:
    """Stands in for the copy's `_CompileOnlyTensorSpec` (interface.py:289): a shape, a dtype,
    strides and a CUDA device, no data."""

    def __init__(self, shape, dtype, assumed_align=16, stride=None):
        self.shape, self.dtype, self.requires_grad, self.is_cuda = tuple(shape), dtype, False, True
        self.device = torch.device("cuda")
        self._stride = stride

    @property
    def ndim(self):
        return len(self.shape)

    def stride(self, dim=None):
        return self._stride if dim is None else self._stride[dim]


def _make_spec(shape, dtype, assumed_align=16, stride=None):
    return None if shape is None else Spec(shape, dtype, assumed_align, stride)


def warmup_call(page=64, splits=32, qhead_per_kvhead=8, dtype=torch.bfloat16):
    """FA4DenseAttentionKernel.compile's call (vllm/v1/attention/backends/flash_attn.py:205-250)
    for a Gemma-4 hd512 warm-up key: q_stage 1, not single-batch (batch 2), FA4_DENSE_NUM_BLOCKS
    256 blocks of K/V (page, 1 KV head, 512) with the cache's strides, FA4_DENSE_MAX_SEQLEN_K
    8192, causal, no window, num_splits 2 for any split key, keyword for keyword."""
    d, batch, max_seqlen_q = 512, 2, 1
    kv_shape = (256, page, 1, d)
    kv_stride = (2 * page * d, 2 * d, 2 * d, 1)
    return dict(
        q_shape=(batch * max_seqlen_q, qhead_per_kvhead, d), k_shape=kv_shape,
        v_shape=kv_shape, k_stride=kv_stride, v_stride=kv_stride, q_dtype=dtype,
        cu_seqlens_q_shape=(batch + 1,), seqused_k_shape=(batch,),
        page_table_shape=(batch, 8192 // page), max_seqlen_q=max_seqlen_q, max_seqlen_k=8192,
        causal=True, window_size=[-1, -1], softcap=0.0,
        num_splits=2 if splits > 1 else 1, fa_version=4, return_softmax_lse=False,
    )


@pytest.fixture
def warm(fa4, monkeypatch):
    """The copy's spec factory under the stand-in interface, and a recording stand-in for
    fa4aot's runtime/vllm_abi.warm: (calls, set_error)."""
    from fa4aot.runtime import vllm_abi

    iface, _ = fa4
    iface._make_compile_only_tensor_spec = _make_spec
    calls, state = [], {"error": None}

    def fake_warm(rt, q, k, v, **kw):
        calls.append(dict(q=q, k=k, v=v, **kw))
        if state["error"] is not None:
            raise state["error"]
        return kw["out"], kw["lse"]

    monkeypatch.setattr(vllm_abi, "warm", fake_warm)
    return calls, state


@pytest.mark.parametrize("splits", [1, 32])
def test_compile_only_warm_up_served_from_the_store(interface, fa4, runtime, warm, splits):
    """vLLM's start-up warm-up through the wheel's compile_flash_attn_varlen_func_from_specs:
    answered by fa4aot (the kernel loaded, nothing launched, no compile by vLLM)."""
    iface, orig = fa4
    calls, _ = warm
    assert interface.compile_flash_attn_varlen_func_from_specs(
        **warmup_call(splits=splits)) is None
    assert orig.calls == [] and runtime.calls == [] and P.counters.hits == 1
    [kw] = calls
    assert isinstance(kw["q"], Spec) and kw["q"].shape == (2, 8, 512)
    assert kw["k"].shape == (256, 64, 1, 512) and kw["k"].stride() == (65536, 1024, 1024, 1)
    assert kw["page_table"].shape == (2, 128) and kw["seqused_k"].shape == (2,)
    assert kw["cu_seqlens_q"].shape == (3,) and kw["cu_seqlens_k"] is None
    assert kw["max_seqlen_q"] == 1 and kw["max_seqlen_k"] == 8192 and kw["causal"] is True
    assert kw["window_size"] == (None, None) and kw["return_lse"] is False
    assert kw["num_splits"] == (2 if splits > 1 else 1) and kw["lse"] is None
    assert isinstance(kw["out"], Spec) and kw["out"].shape == (2, 8, 512)


def test_compile_only_warm_up_returns_what_vllm_expects(fa4, runtime, warm):
    """The copy's `_flash_attn_fwd(compile_only=True)` returns (out, lse, None, None) with the
    specs it was given (interface.py:1867)."""
    iface, _ = fa4
    out = Spec((2, 8, 512), torch.bfloat16)
    got = iface._flash_attn_fwd(
        q=Spec((2, 8, 512), torch.bfloat16), k=Spec((256, 64, 1, 512), torch.bfloat16),
        v=Spec((256, 64, 1, 512), torch.bfloat16), cu_seqlens_q=Spec((3,), torch.int32),
        seqused_k=Spec((2,), torch.int32), page_table=Spec((2, 128), torch.int32),
        max_seqlen_q=1, max_seqlen_k=8192, causal=True, out=out, compile_only=True)
    assert got == (out, None, None, None)


def test_compile_only_miss_goes_back_and_vllm_compiles(interface, fa4, runtime, warm, miss_log):
    iface, orig = fa4
    calls, state = warm
    state["error"] = fa4aot.errors.ArtifactMissing("no artifact serves it")
    interface.compile_flash_attn_varlen_func_from_specs(**warmup_call())
    [(args, kw)] = orig.calls
    assert kw["compile_only"] is True and isinstance(kw["q"], Spec) and len(calls) == 1
    assert sum(P.counters.misses.values()) == 1 and P.counters.hits == 0
    [rec] = _common.read_handbacks(miss_log)
    assert rec["kind"] == "miss" and rec["call"]["q"]["shape"] == [2, 8, 512]
    # the same warm-up again: handed back from the refused-call cache, not asked again
    interface.compile_flash_attn_varlen_func_from_specs(**warmup_call())
    assert len(orig.calls) == 2 and len(calls) == 1


def test_compile_only_dense_goes_back(fa4, runtime, warm):
    iface, orig = fa4
    q = Spec((2, 16, 8, 128), torch.bfloat16)
    iface._flash_attn_fwd(q=q, k=q, v=q, compile_only=True)
    assert len(orig.calls) == 1 and warm[0] == []
    assert dict(P.counters.handbacks) == {"compile_only without a varlen or paged layout": 1}


def combine_warmup(num_splits: int, dtype=torch.bfloat16):
    """vLLM's combine warm-up, the wheel's own statements: the `if compile_key.head_dim == 512
    and compile_key.num_splits > 1:` block of FA4DenseAttentionKernel.compile
    (v1/attention/backends/flash_attn.py:240-262), cut from the wheel's source and run for one
    compile key. It imports `_flash_attn_fwd_combine` from the (stand-in) copy at call time."""
    import ast
    from types import SimpleNamespace

    text = wheels.source("vllm", "vllm/v1/attention/backends/flash_attn.py")
    if text is None:
        pytest.skip(wheels.skip_reason("vllm"))
    cls = next(n for n in ast.parse(text).body
               if isinstance(n, ast.ClassDef) and n.name == "FA4DenseAttentionKernel")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "compile")
    [block] = [n for n in fn.body if isinstance(n, ast.If)
               and "_flash_attn_fwd_combine" in ast.unparse(n)]
    key = SimpleNamespace(head_dim=512, num_splits=num_splits, dtype=dtype)
    exec(compile(ast.Module([block], []), "flash_attn.py", "exec"),
         {"torch": torch, "compile_key": key})


@pytest.fixture
def combine(fa4, engine_fn, monkeypatch):
    """The stand-in copy's `_flash_attn_fwd_combine` (recording; the plugin wraps it) and a
    recording stand-in for runtime/vllm_abi.warm_combine: (engine's combine, calls, state)."""
    from fa4aot.runtime import vllm_abi

    iface, _ = fa4
    orig = engine_fn(None)
    orig.compile_cache = {}
    iface._flash_attn_fwd_combine = orig
    P.uninstall()
    P.install()
    calls, state = [], {"error": None}

    def fake_warm_combine(rt, out_partial, lse_partial, out, *, varlen):
        calls.append(dict(out_partial=out_partial, lse_partial=lse_partial, out=out,
                          varlen=varlen))
        if state["error"] is not None:
            raise state["error"]

    monkeypatch.setattr(vllm_abi, "warm_combine", fake_warm_combine)
    yield orig, calls, state
    P.combine_plugin.counters.reset()


@pytest.mark.parametrize("splits", [32, 64, 128, 256])
def test_combine_warm_up_answered_from_the_store(combine, splits):
    """vLLM's own combine warm-up reaches the plugin with fake tensors: (splits, 2 rows, 1 head,
    512) fp32 partials, packed q (cu_seqlens of 3), no LSE; answered, the copy not called."""
    orig, calls, _ = combine
    combine_warmup(splits)
    assert orig.calls == [] and P.combine_counters.hits == 1
    [kw] = calls
    assert type(kw["out_partial"]).__name__ == "FakeTensor" and kw["varlen"] is True
    assert kw["out_partial"].shape == (splits, 2, 1, 512)
    assert kw["out_partial"].dtype == kw["lse_partial"].dtype == torch.float32
    assert kw["lse_partial"].shape == (splits, 2, 1) and kw["out"].dtype == torch.bfloat16


def test_combine_warm_up_the_store_lacks_goes_back(combine, miss_log):
    orig, calls, state = combine
    state["error"] = fa4aot.errors.ArtifactMissing("no stored combine for 1 query heads")
    combine_warmup(32)
    [(args, kw)] = orig.calls  # vLLM's call, verbatim: the copy compiles it
    assert len(args) == 3 and set(kw) == {"cu_seqlens"} and len(calls) == 1
    assert P.combine_counters.hits == 0 and sum(P.combine_counters.misses.values()) == 1
    [rec] = _common.read_handbacks(miss_log)
    assert rec["function"].endswith("._flash_attn_fwd_combine") and rec["kind"] == "miss"


def test_combine_real_tensors_and_extras_go_to_the_copy(combine):
    """The copy's own split forward (a call fa4aot handed back) combines real tensors: passed
    through uncounted; a fake call with an argument the stored combines lack goes back."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    orig, calls, _ = combine
    iface = sys.modules[MOD]
    op, lp, out = torch.zeros(32, 2, 8, 512), torch.zeros(32, 2, 8), torch.zeros(2, 8, 512)
    iface._flash_attn_fwd_combine(op, lp, out, None, None, _arch=90)
    assert len(orig.calls) == 1 and P.combine_counters.calls == 0
    with FakeTensorMode():
        op, lp = torch.empty(32, 2, 1, 512), torch.empty(32, 2, 1)
        iface._flash_attn_fwd_combine(op, lp, torch.empty(2, 1, 512), torch.empty(2, 1))
    assert len(orig.calls) == 2 and calls == []
    assert dict(P.combine_counters.handbacks) == {"combine warm-up with lse": 1}
