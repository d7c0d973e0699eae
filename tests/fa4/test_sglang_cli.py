"""`--fa4` on `fa4aot build --from-misses` and `fa4aot explain` (CPU, nothing compiled): a miss
log is planned by what the chosen FA4 source can run (SGLang's copy: bf16 sinks only; vLLM's:
hd512; upstream: any sink dtype, no hd512), and explain judges a call by the source whose
stores it reads."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from fa4_copies import engine_root
from fa4aot.cli import explain as E
from fa4aot.cli.app import main
from fa4aot.model.compile_keys import Call
from fa4aot.store.misses import record_miss

CUTE = ("kernels", "ops", "attention", "flash_attn", "cute")


def _variant(**kw):
    base = dict(layout="varlen", batch=300, seqlen_q=1, seqlen_k=1024, num_heads=32,
                num_heads_kv=8, head_dim=128, head_dim_v=128, dtype="bfloat16", causal=True,
                window_left=None, window_right=None, return_lse=False, sink_dtype=None,
                page_size=None)
    base.update(kw)
    return Call(**base).variant("sm90", 132)


@pytest.fixture
def misses(tmp_path, monkeypatch):
    from fa4aot.store import misses as M

    monkeypatch.setattr(M, "_seen", set())  # (the log's per-process dedup)
    hd64 = dict(head_dim=64, head_dim_v=64, num_heads=64)
    vs = {"gqa_b300": _variant(), "sink32": _variant(sink_dtype="float32", **hd64),
          "sink16": _variant(sink_dtype="bfloat16", **hd64),
          "hd512": _variant(head_dim=512, head_dim_v=512, batch=4)}
    log = tmp_path / "misses.jsonl"
    for v in vs.values():
        assert record_miss(v, str(log))
    return log, {v.id: n for n, v in vs.items()}


def _plan(log, names, fa4):
    r = CliRunner().invoke(main, ["build", "--from-misses", str(log), "--fa4", fa4,
                                  "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    refused = {names[u["reason"].split(" ")[0]]: u["reason"] for u in doc["unsupported"]}
    return sorted(names[row["id"]] for row in doc["rows"]), refused


def test_from_misses_plans_by_the_fa4_sources_abi(misses):
    log, names = misses
    sg = str(engine_root("sglang").joinpath(*CUTE))
    built, refused = _plan(log, names, sg)
    assert built == ["gqa_b300", "sink16"] and sorted(refused) == ["hd512", "sink32"]
    assert "float32 sinks: the sglang FA4 source's forward takes bfloat16" in refused["sink32"]
    vl = str(engine_root("vllm") / "vllm_flash_attn" / "cute")
    built, refused = _plan(log, names, vl)
    assert built == ["gqa_b300", "hd512", "sink16", "sink32"] and refused == {}


def test_from_misses_upstream_refuses_hd512_naming_the_vllm_source(misses):
    pytest.importorskip("flash_attn.cute")  # (--fa4 upstream resolves the installed package)
    log, names = misses
    built, refused = _plan(log, names, "upstream")
    assert built == ["gqa_b300", "sink16", "sink32"] and list(refused) == ["hd512"]
    assert "--fa4 vllm" in refused["hd512"]


@pytest.fixture
def explain(monkeypatch, tmp_path):
    """explain over a store holding the exact kernel of every call asked (its stores stood in),
    recording the FA4AOT_KERNEL_SOURCE it matched stores under."""
    seen = []

    def cached(layers, arch, num_sms, python):
        from fa4aot import settings

        seen.append(settings.fa4_source())
        return arts, {}, SimpleNamespace(stores=[], describe_others=lambda: "none")

    arts: list = []
    monkeypatch.setattr(E, "_cached_artifacts", cached)

    def run(*args, stored=()):
        arts[:] = [SimpleNamespace(id=v.id, record={"variant": v.to_dict(), "parts": {"fwd": {}}})
                   for v in stored]
        r = CliRunner().invoke(main, ["explain", *args, "--json", "--cache", str(tmp_path)])
        return r, json.loads(r.stdout) if r.stdout.startswith("{") else None

    return run, seen


def test_explain_fa4_judges_the_call_by_that_source(explain):
    run, seen = explain
    hd512 = ["--heads", "32:4", "--head-dim", "512", "--layout", "varlen", "--batch", "4"]
    v512 = _variant(head_dim=512, head_dim_v=512, num_heads=32, num_heads_kv=4, batch=4)
    r, doc = run(*hd512, "--fa4", "vllm", stored=[v512])
    assert r.exit_code == 0 and doc["fa4"] == "vllm" and doc["fa4_unsupported"] is None
    assert doc["choices"][0]["exact"] and seen[-1] == "vllm"
    for fa4 in ("sglang", "upstream"):  # neither builds hd512: FA4 cannot run it exactly
        r, doc = run(*hd512, "--fa4", fa4, stored=[v512])
        assert doc["fa4"] == fa4 and "out of range on sm90" in doc["fa4_unsupported"]
    sink = ["--heads", "64:8", "--head-dim", "64", "--sink"]  # (explain's sinks: float32)
    r, doc = run(*sink, "--fa4", "sglang")
    assert "bfloat16 sinks only" in doc["fa4_unsupported"] and r.exit_code == 1
    r, doc = run(*sink, "--fa4", "upstream")
    assert doc["fa4_unsupported"] is None
    # a path: the source's ABI read from its interface.py (nothing imported)
    r, doc = run(*hd512, "--fa4", str(engine_root("sglang").joinpath(*CUTE)), stored=[v512])
    assert doc["fa4"] == "sglang" and seen[-1] == "sglang"
    r, _ = run(*hd512, "--fa4", "/nonexistent/tree")
    assert r.exit_code == 2 and "no cute/interface.py" in r.output
