"""Locating and loading libcute_dsl_runtime.so without importing the CuTe compiler."""

from __future__ import annotations

import ctypes
import hashlib
from importlib import metadata
from pathlib import Path

from fa4aot import settings
from fa4aot.errors import RuntimeLibraryMismatch, RuntimeLibraryMissing

_LOADED: str | None = None
_IDENTITY: dict[str, dict] = {}


def find_runtime_lib() -> str:
    """FA4AOT_RUNTIME_LIB, else the cu13 (then cu12) library of the installed cutlass-dsl wheel.

    The wheel's files are found through its package metadata: nothing of the compiler is
    imported.
    """

    env = settings.runtime_lib()
    if env:
        if not env.is_file():
            raise RuntimeLibraryMissing(f"FA4AOT_RUNTIME_LIB={env} does not exist")
        return str(env)
    found = next(_wheel_libs(), None)
    if found is not None:
        return str(found[1])
    raise RuntimeLibraryMissing(
        "libcute_dsl_runtime.so not found: install nvidia-cutlass-dsl-libs-cu13 or set "
        "FA4AOT_RUNTIME_LIB to its path"
    )


def load_runtime_lib() -> str:
    """dlopen the CuTe runtime with RTLD_GLOBAL once, so artifacts resolve its symbols."""
    global _LOADED
    if _LOADED is None:
        path = find_runtime_lib()
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        _LOADED = path
    return _LOADED


def _wheel_libs():
    """(version, path) of each installed nvidia-cutlass-dsl-libs wheel's runtime library, cu13
    first. Found through package metadata: nothing of the compiler is imported."""
    for flavor in ("cu13", "cu12"):
        try:
            dist = metadata.distribution(f"nvidia-cutlass-dsl-libs-{flavor}")
        except metadata.PackageNotFoundError:
            continue
        p = Path(str(dist.locate_file(f"nvidia_cutlass_dsl/{flavor}/lib/libcute_dsl_runtime.so")))
        if p.is_file():
            yield dist.version, p


def _wheel_version(path: str) -> str | None:
    """The version of the nvidia-cutlass-dsl-libs wheel that installed `path`, if one did."""
    for version, p in _wheel_libs():
        if p.resolve() == Path(path).resolve():
            return version
    return None


def identity(path: str | None = None, digest: bool = True) -> dict:
    """{"version": the libs wheel's version or None (a copy named by FA4AOT_RUNTIME_LIB),
    "sha256": of the file (when `digest`)} of the runtime library, computed once per process:
    hashing its 43 MB takes ~0.1 s."""
    path = path or find_runtime_lib()
    got = _IDENTITY.get(path)
    if got is None or (digest and "sha256" not in got):
        got = {"version": _wheel_version(path)}
        if digest:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            got["sha256"] = h.hexdigest()
        _IDENTITY[path] = got
    return got


def check_matches(recorded: dict | None, path: str | None = None) -> None:
    """Refuse to serve a store with another runtime library than the one it was built with.

    `recorded`: the store toolchain's "runtime_lib" ({"version", "sha256"}; None for stores
    built before it was recorded: not checked). The artifacts call into this library's
    internal ABI, which the CuTe DSL does not promise to keep between releases, so a 4.9
    library loading a 4.8.1 store is refused up front rather than left to fail at a call.
    The version is compared when both sides know it (the wheel's metadata, free); otherwise
    (FA4AOT_RUNTIME_LIB names a copy) the sha256 of the file, once per process."""
    if not recorded:
        return
    path = path or find_runtime_lib()
    mine = identity(path, digest=False)
    if recorded.get("version") and mine["version"]:
        if mine["version"] == recorded["version"]:
            return
        same = False
    else:
        same = identity(path)["sha256"] == recorded.get("sha256")
    if not same:
        theirs = recorded.get("version") or "unknown version"
        ours = mine["version"] or f"a copy at {path}"
        raise RuntimeLibraryMismatch(
            f"this store was built against libcute_dsl_runtime.so {theirs} (sha256 "
            f"{str(recorded.get('sha256'))[:12]}...), this process loads {ours} (sha256 "
            f"{identity(path)['sha256'][:12]}...). Install nvidia-cutlass-dsl-libs==" 
            f"{theirs} (or point FA4AOT_RUNTIME_LIB at that version's library), or rebuild "
            f"the store with this one: fa4aot build"
        )
