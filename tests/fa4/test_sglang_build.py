"""`fa4aot build --fa4 <SGLang's copy>` (CPU): what it plans, and (slow) a real cross-compile of a
llama-style spec (hd128, 32:8 GQA, varlen and paged at a TMA page and a cp.async page, decode
at batches 1 and > 256) into a store, read back as the runtime reads it.

The copy comes from the released wheel (tests/fa4_copies.py). Checked: each artifact's single
part is the copy's forward (`fa4_abi` "sglang", no helper kernels: the copy has none), its key
read by field name is the canonical form of the variant it is stored under
(sglang_copy.canonical), variants of one canonical form hold the same kernel; the toolchain
names the source; FA4AOT_KERNEL_SOURCE=sglang serves the store, whose every artifact the
runtime loads and binds to the copy's 17-slot launcher with no compiler imported; `explain
--fa4` finds them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fa4_copies import engine_root
from fa4aot.build.builder import plan_for
from fa4aot.model.specs import load_default, parse_spec

ROOT = Path(__file__).resolve().parents[2]
CUTE = ("kernels", "ops", "attention", "flash_attn", "cute")

LLAMA = """
name = "llama-sg"
model = "test/llama-style"
[[attention]]
name = "full"
num_q_heads = 32
num_kv_heads = 8
head_dim = 128
causal = true
[serving]
tp = [1]
layouts = ["varlen", "paged"]
phases = ["decode"]
page_sizes = [16, 128]
max_batch = 512
speculative = 1
"""

SINKS = """
name = "sinks-sg"
model = "test/gpt-oss-style"
[[attention]]
name = "bf16"
num_q_heads = 64
num_kv_heads = 8
head_dim = 64
sinks = true
sink_dtype = "bfloat16"
window = 128
[[attention]]
name = "fp32"
num_q_heads = 64
num_kv_heads = 8
head_dim = 64
sinks = true
[serving]
tp = [1]
layouts = ["paged"]
page_sizes = [128]
max_batch = 8
"""


def test_plan_from_sglang_plain_forwards_its_sinks_and_head_dims():
    plan = plan_for([parse_spec(SINKS)], "sm90", fa4="sglang")
    why = {u.layer: u.reason for u in plan.unsupported}
    assert list(why) == ["fp32"] and "bfloat16 sinks only" in why["fp32"]
    assert {n.variant.sink_dtype for n in plan.needs} == {"bfloat16"}
    # upstream takes both sink dtypes
    up = plan_for([parse_spec(SINKS)], "sm90")
    assert {"bfloat16", "float32"} <= {n.variant.sink_dtype for n in up.needs}
    # plain forwards only (no fold or split kernels: they patch upstream's internals)
    llama = plan_for([load_default("llama-3.1-8b")], "sm90", fa4="sglang")
    vs = [n.variant for n in llama.needs]
    assert vs and not any(v.tile_m or v.split_kv or v.split_kernel for v in vs)
    assert llama.unsupported == []
    gemma = plan_for([load_default("gemma-4")], "sm90", fa4="sglang")
    assert [u.layer for u in gemma.unsupported] == ["full"]  # hd512: not built from SGLang's
    assert all(n.variant.kv_dtype is None for n in gemma.needs)  # no FP8-KV dequant there


@pytest.fixture
def stub_build(tmp_path, monkeypatch, knobs):
    """build(LLAMA) from SGLang's copy with the stub compiler into tmp_path -> (results, the
    store, the variant ids compiled); call it again to rebuild."""
    from fa4aot.build import builder

    knobs(stub_compiler="1")
    compiled: list[str] = []
    stub = builder._compile_stub

    def compile_stub(call, variant, workdir):
        compiled.append(variant.id)
        return stub(call, variant, workdir)

    monkeypatch.setattr(builder, "_compile_stub", compile_stub)
    cute = engine_root("sglang").joinpath(*CUTE)

    def run():
        store, _, res = builder.build([parse_spec(LLAMA)], arch="sm90", root=tmp_path,
                                      fa4=str(cute), jobs=1)
        return {r.id: r for r in res}, store, compiled

    return run


def _records(store) -> dict:
    return {p.parent.name: json.loads(p.read_text())
            for p in store.dir.glob("artifacts/*/record.json")}


def test_one_kernel_of_several_variants_is_compiled_once(stub_build):
    """SGLang's copy compiles one kernel for the variants of one canonical form (here batch <= 256
    and > 256 of each of varlen, paged TMA, paged cp.async): the builder compiles it once and
    stores a copy under each variant's id, recording which artifact it copies."""
    from fa4aot.fa4.sglang_copy import kernel_id
    from fa4aot.model.variants import Variant

    res, store, compiled = stub_build()
    assert len(res) == 6 and {r.status for r in res.values()} == {"built"}
    recs = _records(store)
    kernels = {vid: kernel_id(Variant.from_dict(r["variant"])) for vid, r in recs.items()}
    # each kernel compiled once
    assert sorted(kernels[v] for v in compiled) == sorted(set(kernels.values()))
    assert len(compiled) == 3
    for vid, rec in recs.items():
        lead = rec.get("same_kernel_as")
        assert (lead is None) == (vid in compiled)
        if lead:
            assert kernels[lead] == kernels[vid] and recs[lead].get("same_kernel_as") is None
            assert rec["parts"]["fwd"]["sha256"] == recs[lead]["parts"]["fwd"]["sha256"]
            assert rec["fa4_key"] == recs[lead]["fa4_key"] and rec["compile_seconds"] == 0.0
        assert store.get(vid) is not None  # each one a whole, verified artifact


def test_a_missing_variant_copies_the_kernel_the_store_holds(stub_build):
    import shutil

    res, store, compiled = stub_build()
    copied = [vid for vid, r in _records(store).items() if r.get("same_kernel_as")]
    lead = _records(store)[copied[0]]["same_kernel_as"]
    shutil.rmtree(store.artifact_dir(copied[0]))
    n = len(compiled)
    res, store, compiled = stub_build()
    assert res[copied[0]].status == "built" and len(compiled) == n  # nothing compiled
    assert _records(store)[copied[0]]["same_kernel_as"] == lead


def test_a_failed_kernel_fails_each_variant_of_it(stub_build, monkeypatch):
    from fa4aot.build import builder

    def broken(call, variant, workdir):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(builder, "_compile_stub", broken)
    res, store, _ = stub_build()
    assert {r.status for r in res.values()} == {"failed"}
    copies = [r for r in res.values() if "which was not built" in r.error]
    assert len(copies) == 3 and all("no kernel" not in r.error for r in copies)
    assert not _records(store)


def _cli(*args, env=None, timeout=900):
    e = {**os.environ, "FA4AOT_PROGRESS": "0", **(env or {}),
         "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "fa4aot", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, env=e, timeout=timeout)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sglang-store")
    spec = tmp / "llama-sg.toml"
    spec.write_text(LLAMA)
    cute = engine_root("sglang").joinpath(*CUTE)
    r = _cli("build", "--arch", "sm90", "--spec", spec, "--fa4", cute, "--cache", tmp / "s",
             "-j", "2", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "s", json.loads(r.stdout), cute


@pytest.mark.slow
def test_records_hold_the_copys_forward_under_each_variant(built):
    from fa4aot.fa4 import sglang_copy  # (reads keys by name; imports no compiler)
    from fa4aot.model.abis import SGLANG_FWD_KEY
    from fa4aot.model.variants import Variant

    root, doc, _ = built
    assert doc["counts"]["built"] == 6 and not doc["counts"]["failed"]
    (store,) = [Path(s) for s in doc["stores"]]
    tc = json.loads((store / "toolchain.json").read_text())
    assert tc["fa4_abi"] == "sglang" and tc["fa4"] == "sglang 0.5.23"
    assert tc["fa4_source"]["prefix"] == "sglang.kernels.ops.attention.flash_attn.cute"
    by_canonical: dict = {}
    copies = 0
    for rec_path in sorted(store.glob("artifacts/*/record.json")):
        rec = json.loads(rec_path.read_text())
        v = Variant.from_dict(rec["variant"])
        assert list(rec["parts"]) == ["fwd"], v.describe()  # no helper kernels, even b > 256
        fwd = rec["parts"]["fwd"]
        assert fwd["fa4_abi"] == "sglang" and not fwd["split_kv"]
        assert (fwd["tile_m"], fwd["tile_n"]) == (128, 128) and fwd["size"] > 50_000
        f = dict(zip(SGLANG_FWD_KEY, fwd["key"].strip("()").split(", ")))
        assert f["page_table is not None"] == str(v.paged)
        if v.paged:
            assert f["page_size not in [None, tile_n]"] == str(not v.paged_tma)
        # (the build compared the whole key with canonical(v): sglang_copy.compile_variant)
        by_canonical.setdefault(sglang_copy.canonical(v), set()).add(fwd["sha256"])
        copies += bool(rec.get("same_kernel_as"))
    # three kernels (varlen, paged TMA, paged cp.async), each under its batch<=256 and >256 ids,
    # compiled once each
    assert len(by_canonical) == 3 and all(len(s) == 1 for s in by_canonical.values())
    assert copies == 3


@pytest.mark.slow
def test_the_runtime_serves_it_without_a_compiler(built):
    root, _, cute = built
    code = """
import json, sys
from pathlib import Path
from fa4aot.model.variants import Variant
from fa4aot.runtime import launch as L, reset
rt = reset()
out = []
for p in sorted(Path(sys.argv[1]).glob("v1/*/artifacts/*/record.json")):
    v = Variant.from_dict(json.loads(p.read_text())["variant"])
    plan = rt.plan(v, 132)
    out.append(plan and [v.id, plan.abi is L.SM90_SGLANG, plan.tile is None,
                         type(plan.fwd).__name__])
print(json.dumps({"plans": out, "abi": rt.fa4_abi("sm90", 132),
                  "imported": sorted(m for m in sys.modules if m.split(".")[0] in
                                     ("cutlass", "flash_attn", "sglang"))}))
"""
    env = {**os.environ, "FA4AOT_CACHE_DIR": str(root), "FA4AOT_KERNEL_SOURCE": "sglang",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["abi"] == "sglang" and got["imported"] == []
    assert len(got["plans"]) == 6 and all(p[1:] == [True, True, "Function"] for p in got["plans"])
    # upstream's runtime refuses a store built from SGLang's copy, by name
    r = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True,
                       env={**env, "FA4AOT_KERNEL_SOURCE": "upstream"}, cwd=ROOT, timeout=300)
    assert r.returncode and "FingerprintMismatch" in r.stderr
    assert "fa4_abi: store has 'sglang', this process needs 'upstream'" in r.stderr


@pytest.mark.slow
def test_explain_fa4_finds_the_stores_kernels(built):
    root, _, cute = built
    call = ["explain", "--heads", "32:8", "--head-dim", "128", "--layout", "paged",
            "--page-size", "16", "--batch", "300", "--cache", root, "--json"]
    for fa4 in ("sglang", cute):  # a name, or the copy's path (its ABI read from it)
        r = _cli(*call, "--fa4", fa4)
        assert r.returncode == 0, r.stdout + r.stderr
        doc = json.loads(r.stdout)
        assert doc["fa4"] == "sglang" and doc["choices"][0]["exact"]
    r = _cli(*call, "--fa4", "upstream")
    assert r.returncode == 1 and json.loads(r.stdout)["choices"] == []
