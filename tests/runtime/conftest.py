"""Fixtures for the runtime's CPU tests."""

from __future__ import annotations

import pytest
import torch
from stub_store import serve_variants

import fa4aot.runtime as R


@pytest.fixture
def stand_in_store(monkeypatch, tmp_path, knobs):
    """stand_in_store(kernels, parts, num_sms) -> serve(variants, arch="sm100"): the default
    runtime, its stores holding exactly `variants` (stub_store.serve_variants) with record parts
    parts(variant), each part bound to kernels(variant, log)[part]; CPU tensors report device 0,
    and rt.log is the kernels' log."""
    knobs(cache_dir=str(tmp_path / "cache"), padding=None)
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    log: list = []

    def make(kernels, parts, num_sms):
        def load(self, art, *names):
            got = kernels(art.variant, log)
            return [got[n] if n in art.record["parts"] else None for n in names]

        def serve(variants, arch="sm100"):
            rt = serve_variants(monkeypatch, tmp_path / "cache", variants, load, arch, num_sms,
                                parts)
            rt.log = log
            return rt

        return serve

    yield make
    R.reset(roots=[tmp_path / "cache"])
