"""Gemma-4 on sm90 from vLLM's FA4 copy: fa4aot's feature model (Call.variant, with the hd512
64 x 64 tile and FP8-KV's `kv_dtype`) names the kernel the copy compiles, read back from the
copy's own compile key by field name (vllm_copy.variant_from_key); each variant's
representative call compiles that same kernel; and (slow) the copy's kernels cross-compile and
export for sm_90a. The copy comes from the released wheel (tests/fa4_copies.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fa4_copies import engine_root

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "fa4" / "_vllm_build_check.py"


def _run(*args) -> dict:
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(SCRIPT), str(engine_root("vllm")), *map(str, args)],
                       capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout[r.stdout.index("@@") + 2:])


@pytest.fixture(scope="module")
def traced():
    return _run()


def test_feature_model_names_the_copys_kernels(traced):
    assert len(traced) == 15
    for name, row in traced.items():
        assert row["match"], f"{name}: model {row['variant']}, copy's key {row['key_variant']}"
        assert row["representative_match"], name


def test_gemma4_variants_are_distinct_where_the_copy_compiles_distinct_kernels(traced):
    ids = {n: r["id"] for n, r in traced.items()}
    assert len(set(ids.values())) == len(ids)  # (TP1/2/4 share ratio 8: one case stands for them)
    assert "kv:float8_e4m3fn" in traced["fp8_p64_decode"]["variant"]
    assert "page!=tile_n" in traced["bf16_p16_decode"]["variant"]
    assert "ratio4" in traced["bf16_p64_decode_tp8"]["variant"]


def test_split_twins_are_the_copys_split_forwards(traced):
    """Each split twin's build call (vllm_copy.split_needs) compiles one split forward whose key
    reads back as the twin, and the copy's combine beside it; the twin is its decode kernel
    with split_kv, a distinct artifact."""
    for name, base in (("bf16_p64_split", "bf16_p64_decode"), ("bf16_p16_split", "bf16_p16_decode"),
                       ("fp8_p64_split", "fp8_p64_decode"),
                       ("fp8_p64_split_tp8", "fp8_p64_decode_tp8")):
        row = traced[name]
        assert row["match"] and row["representative_match"] and row["combines"] == 1, name
        assert "split-kv" in row["variant"], name
        assert row["variant"].replace(" split-kv", "") == traced[base]["variant"], name
        assert row["id"] != traced[base]["id"], name


@pytest.mark.slow
def test_fp8_kv_and_non_tma_kernels_cross_compile(tmp_path):
    got = _run("--compile", tmp_path, "fp8_p64_decode", "bf16_p16_decode")
    for name, row in got.items():
        fwd = row["parts"]["fwd"]
        assert fwd["fa4_abi"] == "vllm" and (fwd["tile_m"], fwd["tile_n"]) == (64, 64), name
        assert fwd["bytes"] > 50_000 and not fwd["split_kv"], name
        assert (tmp_path / name / "fwd.o").is_file()
    assert "True, torch.bfloat16, torch.bfloat16" in got["fp8_p64_decode"]["parts"]["fwd"]["key"]


@pytest.mark.slow
def test_a_split_twin_exports_its_forward_and_every_combine(tmp_path):
    """The split forward and one combine per (query heads, split bucket) the runtime may pick:
    vllm_copy.COMBINE_KV_HEADS x the ratio, vllm_copy.COMBINE_SPLITS."""
    from fa4aot.fa4 import vllm_copy

    row = _run("--compile", tmp_path, "fp8_p64_split_tp8")["fp8_p64_split_tp8"]
    parts = row["parts"]
    assert parts["fwd"]["split_kv"] and parts["fwd"]["fa4_abi"] == "vllm"
    want = {vllm_copy.combine_part(4 * hk, n)
            for hk in vllm_copy.COMBINE_KV_HEADS for n in vllm_copy.COMBINE_SPLITS}
    assert set(parts) == {"fwd"} | want
    for name in want:
        p = parts[name]
        assert name == vllm_copy.combine_part(p["num_head"], p["max_splits"])
        assert p["partial_dtype"] == "float32" and p["bytes"] > 20_000
        assert (tmp_path / "fp8_p64_split_tp8" / f"{name}.o").is_file()
