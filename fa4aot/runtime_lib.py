"""Locating and loading libcute_dsl_runtime.so without importing the CuTe compiler."""

from __future__ import annotations

import ctypes
from importlib import metadata
from pathlib import Path

from .errors import RuntimeLibraryMissing

_LOADED: str | None = None


def find_runtime_lib() -> str:
    """FA4AOT_RUNTIME_LIB, else the cu13 (then cu12) library of the installed cutlass-dsl wheel.

    The wheel's files are found through its package metadata: nothing of the compiler is
    imported.
    """
    from . import settings

    env = settings.runtime_lib()
    if env:
        if not env.is_file():
            raise RuntimeLibraryMissing(f"FA4AOT_RUNTIME_LIB={env} does not exist")
        return str(env)
    for flavor in ("cu13", "cu12"):
        try:
            dist = metadata.distribution(f"nvidia-cutlass-dsl-libs-{flavor}")
        except metadata.PackageNotFoundError:
            continue
        p = Path(str(dist.locate_file(f"nvidia_cutlass_dsl/{flavor}/lib/libcute_dsl_runtime.so")))
        if p.is_file():
            return str(p)
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
