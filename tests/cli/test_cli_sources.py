"""`coverage` and `doctor` see stores built from an engine's FA4 copy (`fa4aot build --fa4
vllm`) and name their source: coverage checks them under --fa4 or FA4AOT_KERNEL_SOURCE, against
what that copy runs (hd512, its split forward), and says how to reach them when another source
is asked for. Stub-built stores (resealed as real kernels: coverage skips stubs), CliRunner."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from fa4_copies import engine_root
from stub_store import artifact_dirs, reseal

from fa4aot import settings
from fa4aot.cli import common, main
from fa4aot.store.layers import scan_root

SPEC = """
name = "gemma-4-paged"
model = "google/gemma-4"
[[attention]]
name = "sliding"
num_q_heads = 32
num_kv_heads = 16
head_dim = 256
window = 1024
[[attention]]
name = "full"
num_q_heads = 32
num_kv_heads = 4
head_dim = 512
[serving]
tp = [1]
layouts = ["paged"]
page_sizes = [64]
max_batch = 8
"""


@pytest.fixture
def run(run):
    """run(*args, source=...) -> (result, its --json output), under that kernel source."""

    def invoke(*args, source="upstream"):
        r = run(*args, "--json", kernel_source=source)
        return r, json.loads(r.stdout)

    return invoke


@pytest.fixture
def stores(run, tmp_path):
    """One root holding the spec built from vLLM's copy and from upstream."""
    spec = tmp_path / "g.toml"
    spec.write_text(SPEC)
    root = tmp_path / "c"
    vllm = str(engine_root("vllm") / "vllm_flash_attn" / "cute")
    for fa4 in (vllm, "upstream"):
        r, _ = run("build", "--spec", str(spec), "--cache", str(root), "--fa4", fa4)
        assert r.exit_code == 0, r.output
    for s in scan_root(root)[0]:
        for d in artifact_dirs(s):
            reseal(d, stub=False)
    return root, spec, vllm


def test_coverage_checks_the_vllm_store_by_fa4_or_kernel_source(run, stores):
    root, spec, vllm = stores
    for args, source in (((), "vllm"), (("--fa4", "vllm"), "upstream"), (("--fa4", vllm), "auto")):
        r, doc = run("coverage", "--spec", str(spec), "--cache", str(root), *args, source=source)
        assert r.exit_code == 0, r.output
        assert doc["fa4"] == "vllm" and doc["fa4_sources"] == ["vllm 0.33.0 (f3bcc631ba55)"]
        assert len(doc["stores"]) == 1 and doc["counts"]["unsupported"] == 0
        # every kernel the copy runs, hd512 and its split forward included, is a hit
        assert {r["status"] for r in doc["rows"]} == {"hit"}
        assert any("hd512" in r["variant"] and "split-kv" in r["variant"] for r in doc["rows"])
        assert {r["layer"] for r in doc["rows"]} == {"sliding", "full"}


def test_coverage_of_upstream_refuses_hd512_and_names_the_vllm_store(run, stores):
    root, spec, _ = stores
    # (--no-trace: a stub build holds no FA4 compile keys)
    r, doc = run("coverage", "--spec", str(spec), "--cache", str(root), "--fa4", "upstream",
                 "--no-trace")
    assert r.exit_code == 1 and doc["fa4"] == "upstream"
    status = {(row["layer"], row["status"]) for row in doc["rows"]}
    assert status == {("sliding", "hit"), ("full", "unsupported")}
    assert all("--fa4 vllm" in row["detail"] for row in doc["rows"] if row["layer"] == "full")


def test_no_store_of_the_source_names_the_others_and_how_to_check_them(run, stores, tmp_path):
    root, spec, _ = stores
    only = tmp_path / "only-vllm"
    (only / "v1").mkdir(parents=True)
    for s in scan_root(root)[0]:
        if s.toolchain["fa4_abi"] == "vllm":
            s.dir.rename(only / "v1" / s.dir.name)
    for fa4 in ("upstream", "sglang"):
        r, doc = run("coverage", "--spec", str(spec), "--cache", str(only), "--fa4", fa4)
        assert r.exit_code == 1
        assert "FA4 vllm 0.33.0 (f3bcc631ba55)" in doc["error"]
        assert "--fa4 vllm or FA4AOT_KERNEL_SOURCE=vllm" in doc["error"]
    assert "from sglang's FA4 copy" in doc["error"] and "--fa4 sglang" in doc["error"]


def test_coverage_refuses_two_sources_at_once(run, stores, monkeypatch):
    """auto where flash-attn-4 is not installed matches every source, as the runtime does:
    coverage asks for one instead of mixing two sources' kernels."""
    root, spec, _ = stores
    tc = common.build_toolchain

    def no_fa4(*a, **kw):
        return {**tc(*a, **kw), "fa4": None}

    monkeypatch.setattr(common, "build_toolchain", no_fa4)
    r, doc = run("coverage", "--spec", str(spec), "--cache", str(root), source="auto")
    assert r.exit_code == 2 and "several FA4 sources match (upstream, vllm)" in doc["error"]


def test_doctor_names_each_stores_source_and_the_one_served(run, stores):
    root, _, _ = stores
    for served in ("vllm", "upstream"):
        r, doc = run("doctor", "--cache", str(root), source=served)
        assert r.exit_code == 0, r.output
        assert doc["kernel_source"] == served
        rows = {s["fa4_abi"]: s for s in doc["layers"][0]["stores"]}
        assert sorted(rows) == ["upstream", "vllm"]
        assert rows["vllm"]["fa4_source"] == "vllm 0.33.0 (f3bcc631ba55)"
        assert [a for a, s in rows.items() if s["compatible"]] == [served]
    with settings.scope(kernel_source="upstream", cache_dir=str(root)):
        text = CliRunner().invoke(main, ["doctor", "--cache", str(root)]).stdout
    assert "FA4 source served:    upstream" in text
    assert "FA4 vllm 0.33.0 (f3bcc631ba55), incompatible" in text
    assert "(served with FA4AOT_KERNEL_SOURCE=vllm)" in text
