"""Sharded builds (`fa4aot build --shard I/N`) and `fa4aot merge`: partitions are disjoint,
complete, balanced and stable; shards' stores merge into what one unsharded build makes; a
conflict or a corrupt entry refuses the merge and writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from stub_store import artifact_dirs, build_stub, cli, reseal, write_spec

from fa4aot.cli import main
from fa4aot.errors import MergeConflict
from fa4aot.store.merge import merge, parse_shard, shard
from fa4aot.store.layers import stores_at, verify_root

N_TINY = 8


def _dry_run_ids(*args: str) -> list[str]:
    r = CliRunner().invoke(main, ["build", "--dry-run", "--json", *args])
    assert r.exit_code == 0, r.output
    return [row["id"] for row in json.loads(r.stdout)["rows"]]


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_shards_of_the_default_plan_partition_it(n):
    everything = _dry_run_ids()
    assert len(everything) == 154
    parts = [_dry_run_ids("--shard", f"{i}/{n}") for i in range(n)]
    seen = [vid for p in parts for vid in p]
    assert len(seen) == len(set(seen)), "shards overlap"
    assert set(seen) == set(everything), "shards do not cover the plan"
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1, sizes
    assert parts == [_dry_run_ids("--shard", f"{i}/{n}") for i in range(n)], "not stable"


def test_shard_depends_only_on_the_id_set():
    ids = [f"{i:016x}" for i in range(50)]
    assert shard(ids, 1, 4) == shard(list(reversed(ids)), 1, 4)
    assert shard(ids, 0, 1) == sorted(ids)


@pytest.mark.parametrize("bad", ["3/3", "-1/2", "1/0", "a/b", "1", "1/2/3"])
def test_bad_shard_is_a_usage_error(bad):
    with pytest.raises(ValueError, match="I/N"):
        parse_shard(bad)
    r = CliRunner().invoke(main, ["build", "--dry-run", "--shard", bad])
    assert r.exit_code == 2 and "--shard" in r.output, r.output


@pytest.fixture
def shards(tmp_path, monkeypatch):
    spec = write_spec(tmp_path)
    roots = []
    for i in range(3):
        root = tmp_path / f"shard{i}"
        _, results = build_stub(root, spec, monkeypatch, shard=(i, 3))
        assert len(results) in (2, 3)
        roots.append(root)
    whole, _ = build_stub(tmp_path / "whole", spec, monkeypatch)
    return roots, whole


def _ids(root: Path) -> set[str]:
    return {r["id"] for r in verify_root(root) if r["status"] == "ok"}


def test_merged_shards_equal_one_build(shards, tmp_path):
    roots, whole = shards
    assert sum(len(_ids(r)) for r in roots) == N_TINY
    res = merge(roots, tmp_path / "dest")
    assert {r["status"] for r in res.rows} == {"added"} and len(res.rows) == N_TINY
    assert _ids(tmp_path / "dest") == _ids(whole.root)
    assert all(r["status"] == "ok" for r in verify_root(tmp_path / "dest"))
    (dest,) = stores_at(tmp_path / "dest")
    assert dest.dir.name == whole.dir.name
    # every shard wrote the whole spec index; the merged one is the unsharded build's
    assert dest.spec_index("tiny").read_bytes() == whole.spec_index("tiny").read_bytes()
    # merging again adds nothing
    again = merge(roots, tmp_path / "dest")
    assert {r["status"] for r in again.rows} == {"present"}


def test_merge_cli_json(shards, tmp_path):
    roots, _ = shards
    r = cli("merge", *map(str, roots), "--cache", str(tmp_path / "dest"), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["counts"] == {"added": N_TINY, "replaced": 0, "present": 0}
    assert [s["spec"] for s in doc["specs"]] == ["tiny"]


def _snapshot(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def test_conflicting_records_refuse_the_merge(shards, tmp_path):
    roots, whole = shards
    victim = artifact_dirs(stores_at(roots[0])[0])[0]
    reseal(victim, fa4_key="another kernel")
    # the same id, built unsharded, says the kernel is something else
    with pytest.raises(MergeConflict, match=f"conflict: .*/{victim.name} differs"):
        merge([roots[0], whole.root], tmp_path / "dest")
    assert _snapshot(tmp_path / "dest") == []
    r = cli("merge", str(roots[0]), str(whole.root), "--cache", str(tmp_path / "dest"))
    assert r.returncode == 1 and "nothing written" in r.stderr


def test_conflict_with_the_destination(shards, tmp_path):
    roots, whole = shards
    merge(roots, tmp_path / "dest")
    victim = artifact_dirs(stores_at(tmp_path / "dest")[0])[0]
    reseal(victim, fa4_key="another kernel")
    before = _snapshot(tmp_path / "dest")
    with pytest.raises(MergeConflict, match="in .*dest differs"):
        merge([whole.root], tmp_path / "dest")
    assert _snapshot(tmp_path / "dest") == before


def test_conflicting_spec_indexes_refuse_the_merge(shards, tmp_path):
    roots, _ = shards
    index = stores_at(roots[1])[0].spec_index("tiny")
    doc = json.loads(index.read_text())
    doc["spec"]["serving"]["max_batch"] = 1234
    index.write_text(json.dumps(doc))
    with pytest.raises(MergeConflict, match="spec 'tiny'"):
        merge(roots, tmp_path / "dest")
    assert _snapshot(tmp_path / "dest") == []


def test_corrupt_source_refuses_the_merge(shards, tmp_path):
    roots, _ = shards
    victim = artifact_dirs(stores_at(roots[2])[0])[0]
    part = victim / "fwd.so"
    data = bytearray(part.read_bytes())
    data[100] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(MergeConflict, match=f"{victim.name}.*sha256"):
        merge(roots, tmp_path / "dest")
    assert _snapshot(tmp_path / "dest") == []


def test_merge_refuses_bad_sources(tmp_path, shards):
    roots, _ = shards
    with pytest.raises(MergeConflict, match="not a directory"):
        merge([tmp_path / "nope"], tmp_path / "dest")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MergeConflict, match="holds no store"):
        merge([tmp_path / "empty"], tmp_path / "dest")
    with pytest.raises(MergeConflict, match="both a source and the destination"):
        merge([roots[0]], roots[0])
