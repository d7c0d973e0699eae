"""A store's toolchain: the fingerprint of the FA4 / CuTe DSL / tvm-ffi / Python / arch that
built it, what a runtime expects, and how the two differ."""

from __future__ import annotations

import hashlib
import json
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from fa4aot.errors import CorruptArtifact, RuntimeLibraryMissing
from fa4aot.store import runtime_lib
from fa4aot.store.files import MAX_RECORD_BYTES

FINGERPRINT_FIELDS = ("fa4", "cutlass_dsl", "cutlass_libs", "tvm_ffi", "python", "arch", "num_sms")


def canonical_json(d: Any) -> str:
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cutlass_libs() -> str | None:
    # The compiler picks the newest CUDA flavor installed when no driver is present; the
    # project pins [cu13] and the runtime loads the cu13 libcute_dsl_runtime.so.
    for flavor in ("cu13", "cu12"):
        if _version(f"nvidia-cutlass-dsl-libs-{flavor}"):
            return flavor
    return None


def build_toolchain(arch: str, num_sms: int, python: str | None = None) -> dict[str, Any]:
    """The fingerprint of a build: versions read from package metadata (no compiler import).

    `python` is the target interpreter's minor version: artifacts are C shared objects called
    through tvm-ffi's C ABI, so a build on 3.11 may target a 3.12 runtime; the store records the
    target and the runtime refuses any other.
    """
    tc = {
        "fa4": _version("flash-attn-4"),
        "cutlass_dsl": _version("nvidia-cutlass-dsl"),
        "cutlass_libs": _cutlass_libs(),
        "tvm_ffi": _version("apache-tvm-ffi"),
        "python": python or f"{sys.version_info.major}.{sys.version_info.minor}",
        "arch": arch,
        "num_sms": int(num_sms),
    }
    # the runtime library the artifacts link against: recorded, not fingerprinted (stores
    # built before it keep their directory); the runtime refuses another one at load
    # (runtime_lib.check_matches)

    try:
        tc["runtime_lib"] = runtime_lib.identity()
    except (RuntimeLibraryMissing, OSError):
        pass
    return tc


def fingerprint_dir(tc: dict[str, Any]) -> str:
    h = hashlib.sha256(canonical_json({k: tc[k] for k in FINGERPRINT_FIELDS}).encode()).hexdigest()[
        :12
    ]
    return f"{tc['arch']}-{tc['num_sms']}sm-py{tc['python'].replace('.', '')}-{h}"


def runtime_expectation(arch: str, num_sms: int) -> dict[str, Any]:
    """What this process can serve: fields it cannot know (no FA4 installed) are left out."""
    exp = {
        "fa4": _version("flash-attn-4"),
        "cutlass_dsl": _version("nvidia-cutlass-dsl"),
        "cutlass_libs": _cutlass_libs(),
        "tvm_ffi": _version("apache-tvm-ffi"),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "arch": arch,
        "num_sms": int(num_sms),
    }
    return {k: v for k, v in exp.items() if v is not None}


def mismatches(tc: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    return [
        f"{k}: store has {tc.get(k)!r}, this process needs {v!r}"
        for k, v in expected.items()
        if tc.get(k) != v
    ]


def read_toolchain(d: Path) -> dict[str, Any]:
    """A fingerprint directory's toolchain.json; CorruptArtifact unless it is well-formed and
    hashes to the directory's own name."""
    where = d / "toolchain.json"
    try:
        raw = where.read_bytes()[:MAX_RECORD_BYTES]
        tc = json.loads(raw)
        ok = (
            isinstance(tc, dict)
            and all(k in tc for k in FINGERPRINT_FIELDS)
            and isinstance(tc["arch"], str)
            and isinstance(tc["python"], str)
            and type(tc["num_sms"]) is int
            and fingerprint_dir(tc) == d.name
        )
    except FileNotFoundError:
        raise CorruptArtifact(f"{where}: missing") from None
    except OSError as e:
        raise CorruptArtifact(f"{where}: unreadable: {e.strerror}") from None
    except (ValueError, UnicodeDecodeError, RecursionError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise CorruptArtifact(f"{where}: not a valid toolchain for directory {d.name}")
    return tc


