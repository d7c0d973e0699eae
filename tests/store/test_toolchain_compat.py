"""Which toolchain differences a store survives at load.

fa4aot's runtime never imports FA4 or the CuTe DSL compiler (tests/test_house.py), so their
installed versions cannot change what an artifact does: a store built with flash-attn-4 b36 /
CuTe DSL 4.8.1 is served in an engine image that pins other versions. What the artifacts do call
is checked: the CuTe runtime library by identity (runtime_lib.check_matches) and tvm-ffi by ABI
series, whose C symbols an artifact needs are all exported by the oldest tvm-ffi the package
allows (0.1.11, both engines' pin): checked below on a real artifact.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from fa4aot.errors import FingerprintMismatch
from fa4aot.store.layers import find_serving_store
from fa4aot.store.layers import Store
from fa4aot.store.toolchain import FINGERPRINT_FIELDS, runtime_expectation

TINY = (Path(__file__).parents[1] / "specs" / "tiny.toml").read_text()
OLDEST_TVM_FFI = "0.1.11"  # pyproject's floor


def _store(root: Path, **changes) -> Store:
    tc = {k: v for k, v in runtime_expectation("sm90", 132, compiler=True).items()}
    tc.update({"fa4": "4.0.0b36", "cutlass_dsl": "4.8.1", "cutlass_libs": "cu13",
               "tvm_ffi": "0.1.15.post2", "python": tc["python"], "fa4_abi": "upstream"})
    tc.update(changes)
    assert set(FINGERPRINT_FIELDS) <= set(tc)
    s = Store(root, tc)
    s.ensure()
    return s


@pytest.mark.parametrize(
    "changes",
    [{"fa4": "4.0.0b40"}, {"cutlass_dsl": "4.8.0"}, {"tvm_ffi": OLDEST_TVM_FFI}],
    ids=["fa4", "cutlass_dsl", "tvm_ffi-patch"],
)
def test_the_runtime_serves_a_store_whatever_compiler_is_installed(tmp_path, monkeypatch, changes):
    from fa4aot.store import toolchain as T

    built = _store(tmp_path)
    # this process: an engine image with its own pins
    installed = {"flash-attn-4": "4.0.0b36", "nvidia-cutlass-dsl": "4.8.1",
                 "apache-tvm-ffi": "0.1.15.post2", "nvidia-cutlass-dsl-libs-cu13": "4.8.1"}
    dist = {"fa4": "flash-attn-4", "cutlass_dsl": "nvidia-cutlass-dsl", "tvm_ffi": "apache-tvm-ffi"}
    for k, v in changes.items():
        installed[dist[k]] = v
    monkeypatch.setattr(T, "_version", installed.get)
    (s,) = find_serving_store([tmp_path], T.runtime_expectation("sm90", 132))
    assert s.dir == built.dir
    # install() serves FA4's own calls: its compile keys and JIT need the exact FA4 and compiler
    if "tvm_ffi" not in changes:
        with pytest.raises(FingerprintMismatch, match="store has"):
            find_serving_store([tmp_path], T.runtime_expectation("sm90", 132, compiler=True))


def test_another_tvm_ffi_series_is_refused_by_name(tmp_path, monkeypatch):
    from fa4aot.store import toolchain as T

    _store(tmp_path, tvm_ffi="0.2.0")
    monkeypatch.setattr(T, "_version", {"apache-tvm-ffi": "0.1.15.post2"}.get)
    with pytest.raises(FingerprintMismatch, match=r"tvm_ffi_abi: store has '0\.2', this process needs '0\.1'"):
        find_serving_store([tmp_path], T.runtime_expectation("sm90", 132))


def test_a_failed_builds_empty_store_never_shadows_one_that_serves(tmp_path, monkeypatch):
    """Two stores of one layer that the runtime cannot tell apart (they differ only in compiler
    fields it does not compare): both serve, the one holding artifacts first, whatever their
    names' order; a store of another FA4 source in the layer is left out."""
    from fa4aot.store import toolchain as T

    a = _store(tmp_path, cutlass_dsl="4.8.0")
    b = _store(tmp_path, cutlass_dsl="4.8.1")
    empty, full = sorted([a, b], key=lambda s: s.dir.name)  # the empty one sorts first
    (full.dir / "artifacts" / "0123456789abcdef").mkdir()
    _store(tmp_path, cutlass_dsl="4.7.0", fa4_abi="vllm")
    monkeypatch.setattr(T, "_version", {"apache-tvm-ffi": "0.1.15.post2"}.get)  # no compiler
    got = find_serving_store([tmp_path], T.runtime_expectation("sm90", 132))
    assert [s.dir for s in got] == [full.dir, empty.dir]


def _tvm_ffi_lib(version: str, dest: Path) -> Path:
    """libtvm_ffi.so of a tvm-ffi release, from its wheel (pip download, cached)."""
    cache = Path.home() / ".cache" / "fa4aot-test-wheels"
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"apache_tvm_ffi-{version}-*.whl"))
    if not wheels:
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--platform", "manylinux_2_28_x86_64", "--python-version", "3.12", "-d", str(cache),
             f"apache-tvm-ffi=={version}"],
            capture_output=True, text=True, timeout=300,
        )
        wheels = sorted(cache.glob(f"apache_tvm_ffi-{version}-*.whl"))
        if not wheels:
            pytest.skip(f"apache-tvm-ffi {version} wheel not downloadable: {r.stderr[-200:]}")
    with zipfile.ZipFile(wheels[0]) as z:
        (name,) = [n for n in z.namelist() if n.endswith("/libtvm_ffi.so")]
        out = dest / "libtvm_ffi.so"
        out.write_bytes(z.read(name))
    return out


def _symbols(lib: Path, undefined: bool) -> set[str]:
    flag = "--undefined-only" if undefined else "--defined-only"
    out = subprocess.run(["nm", "-D", flag, str(lib)], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}


@pytest.mark.slow
def test_an_artifact_needs_only_symbols_the_oldest_allowed_tvm_ffi_exports(tmp_path):
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) not installed")
    from fa4aot.build.builder import build
    from fa4aot.model.specs import parse_spec

    store, _, results = build([parse_spec(TINY, "tiny.toml")], arch="sm90",
                              root=tmp_path / "store", jobs=1)
    assert {r.status for r in results} == {"built"}
    parts = sorted((store.dir / "artifacts").glob("*/*.so"))
    assert parts
    needed = set().union(*(_symbols(p, undefined=True) for p in parts))
    tvm = {s for s in needed if s.startswith("TVMFFI")}
    assert tvm, "an artifact calls tvm-ffi's C ABI"
    missing = tvm - _symbols(_tvm_ffi_lib(OLDEST_TVM_FFI, tmp_path), undefined=False)
    assert not missing, f"tvm-ffi {OLDEST_TVM_FFI} lacks {sorted(missing)}"
