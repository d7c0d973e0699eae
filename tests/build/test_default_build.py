"""The README's build (`fa4aot build --cache cache`, all default specs) checked as a whole.

CI runs that build before the tests (.ci/run); elsewhere these tests skip until it has run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from fa4aot.model import constraints as C
from fa4aot.cli import main
from fa4aot.store.layers import stores_at
from fa4aot.store.toolchain import build_toolchain

CACHE = Path(__file__).resolve().parents[2] / "cache"


def _store():
    tc = build_toolchain("sm90", 132)
    for s in stores_at(CACHE):
        if s.toolchain == tc:
            return s
    pytest.skip(
        f"no default build in {CACHE} for this toolchain: run the README's build command first"
    )


def test_default_build_covers_every_default_spec():
    """coverage (with FA4's real compile keys traced) finds every variant of every default spec;
    the unsupported layers on sm90 are gemma-4's hd512 one and the two MLA specs' (sm100-only
    kernels), accepted explicitly: without --allow-unsupported they fail the check."""
    _store()
    r = CliRunner().invoke(main, ["coverage", "--cache", str(CACHE), "--json"])
    assert r.exit_code == 1 and json.loads(r.stdout)["counts"]["unsupported"] == 3
    args = ["coverage", "--cache", str(CACHE), "--allow-unsupported", "--json"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output[-2000:]
    doc = json.loads(r.stdout)
    assert doc["counts"]["missing"] == 0 and doc["counts"]["padding"] == 0
    assert doc["counts"]["hit"] >= 109
    unsupported = [(u["spec"], u["layer"]) for u in doc["rows"] if u["status"] == "unsupported"]
    assert sorted(unsupported) == [("deepseek-v3", "mla"), ("gemma-4", "full"),
                                   ("glm-4.7-flash", "mla")]


def test_default_build_verifies_and_is_a_noop_second_time():
    s = _store()
    r = CliRunner().invoke(main, ["verify", "--cache", str(CACHE), "--json"])
    assert r.exit_code == 0, r.output[-2000:]
    before = {p: p.stat().st_mtime_ns for p in s.dir.rglob("*") if p.is_file()}
    r = CliRunner().invoke(main, ["build", "--cache", str(CACHE), "--json"])
    assert r.exit_code == 0, r.output[-2000:]
    doc = json.loads(r.output)
    assert (
        doc["counts"]["built"] == 0
        and doc["counts"]["failed"] == 0
        and doc["counts"]["cached"] == 154
    )
    after = {p: p.stat().st_mtime_ns for p in s.dir.rglob("*") if p.is_file()}
    assert before == after, "a no-op build wrote into the store"


def test_default_build_block_sizes():
    """The KV block-size contract from the real store: TMA page == tile_n, any other size served."""
    import fa4aot

    _store()
    bs = fa4aot.supported_block_sizes("sm90", "bfloat16", 128, qhead_per_kvhead=4, cache=CACHE)
    assert bs.tma == (128,) and bs.any_size
    assert (
        fa4aot.preferred_block_size(
            "sm90", "bfloat16", 256, qhead_per_kvhead=2, window=1024, cache=CACHE
        )
        == 64
    )
    assert (
        fa4aot.preferred_block_size(
            "sm90",
            "bfloat16",
            64,
            qhead_per_kvhead=8,
            window=128,
            sink_dtype="float32",
            cache=CACHE,
        )
        == 128
    )


def test_default_split_kernels_merge_with_fa4aots_merge_kernel():
    """Every split chunk kernel of the default build carries fa4aot's merge kernel (part
    `merge`, kernels.trace_merge), exported under its entry point, and not FA4's combine; and
    the chunk metadata kernel of its K form (kernels.trace_chunk_meta)."""
    from fa4aot.model.variants import Variant

    s = _store()
    n = 0
    for d in (s.dir / "artifacts").iterdir():
        rec = json.loads((d / "record.json").read_text())
        if not Variant.from_dict(rec["variant"]).split_kernel:
            continue
        n += 1
        parts = rec["parts"]
        assert "combine" not in parts and parts["merge"]["max_splits"] == 128, d.name
        assert parts["fwd"]["q_broadcast"] is True, d.name
        assert parts["fwd"].get("chunk_lengths", False) is rec["variant"]["paged"], d.name
        assert ("fwd_bounds" in parts) is (not rec["variant"]["paged"]), d.name
        assert parts.get("fwd_bounds", {}).get("rows") == (
            None if rec["variant"]["paged"] else C.BOUNDS_FORM), d.name
        assert parts["merge"]["partial_dtype"] == rec["variant"]["dtype"]
        assert b"fa4aot_merge" in (d / parts["merge"]["file"]).read_bytes()
        form = "lengths" if rec["variant"]["paged"] else "bounds"
        assert parts["chunk_meta"]["form"] == form, d.name
        assert b"fa4aot_chunk_meta" in (d / parts["chunk_meta"]["file"]).read_bytes()
        # the wide split kernel at hd128, packed or paged K (constraints.wide_split)
        v = Variant.from_dict(rec["variant"])
        if (v.head_dim, v.head_dim_v, v.tile_m) == (128, 128, 64):
            assert parts["fwd_wide_split"]["ctas_per_sm"] == 2, d.name
            assert parts["fwd_wide_split"]["q_broadcast"] is True, d.name
        # a paged K's packed-rows metadata kernel (kernels.trace_packed_meta)
        assert ("packed_meta" in parts) is rec["variant"]["paged"], d.name
        if rec["variant"]["paged"]:
            assert parts["packed_meta"]["version"] == 1
            assert b"fa4aot_packed_meta" in (d / parts["packed_meta"]["file"]).read_bytes()
    assert n >= 6
