"""`fa4aot prune` (plans, then deletes only what the plan says) and `fa4aot doctor`."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from stub_store import artifact_dirs, build_stub, cli, stub_env, write_spec

from fa4aot.store import prune as P
from fa4aot.store.layers import stores_at, verify_root

N_TINY = 8


@pytest.fixture
def root(tmp_path, monkeypatch):
    spec = write_spec(tmp_path)
    store, _ = build_stub(tmp_path / "root", spec, monkeypatch)
    # a store of another toolchain (tvm-ffi of another ABI series) next to it
    import fa4aot.build.builder as B

    real = B.build_toolchain
    monkeypatch.setattr(B, "build_toolchain", lambda *a, **k: dict(real(*a, **k), tvm_ffi="0.2.0"))
    old, _ = build_stub(tmp_path / "root", spec, monkeypatch)
    monkeypatch.setattr(B, "build_toolchain", real)
    assert old.dir != store.dir
    return tmp_path / "root", store, old


def test_parse_size():
    assert P.parse_size("2G") == 2 << 30
    assert P.parse_size("500M") == 500 << 20
    assert P.parse_size("1.5GiB") == int(1.5 * (1 << 30))
    assert P.parse_size("123") == 123
    for bad in ("", "G", "2X", "-1G", "two"):
        with pytest.raises(ValueError, match="expected a size"):
            P.parse_size(bad)


def test_clean_store_plans_nothing(root):
    r, store, _ = root
    assert P.plan(r) == []


def test_keep_current_removes_other_toolchains(root):
    r, store, old = root
    actions = P.plan(r, keep=["CURRENT"])
    assert [(a.kind, a.path) for a in actions] == [("store", str(old.dir))]
    assert "tvm_ffi=0.2.0" in actions[0].reason and actions[0].bytes > 0
    rows = P.execute(r, actions)
    assert [x["status"] for x in rows] == ["removed"]
    assert [s.dir for s in stores_at(r)] == [store.dir]
    assert len(list(store.iter_artifacts())) == N_TINY
    # a fingerprint directory name keeps exactly that store
    assert P.plan(r, keep=[store.dir.name]) == []
    assert [a.path for a in P.plan(r, keep=["sm90-0sm-py00-000000000000"])] == [str(store.dir)]


def test_leftovers_are_planned_and_removed(root):
    r, store, _ = root
    arts = artifact_dirs(store)
    # quarantined entry, dead builder's scratch, live builder's scratch, record-less dir, corrupt
    q = store.dir / "quarantine" / "x.1.host~1~"
    q.mkdir(parents=True)
    (q / "fwd.so").write_bytes(b"x" * 10)
    dead = store.dir / "tmp" / "abc.nohost~99999999~"
    dead.mkdir(parents=True)
    os.utime(dead, (time.time() - 2 * 86400,) * 2)
    live = store.dir / "tmp" / f"abc.{P.owner_tag()}"
    live.mkdir()
    incomplete = store.dir / "artifacts" / "00000000deadbeef"
    incomplete.mkdir()
    (incomplete / "fwd.so").write_bytes(b"half")
    (arts[0] / "fwd.so").write_bytes(b"flipped")
    plan = P.plan(r)
    kinds = {a.kind: a.path for a in plan}
    assert kinds == {
        "quarantine": str(q),
        "scratch": str(dead),
        "incomplete": str(incomplete),
        "corrupt": str(arts[0]),
    }
    rows = P.execute(r, plan)
    assert {x["status"] for x in rows} == {"removed"}
    assert live.exists(), "a live builder's scratch was removed"
    assert not any(p.exists() for p in (q, dead, incomplete, arts[0]))
    assert {x["status"] for x in verify_root(r)} == {"ok"}
    assert len(verify_root(r)) == N_TINY * 2 - 1


def test_max_size_evicts_unnamed_then_least_recently_used(root):
    r, store, old = root
    P.execute(r, P.plan(r, keep=["CURRENT"]))
    arts = artifact_dirs(store)
    size = sum(P._du(a) for a in arts)
    # one artifact no spec names; the others used at increasing times
    index = store.spec_index("tiny")
    doc = json.loads(index.read_text())
    doc["variants"].remove(arts[5].name)
    index.write_text(json.dumps(doc))
    for i, a in enumerate(arts):
        for f in a.iterdir():
            os.utime(f, (1_000_000 + i, 1_000_000 + i))
    # fa4aot's own reads (a dry run's checksums, doctor's verify) are not uses: before reads
    # skipped O_NOATIME, they moved every access time to "now" and the order came from read order
    P.plan(r, max_bytes=0)
    verify_root(r)
    assert [max(f.stat().st_atime for f in a.iterdir()) for a in arts] == [
        1_000_000 + i for i in range(len(arts))
    ]
    # exactly what evicting those two frees: artifact sizes differ by a few bytes (record
    # lengths), so an average per-artifact size can make a third eviction necessary
    plan = P.plan(r, max_bytes=size - P._du(arts[5]) - P._du(arts[0]))
    assert [Path(a.path).name for a in plan] == [arts[5].name, arts[0].name]
    assert all(a.kind == "evict" for a in plan)
    assert "no spec names it" in plan[0].reason
    P.execute(r, plan)
    assert {d.name for d in artifact_dirs(store)} == {a.name for a in arts} - {
        arts[5].name,
        arts[0].name,
    }
    assert P.plan(r, max_bytes=size) == []


def test_own_reads_leave_access_times_alone(tmp_path):
    from fa4aot.store.files import read_quietly, sha256_file

    f = tmp_path / "part"
    f.write_bytes(b"x" * 4096)
    os.utime(f, (1_000_000, 1_000_000))  # old and not after mtime: relatime updates it too
    f.read_bytes()
    if f.stat().st_atime == 1_000_000:
        pytest.skip("this filesystem does not record access times (noatime)")
    os.utime(f, (1_000_000, 1_000_000))
    assert read_quietly(f) == b"x" * 4096 and len(sha256_file(f)) == 64
    assert f.stat().st_atime == 1_000_000


def test_prune_cli_dry_run_then_run(root):
    r, store, old = root
    args = ["prune", "--cache", str(r), "--keep-fingerprint", "CURRENT", "--json"]
    dry = cli(*args, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    doc = json.loads(dry.stdout)
    assert doc["executed"] is False and [x["path"] for x in doc["rows"]] == [str(old.dir)]
    assert old.dir.exists(), "--dry-run deleted something"
    run = cli(*args)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["rows"][0]["status"] == "removed"
    assert not old.dir.exists() and store.dir.exists()
    text = cli("prune", "--cache", str(r), "--max-size", "1")
    assert text.returncode == 0 and "removed 8 entries" in text.stdout, text.stdout
    bad = cli("prune", "--cache", str(r), "--max-size", "lots")
    assert bad.returncode == 2 and "--max-size" in bad.stderr


def test_doctor_reports_layers_and_compatibility(root, tmp_path):
    r, store, old = root
    env = stub_env(FA4AOT_CACHE_DIR=f"{r}{os.pathsep}{tmp_path / 'absent'}")
    res = cli("doctor", "--json", env=env)
    doc = json.loads(res.stdout)
    assert doc["gpu"] is None and doc["serving"] is None  # no GPU here (CI)
    assert doc["versions"]["fa4aot"] and doc["versions"]["torch"]
    assert [layer["root"] for layer in doc["layers"]][:2] == [str(r), str(tmp_path / "absent")]
    by_dir = {s["dir"]: s for s in doc["layers"][0]["stores"]}
    assert by_dir[store.dir.name]["compatible"] is True
    assert by_dir[store.dir.name]["artifacts"] == N_TINY
    assert by_dir[old.dir.name]["compatible"] is False
    assert any("tvm_ffi" in m for m in by_dir[old.dir.name]["mismatches"])
    assert doc["layers"][1]["exists"] is False
    assert res.returncode == (1 if doc["problems"] else 0)
    text = cli("doctor", env=env)
    assert "store layers (lookup order):" in text.stdout and store.dir.name in text.stdout


def test_doctor_counts_superseded_split_kernels(root, monkeypatch, capsys):
    """Split kernels an earlier fa4aot built (build.superseded) are counted per store and named
    in the text report, with what replaces them; they are not problems (they serve)."""
    import fa4aot.build.builder as B
    from fa4aot.store import doctor
    from fa4aot.store.layers import Layer

    r, store, old = root
    some = {a.id for _, a in list(store.iter_artifacts())[:2]}
    monkeypatch.setattr(B, "superseded", lambda art: art.id in some)
    doc = doctor.report([Layer(r, "test")])
    by_dir = {s["dir"]: s for s in doc["layers"][0]["stores"]}
    assert by_dir[store.dir.name]["superseded"] == 2
    text = doctor.format_text(doc)
    assert "note: 2 split kernels built by an earlier fa4aot" in text and "`fa4aot build`" in text
    assert not any("superseded" in p or "earlier fa4aot" in p for p in doc["problems"])


def test_doctor_names_a_missing_runtime_library(tmp_path):
    env = stub_env(FA4AOT_RUNTIME_LIB=str(tmp_path / "nope.so"), FA4AOT_CACHE_DIR=str(tmp_path))
    res = cli("doctor", "--json", env=env)
    assert res.returncode == 1
    assert any("FA4AOT_RUNTIME_LIB" in p for p in json.loads(res.stdout)["problems"])
