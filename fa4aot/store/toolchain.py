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


# what of a store's `fa4_source` record names it (its prefix is descriptive)
SOURCE_FIELDS = ("name", "package", "version", "sha256", "abi")


def source_name(tc: dict[str, Any]) -> str:
    """The FA4 source a toolchain records ("upstream" for stores that predate the record)."""
    src = tc.get("fa4_source")
    return src.get("name", "upstream") if isinstance(src, dict) else "upstream"


def fa4_abi(tc: dict[str, Any]) -> str:
    """The FA4 source ABI a toolchain's artifacts were built for (upstream in stores that
    predate the field)."""
    return tc.get("fa4_abi", "upstream")


def source_label(tc: dict[str, Any]) -> str:
    """A store's FA4 source for a listing: "upstream 4.0.0b36", "vllm 0.33.0 (f3bcc631ba55)"."""
    src = tc.get("fa4_source")
    if not isinstance(src, dict):
        return f"upstream {tc.get('fa4')}"
    ver = src.get("version") or ""
    return f"{src.get('name')} {ver} ({str(src.get('sha256'))[:12]})".replace("  ", " ")


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


def build_toolchain(arch: str, num_sms: int, python: str | None = None,
                    source: Any = None) -> dict[str, Any]:
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
    if source is not None and source.name != "upstream":
        # the FA4 the kernels were compiled from (fa4.sources.Fa4Source): another fingerprint
        # directory (fingerprint_dir), selected by fa4_abi. An upstream store records none: its
        # `fa4` (flash-attn-4's version) names it, as before sources were recorded.
        tc["fa4_source"] = source.record()
        tc["fa4_abi"] = source.abi
        tc["fa4"] = f"{source.package or source.name} {source.version or source.sha256[:12]}"
    # the runtime library the artifacts link against: recorded, not fingerprinted (stores
    # built before it keep their directory); the runtime refuses another one at load
    # (runtime_lib.check_matches)

    try:
        tc["runtime_lib"] = runtime_lib.identity()
    except (RuntimeLibraryMissing, OSError):
        pass
    return tc


def fingerprint_dir(tc: dict[str, Any]) -> str:
    fields = {k: tc[k] for k in FINGERPRINT_FIELDS}
    if source_name(tc) != "upstream":  # (upstream stores keep the directories they had)
        fields["fa4_source"] = {k: tc["fa4_source"].get(k) for k in SOURCE_FIELDS}
    h = hashlib.sha256(canonical_json(fields).encode()).hexdigest()[:12]
    return f"{tc['arch']}-{tc['num_sms']}sm-py{tc['python'].replace('.', '')}-{h}"


def tvm_ffi_series(version: str | None) -> str | None:
    """tvm-ffi's ABI series ("0.1" of "0.1.15.post2"): artifacts call its C ABI, which is kept
    within a series (tests/store/test_toolchain_compat.py checks the symbols)."""
    return ".".join(version.split(".")[:2]) if version else None


def store_value(tc: dict[str, Any], key: str) -> Any:
    """A store toolchain's value for an expectation key (`runtime_expectation`)."""
    return tvm_ffi_series(tc.get("tvm_ffi")) if key == "tvm_ffi_abi" else tc.get(key)


def runtime_expectation(arch: str, num_sms: int, compiler: bool = False) -> dict[str, Any]:
    """What this process can serve: fields it cannot know (no FA4 installed) are left out.
    FA4AOT_KERNEL_SOURCE picks the FA4 source's ABI (auto: upstream's where flash-attn-4 is installed,
    any otherwise; vllm: stores built from vLLM's copy, whatever else is installed).

    compiler=False, fa4aot's own runtime: it never imports the installed FA4 or CuTe DSL
    compiler, so their versions are not compared (the CuTe runtime library the artifacts call
    is checked by identity at load, runtime_lib.check_matches), and tvm-ffi is compared by ABI
    series. compiler=True, install(): FA4's own calls and compile keys, every version exactly."""
    from fa4aot import settings

    want = settings.fa4_source()
    upstream = want == "upstream" or (want == "auto" and _version("flash-attn-4"))
    exp = {
        "fa4": _version("flash-attn-4") if upstream else None,
        "fa4_abi": "upstream" if upstream else (None if want == "auto" else want),
        "cutlass_dsl": _version("nvidia-cutlass-dsl"),
        "cutlass_libs": _cutlass_libs(),
        "tvm_ffi": _version("apache-tvm-ffi"),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "arch": arch,
        "num_sms": int(num_sms),
    }
    if not compiler:
        exp["fa4"] = exp["cutlass_dsl"] = None
        exp["tvm_ffi_abi"] = tvm_ffi_series(exp.pop("tvm_ffi"))
    return {k: v for k, v in exp.items() if v is not None}


def mismatches(tc: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    return [
        f"{k}: store has {store_value(tc, k)!r}, this process needs {v!r}"
        for k, v in expected.items()
        if store_value(tc, k) != v
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
            and isinstance(tc.get("fa4_source", {}), dict)
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
    tc.setdefault("fa4_abi", "upstream")  # (stores from before sources were recorded)
    return tc


