"""The engines' released sources still have what the plugins assume (parsed with ast from the
vLLM 0.33.0 / SGLang 0.5.23 wheels; skipped, with the reason, when the wheels are not at hand):
the wrapped functions' parameters, and the call sites that look the wrapped names up per call."""

from __future__ import annotations

import ast

import pytest

import wheels
from fa4aot.engines import sglang as sglang_plugin, vllm as vllm_plugin


def _tree(engine, path):
    text = wheels.source(engine, path)
    if text is None:
        pytest.skip(wheels.skip_reason(engine))
    return ast.parse(text)


def _func(tree, name):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"no top-level def {name}")


def _params(fn: ast.FunctionDef) -> list[tuple[str, object]]:
    a = fn.args
    assert not a.kwonlyargs and a.vararg is None and a.kwarg is None
    defaults = [None] * (len(a.args) - len(a.defaults)) + [ast.literal_eval(d) for d in a.defaults]
    return [(x.arg, d) for x, d in zip(a.args, defaults)]


def _imports_in(fn, module_suffix):
    return {
        alias.name
        for node in ast.walk(fn)
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith(module_suffix)
        for alias in node.names
    }


def _calls(fn):
    return {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)}


def test_vllm_flash_attn_fwd_signature():
    tree = _tree("vllm", "vllm/vllm_flash_attn/cute/interface.py")
    assert _params(_func(tree, "_flash_attn_fwd")) == vllm_plugin.PARAMS


def test_vllm_interface_looks_fa4_up_per_call():
    """flash_attn_varlen_func imports _flash_attn_fwd inside its body (so patching the module
    attribute reaches every caller, however they bound flash_attn_varlen_func)."""
    tree = _tree("vllm", "vllm/vllm_flash_attn/flash_attn_interface.py")
    fn = _func(tree, "flash_attn_varlen_func")
    assert _imports_in(fn, "vllm_flash_attn.cute.interface") == {"_flash_attn_fwd"}
    assert "_flash_attn_fwd" in _calls(fn)
    top = {a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "_flash_attn_fwd" not in top


def test_vllm_backend_calls_through_the_interface():
    """flash_attn.py:47-53 takes flash_attn_varlen_func from fa_utils, which on CUDA takes it
    from vllm.vllm_flash_attn (fa_utils.py:24): the interface function, never _flash_attn_fwd."""

    def names(tree, prefix):
        return {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and (n.module or "").startswith(prefix) for a in n.names}

    backend = _tree("vllm", "vllm/v1/attention/backends/flash_attn.py")
    utils = _tree("vllm", "vllm/v1/attention/backends/fa_utils.py")
    assert "flash_attn_varlen_func" in names(backend, "vllm.v1.attention.backends.fa_utils")
    assert "flash_attn_varlen_func" in names(utils, "vllm.vllm_flash_attn")
    for tree in (backend, utils):
        assert "_flash_attn_fwd" not in names(tree, "vllm.vllm_flash_attn")


def test_sglang_cute_varlen_signature():
    tree = _tree("sglang", "sglang/kernels/ops/attention/flash_attn/cute/interface.py")
    assert _params(_func(tree, "flash_attn_varlen_func")) == sglang_plugin.PARAMS


def test_sglang_wrapper_calls_the_patched_global():
    tree = _tree("sglang", "sglang/kernels/ops/attention/flash_attention_v4.py")
    assert "_flash_attn_varlen_func" in _calls(_func(tree, "flash_attn_varlen_func"))
    assert "flash_attn_varlen_func" in _calls(_func(tree, "flash_attn_with_kvcache"))
    imported = {a.asname for n in tree.body if isinstance(n, ast.Try) for s in n.body
                if isinstance(s, ast.ImportFrom) for a in s.names}
    assert imported == {"_flash_attn_varlen_func"}


def test_sglang_dispatcher_imports_v4_per_call():
    tree = _tree("sglang", "sglang/kernels/ops/attention/flash_attention.py")
    for name in ("flash_attn_with_kvcache", "flash_attn_varlen_func"):
        assert _imports_in(_func(tree, name), "flash_attention_v4") == {name}


def test_sglang_general_plugin_group():
    tree = _tree("sglang", "sglang/srt/plugins/__init__.py")
    consts = {n.targets[0].id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Constant) and isinstance(n.targets[0], ast.Name)}
    assert consts["GENERAL_PLUGINS_GROUP"] == "sglang.srt.plugins"


def test_vllm_general_plugin_group():
    tree = _tree("vllm", "vllm/plugins/__init__.py")
    consts = {n.targets[0].id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Constant) and isinstance(n.targets[0], ast.Name)}
    assert consts["DEFAULT_PLUGINS_GROUP"] == "vllm.general_plugins"
