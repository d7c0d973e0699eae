"""`fa4aot pack` / `fa4aot unpack`: a round trip, and archives as untrusted input (every hostile
member rejected, nothing written outside the staging area, nothing published unless all of the
archive passes its checks)."""

from __future__ import annotations

import io
import json
import os
import tarfile
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stub_store import artifact_dirs, build_stub, cli, stub_env, write_spec

from fa4aot.store import archive as A
from fa4aot.errors import BuildError, UnsafeArchive
from fa4aot.store.layers import stores_at, verify_root
from fa4aot.store.records import RECORD

N_TINY = 8


@pytest.fixture
def built(tmp_path, monkeypatch):
    store, _ = build_stub(tmp_path / "src", write_spec(tmp_path), monkeypatch)
    return store


@pytest.fixture
def packed(tmp_path, built):
    out = tmp_path / "store.tar.gz"
    r = cli("pack", str(out), "--cache", str(built.root), "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["rows"]) == N_TINY
    return out


def _members(path: Path) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    out = []
    with tarfile.open(path) as tf:
        for m in tf.getmembers():
            out.append((m, tf.extractfile(m).read() if m.isreg() else None))
    return out


def _write(path: Path, members, mode: str = "w") -> Path:
    with tarfile.open(path, mode, format=tarfile.PAX_FORMAT) as tf:
        for m, data in members:
            tf.addfile(m, io.BytesIO(data) if data is not None else None)
    return path


def _info(name: str, type_=tarfile.REGTYPE, data: bytes | None = b"x", **kw) -> tuple:
    ti = tarfile.TarInfo(name)
    ti.type = type_
    ti.size = (
        len(data) if (data is not None and type_ in (tarfile.REGTYPE, tarfile.AREGTYPE)) else 0
    )
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti, data if ti.size else None


def _assert_nothing_imported(root: Path) -> None:
    leftovers = [p for p in root.rglob("*")] if root.exists() else []
    assert leftovers == [], leftovers


def test_pack_unpack_round_trip_through_the_cli(tmp_path, packed, built):
    dst = tmp_path / "dst"
    r = cli("unpack", str(packed), "--cache", str(dst), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["counts"] == {"added": N_TINY, "replaced": 0, "present": 0}
    assert [x["status"] for x in verify_root(dst)] == ["ok"] * N_TINY
    (store,) = stores_at(dst)
    assert store.dir.name == built.dir.name and (store.dir / "specs" / "tiny.json").exists()
    r = cli("unpack", str(packed), "--cache", str(dst), "--json")
    assert json.loads(r.stdout)["counts"] == {"added": 0, "replaced": 0, "present": N_TINY}
    victim = artifact_dirs(store)[0] / "fwd.so"
    victim.write_bytes(b"corrupt")
    r = cli("unpack", str(packed), "--cache", str(dst), "--json")
    assert json.loads(r.stdout)["counts"] == {"added": 0, "replaced": 1, "present": N_TINY - 1}
    assert [x["status"] for x in verify_root(dst)] == ["ok"] * N_TINY
    assert not [p for p in dst.iterdir() if p.name.startswith(".")]  # staging removed


@pytest.mark.parametrize("suffix", [".tar", ".tar.xz", ".tgz"])
def test_pack_formats(tmp_path, built, suffix):
    out = tmp_path / f"s{suffix}"
    res = A.pack([built.root], out)
    assert len(res.artifacts) == N_TINY and res.skipped == []
    assert len(A.unpack(out, [tmp_path / "dst"]).rows) == N_TINY


def test_pack_leaves_out_corrupt_artifacts_and_exits_1(tmp_path, built):
    (artifact_dirs(built)[0] / "fwd.so").write_bytes(b"bad")
    out = tmp_path / "s.tar"
    r = cli("pack", str(out), "--cache", str(built.root))
    assert r.returncode == 1 and "skipped" in r.stdout
    assert len(A.unpack(out, [tmp_path / "dst"]).rows) == N_TINY - 1


def test_pack_needs_store_when_there_are_several(tmp_path, built, monkeypatch):
    build_stub(built.root, write_spec(tmp_path), monkeypatch, num_sms=114)
    with pytest.raises(UnsafeArchive, match="several stores; pick one with --store"):
        A.pack([built.root], tmp_path / "x.tar")
    assert A.pack([built.root], tmp_path / "x.tar", built.dir.name).store == built.dir.name


def _hostile(fp: str, vid: str) -> dict:
    part = f"{fp}/artifacts/{vid}/fwd.so"
    return {
        "absolute path": [_info("/tmp/fa4aot-evil")],
        "dot-dot at start": [_info("../evil")],
        "dot-dot inside": [_info(f"{fp}/artifacts/../../evil")],
        "dot component": [_info(f"./{fp}/toolchain.json")],
        "empty component": [_info(f"{fp}//toolchain.json")],
        "symlink part": [_info(part, tarfile.SYMTYPE, None, linkname="/etc/passwd")],
        "symlink dir": [_info(f"{fp}/artifacts/{vid}x", tarfile.SYMTYPE, None, linkname="/etc")],
        "hard link": [_info(part, tarfile.LNKTYPE, None, linkname="/etc/passwd")],
        "char device": [
            _info(f"{fp}/artifacts/{vid}/fwd.so", tarfile.CHRTYPE, None, devmajor=1, devminor=3)
        ],
        "block device": [
            _info(f"{fp}/artifacts/{vid}/fwd.so", tarfile.BLKTYPE, None, devmajor=8, devminor=0)
        ],
        "fifo": [_info(f"{fp}/artifacts/{vid}/fwd.so", tarfile.FIFOTYPE, None)],
        "contiguous file": [_info(part, tarfile.CONTTYPE, b"x")],
        "backslash": [_info(f"{fp}/specs/..\\..\\evil.json")],
        "odd characters": [_info(f"{fp}/specs/a b.json")],
        "non-ascii": [_info(f"{fp}/specs/\u00e9.json")],
        "hidden file": [_info(f"{fp}/specs/.x.json")],
        "path a store lacks": [_info(f"{fp}/locks/{vid}.lock")],
        "too deep": [_info(f"{fp}/artifacts/{vid}/sub/fwd.so")],
        "file where a dir goes": [_info(f"{fp}/artifacts/{vid}2")],
        "second store": [_info("sm90-1sm-py311-000000000000/toolchain.json")],
        "duplicate member": [_info(f"{fp}/toolchain.json", data=b"{}")],
        "oversized record": [_info(f"{fp}/specs/big.json", data=b" " * (A.MAX_RECORD_BYTES + 1))],
    }


HOSTILE = sorted(_hostile("fp", "v"))


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_members_are_rejected_and_nothing_is_imported(tmp_path, packed, built, case):
    vid = artifact_dirs(built)[0].name
    members = _members(packed) + _hostile(built.dir.name, vid)[case]
    bad = _write(tmp_path / "bad.tar", members)
    dst = tmp_path / "dst"
    r = cli("unpack", str(bad), "--cache", str(dst))
    assert r.returncode == 1 and "error:" in r.stderr, (case, r.stderr)
    _assert_nothing_imported(dst)
    assert not Path("/tmp/fa4aot-evil").exists() and not (tmp_path / "evil").exists()


def _tamper(members, name_end: str, fn):
    out = []
    for m, data in members:
        if m.name.endswith(name_end) and data is not None:
            data = fn(data)
            m = tarfile.TarInfo(m.name)
            m.size = len(data)
        out.append((m, data))
    return out


def _resealed(data: bytes, **changes) -> bytes:
    from fa4aot.store.records import seal_record

    rec = json.loads(data)
    rec.pop("record_sha256")
    rec.update(changes)
    return json.dumps(seal_record(rec)).encode()


CONTENT = {
    "part bytes changed": ("fwd.so", lambda d: d[:-1] + bytes([d[-1] ^ 1]), "sha256 differs"),
    "part truncated": ("fwd.so", lambda d: d[:100], "size"),
    "record edited": (
        "record.json",
        lambda d: d.replace(b'"tile_m": 128', b'"tile_m": 64'),
        "own sha256",
    ),
    "record of another toolchain": (
        "record.json",
        lambda d: _resealed(d, toolchain={"arch": "sm90"}),
        "built for toolchain",
    ),
    "record not json": ("record.json", lambda d: b"\x80\x04pickle", "not valid JSON"),
    "toolchain edited": (
        "toolchain.json",
        lambda d: d.replace(b"132", b"114"),
        "not a valid toolchain",
    ),
    "spec index not an object": ("tiny.json", lambda d: b"[]", "not a JSON object"),
}


@pytest.mark.parametrize("case", sorted(CONTENT))
def test_content_that_fails_its_checks_imports_nothing(tmp_path, packed, case):
    end, fn, msg = CONTENT[case]
    first = [m.name for m, _ in _members(packed) if m.name.endswith(end)][0]
    members = _tamper(_members(packed), first, fn)
    bad = _write(tmp_path / "bad.tar.gz", members, "w:gz")
    with pytest.raises(UnsafeArchive, match=msg):
        A.unpack(bad, [tmp_path / "dst"])
    _assert_nothing_imported(tmp_path / "dst")


def test_artifact_without_record_or_with_extra_files_imports_nothing(tmp_path, packed):
    members = _members(packed)
    rec = [m.name for m, _ in members if m.name.endswith(RECORD)][0]
    no_rec = [(m, d) for m, d in members if m.name != rec]
    with pytest.raises(UnsafeArchive, match="has no record.json"):
        A.unpack(_write(tmp_path / "a.tar", no_rec), [tmp_path / "dst"])
    extra = members + [_info(rec.replace(RECORD, "payload.so"), data=b"\x7fELF")]
    with pytest.raises(UnsafeArchive, match="files its record does not name: payload.so"):
        A.unpack(_write(tmp_path / "b.tar", extra), [tmp_path / "dst"])
    _assert_nothing_imported(tmp_path / "dst")


def test_truncated_garbage_and_oversized_archives(tmp_path, packed, monkeypatch):
    data = packed.read_bytes()
    for i, blob in enumerate(
        [
            data[: len(data) // 2],
            data[:10],
            os.urandom(5000),
            b"",
            b"\x1f\x8b" + os.urandom(100),
            b"\xfd7zXZ\x00" + os.urandom(50),
        ]
    ):
        p = tmp_path / f"g{i}.tar.gz"
        p.write_bytes(blob)
        with pytest.raises(UnsafeArchive):
            A.unpack(p, [tmp_path / "dst"])
    monkeypatch.setattr(A, "MAX_TOTAL_BYTES", 10_000)
    with pytest.raises(UnsafeArchive, match="more than 10000 bytes"):
        A.unpack(packed, [tmp_path / "dst"])
    _assert_nothing_imported(tmp_path / "dst")


def test_unpack_into_no_writable_layer_is_a_build_error(tmp_path, packed):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(BuildError, match="no writable store layer"):
        A.unpack(packed, [f / "store"])


# -- fuzzing -------------------------------------------------------------------------------

_component = st.sampled_from(
    [
        "sm90-132sm-py311-abc",
        "artifacts",
        "specs",
        "toolchain.json",
        "record.json",
        "fwd.so",
        "x.json",
        "..",
        ".",
        "",
        "a b",
        "/",
        "\\",
        "\u00e9",
        "v1",
        "locks",
    ]
) | st.text(max_size=6)
_name = st.lists(_component, min_size=1, max_size=5).map("/".join) | st.text(max_size=20)
_type = st.sampled_from(
    [
        tarfile.REGTYPE,
        tarfile.AREGTYPE,
        tarfile.DIRTYPE,
        tarfile.SYMTYPE,
        tarfile.LNKTYPE,
        tarfile.CHRTYPE,
        tarfile.BLKTYPE,
        tarfile.FIFOTYPE,
        tarfile.CONTTYPE,
        tarfile.GNUTYPE_SPARSE,
    ]
)
_member = st.tuples(_name, _type, st.binary(max_size=64), st.text(max_size=10))


@settings(
    max_examples=600, deadline=2000, suppress_health_check=list(HealthCheck), derandomize=True
)
@given(st.lists(_member, max_size=8))
def test_fuzz_unpack_only_typed_errors_and_nothing_outside_its_root(members):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        built = []
        for name, type_, data, link in members:
            if not name or "\0" in name:
                continue
            ti = tarfile.TarInfo(name)
            ti.type = type_
            if type_ in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                ti.linkname = link
            elif type_ in (tarfile.REGTYPE, tarfile.AREGTYPE):
                ti.size = len(data)
            built.append((ti, data if ti.size else None))
        arc = tmp / "a.tar"
        try:
            _write(arc, built)
        except (ValueError, UnicodeError, tarfile.TarError):
            return
        dst = tmp / "root" / "dst"
        try:
            A.unpack(arc, [dst])
        except (UnsafeArchive, BuildError):
            pass
        outside = sorted(
            str(p.relative_to(tmp)) for p in tmp.rglob("*") if not str(p).startswith(str(dst))
        )
        assert outside == ["a.tar", "root"]
        assert not [p for p in dst.iterdir() if p.name.startswith(".unpack")]


@settings(max_examples=2000, deadline=500, derandomize=True)
@given(_name, _type, st.integers(-5, 1 << 31))
def test_fuzz_member_header_check(name, type_, size):
    ti = tarfile.TarInfo(name)
    ti.type, ti.size = type_, size
    assert A.member_problem(ti) is None or isinstance(A.member_problem(ti), str)


def test_pack_filters_by_spec_and_arch(tmp_path, built):
    out = tmp_path / "tiny.tar"
    r = cli(
        "pack", str(out), "--cache", str(built.root), "--spec", "tiny", "--arch", "sm90", "--json"
    )
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["rows"]) == N_TINY
    names = {m.name for m, _ in _members(out)}
    assert f"{built.dir.name}/specs/tiny.json" in names
    r = cli("pack", str(tmp_path / "x.tar"), "--cache", str(built.root), "--spec", "nope")
    assert r.returncode == 1 and "no artifact of spec(s) nope" in r.stderr
    r = cli("pack", str(tmp_path / "y.tar"), "--cache", str(built.root), "--arch", "sm100")
    assert r.returncode == 1 and "no store" in r.stderr
    assert not (tmp_path / "x.tar").exists() and not (tmp_path / "y.tar").exists()


# -- several layers hold the store: pack their union ----------------------------------------


@pytest.fixture
def two_layers(tmp_path, monkeypatch):
    """The same store in two layers: `node` holds half of the artifacts, `img` all of them."""
    spec = write_spec(tmp_path)
    img, _ = build_stub(tmp_path / "img", spec, monkeypatch)
    node, _ = build_stub(tmp_path / "node", spec, monkeypatch, shard=(0, 2))
    assert node.dir.name == img.dir.name and len(artifact_dirs(node)) == N_TINY // 2
    return node, img


def _archived_parts(path: Path) -> dict[str, bytes]:
    return {m.name: d for m, d in _members(path) if m.name.endswith("/fwd.so")}


def test_pack_of_several_layers_packs_the_union(tmp_path, two_layers, monkeypatch):
    node, img = two_layers
    out = tmp_path / "u.tar"
    res = A.pack([node.root, img.root], out)
    assert sorted(res.artifacts) == [d.name for d in artifact_dirs(img)] and res.skipped == []
    assert len(A.unpack(out, [tmp_path / "dst"]).rows) == N_TINY
    assert [x["status"] for x in verify_root(tmp_path / "dst")] == ["ok"] * N_TINY
    # two halves, neither a superset: every artifact from the layer that holds it
    other_half, _ = build_stub(tmp_path / "half", write_spec(tmp_path), monkeypatch, shard=(1, 2))
    res = A.pack([node.root, other_half.root], tmp_path / "v.tar")
    assert sorted(res.artifacts) == [d.name for d in artifact_dirs(img)]


def test_pack_of_several_layers_through_the_cli(tmp_path, two_layers):
    node, img = two_layers
    import shutil

    for d in artifact_dirs(node):  # node: the store directory, with no artifact at all
        shutil.rmtree(d)
    env = stub_env(FA4AOT_CACHE_DIR=f"{node.root}{os.pathsep}{img.root}")
    r = cli("pack", str(tmp_path / "c.tar"), env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"packed {N_TINY} artifacts of {img.dir.name}")


def test_pack_takes_the_first_valid_copy_in_layer_order(tmp_path, two_layers):
    node, img = two_layers
    good, bad = artifact_dirs(node)[:2]
    (bad / "fwd.so").write_bytes(b"corrupt")
    (img.artifact_dir(good.name) / "fwd.so").write_bytes(b"also corrupt, but shadowed")
    out = tmp_path / "f.tar"
    res = A.pack([node.root, img.root], out)
    assert len(res.artifacts) == N_TINY and res.skipped == []
    parts = _archived_parts(out)
    fp = node.dir.name
    from_img = (img.artifact_dir(bad.name) / "fwd.so").read_bytes()
    assert parts[f"{fp}/artifacts/{bad.name}/fwd.so"] == from_img
    assert parts[f"{fp}/artifacts/{good.name}/fwd.so"] == (good / "fwd.so").read_bytes()


def test_pack_skips_an_artifact_corrupt_in_every_layer(tmp_path, two_layers):
    node, img = two_layers
    vid = artifact_dirs(node)[0].name
    for s in (node, img):
        (s.artifact_dir(vid) / "fwd.so").write_bytes(b"bad")
    res = A.pack([node.root, img.root], tmp_path / "s.tar")
    assert len(res.artifacts) == N_TINY - 1
    (skip,) = res.skipped
    assert skip["id"] == vid and str(node.dir) in skip["error"] and str(img.dir) in skip["error"]


def test_pack_spec_indexes_first_layer_wins(tmp_path, two_layers):
    node, img = two_layers
    mine = json.loads(node.spec_index("tiny").read_text())
    mine["note"] = "node's"
    node.spec_index("tiny").write_text(json.dumps(mine))
    img.spec_index("other").write_text(json.dumps({"variants": []}))
    out = tmp_path / "i.tar"
    A.pack([node.root, img.root], out)
    idx = {m.name.rsplit("/", 1)[1]: d for m, d in _members(out) if "/specs/" in m.name}
    assert set(idx) == {"tiny.json", "other.json"}
    assert json.loads(idx["tiny.json"])["note"] == "node's"
    out = tmp_path / "j.tar"
    res = A.pack([node.root, img.root], out, specs=["tiny"])
    assert len(res.artifacts) == N_TINY  # the spec's artifacts of every layer
    assert {m.name for m, _ in _members(out) if "/specs/" in m.name} == {
        f"{node.dir.name}/specs/tiny.json"
    }


def test_pack_of_layers_with_different_stores_needs_store(tmp_path, two_layers, monkeypatch):
    node, img = two_layers
    other, _ = build_stub(tmp_path / "o", write_spec(tmp_path), monkeypatch, num_sms=114)
    with pytest.raises(UnsafeArchive, match="several stores; pick one with --store"):
        A.pack([node.root, other.root], tmp_path / "x.tar")
    res = A.pack([node.root, other.root, img.root], tmp_path / "x.tar", node.dir.name)
    assert res.store == node.dir.name and len(res.artifacts) == N_TINY


UNPACK_FAULTS = ["unpack-staged", "unpack-imported-one", "unpack-indexes"]


def test_unpack_sigkilled_anywhere_leaves_only_whole_entries_and_a_rerun_completes(
    tmp_path, packed
):
    """`fa4aot unpack` SIGKILLed at named points (archive staged and checked; one artifact
    published; all published, spec indexes not yet) and at random times: every visible entry is
    whole and valid, the staging directory of the dead process is swept by the next unpack,
    which completes the store."""
    import random
    import signal
    import subprocess

    from stub_store import popen_cli

    import time

    rng = random.Random(20261129)
    t0 = time.monotonic()  # one whole unpack, to aim the random kills inside its lifetime
    assert cli("unpack", str(packed), "--cache", str(tmp_path / "whole")).returncode == 0
    whole = time.monotonic() - t0
    trials = [("fault", p) for p in UNPACK_FAULTS] + [
        ("timer", rng.uniform(0.5, 0.95) * whole) for _ in range(6)
    ]
    killed = 0
    for n, (kind, arg) in enumerate(trials):
        root = tmp_path / f"u{n}"
        env = stub_env(**({"FA4AOT_FAULT": arg} if kind == "fault" else {}))
        p = popen_cli("unpack", str(packed), "--cache", str(root), env=env)
        if kind == "timer":
            try:
                p.wait(timeout=arg)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
        p.communicate(timeout=60)
        if kind == "timer" and p.returncode == 0:
            continue  # finished first: not a crash trial
        killed += 1
        assert p.returncode == -signal.SIGKILL, (n, kind, arg, p.returncode)
        seen = 0
        for store in stores_at(root):
            for d in artifact_dirs(store):
                assert store.get(d.name, verify=True) is not None, (n, d)
                seen += 1
        if arg == "unpack-indexes":
            assert seen == N_TINY and not list(stores_at(root)[0].dir.glob("specs/*.json"))
        if arg == "unpack-staged":
            assert seen == 0 and any(root.glob(".unpack.*.tmp"))  # the dead process's staging
        r = cli("unpack", str(packed), "--cache", str(root), "--json")
        assert r.returncode == 0, (n, r.stderr)
        (store,) = stores_at(root)
        assert len(artifact_dirs(store)) == N_TINY
        assert [x["status"] for x in verify_root(root)] == ["ok"] * N_TINY, n
        assert store.spec_index("tiny").exists()
        assert not list(root.glob(".unpack.*")), (n, list(root.iterdir()))
        assert not list((store.dir / "tmp").iterdir())
    assert killed >= len(UNPACK_FAULTS), killed  # random kills count only if they landed
