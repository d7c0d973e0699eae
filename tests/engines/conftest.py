"""Fixtures for the engine plugins: package stand-ins in sys.modules, a recording stand-in for
fa4aot's runtime, a miss log, and plugins put back after each test."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import fa4aot
from fa4aot.engines import _common, sglang as sglang_plugin, vllm as vllm_plugin

sys.path.insert(0, __file__.rsplit("/", 1)[0])


@pytest.fixture
def packages(monkeypatch):
    """make(*names): empty package stand-ins (e.g. "vllm", "vllm.vllm_flash_attn"), removed
    after the test, as is any module the test puts under those names."""
    made = []

    def make(*names):
        for n in names:
            m = types.ModuleType(n)
            m.__path__ = []
            monkeypatch.setitem(sys.modules, n, m)
            made.append(n)
            parent, _, leaf = n.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], leaf, m)
        return [sys.modules[n] for n in names]

    roots = {n.split(".")[0] for n in ("vllm", "sglang")}
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in roots}
    yield make
    for k in [k for k in sys.modules if k.split(".")[0] in roots]:
        if k not in saved:
            del sys.modules[k]


class Runtime:
    """Stands in for fa4aot.flash_attn_func / flash_attn_varlen_func: records each call's
    function and kwargs; returns (out or a new tensor, lse or None), or raises `self.error`."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        self.error: Exception | None = None

    def _run(self, name, q, k, v, kw):
        self.calls.append((name, dict(q=q, k=k, v=v, **kw)))
        if self.error is not None:
            raise self.error
        out = kw.get("out")
        if out is None:
            out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
        lse = kw.get("lse")
        if lse is None and kw.get("return_lse"):
            hq = q.shape[-2]
            shape = (hq, q.shape[0]) if kw.get("cu_seqlens_q") is not None else (
                q.shape[0], hq, q.shape[1])
            lse = torch.zeros(shape, dtype=torch.float32)
        return out, lse

    def varlen(self, q, k, v, **kw):
        return self._run("flash_attn_varlen_func", q, k, v, kw)

    def dense(self, q, k, v, **kw):
        return self._run("flash_attn_func", q, k, v, kw)


@pytest.fixture
def runtime(monkeypatch):
    rt = Runtime()

    def flash_attn_varlen_func(q, k, v, **kw):
        return rt.varlen(q, k, v, **kw)

    def flash_attn_func(q, k, v, **kw):
        return rt.dense(q, k, v, **kw)

    monkeypatch.setattr(fa4aot, "flash_attn_varlen_func", flash_attn_varlen_func, raising=False)
    monkeypatch.setattr(fa4aot, "flash_attn_func", flash_attn_func, raising=False)
    return rt


@pytest.fixture
def miss_log(tmp_path, monkeypatch):
    path = tmp_path / "misses.jsonl"
    monkeypatch.setenv("FA4AOT_MISS_LOG", str(path))
    monkeypatch.delenv("FA4AOT_MISS_LOG_MAX", raising=False)
    return path


@pytest.fixture(autouse=True)
def _plugins_reset(monkeypatch):
    monkeypatch.setattr(_common, "_logged", set())
    yield
    for p in (vllm_plugin, sglang_plugin):
        p.uninstall()
        p.plugin.counters.reset()
        p.plugin._refused.clear()
        p.plugin.original = None


class Engine:
    """A recording stand-in for the engine's own FA4 function: what it got, verbatim."""

    def __init__(self, result):
        self.calls: list[tuple[tuple, dict]] = []
        self.result = result

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result


@pytest.fixture
def engine_fn():
    return Engine
