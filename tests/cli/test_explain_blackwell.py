"""`fa4aot explain` for Blackwell calls the runtime serves: FP8 (with descales) and FA4's native
split-KV (issue 15). explain's view of the stores is the variants `fa4aot build --arch sm100`
plans for the default FP8 spec (llama-3.1-8b-fp8: FP8 with all three descales, and FA4's own
split kernels beside its decode kernels, each with its combine), through CliRunner; the split
count is the one the runtime's Blackwell path computes (variants.native_split_variant, with
FA4's heuristic constraints.native_num_splits), which test_plan_sm100 runs end to end."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from fa4aot.model import constraints as C
from fa4aot.build.builder import plan_for
from fa4aot.cli import explain as E
from fa4aot.cli import main
from fa4aot.model.specs import load_default

SMS = 148
FP8 = ["--arch", "sm100", "--dtype", "float8_e4m3fn", "--heads", "32:8", "--head-dim", "128"]


@pytest.fixture
def stored(monkeypatch, tmp_path):
    """explain reads a store holding the default FP8 spec's sm100 variants (split kernels with
    their combine, as the builder records it)."""
    variants = [n.variant for n in
                plan_for([load_default("llama-3.1-8b-fp8")], "sm100").variants().values()]  # fmt: skip
    arts = [
        SimpleNamespace(id=v.id, record={"variant": v.to_dict(), "parts": {
            "fwd": {}, **({"combine": {"partial_dtype": "float32"}} if v.split_kv else {})}})
        for v in variants
    ]  # fmt: skip
    match = SimpleNamespace(stores=[], describe_others=lambda: "none")
    monkeypatch.setattr(E, "_cached_artifacts", lambda *a: (arts, {}, match))

    def run(*args):
        r = CliRunner().invoke(main, ["explain", *args, "--cache", str(tmp_path)])
        return r, (json.loads(r.stdout) if "--json" in args else None)

    return {v.id: v for v in variants}, run


def test_fp8_call_resolves_to_its_descale_kernel_padded_or_folded(stored):
    by_id, run = stored
    r, doc = run(*FP8, "--seqlen-q", "1", "--lse", "--json")
    assert r.exit_code == 0, r.output
    (only,) = doc["choices"]
    v = by_id[only["id"]]
    assert only["exact"] and (v.dtype, v.descales, v.qhead_per_kvhead) == ("float8_e4m3fn", "qkv", 4)
    assert doc["fp8"]["descales"] == "qkv" and doc["fp8"]["out_dtype"] == "bfloat16"
    text = run(*FP8, "--seqlen-q", "1", "--lse")[0].output
    assert "fp8         : FP8 float8_e4m3fn with q_descale, k_descale, v_descale" in text
    assert "the descales pass on unchanged" in text
    # another descale set is another kernel: a miss, and no kernel of another set stands in
    r, doc = run(*FP8, "--seqlen-q", "1", "--lse", "--descales", "kv", "--json")
    assert r.exit_code == 1 and doc["choices"] == [] and doc["variant"]["descales"] == "kv"
    # hd 72 is no FP8 head dim (multiples of 16): the hd128 kernel of the same descale set
    r, doc = run(*FP8[:-1], "72", "--seqlen-q", "1", "--lse", "--json")
    assert r.exit_code == 0 and "multiples of 16" in doc["fa4_unsupported"]
    best = doc["choices"][0]
    assert (best["head_dim"], best["exact"]) == (128, False)
    assert by_id[best["id"]].descales == "qkv"
    # ratio 3 (24:8) prefill: padded to the cached ratio 4; ratio 5 decode: folded onto the
    # 1:1 kernel (5 query rows per KV head)
    doc = run(*FP8[:5], "24:8", *FP8[6:], "--seqlen-q", "300", "--lse", "--json")[1]
    assert (doc["choices"][0]["ratio"], doc["choices"][0]["fold"]) == (4, 1)
    doc = run(*FP8[:5], "40:8", *FP8[6:], "--seqlen-q", "1", "--lse", "--json")[1]
    assert (doc["choices"][0]["ratio"], doc["choices"][0]["fold"]) == (1, 5)
    # off Blackwell FP8 is refused with FA4's reason; descales with bf16 are a usage error
    r, doc = run("--arch", "sm90", *FP8[2:], "--json")
    assert r.exit_code == 1 and "sm100-only" in doc["fa4_unsupported"]
    r, _ = run("--arch", "sm100", "--heads", "32:8", "--head-dim", "128", "--descales", "kv")
    assert r.exit_code == 2 and "descales scale FP8" in r.output


def test_native_split_shows_fa4s_count_and_its_split_kernel(stored, knobs):
    by_id, run = stored
    args = [*FP8, "--seqlen-q", "1", "--seqlen-k", "65536", "--lse"]
    r, doc = run(*args, "--json")
    assert r.exit_code == 0, r.output
    n = C.native_num_splits("sm100", batch=1, num_heads_kv=8, qhead_per_kvhead=4, seqlen_q=1,
                            max_seqlen_k=65536, head_dim=128, num_sms=SMS)  # fmt: skip
    assert n > 1 and doc["split"]["splits"] == n
    sv = by_id[doc["split"]["kernel"]]
    assert sv.split_kv and sv.return_lse and sv.descales == "qkv" and sv.layout == "dense"
    assert doc["choices"][0]["exact"]  # the unsplit kernel is the plan the split starts from
    text = run(*args)[0].output
    assert f"served by   : FA4's native split-KV, {n} splits (FA4's heuristic)" in text
    assert "unsplit     : exact" in text
    # FA4AOT_SPLIT_KV=N forces N, 0 never splits
    knobs(split_kv="3")
    assert run(*args, "--json")[1]["split"]["splits"] == 3
    knobs(split_kv="0")
    doc = run(*args, "--json")[1]
    assert doc["split"] == {"splits": 0, "why": "FA4AOT_SPLIT_KV=0"}
    assert "split-KV    : no (FA4AOT_SPLIT_KV=0)" in run(*args)[0].output


def test_native_split_refusals_name_why(stored):
    _, run = stored
    # a short KV: FA4's heuristic gives one split
    doc = run(*FP8, "--seqlen-q", "1", "--seqlen-k", "256", "--lse", "--json")[1]
    assert doc["split"]["splits"] == 0 and "one split" in doc["split"]["why"]
    # q packed at batch > 256: FA4 would need its scheduler-metadata kernel
    doc = run(*FP8, "--layout", "varlen", "--seqlen-q", "1", "--seqlen-k", "65536",
              "--batch", "300", "--json")[1]  # fmt: skip
    assert doc["split"]["splits"] == 0 and "scheduler-metadata" in doc["split"]["why"]
    # the same rows per sequence below that: split as q in batch form (the packed-K split
    # kernel of the spec)
    doc = run(*FP8, "--layout", "varlen", "--seqlen-q", "1", "--seqlen-k", "65536", "--json")[1]
    assert doc["split"]["splits"] > 1, doc["split"]
    # bf16 at these shapes: nothing cached at all, so nothing to split either
    r, doc = run("--arch", "sm100", "--heads", "32:8", "--head-dim", "128", "--seqlen-k",
                 "65536", "--json")  # fmt: skip
    assert r.exit_code == 1 and "no kernel serves the call" in doc["split"]["why"]
