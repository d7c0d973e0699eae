"""`fa4aot wheel`: cache wheels written by hand are valid wheels (RECORD, METADATA, entry point,
tag), deterministic, filtered by spec; pip installs them into a fresh virtualenv, where the
runtime finds their stores as read-only layers with no configuration, and two stack."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import logging
import os
import re
import shutil
import site
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from stub_store import ROOT, TINY_SPEC, artifact_dirs, build_stub, write_spec

from fa4aot.store import layers as S
from fa4aot.errors import BuildError
from fa4aot.store.wheel import build_wheels
from fa4aot.store.records import RECORD

N_TINY = 8
# head dim 64, dense only: variants disjoint from tiny's
OTHER_SPEC = (
    TINY_SPEC.replace('name = "tiny"', 'name = "other"')
    .replace("head_dim = 128", "head_dim = 64")
    .replace('["dense", "varlen"]', '["dense"]')
)
PYTAG = f"cp{sys.version_info.major}{sys.version_info.minor}"


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """One stub store holding two specs' artifacts (built once for the module)."""
    d = tmp_path_factory.mktemp("src")
    with pytest.MonkeyPatch.context() as mp:
        build_stub(d / "store", write_spec(d), mp)
        store, _ = build_stub(d / "store", write_spec(d, OTHER_SPEC, "other.toml"), mp)
    return store


@pytest.fixture(scope="module")
def n_other(src):
    return len(json.loads(src.spec_index("other").read_text())["variants"])


def _zip(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


def _info(files: dict[str, bytes]) -> str:
    (d,) = {n.split("/")[0] for n in files if ".dist-info/" in n}
    return d


def test_wheel_contents_record_metadata_entry_point_and_tag(tmp_path, src, n_other):
    (res,) = build_wheels([src.root], tmp_path)
    assert res.dist == "fa4aot-cache-sm90" and res.store == src.dir.name
    assert len(res.artifacts) == N_TINY + n_other and res.skipped == []
    # the version is derived from the content: the fingerprint, then a hash of what is inside
    from packaging.version import Version

    fp_hash = src.dir.name.rsplit("-", 1)[1][:8]
    v = Version(res.version)
    assert v.public == "1.0.0" and v.local.startswith(f"fp{fp_hash}.") and len(v.local) == 23
    assert res.path.name.startswith(f"fa4aot_cache_sm90-{res.version}-{PYTAG}-none-linux_")
    assert res.size == res.path.stat().st_size
    files = _zip(res.path)
    info = _info(files)
    assert info == f"fa4aot_cache_sm90-{res.version}.dist-info"
    rows = list(csv.reader(io.StringIO(files[f"{info}/RECORD"].decode())))
    assert sorted(r[0] for r in rows) == sorted(files)  # every member, once
    for name, digest, size in rows:
        if name == f"{info}/RECORD":
            assert digest == size == ""
            continue
        b64 = base64.urlsafe_b64encode(hashlib.sha256(files[name]).digest()).rstrip(b"=")
        assert digest == "sha256=" + b64.decode() and int(size) == len(files[name])
    meta = files[f"{info}/METADATA"].decode()
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    for line in ("Name: fa4aot-cache-sm90", f"Version: {res.version}", "Requires-Dist: fa4aot=="):
        assert line in meta
    # the exact runtime the parts were linked against, and the fa4aot that reads the records
    import fa4aot

    requires = [ln.split(": ", 1)[1] for ln in meta.splitlines() if ln.startswith("Requires-Dist")]
    assert requires[0] == f"fa4aot=={fa4aot.__version__}"
    tc = src.toolchain
    if tc["tvm_ffi"]:
        assert f"apache-tvm-ffi=={tc['tvm_ffi']}" in requires
    if tc["cutlass_libs"] and tc["cutlass_dsl"]:
        assert f"nvidia-cutlass-dsl-libs-{tc['cutlass_libs']}=={tc['cutlass_dsl']}" in requires
    assert f"Requires-Python: =={py}.*\n" in meta
    wheel = files[f"{info}/WHEEL"].decode()
    assert "Root-Is-Purelib: false\n" in wheel and f"Tag: {PYTAG}-none-linux_" in wheel
    assert files[f"{info}/entry_points.txt"] == b"[fa4aot.stores]\nsm90 = fa4aot_cache_sm90\n"
    assert (
        'ROOT = Path(__file__).parent / "store"' in files["fa4aot_cache_sm90/__init__.py"].decode()
    )
    base = f"fa4aot_cache_sm90/store/v1/{src.dir.name}"
    assert files[f"{base}/toolchain.json"] == (src.dir / "toolchain.json").read_bytes()
    assert {f"{base}/specs/tiny.json", f"{base}/specs/other.json"} <= set(files)
    for d in artifact_dirs(src):
        for f in d.iterdir():
            assert files[f"{base}/artifacts/{d.name}/{f.name}"] == f.read_bytes()
    assert not [n for n in files if "/locks/" in n or "/tmp/" in n or "CACHEDIR" in n]
    with zipfile.ZipFile(res.path) as zf:
        assert {i.date_time for i in zf.infolist()} == {(1980, 1, 1, 0, 0, 0)}
        assert zf.namelist()[-1] == f"{info}/RECORD"


def test_same_store_gives_byte_identical_wheels(tmp_path, src):
    (a,) = build_wheels([src.root], tmp_path / "a")
    (b,) = build_wheels([src.root], tmp_path / "b")
    assert a.path.read_bytes() == b.path.read_bytes()
    (c,) = build_wheels([src.root], tmp_path / "a")  # rewritten in place, atomically
    assert c.path == a.path and c.path.read_bytes() == b.path.read_bytes()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [a.path.name]


def test_spec_filter_name_and_version(tmp_path, src, n_other):
    (res,) = build_wheels([src.root], tmp_path, specs=["other"])
    assert res.dist == "fa4aot-cache-sm90-other" and len(res.artifacts) == n_other
    files = _zip(res.path)
    specs = sorted(n.rsplit("/", 1)[1] for n in files if "/specs/" in n)
    assert specs == ["other.json"]
    want = set(json.loads(src.spec_index("other").read_text())["variants"])
    assert {n.split("/")[5] for n in files if "/artifacts/" in n} == want
    (res,) = build_wheels(
        [src.root], tmp_path, name="My_Cache.v2", specs=["tiny", "other"], version="2.1"
    )
    assert res.dist == "fa4aot-cache-my-cache-v2" and len(res.artifacts) == N_TINY + n_other
    assert res.path.name.startswith("fa4aot_cache_my_cache_v2-2.1-")
    ep = _zip(res.path)["fa4aot_cache_my_cache_v2-2.1.dist-info/entry_points.txt"]
    assert ep == b"[fa4aot.stores]\nmy-cache-v2 = fa4aot_cache_my_cache_v2\n"


def test_errors(tmp_path, src):
    with pytest.raises(BuildError, match="no store in"):
        build_wheels([tmp_path / "empty"], tmp_path / "out")
    with pytest.raises(BuildError, match="no sm100 store"):
        build_wheels([src.root], tmp_path / "out", arch="sm100")
    for bad in ("bad name", "-x", "x-", "é", "a/b", ""):
        with pytest.raises(BuildError, match="invalid wheel name"):
            build_wheels([src.root], tmp_path / "out", name=bad)
    with pytest.raises(BuildError, match="invalid version"):
        build_wheels([src.root], tmp_path / "out", version="1.0-final")
    with pytest.raises(BuildError, match="spec 'nope' matches no artifact"):
        build_wheels([src.root], tmp_path / "out", specs=["tiny", "nope"])
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_corrupt_artifacts_are_left_out(tmp_path, src, n_other):
    root = tmp_path / "copy"
    shutil.copytree(src.root, root)
    (store,) = S.stores_at(root)
    victim = artifact_dirs(store)[0]
    (victim / "fwd.so").write_bytes(b"corrupt")
    (res,) = build_wheels([root], tmp_path / "out")
    assert len(res.artifacts) == N_TINY + n_other - 1
    assert [s["id"] for s in res.skipped] == [victim.name] and "size" in res.skipped[0]["error"]
    assert not [n for n in _zip(res.path) if f"/{victim.name}/" in n]
    # layers: the same store in a second root supplies the good copy
    (res,) = build_wheels([root, src.root], tmp_path / "out")
    assert len(res.artifacts) == N_TINY + n_other and res.skipped == []


def test_one_wheel_per_store(tmp_path, src, monkeypatch):
    root = tmp_path / "two"
    shutil.copytree(src.root, root)
    build_stub(root, write_spec(tmp_path), monkeypatch, num_sms=114)
    res = build_wheels([root], tmp_path / "out")
    assert sorted(r.dist for r in res) == ["fa4aot-cache-sm90", "fa4aot-cache-sm90-114sm"]
    with pytest.raises(BuildError, match="would both be fa4aot-cache-x"):
        build_wheels([root], tmp_path / "out2", name="x")
    (res,) = build_wheels([root], tmp_path / "out2", name="x", store="sm90-114sm")
    assert len(res.artifacts) == N_TINY


def test_builds_never_go_into_a_wheel_store(tmp_path, src):
    (res,) = build_wheels([src.root], tmp_path / "out")
    with zipfile.ZipFile(res.path) as zf:
        zf.extractall(tmp_path / "site")
    wheel_root = tmp_path / "site" / "fa4aot_cache_sm90" / "store"
    assert [r["status"] for r in S.verify_root(wheel_root)] == ["ok"] * len(res.artifacts)
    user = tmp_path / "user"
    assert S.build_root([user, wheel_root]) == user
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(BuildError, match="installed cache wheel's store"):
        S.build_root([blocked / "store", wheel_root])


def test_entry_point_discovery_skips_broken_ones(tmp_path, monkeypatch, caplog, knobs):
    good = tmp_path / "mods" / "fa4aot_cache_good"
    (good / "store").mkdir(parents=True)
    (good / "__init__.py").write_text(
        'from pathlib import Path\nROOT = Path(__file__).parent / "store"\n'
    )
    (tmp_path / "mods" / "fa4aot_cache_boom.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / "mods" / "fa4aot_cache_noroot.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    eps = [
        metadata.EntryPoint(n, v, "fa4aot.stores")
        for n, v in [
            ("zz", "fa4aot_cache_good"),
            ("a-missing", "no_such_module_fa4aot"),
            ("b-boom", "fa4aot_cache_boom"),
            ("c-noroot", "fa4aot_cache_noroot"),
            ("dup", "fa4aot_cache_good"),
        ]
    ]
    monkeypatch.setattr(S.metadata, "entry_points", lambda group: eps)
    knobs(cache_dir=str(tmp_path / "user"))
    with caplog.at_level(logging.WARNING, logger="fa4aot"):
        assert S.default_roots() == [tmp_path / "user", good / "store"]
    assert all(n in caplog.text for n in ("a-missing", "b-boom", "c-noroot"))
    assert S.default_roots(wheels=False) == [tmp_path / "user"]
    knobs(cache_wheels="0")
    assert S.default_roots() == [tmp_path / "user"]


# -- installed with pip into a fresh virtualenv -----------------------------------------------

_CHECK = """
import json, sys
from fa4aot.runtime import Runtime
from fa4aot.store.layers import default_roots
from fa4aot.model.variants import Variant
wanted = json.loads(sys.argv[1])
rt = Runtime()
found = {}
for vid, v in wanted.items():
    art = rt.find(Variant.from_dict(v), 132)
    found[vid] = str(art.dir) if art else None
print(json.dumps({"roots": [str(r) for r in default_roots()], "found": found}))
"""


def _venv(tmp_path: Path) -> Path:
    """A fresh virtualenv where fa4aot and its dependencies import from this checkout and this
    interpreter's site-packages (a .pth), and pip (this interpreter's) installs into it."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    out = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    paths = [str(ROOT), *site.getsitepackages()]
    (Path(out.stdout.strip()) / "fa4aot_test_deps.pth").write_text("\n".join(paths) + "\n")
    return py


def _pip_install(py: Path, *wheels: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q"]
        + ["--no-deps", "--no-index", "--disable-pip-version-check", *map(str, wheels)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def _check(py: Path, user: Path, wanted: dict, **env: str) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("FA4AOT_", "PYTHON"))}
    e.update(FA4AOT_CACHE_DIR=str(user), **env)
    r = subprocess.run(
        [str(py), "-c", _CHECK, json.dumps(wanted)],
        env=e,
        cwd=user.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_pip_installed_wheels_are_found_and_stack(tmp_path, src):
    pytest.importorskip("pip")
    (a,) = build_wheels([src.root], tmp_path / "dist", name="a", specs=["tiny"])
    (b,) = build_wheels([src.root], tmp_path / "dist", name="b", specs=["other"])
    py = _venv(tmp_path)
    _pip_install(py, a.path, b.path)
    variants = {
        d.name: json.loads((d / RECORD).read_text())["variant"] for d in artifact_dirs(src)
    }
    user = tmp_path / "user"
    user.mkdir()
    got = _check(py, user, variants)
    site_dir = Path(
        subprocess.run(
            [str(py), "-c", "import fa4aot_cache_a; print(fa4aot_cache_a.ROOT.parent.parent)"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    roots = [user, site_dir / "fa4aot_cache_a" / "store", site_dir / "fa4aot_cache_b" / "store"]
    assert [Path(r) for r in got["roots"]] == roots  # the user's layer first, wheels by name
    for vid, where in got["found"].items():
        wheel = "a" if vid in a.artifacts else "b"
        assert where == str(
            roots[1 if wheel == "a" else 2] / "v1" / src.dir.name / "artifacts" / vid
        )
    assert set(got["found"]) == set(a.artifacts) | set(b.artifacts)
    assert [r["status"] for r in S.verify_root(roots[1])] == ["ok"] * len(a.artifacts)
    off = _check(py, user, variants, FA4AOT_CACHE_WHEELS="0")
    assert [Path(r) for r in off["roots"]] == [user]
    assert set(off["found"].values()) == {None}


def test_a_rebuilt_cache_wheel_replaces_the_installed_one(tmp_path, src):
    """Issue 14: with a fixed version, pip called a rebuilt cache wheel "already installed"
    and kept the old store (this test fails so with version="1.0.0" for both). Two wheels of
    one name, different content: the second install wins and the runtime sees exactly its
    artifacts."""
    pytest.importorskip("pip")
    (a,) = build_wheels([src.root], tmp_path / "d1", name="fleet", specs=["tiny"])
    (b,) = build_wheels([src.root], tmp_path / "d2", name="fleet", specs=["other"])
    assert a.version != b.version and set(a.artifacts).isdisjoint(b.artifacts)
    py = _venv(tmp_path)
    variants = {
        d.name: json.loads((d / RECORD).read_text())["variant"] for d in artifact_dirs(src)
    }
    user = tmp_path / "user"
    user.mkdir()
    _pip_install(py, a.path)
    first = {v for v, where in _check(py, user, variants)["found"].items() if where}
    _pip_install(py, b.path)
    second = {v for v, where in _check(py, user, variants)["found"].items() if where}
    assert first == set(a.artifacts) and second == set(b.artifacts)


# -- the platform tag of real ELF parts --------------------------------------------------------


def _objdump_glibc(path: Path):
    out = subprocess.run(["objdump", "-T", str(path)], capture_output=True, text=True, check=True)
    vers = {
        tuple(map(int, v.split(".")))
        for v in re.findall(r"GLIBC_([0-9.]+)\b", out.stdout)
    }
    vers = {v for v in vers if len(v) == 2}
    return max(vers) if vers else None


@pytest.mark.skipif(
    shutil.which("objdump") is None or shutil.which("gcc") is None, reason="binutils/gcc"
)
def test_glibc_needed_matches_objdump(tmp_path):
    """The .gnu.version_r parser agrees with objdump on this Python and on a shared object
    that calls a versioned glibc function (and on one that calls none, like fa4aot's parts)."""
    from fa4aot.store.wheel import glibc_needed

    src = tmp_path / "x.c"
    src.write_text(
        "#include <string.h>\nvoid f(char *a, const char *b, unsigned n) { memcpy(a, b, n); }\n"
    )
    none = tmp_path / "none.c"
    none.write_text("int g(int x) { return 2 * x; }\n")
    for c in (src, none):
        subprocess.run(
            ["gcc", "-O2", "-shared", "-fPIC", "-o", str(c.with_suffix(".so")), str(c)], check=True
        )
    paths = [Path(os.path.realpath(sys.executable)), src.with_suffix(".so")]
    for p in paths:
        want = _objdump_glibc(p)
        assert want is not None and glibc_needed(p.read_bytes()) == want, p
    assert glibc_needed(none.with_suffix(".so").read_bytes()) is None


def _elf(machine: int) -> bytes:
    """A 64-bit little-endian ELF header with no sections."""
    h = bytearray(64)
    h[:6] = b"\x7fELF\x02\x01"
    h[18:20] = machine.to_bytes(2, "little")
    return bytes(h)


def test_platform_tag_from_elf_parts():
    from fa4aot.store.wheel import _platform

    assert _platform({"a/fwd.so": _elf(62), "a/record.json": b"{}"}) == "manylinux_2_17_x86_64"
    assert _platform({"a/fwd.so": _elf(183)}) == "manylinux_2_17_aarch64"
    with pytest.raises(BuildError, match="ELF machine 3 has no wheel platform tag"):
        _platform({"a/fwd.so": _elf(3)})
    with pytest.raises(BuildError, match="other parts are 62"):
        _platform({"a/fwd.so": _elf(62), "b/fwd.so": _elf(183)})
    bad = bytearray(_elf(62))  # one section header, 1 GB past the end of the file
    bad[0x28:0x30] = (10**9).to_bytes(8, "little")
    bad[0x3A:0x3E] = (64).to_bytes(2, "little") + (1).to_bytes(2, "little")
    with pytest.raises(BuildError, match="unreadable ELF"):
        _platform({"a/fwd.so": bytes(bad)})


def test_version_follows_the_content(tmp_path, src):
    """One store, one version; a store whose content differs gets another (pip would otherwise
    call the second wheel "already installed")."""
    (a,) = build_wheels([src.root], tmp_path / "a", specs=["tiny"])
    (b,) = build_wheels([src.root], tmp_path / "b", specs=["tiny"])
    (c,) = build_wheels([src.root], tmp_path / "c")  # more artifacts
    assert a.version == b.version != c.version
    assert a.version.split(".")[-1] != c.version.split(".")[-1]
    assert a.version.split("+")[1].split(".")[0] == c.version.split("+")[1].split(".")[0]
