"""The runtime library a store was built against is recorded, and a different one refused
(issue 14: a 4.9 libcute_dsl_runtime.so serving a 4.8.1 store loaded without a word)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fa4aot.store import runtime_lib
from fa4aot.errors import RuntimeLibraryMismatch, RuntimeLibraryMissing
from fa4aot.store.layers import Store
from fa4aot.store.records import Artifact
from fa4aot.store.toolchain import build_toolchain


def _lib(tmp_path: Path, content: bytes) -> str:
    p = tmp_path / f"libcute_dsl_runtime-{len(content)}.so"
    p.write_bytes(content)
    return str(p)


def test_a_copy_is_compared_by_sha256(tmp_path):
    lib = _lib(tmp_path, b"the library" * 100)
    recorded = runtime_lib.identity(lib)
    assert recorded["version"] is None and len(recorded["sha256"]) == 64
    runtime_lib.check_matches(recorded, lib)
    runtime_lib.check_matches(None, lib)  # stores from before the record: not checked
    other = _lib(tmp_path, b"another build")
    with pytest.raises(RuntimeLibraryMismatch, match="rebuild the store"):
        runtime_lib.check_matches(recorded, other)


def test_the_installed_wheel_is_compared_by_version():
    try:
        lib = runtime_lib.find_runtime_lib()
    except RuntimeLibraryMissing:
        pytest.skip("no nvidia-cutlass-dsl-libs installed")
    mine = runtime_lib.identity(lib)
    if mine["version"] is None:
        pytest.skip("FA4AOT_RUNTIME_LIB names a copy")
    runtime_lib.check_matches({"version": mine["version"], "sha256": "x" * 64}, lib)
    with pytest.raises(RuntimeLibraryMismatch) as e:
        runtime_lib.check_matches({"version": "4.9.0", "sha256": "x" * 64}, lib)
    assert "4.9.0" in str(e.value) and mine["version"] in str(e.value)  # both versions named


def test_builds_record_it_and_the_runtime_checks_it_before_loading(tmp_path, monkeypatch):
    import fa4aot.runtime as R

    tc = build_toolchain("sm90", 132)
    if "runtime_lib" not in tc:
        pytest.skip("no runtime library to record")
    assert tc["runtime_lib"] == runtime_lib.identity()
    bad = dict(tc, runtime_lib={"version": "0.0.1", "sha256": "0" * 64})
    store = Store(tmp_path, bad)
    store.ensure()  # (runtime_lib is not a fingerprint field: same directory as `tc`)
    assert store.dir == Store(tmp_path, tc).dir
    art = Artifact(store.artifact_dir("0" * 16), {"id": "0" * 16, "parts": {}})
    rt = R.Runtime(roots=[tmp_path])
    with pytest.raises(RuntimeLibraryMismatch, match="0.0.1"):
        rt._check_runtime_lib(art)
