"""The on-disk store: versioned by toolchain fingerprint, one directory per artifact.

    <root>/CACHEDIR.TAG
    <root>/v1/<fingerprint dir>/toolchain.json          the fingerprint's fields
    <root>/v1/<fp>/artifacts/<variant id>/fwd.so ...    parts (shared objects)
    <root>/v1/<fp>/artifacts/<variant id>/record.json   written last: the commit marker
    <root>/v1/<fp>/specs/<spec>.json                    what each spec asked for (ls, coverage)
    <root>/v1/<fp>/locks/<variant id>.lock              per-artifact build lock
    <root>/v1/<fp>/tmp/                                 build scratch, removed on success

Readers trust an artifact only through its record: parts are published before the record and
each part's sha256 is in it, so a directory without a record, or whose parts do not match it,
is never loaded (a process killed mid-publish leaves a miss, not a bad kernel).
Records are JSON; nothing on the load path unpickles.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

from .errors import CorruptArtifact, FingerprintMismatch

LAYOUT = "v1"
RECORD = "record.json"
RECORD_FORMAT = 1
FINGERPRINT_FIELDS = ("fa4", "cutlass_dsl", "cutlass_libs", "tvm_ffi", "python", "arch", "num_sms")
CACHEDIR_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by fa4aot.\n"
    "# For information about cache directory tags see https://bford.info/cachedir/\n"
)


def canonical_json(d: Any) -> str:
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def build_toolchain(arch: str, num_sms: int, python: str | None = None) -> dict[str, Any]:
    """The fingerprint of a build: versions read from package metadata (no compiler import).

    `python` is the target interpreter's minor version: artifacts are C shared objects called
    through tvm-ffi's C ABI, so a build on 3.11 may target a 3.12 runtime; the store records the
    target and the runtime refuses any other.
    """
    return {
        "fa4": _version("flash-attn-4"),
        "cutlass_dsl": _version("nvidia-cutlass-dsl"),
        # The compiler picks the newest CUDA flavor installed when no driver is present; the
        # project pins [cu13] and the runtime loads the cu13 libcute_dsl_runtime.so.
        "cutlass_libs": "cu13" if _version("nvidia-cutlass-dsl-libs-cu13") else (
            "cu12" if _version("nvidia-cutlass-dsl-libs-cu12") else None),
        "tvm_ffi": _version("apache-tvm-ffi"),
        "python": python or f"{sys.version_info.major}.{sys.version_info.minor}",
        "arch": arch,
        "num_sms": int(num_sms),
    }


def fingerprint_dir(tc: dict[str, Any]) -> str:
    h = hashlib.sha256(canonical_json({k: tc[k] for k in FINGERPRINT_FIELDS}).encode()).hexdigest()[:12]
    return f"{tc['arch']}-{tc['num_sms']}sm-py{tc['python'].replace('.', '')}-{h}"


def runtime_expectation(arch: str, num_sms: int) -> dict[str, Any]:
    """What this process can serve: fields it cannot know (no FA4 installed) are left out."""
    exp = {
        "fa4": _version("flash-attn-4"),
        "cutlass_dsl": _version("nvidia-cutlass-dsl"),
        "tvm_ffi": _version("apache-tvm-ffi"),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "arch": arch,
        "num_sms": int(num_sms),
    }
    return {k: v for k, v in exp.items() if v is not None}


def mismatches(tc: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    return [f"{k}: store has {tc.get(k)!r}, this process needs {v!r}"
            for k, v in expected.items() if tc.get(k) != v]


def default_roots() -> list[Path]:
    """Store roots, in lookup order: FA4AOT_CACHE_DIR (':'-separated layers), else platformdirs."""
    env = os.environ.get("FA4AOT_CACHE_DIR")
    if env:
        return [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    import platformdirs

    return [Path(platformdirs.user_cache_dir("fa4aot"))]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    """temp file in the same directory + fsync + os.replace: readers see all or nothing."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@dataclass(frozen=True)
class Artifact:
    """A published artifact, as read from its record."""

    dir: Path
    record: dict[str, Any]

    @property
    def id(self) -> str:
        return self.record["id"]

    def part_path(self, name: str) -> Path:
        return self.dir / self.record["parts"][name]["file"]

    @property
    def size(self) -> int:
        return sum(p["size"] for p in self.record["parts"].values())

    def verify(self) -> None:
        """Raise CorruptArtifact unless every part matches its size and sha256."""
        for name, p in self.record["parts"].items():
            path = self.dir / p["file"]
            try:
                st = path.stat()
            except OSError as e:
                raise CorruptArtifact(f"{self.dir}: part {name} unreadable: {e.strerror}") from None
            if st.st_size != p["size"]:
                raise CorruptArtifact(f"{path}: size {st.st_size} != recorded {p['size']}")
            if sha256_file(path) != p["sha256"]:
                raise CorruptArtifact(f"{path}: sha256 differs from its record")


def parse_record(text: str | bytes, where: str) -> dict[str, Any]:
    """Record JSON -> dict, with the fields the loader relies on type-checked."""
    try:
        rec = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptArtifact(f"{where}: record is not valid JSON: {e}") from None
    ok = (
        isinstance(rec, dict)
        and rec.get("format") == RECORD_FORMAT
        and isinstance(rec.get("id"), str)
        and isinstance(rec.get("variant"), dict)
        and isinstance(rec.get("parts"), dict)
        and rec["parts"]
        and all(
            isinstance(p, dict)
            and isinstance(p.get("file"), str)
            and "/" not in p["file"] and p["file"] not in ("", ".", "..")
            and isinstance(p.get("sha256"), str)
            and isinstance(p.get("size"), int)
            for p in rec["parts"].values()
        )
    )
    if not ok:
        raise CorruptArtifact(f"{where}: record is missing fields or has wrong types")
    return rec


class Store:
    """One fingerprint directory of one root."""

    def __init__(self, root: Path, toolchain: dict[str, Any]):
        self.root = Path(root)
        self.toolchain = toolchain
        self.dir = self.root / LAYOUT / fingerprint_dir(toolchain)

    # paths
    def artifact_dir(self, vid: str) -> Path:
        return self.dir / "artifacts" / vid

    def lock_path(self, vid: str) -> Path:
        return self.dir / "locks" / f"{vid}.lock"

    def spec_index(self, spec: str) -> Path:
        return self.dir / "specs" / f"{spec}.json"

    def ensure(self) -> None:
        """Create the layout (writers only)."""
        for d in ("artifacts", "locks", "tmp", "specs"):
            (self.dir / d).mkdir(parents=True, exist_ok=True)
        tag = self.root / "CACHEDIR.TAG"
        if not tag.exists():
            atomic_write(tag, CACHEDIR_TAG.encode())
        tc = self.dir / "toolchain.json"
        if not tc.exists():
            atomic_write(tc, (json.dumps(self.toolchain, indent=2, sort_keys=True) + "\n").encode())

    # reading
    def get(self, vid: str, verify: bool = True) -> Artifact | None:
        """The published artifact `vid`, or None if absent. Corruption raises CorruptArtifact."""
        d = self.artifact_dir(vid)
        try:
            text = (d / RECORD).read_bytes()
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            return None
        rec = parse_record(text, str(d / RECORD))
        if rec["id"] != vid:
            raise CorruptArtifact(f"{d}: record id {rec['id']!r} does not match its directory")
        art = Artifact(d, rec)
        if verify:
            art.verify()
        return art

    def iter_artifacts(self) -> Iterator[tuple[str, Artifact | CorruptArtifact]]:
        base = self.dir / "artifacts"
        if not base.is_dir():
            return
        for d in sorted(base.iterdir()):
            if not (d / RECORD).exists():
                continue  # unpublished: a build in progress or killed
            try:
                a = self.get(d.name, verify=False)
                yield d.name, a
            except CorruptArtifact as e:
                yield d.name, e


def stores_at(root: Path) -> list[Store]:
    """Every fingerprint directory under a root (for ls / verify / diagnostics)."""
    base = Path(root) / LAYOUT
    out = []
    if base.is_dir():
        for d in sorted(base.iterdir()):
            try:
                tc = json.loads((d / "toolchain.json").read_text())
                s = Store(Path(root), tc)
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
            if s.dir.name == d.name:
                out.append(s)
    return out


def find_serving_store(roots: list[Path], expected: dict[str, Any]) -> list[Store]:
    """The stores (one per layer at most) whose toolchain matches `expected`, in layer order.

    Raises FingerprintMismatch when no layer has a match but some have stores: the message
    names each field that differs, so version skew is never a silent miss.
    """
    found, skew = [], []
    for root in roots:
        for s in stores_at(root):
            if s.toolchain.get("arch") != expected.get("arch"):
                continue
            bad = mismatches(s.toolchain, expected)
            if bad:
                skew.append(f"{s.dir}: " + "; ".join(bad))
            else:
                found.append(s)
                break
    if not found and skew:
        raise FingerprintMismatch(
            "no store built for this toolchain/GPU:\n  " + "\n  ".join(skew)
            + "\nrebuild with: fa4aot build --arch {a} --num-sms {n} --python {p}".format(
                a=expected.get("arch"), n=expected.get("num_sms"), p=expected.get("python"))
        )
    return found


def unsafe_dir_reason(path: Path) -> str | None:
    """Why loading native code from `path` is unsafe: writable by others and not ours/root's."""
    try:
        st = path.stat()
    except OSError:
        return None
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and st.st_uid not in (0, os.getuid()):
        return f"{path} is group/world-writable and owned by uid {st.st_uid}"
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return f"{path} is world-writable"
    return None
