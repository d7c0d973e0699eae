"""Reliability and security of the store: concurrent builders, crashes, corruption, version skew,
read-only and layered stores, untrusted input. CPU only: real processes on the real filesystem,
with the stub compiler (FA4AOT_STUB_COMPILER=1) where compiling would be too slow.

docs/reliability.md gives the figures these tests establish.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stub_store import (
    PY,
    TINY_SPEC,
    artifact_dirs,
    build_stub,
    cli,
    popen_cli,
    popen_py,
    reseal,
    run_readonly,
    stub_env,
    write_spec,
)

from fa4aot.store import locking
from fa4aot.errors import BuildError, CorruptArtifact, Fa4aotError, FingerprintMismatch
from fa4aot.store.layers import Store, build_root, find_serving_store, not_writable_reason, stores_at, verify_root
from fa4aot.store.records import RECORD, parse_record
from fa4aot.store.toolchain import FINGERPRINT_FIELDS

N_TINY = 8  # variants of stub_store.TINY_SPEC on sm90


@pytest.fixture
def spec(tmp_path):
    return write_spec(tmp_path)


@pytest.fixture
def built(tmp_path, spec, monkeypatch):
    store, _ = build_stub(tmp_path / "store", spec, monkeypatch)
    return store


def _statuses(outs: list[str]) -> dict[str, list[str]]:
    by_id: dict[str, list[str]] = {}
    for out in outs:
        for r in json.loads(out)["rows"]:
            by_id.setdefault(r["id"], []).append(r["status"])
    return by_id


def _assert_clean(store: Store, n: int) -> None:
    """n valid artifacts, nothing half-built, no scratch, no lock left held."""
    rows = verify_root(store.root)
    assert [r for r in rows if r["status"] != "ok"] == []
    assert len(rows) == n
    assert list((store.dir / "tmp").iterdir()) == []
    leftovers = [p for p in store.root.rglob("*") if p.name.endswith((".tmp", ".new", ".stale"))]
    assert leftovers == []
    for lock in (store.dir / "locks").iterdir():
        assert lock.suffix == ".lock" and lock.stat().st_size == 0  # a marker file has content
        with locking.hold(lock, timeout=0.5, mode="flock"):  # and no flock is held
            pass


# -- 1. concurrent builders and readers -------------------------------------------------------


@pytest.mark.parametrize("mode", ["flock", "marker"])
def test_8_concurrent_builders_publish_each_artifact_exactly_once(tmp_path, spec, mode):
    root = tmp_path / "store"
    env = stub_env(FA4AOT_LOCK=mode, FA4AOT_STUB_DELAY="0.1")
    procs = [
        popen_cli("build", "--spec", str(spec), "--cache", str(root), "-j", "1", "--json", env=env)
        for _ in range(8)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 8, [e for _, e in outs]
    by_id = _statuses([o for o, _ in outs])
    assert len(by_id) == N_TINY
    for vid, sts in by_id.items():
        assert sorted(sts) == ["built"] + ["cached"] * 7, (vid, sts)
    store = stores_at(root)[0]
    _assert_clean(store, N_TINY)
    if mode == "marker":
        assert list((store.dir / "locks").iterdir()) == []  # markers are removed on release


NO_LOCK_BUILD = r"""
import contextlib, sys
import fa4aot.store.locking
fa4aot.store.locking.hold = lambda *a, **k: contextlib.nullcontext()  # flock "succeeding" for everyone
from fa4aot.cli import main
sys.argv = ["fa4aot", *sys.argv[1:]]
main()
"""


def test_publication_is_exactly_once_even_when_the_lock_excludes_nothing(tmp_path, spec):
    """A filesystem where flock silently succeeds: 8 builders all compile, one rename wins."""
    root = tmp_path / "store"
    env = stub_env(FA4AOT_STUB_DELAY="0.1")
    procs = [
        popen_py(
            NO_LOCK_BUILD,
            "build",
            "--spec",
            str(spec),
            "--cache",
            str(root),
            "-j",
            "1",
            "--json",
            env=env,
        )
        for _ in range(8)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 8, [e for _, e in outs]
    for vid, sts in _statuses([o for o, _ in outs]).items():
        assert sts.count("built") == 1 and sts.count("cached") == 7, (vid, sts)
    _assert_clean(stores_at(root)[0], N_TINY)


READER = r"""
import json, sys, time
from pathlib import Path
from fa4aot.errors import Fa4aotError
from fa4aot.store.layers import find_serving_store
from fa4aot.store.toolchain import runtime_expectation
root, stop, out = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
loads = errors = partial = scans = 0
msgs, seen = [], set()
print("ready", flush=True)
while True:
    done = stop.exists()
    try:
        stores = find_serving_store([root], runtime_expectation("sm90", 132))
    except Fa4aotError as e:
        stores = []
    for s in stores:
        base = s.dir / "artifacts"
        for d in sorted(base.iterdir()) if base.is_dir() else []:
            try:
                a = s.get(d.name, verify=True)
            except (Fa4aotError, OSError) as e:
                errors += 1
                msgs.append(repr(e))
                continue
            if a is None:
                partial += 1  # a directory without its record: never visible with atomic publish
            else:
                loads += 1
                seen.add(d.name)
    scans += 1
    if done:
        break
    time.sleep(0.001)
json.dump(dict(loads=loads, errors=errors, partial=partial, scans=scans, seen=len(seen),
               msgs=msgs[:5]), open(out, "w"))
"""


def test_16_readers_never_see_a_partial_entry_while_a_build_adds_artifacts(tmp_path):
    root, stop = tmp_path / "store", tmp_path / "stop"
    env = stub_env(FA4AOT_STUB_DELAY="0.02")
    readers = [
        popen_py(READER, str(root), str(stop), str(tmp_path / f"r{i}.json"), env=env)
        for i in range(16)
    ]
    for r in readers:
        assert r.stdout.readline().strip() == "ready"
    b = cli("build", "--spec", "llama-3.1-8b", "--cache", str(root), "-j", "2", "--json", env=env)
    stop.touch()
    for r in readers:
        r.communicate(timeout=120)
        assert r.returncode == 0, r.stderr
    assert b.returncode == 0, b.stderr
    n = len(json.loads(b.stdout)["rows"])
    res = [json.loads((tmp_path / f"r{i}.json").read_text()) for i in range(16)]
    assert sum(r["errors"] for r in res) == 0, [r["msgs"] for r in res]
    assert sum(r["partial"] for r in res) == 0
    assert all(r["seen"] == n for r in res)  # each reader's last scan saw the whole store
    assert sum(r["scans"] for r in res) > 16 * 2  # they did read during the build
    print(
        f"readers: 16, artifacts: {n}, verified loads: {sum(r['loads'] for r in res)}, "
        f"scans: {sum(r['scans'] for r in res)}, errors: 0"
    )


HOLDER = r"""
import sys, time
from pathlib import Path
from fa4aot.store import locking
with locking.hold(Path(sys.argv[1]), timeout=5, mode=sys.argv[2]):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.mark.parametrize("mode", ["flock", "marker"])
def test_lock_is_taken_over_at_once_after_its_holder_is_sigkilled(tmp_path, mode):
    lock = tmp_path / "x.lock"
    p = popen_py(HOLDER, str(lock), mode)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(locking.LockTimeout):
            with locking.hold(lock, timeout=0.3, mode=mode):
                pass
    finally:
        p.kill()
        p.wait()
    t0 = time.monotonic()
    with locking.hold(lock, timeout=5, mode=mode):
        pass
    assert time.monotonic() - t0 < 1.0
    assert lock.exists() == (mode == "flock")  # flock files stay (same inode for all waiters)


def test_marker_of_another_machine_is_stale_only_after_its_lease(tmp_path, knobs):
    knobs(lock_lease_s="1")
    lock = tmp_path / "y.lock"
    lock.write_text(
        json.dumps({"machine": "elsewhere/boot/1", "pid": 1, "start": "", "nonce": "n"})
    )
    with pytest.raises(locking.LockTimeout):  # fresh lease: another host's live builder
        with locking.hold(lock, timeout=0.3, mode="marker"):
            pass
    old = time.time() - 5
    os.utime(lock, (old, old))
    with locking.hold(lock, timeout=2, mode="marker"):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists()


def test_marker_holder_keeps_its_lease_fresh(tmp_path, knobs):
    knobs(lock_lease_s="1")
    lock = tmp_path / "z.lock"
    with locking.hold(lock, timeout=1, mode="marker"):
        t0 = lock.stat().st_mtime
        time.sleep(1.6)
        # refreshed well after it was taken (every 0.25 s; a bound on the age instead would
        # fail whenever a loaded CI machine delays the heartbeat thread)
        assert lock.stat().st_mtime > t0 + 0.7
        assert not locking.holder_stale(lock.read_text(), lock.stat().st_mtime, time.time() + 30)


def test_marker_staleness_rules():
    me = json.loads(
        json.dumps(
            {
                "machine": locking._machine(),
                "pid": os.getpid(),
                "start": locking._start_time(os.getpid()),
            }
        )
    )
    now = time.time()
    assert not locking.holder_stale(json.dumps(me), now)
    assert not locking.holder_stale(json.dumps(me), now - 10_000)  # alive: age does not matter
    assert locking.holder_stale(json.dumps({**me, "start": "1"}), now)  # pid reused
    dead = subprocess.Popen([PY, "-c", "pass"])
    dead.wait()
    assert locking.holder_stale(json.dumps({**me, "pid": dead.pid}), now)
    assert not locking.holder_stale("", now) and locking.holder_stale("", now - 10_000)  # torn


MOUNTS = r"""/dev/vda / ext4 rw,relatime 0 0
srv:/export /mnt/nfs nfs4 rw,vers=4.2 0 0
srv:/x /mnt/nfs/deep\040dir nfs rw,nolock 0 0
bucket /mnt/s3 fuse.s3fs rw 0 0
tmpfs /mnt/nfs/tmp tmpfs rw 0 0
"""


def test_filesystem_detection_picks_the_lock_and_refuses_object_stores(monkeypatch, knobs):
    knobs(lock=None)
    cases = {
        "/": "ext4",
        "/home/u/cache": "ext4",
        "/mnt/nfs/a": "nfs4",
        "/mnt/nfs/deep dir/a": "nfs",
        "/mnt/nfs/tmp/a": "tmpfs",
        "/mnt/nfsx": "ext4",
        "/mnt/s3/store": "fuse.s3fs",
    }
    for path, kind in cases.items():
        assert locking.fs_type(Path(path), MOUNTS) == kind, path
    assert "fuse.s3fs" in locking.NO_ATOMIC_RENAME_FS and "nfs4" not in locking.LOCAL_FS
    real = locking.fs_type
    for kind, mode in (
        ("ext4", "flock"),
        ("nfs4", "marker"),
        ("fuse.sshfs", "marker"),
        ("unknown", "marker"),
        ("lustre", "marker"),
    ):
        monkeypatch.setattr(locking, "fs_type", lambda p, m=None, k=kind: k)
        assert locking.lock_mode(Path("/x")) == mode
    monkeypatch.setattr(locking, "fs_type", lambda p, m=None: "fuse.s3fs")
    assert "no atomic rename" in locking.write_refusal(Path("/mnt/s3"))
    monkeypatch.setattr(locking, "fs_type", real)
    knobs(lock="marker")
    assert locking.lock_mode(Path("/")) == "marker"


# -- 2. crash safety --------------------------------------------------------------------------

FAULT_POINTS = ["export", "link", "stage", "publish", "published"]


def test_sigkill_at_any_moment_never_leaves_an_entry_the_loader_accepts(tmp_path, spec):
    """24 builds SIGKILLed (10 at named points: mid-export, mid-link, parts staged, record
    written, just published; 14 at random times, with 1 or 2 build processes, flock or marker
    locks); after each, every visible entry is whole and valid, and the next build completes the
    store and leaves no scratch."""
    rng = random.Random(20261129)
    trials = [
        ("fault", p, 1, "flock" if i % 2 else "marker") for i, p in enumerate(FAULT_POINTS * 2)
    ]
    trials += [
        ("timer", rng.uniform(0.3, 1.2), 1 + i % 2, "marker" if i % 3 == 0 else "flock")
        for i in range(14)
    ]
    killed, survived = [], 0
    for n, (kind, arg, jobs, mode) in enumerate(trials):
        root = tmp_path / f"s{n}"
        extra = {"FA4AOT_FAULT": arg} if kind == "fault" else {}
        env = stub_env(
            FA4AOT_STUB_DELAY="0.25" if kind == "timer" else "0.05", FA4AOT_LOCK=mode, **extra
        )
        p = popen_cli(
            "build",
            "--spec",
            str(spec),
            "--cache",
            str(root),
            "-j",
            str(jobs),
            env=env,
            start_new_session=True,
        )
        if kind == "timer":
            try:
                p.wait(timeout=arg)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)  # the builder and its worker processes
        p.communicate(timeout=60)
        if kind == "timer" and p.returncode == 0:
            continue  # finished before the timer: not a crash trial
        killed.append((kind, jobs, mode))
        assert p.returncode == -signal.SIGKILL, (n, kind, arg, p.returncode)
        published = 0
        for store in stores_at(root):  # none yet if killed before the store was laid out
            for d in artifact_dirs(store):
                assert store.get(d.name, verify=True) is not None, (n, d)  # whole and valid
                published += 1
        if kind == "fault" and arg == "published":
            assert published >= 1
        r = cli(
            "build",
            "--spec",
            str(spec),
            "--cache",
            str(root),
            "-j",
            "1",
            "--json",
            env=stub_env(FA4AOT_STUB_DELAY="0", FA4AOT_LOCK=mode),
        )
        assert r.returncode == 0, (n, r.stderr)
        st = [row["status"] for row in json.loads(r.stdout)["rows"]]
        assert st.count("cached") == published and st.count("built") == N_TINY - published
        _assert_clean(stores_at(root)[0], N_TINY)
        survived += published
    print(
        f"crash trials: {len(killed)} SIGKILLed ({sum(k == 'fault' for k, _, _ in killed)} at "
        f"named points, {sum(k == 'timer' for k, _, _ in killed)} at random times, "
        f"{sum(j == 2 for _, j, _ in killed)} with 2 processes, "
        f"{sum(m == 'marker' for _, _, m in killed)} with marker locks); "
        f"{survived} artifacts published before a kill kept, 0 bad entries accepted"
    )
    assert len(killed) >= 20


def test_a_killed_builders_scratch_is_swept_but_a_live_ones_is_not(built):
    from fa4aot.store.layers import sweep_temp
    from fa4aot.store.files import owner_tag

    tmp = built.dir / "tmp"
    dead = subprocess.Popen([PY, "-c", "pass"])
    dead.wait()
    host = owner_tag().split("~")[0]
    (tmp / f"abc.{host}~{dead.pid}~x1").mkdir()
    (tmp / f"abc.{owner_tag()}x2").mkdir()  # this process: alive
    (built.dir / "specs" / f".tiny.json.{host}~{dead.pid}~zz.tmp").write_text("torn")
    (tmp / f"abc.otherhost~{dead.pid}~x3").mkdir()  # another machine's, recent: kept
    assert sweep_temp(built) == 2
    assert sorted(p.name for p in tmp.iterdir()) == sorted(
        [f"abc.{owner_tag()}x2", f"abc.otherhost~{dead.pid}~x3"]
    )


# -- 3. integrity ---------------------------------------------------------------------------


def _make_real(art_dir: Path) -> None:
    """A stub artifact relabelled as a kernel, so the runtime's loader goes all the way."""
    reseal(art_dir, stub=False)


@pytest.fixture
def no_dlopen(monkeypatch):
    """The runtime's dlopen entry points, replaced by a sentinel: reaching them proves every
    check before them passed; a corrupt artifact must never reach them."""
    calls = []

    class Dlopen(Exception):
        pass

    def refuse(*a, **k):
        calls.append(a)
        raise Dlopen("dlopen reached")

    from fa4aot.store import runtime_lib

    monkeypatch.setattr(runtime_lib, "load_runtime_lib", refuse)
    fake = type(sys)("tvm_ffi")
    fake.load_module = refuse
    monkeypatch.setitem(sys.modules, "tvm_ffi", fake)
    return calls, Dlopen


def _variant(art_dir: Path):
    from fa4aot.model.variants import Variant

    return Variant.from_dict(json.loads((art_dir / RECORD).read_text())["variant"])


def test_every_bit_flip_and_truncation_of_a_record_is_detected(built):
    """Exhaustive in memory (the checks Store.get applies to the bytes it reads), then a sample
    through the file. Only removing the trailing newline leaves the same record."""
    d = artifact_dirs(built)[0]
    good = (d / RECORD).read_bytes()
    assert built.get(d.name) is not None
    n = 0
    for i in range(len(good)):
        for bit in range(8):
            bad = bytearray(good)
            bad[i] ^= 1 << bit
            with pytest.raises(CorruptArtifact):
                built.check_record(d.name, bytes(bad))
            n += 1
    body = len(good.rstrip())
    for cut in range(body):
        with pytest.raises(CorruptArtifact):
            built.check_record(d.name, good[:cut])
        n += 1
    rng = random.Random(3)
    with open(d / RECORD, "r+b") as f:  # in place: no truncation, the file keeps its blocks
        for i in rng.sample(range(len(good)), 200):
            f.seek(i)
            f.write(bytes([good[i] ^ (1 << rng.randrange(8))]))
            f.flush()
            with pytest.raises(CorruptArtifact):
                built.get(d.name, verify=False)
            f.seek(i)
            f.write(good[i : i + 1])
            f.flush()
            n += 1
    for cut in rng.sample(range(body), 20):
        os.truncate(d / RECORD, cut)
        with pytest.raises(CorruptArtifact):
            built.get(d.name, verify=False)
        n += 1
    print(f"record corruptions tried: {n} ({len(good)} bytes), all detected")
    (d / RECORD).write_bytes(good)
    assert built.get(d.name) is not None


def test_bit_flips_and_truncations_of_an_artifact_are_detected_and_never_loaded(built, no_dlopen):
    from fa4aot.runtime import Runtime

    calls, Dlopen = no_dlopen
    d = artifact_dirs(built)[0]
    _make_real(d)
    part = d / "fwd.so"
    good = part.read_bytes()
    rt = Runtime([built.root], allow_unsafe_dirs=False)
    with pytest.raises(Dlopen):  # the intact artifact passes every check and reaches dlopen
        rt.plan(_variant(d), 132)
    calls.clear()
    rng = random.Random(7)
    flips = sorted({0, len(good) - 1, *(rng.randrange(len(good)) for _ in range(1000))})
    cuts = [0, 1, len(good) // 2, len(good) - 1, *(rng.randrange(len(good)) for _ in range(50))]
    n = 0
    with open(part, "r+b") as f:  # flip in place, then restore
        for i in flips:
            f.seek(i)
            f.write(bytes([good[i] ^ (1 << rng.randrange(8))]))
            f.flush()
            with pytest.raises(CorruptArtifact):
                Runtime([built.root]).plan(_variant(d), 132)
            f.seek(i)
            f.write(good[i : i + 1])
            f.flush()
            n += 1
    for c in cuts:
        os.truncate(part, c)
        with pytest.raises(CorruptArtifact):
            Runtime([built.root]).plan(_variant(d), 132)
        part.write_bytes(good)
        n += 1
    part.write_bytes(good + b"\0")
    with pytest.raises(CorruptArtifact):
        Runtime([built.root]).plan(_variant(d), 132)
    assert calls == []  # never dlopen'ed
    print(f"artifact corruptions tried: {n + 1}, all refused before dlopen")


def test_build_quarantines_and_rebuilds_corrupt_entries_and_verify_reports_them(built, spec):
    dirs = artifact_dirs(built)
    flip = dirs[0] / "fwd.so"
    b = bytearray(flip.read_bytes())
    b[100] ^= 4
    flip.write_bytes(b)
    (dirs[1] / RECORD).write_bytes((dirs[1] / RECORD).read_bytes()[:200])
    (dirs[2] / "fwd.so").unlink()
    reseal(
        dirs[3],
        description="edited, resealed, but its part's sha256 no longer matches",
        parts={
            "fwd": {
                **json.loads((dirs[3] / RECORD).read_text())["parts"]["fwd"],
                "sha256": "0" * 64,
            }
        },
    )
    (dirs[4] / RECORD).unlink()  # a record-less directory (an old builder's leftover)
    r = cli("verify", "--cache", str(built.root), "--json")
    assert r.returncode == 1
    rows = {x["id"]: x["status"] for x in json.loads(r.stdout)["rows"]}
    assert [rows[d.name] for d in dirs[:5]] == ["corrupt"] * 4 + ["incomplete"]
    assert list(rows.values()).count("ok") == N_TINY - 5
    r = cli("build", "--spec", str(spec), "--cache", str(built.root), "--json")
    assert r.returncode == 0, r.stderr
    st = {x["id"]: x["status"] for x in json.loads(r.stdout)["rows"]}
    assert [st[d.name] for d in dirs[:5]] == ["rebuilt"] * 4 + ["built"]
    assert len(list((built.dir / "quarantine").iterdir())) == 4
    r = cli("verify", "--cache", str(built.root), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] == N_TINY


def test_format_1_records_are_resealed_without_recompiling_when_their_parts_verify(built, spec):
    dirs = artifact_dirs(built)
    for d in dirs[:2]:
        rec = json.loads((d / RECORD).read_text())
        for k in ("record_sha256", "sm_count_independent"):
            rec.pop(k)
        (d / RECORD).write_text(json.dumps({**rec, "format": 1}, indent=2))
    (dirs[1] / "fwd.so").write_bytes(b"corrupt")
    with pytest.raises(CorruptArtifact, match="record format 1, this fa4aot reads 2"):
        built.get(dirs[0].name)
    r = cli("build", "--spec", str(spec), "--cache", str(built.root), "--json")
    assert r.returncode == 0, r.stderr
    st = {x["id"]: x["status"] for x in json.loads(r.stdout)["rows"]}
    assert st[dirs[0].name] == "cached" and st[dirs[1].name] == "rebuilt"
    rec = built.get(dirs[0].name).record
    assert rec["format"] == 2 and rec["sm_count_independent"] is False


def test_verify_reports_a_broken_toolchain_file(built):
    (built.dir / "toolchain.json").write_text('{"arch": "sm90"}')
    r = cli("verify", "--cache", str(built.root), "--json")
    assert r.returncode == 1
    assert json.loads(r.stdout)["rows"][0]["error"].endswith(
        f"not a valid toolchain for directory {built.dir.name}"
    )


# -- 4. version skew -----------------------------------------------------------------------


FULL = {
    "fa4": "4.0.0b36",
    "cutlass_dsl": "4.8.1",
    "cutlass_libs": "cu13",
    "tvm_ffi": "0.1.15.post2",
    "python": "3.12",
    "arch": "sm90",
    "num_sms": 132,
}
OTHER = {
    "fa4": "4.0.0b37",
    "cutlass_dsl": "4.9.0",
    "cutlass_libs": "cu12",
    "tvm_ffi": "0.1.16",
    "python": "3.11",
    "arch": "sm100",
    "num_sms": 114,
}


def _store_with(root: Path, tc: dict) -> Store:
    s = Store(root, tc)
    s.ensure()
    return s


@pytest.mark.parametrize("field", FINGERPRINT_FIELDS)
def test_a_store_of_another_toolchain_or_gpu_is_never_served(tmp_path, field):
    assert set(FULL) == set(FINGERPRINT_FIELDS)
    _store_with(tmp_path, {**FULL, field: OTHER[field]})
    expected = dict(FULL)
    if field == "num_sms":  # same toolchain, other SM count: served only SM-independent artifacts
        (s,) = find_serving_store([tmp_path], expected)
        assert s.serve_num_sms == 132
        return
    with pytest.raises(FingerprintMismatch) as e:
        find_serving_store([tmp_path], expected)
    assert f"{field}: store has {OTHER[field]!r}, this process needs {FULL[field]!r}" in str(
        e.value
    )


def test_runtime_expectation_names_every_installed_version(monkeypatch):
    from fa4aot.store import toolchain as S

    vers = {
        "flash-attn-4": "4.0.0b36",
        "nvidia-cutlass-dsl": "4.8.1",
        "nvidia-cutlass-dsl-libs-cu13": "4.8.1",
        "apache-tvm-ffi": "0.1.15.post2",
    }
    monkeypatch.setattr(S, "_version", vers.get)
    # fa4aot's runtime imports neither FA4 nor the compiler: only tvm-ffi's ABI series counts
    exp = S.runtime_expectation("sm90", 114)
    assert "fa4" not in exp and "cutlass_dsl" not in exp and "tvm_ffi" not in exp
    assert exp["tvm_ffi_abi"] == "0.1" and exp["cutlass_libs"] == "cu13"
    exp = S.runtime_expectation("sm90", 114, compiler=True)  # install(): FA4's own compiles
    assert {k: exp[k] for k in ("fa4", "cutlass_dsl", "cutlass_libs", "tvm_ffi", "num_sms")} == {
        "fa4": "4.0.0b36",
        "cutlass_dsl": "4.8.1",
        "cutlass_libs": "cu13",
        "tvm_ffi": "0.1.15.post2",
        "num_sms": 114,
    }
    assert S.build_toolchain("sm90", 132)["cutlass_libs"] == "cu13"


def test_a_132_sm_artifact_is_refused_on_a_114_sm_gpu_unless_proven_independent(
    tmp_path, spec, monkeypatch, no_dlopen
):
    from fa4aot.runtime import Runtime

    store, _ = build_stub(tmp_path / "store", spec, monkeypatch)
    d1, d2 = artifact_dirs(store)[:2]
    _make_real(d1)
    reseal(d2, stub=False, sm_count_independent=True)
    rt = Runtime([store.root])
    with pytest.raises(FingerprintMismatch) as e:
        rt.plan(_variant(d1), 114)
    assert "num_sms: built for 132 SMs, this GPU has 114" in str(e.value)
    assert "--num-sms 114" in str(e.value)
    calls, Dlopen = no_dlopen
    with pytest.raises(Dlopen):  # the independent one gets through every check
        rt.plan(_variant(d2), 114)
    with pytest.raises(Dlopen):
        Runtime([store.root]).plan(_variant(d1), 132)


def test_python_minor_skew_is_refused_by_the_runtime(tmp_path, spec, monkeypatch):
    from fa4aot.runtime import Runtime

    other = "3.12" if sys.version_info[:2] != (3, 12) else "3.13"  # a minor a store can target
    build_stub(tmp_path / "store", spec, monkeypatch, python=other)
    with pytest.raises(FingerprintMismatch) as e:
        Runtime([tmp_path / "store"]).stores_for("sm90", 132)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert f"python: store has '{other}', this process needs '{here}'" in str(e.value)


def test_an_artifact_copied_into_another_toolchains_store_is_refused(tmp_path, built):
    import shutil

    other = _store_with(tmp_path / "store", {**built.toolchain, "num_sms": 100})
    src = artifact_dirs(built)[0]
    shutil.copytree(src, other.artifact_dir(src.name))
    with pytest.raises(CorruptArtifact, match="built for toolchain"):
        other.get(src.name)


# -- 5. read-only and layered stores ---------------------------------------------------------

RO_DRIVER = r"""
import json, os, sys
from pathlib import Path
ro = [os.path.realpath(p) for p in sys.argv[1].split(os.pathsep)]
writes = []
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
EVENTS = {"os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.chmod", "os.chown", "os.utime",
          "os.link", "os.symlink", "os.truncate", "shutil.rmtree", "os.makedirs"}

def under_ro(p):
    try:
        rp = os.path.realpath(os.fsdecode(p))
    except (TypeError, ValueError):
        return False
    return any(rp == r or rp.startswith(r + "/") for r in ro)

def hook(event, args):
    if event == "open":
        path, mode, flags = args
        w = (mode and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & WRITE_FLAGS)
        if w and isinstance(path, (str, bytes, os.PathLike)) and under_ro(path):
            writes.append([event, os.fsdecode(path)])
    elif event in EVENTS:
        for a in args:
            if isinstance(a, (str, bytes, os.PathLike)) and under_ro(a):
                writes.append([event, os.fsdecode(a)])

sys.addaudithook(hook)
from click.testing import CliRunner
from fa4aot.store import runtime_lib
from fa4aot.cli import main
from fa4aot.runtime import Runtime
from fa4aot.model.variants import Variant

class Dlopen(Exception):
    pass

def refuse(*a, **k):
    raise Dlopen()

runtime_lib.load_runtime_lib = refuse
rt = Runtime()  # FA4AOT_CACHE_DIR layers
served = dlopen = 0
for store in rt.stores_for("sm90", 132):
    for vid, art in store.iter_artifacts():
        v = Variant.from_dict(art.record["variant"])
        a = rt.find(v, 132)
        a.verify()
        served += 1
        if not a.record["stub"]:
            try:
                rt._load(a)
            except Dlopen:
                dlopen += 1
codes = {}
for cmd in (["ls", "--json"], ["verify", "--json"], ["inspect", vid]):
    codes[cmd[0]] = CliRunner().invoke(main, cmd).exit_code
print(json.dumps({"writes": writes, "served": served, "dlopen": dlopen, "codes": codes}))
"""


def _snapshot(root: Path) -> list:
    return sorted(
        (str(p.relative_to(root)), p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")
    )


def test_a_read_only_store_serves_and_nothing_tries_to_write_into_it(tmp_path, built, monkeypatch):
    _make_real(artifact_dirs(built)[0])
    env = stub_env(FA4AOT_CACHE_DIR=str(built.root), FA4AOT_MISS_LOG=str(tmp_path / "misses"))
    before = _snapshot(built.root)
    # every user, root included: an audit hook sees each attempt to write, whether or not the
    # filesystem would refuse it
    r = subprocess.run(
        [PY, "-c", RO_DRIVER, str(built.root)], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc == {
        "writes": [],
        "served": N_TINY,
        "dlopen": 1,
        "codes": {"ls": 0, "verify": 0, "inspect": 0},
    }
    assert _snapshot(built.root) == before
    # and on a store that really is read-only (mount or modes)
    r = run_readonly([PY, "-c", RO_DRIVER, str(built.root)], [built.root], env, tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["writes"] == []


def test_building_with_only_read_only_layers_is_a_clear_build_error(tmp_path, built, spec):
    other = tmp_path / "image2"
    other.mkdir()
    env = stub_env(FA4AOT_CACHE_DIR=f"{built.root}{os.pathsep}{other}")
    r = run_readonly(
        [PY, "-m", "fa4aot.cli", "build", "--spec", str(spec)], [built.root, other], env, tmp_path
    )
    assert r.returncode == 1
    assert "error: no writable store layer to build into" in r.stderr
    assert str(built.root) in r.stderr and str(other) in r.stderr
    r = run_readonly(
        [PY, "-m", "fa4aot.cli", "build", "--spec", str(spec), "--cache", str(built.root)],
        [built.root],
        env,
        tmp_path,
    )
    assert r.returncode == 1 and "no writable store layer" in r.stderr


def test_layer_writability_is_judged_without_touching_anything(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert "not a directory" in not_writable_reason(f / "store")
    assert not_writable_reason(tmp_path / "does" / "not" / "exist") is None
    assert not (tmp_path / "does").exists()
    with pytest.raises(BuildError, match="no writable store layer"):
        build_root([f / "a", f / "b"])
    assert build_root([f / "a", tmp_path / "ok"]) == tmp_path / "ok"


# TINY_SPEC plus the paged layout
BIG_SPEC = TINY_SPEC.replace(
    'layouts = ["dense", "varlen"]', 'layouts = ["dense", "varlen", "paged"]'
)
assert BIG_SPEC != TINY_SPEC


def test_writable_overlay_receives_builds_and_lookups_search_layers_in_order(
    tmp_path, spec, monkeypatch
):
    from fa4aot.runtime import Runtime

    image, node = tmp_path / "image", tmp_path / "node"
    img_store, _ = build_stub(image, spec, monkeypatch)
    in_image = {d.name for d in artifact_dirs(img_store)}
    before = _snapshot(image)
    big = write_spec(tmp_path, BIG_SPEC, "big.toml")
    env = stub_env(FA4AOT_CACHE_DIR=f"{node}{os.pathsep}{image}")
    r = subprocess.run(
        [
            PY,
            "-c",
            RO_DRIVER.split("sys.addaudithook(hook)")[0]
            + """
sys.addaudithook(hook)
from fa4aot.cli import main
sys.argv = ["fa4aot", "build", "--spec", sys.argv[2], "--json"]
main()
""",
            str(image),
            str(big),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    st = {x["id"]: x["status"] for x in rows}
    assert {v for v, s in st.items() if s == "cached"} == in_image
    assert len([s for s in st.values() if s == "built"]) == len(st) - N_TINY > 0
    assert _snapshot(image) == before  # the read-only layer was not touched
    node_store = stores_at(node)[0]
    assert {d.name for d in artifact_dirs(node_store)} == set(st) - in_image
    rt = Runtime([node, image])
    assert [s.root for s in rt.stores_for("sm90", 132)] == [node, image]
    for vid in st:
        d = (node_store if vid not in in_image else img_store).artifact_dir(vid)
        assert rt.find(_variant(d), 132).dir == d
    # a variant in both layers is served from the first
    import shutil

    first = sorted(in_image)[0]
    shutil.copytree(img_store.artifact_dir(first), node_store.artifact_dir(first))
    assert (
        Runtime([node, image]).find(_variant(node_store.artifact_dir(first)), 132).dir.parent.parent
        == node_store.dir
    )


def test_builds_go_to_the_first_writable_layer_even_when_a_read_only_one_comes_first(
    tmp_path, spec, monkeypatch
):
    image, node = tmp_path / "image", tmp_path / "node"
    img_store, _ = build_stub(image, spec, monkeypatch)
    big = write_spec(tmp_path, BIG_SPEC, "big.toml")
    env = stub_env(FA4AOT_CACHE_DIR=f"{image}{os.pathsep}{node}")
    before = _snapshot(image)
    r = run_readonly(
        [PY, "-m", "fa4aot.cli", "build", "--spec", str(big), "--json"], [image], env, tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["store"].startswith(str(node))
    assert _snapshot(image) == before


# -- 6. untrusted input ----------------------------------------------------------------------


def test_nothing_on_the_load_path_unpickles():
    import re

    pkg = Path(__file__).resolve().parents[2] / "fa4aot"
    runtime = sorted(str(p.relative_to(pkg)) for p in (pkg / "runtime").glob("*.py"))
    assert "runtime/launch.py" in runtime
    store = sorted(str(p.relative_to(pkg)) for p in (pkg / "store").glob("*.py"))
    assert "store/records.py" in store and "store/runtime_lib.py" in store
    for mod in (*store, *runtime, "errors.py"):
        src = (pkg / mod).read_text()
        assert not re.search(
            r"\b(pickle|cPickle|marshal|shelve|dill|torch\.load|yaml\.load|eval\(|exec\()", src
        ), mod


def _other_writable(path: Path, mode: int) -> None:
    os.chown(path, 4242, 4242)
    os.chmod(path, mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
@pytest.mark.parametrize("which", ["artifact dir", "store dir", "root", "part"])
def test_native_code_in_a_directory_others_can_write_is_refused(built, no_dlopen, which):
    from fa4aot.runtime import Runtime

    calls, Dlopen = no_dlopen
    d = artifact_dirs(built)[0]
    _make_real(d)
    target = {"artifact dir": d, "store dir": built.dir, "root": built.root, "part": d / "fwd.so"}[
        which
    ]
    _other_writable(target, 0o775 if target.is_dir() else 0o664)
    with pytest.raises(
        CorruptArtifact,
        match="refusing to load native code: .* group/world-writable and owned by uid 4242",
    ):
        Runtime([built.root], allow_unsafe_dirs=False).plan(_variant(d), 132)
    assert calls == []
    with pytest.raises(Dlopen):  # explicitly allowed
        Runtime([built.root], allow_unsafe_dirs=True).plan(_variant(d), 132)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_the_ownership_check_follows_symlinks_to_where_the_code_really_is(
    tmp_path, built, no_dlopen
):
    from fa4aot.runtime import Runtime

    shared = tmp_path / "shared"
    shared.mkdir()
    os.rename(built.root, shared / "store")
    link = tmp_path / "cache"
    link.symlink_to(shared / "store")
    d = artifact_dirs(Store(link, built.toolchain))[0]
    _make_real(d)
    _other_writable(shared, 0o775)
    with pytest.raises(CorruptArtifact, match=f"{shared} is group/world-writable"):
        Runtime([link]).plan(_variant(d), 132)
    assert no_dlopen[0] == []


def test_world_writable_directory_without_sticky_bit_is_refused(built, no_dlopen):
    from fa4aot.runtime import Runtime

    d = artifact_dirs(built)[0]
    _make_real(d)
    os.chmod(d, 0o777)
    with pytest.raises(CorruptArtifact, match="is world-writable"):
        Runtime([built.root]).plan(_variant(d), 132)
    os.chmod(d, 0o1777)  # sticky, like /tmp: others cannot replace our files
    with pytest.raises(no_dlopen[1]):
        Runtime([built.root]).plan(_variant(d), 132)


# fuzzing: the record parser and the runtime's input checks raise only typed errors, and fast

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUZZ = settings(
    max_examples=1000, deadline=1000, suppress_health_check=list(HealthCheck), derandomize=True
)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=20,
)


@pytest.fixture(scope="module")
def good_record(tmp_path_factory):
    root = tmp_path_factory.mktemp("rec")
    mp = pytest.MonkeyPatch()
    try:
        store, _ = build_stub(root / "s", write_spec(root), mp)
    finally:
        mp.undo()
    return json.loads((artifact_dirs(store)[0] / RECORD).read_text())


def _parse_only_typed(data):
    try:
        parse_record(data, "fuzz")
    except CorruptArtifact:
        pass


@FUZZ
@given(st.binary(max_size=4096))
def test_fuzz_record_parser_bytes(data):
    _parse_only_typed(data)


@FUZZ
@given(_json)
def test_fuzz_record_parser_json_values(v):
    _parse_only_typed(json.dumps(v))


@FUZZ
@given(st.data())
def test_fuzz_record_parser_mutated_records(good_record, data):
    """Valid records with one field replaced by anything (sealed again, so only the type checks
    stand between the value and the loader), or deeply nested input."""
    from fa4aot.store.records import seal_record

    rec = dict(good_record)
    rec.pop("record_sha256")
    key = data.draw(st.sampled_from(sorted(rec) + ["parts.fwd"]))
    val = data.draw(_json)
    if key == "parts.fwd":
        rec["parts"] = {"fwd": val}
    else:
        rec[key] = val
    text = json.dumps(seal_record(rec))
    _parse_only_typed(text)
    depth = data.draw(st.integers(1, 100_000))
    _parse_only_typed("[" * depth + "]" * depth)


def test_parser_survives_pathological_inputs():
    for data in (
        "[" * 1_000_000,
        "1" * 10_000,
        '{"a":' * 200_000,
        b"\xff\xfe",
        "\ud800",
        "x" * (2 << 20),
    ):
        _parse_only_typed(data)


def _tensor(shape, dt):
    import torch

    return torch.zeros(shape, dtype=getattr(torch, dt))


_t = st.builds(
    _tensor,
    st.lists(st.integers(0, 3), max_size=5),
    st.sampled_from(["bfloat16", "float16", "float32", "int32", "int64", "bool", "float8_e4m3fn"]),
)
_any = (
    _t
    | st.none()
    | st.integers(-3, 300)
    | st.text(max_size=3)
    | st.floats()
    | st.tuples(st.integers(-2, 5) | st.none(), st.integers(-2, 5) | st.none())
)
_KW = ["softmax_scale", "causal", "window_size", "learnable_sink", "return_lse"]
_VKW = _KW + [
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "seqused_q",
    "seqused_k",
    "page_table",
]


@settings(
    max_examples=1500, deadline=1000, suppress_health_check=list(HealthCheck), derandomize=True
)
@given(
    st.booleans(),
    _t | _any,
    _t | _any,
    _t | _any,
    st.dictionaries(st.sampled_from(_VKW), _any | _t, max_size=6),
)
def test_fuzz_runtime_input_checks(varlen, q, k, v, kw):
    from fa4aot import runtime

    if varlen:
        fn = runtime.flash_attn_varlen_func
    else:
        fn = runtime.flash_attn_func
        kw = {a: b for a, b in kw.items() if a in _KW}
    try:
        fn(q, k, v, **kw)
    except Fa4aotError:
        pass
