"""An artifact's record: what its parts are, with their sha256, sealed by its own digest.
parse_record raises only CorruptArtifact, whatever the input."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fa4aot.errors import CorruptArtifact
from fa4aot.store.files import MAX_RECORD_BYTES, sha256_file, unsafe_dir_reason
from fa4aot.store.toolchain import canonical_json

LAYOUT = "v1"
RECORD = "record.json"
# 2: records carry `record_sha256`, a digest of their own canonical JSON (format 1 had none:
# a bit flip in a contract field went unnoticed).
RECORD_FORMAT = 2
CACHEDIR_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by fa4aot.\n"
    "# For information about cache directory tags see https://bford.info/cachedir/\n"
)
NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")  # ids, part files, spec names
_HEX64 = re.compile(r"[0-9a-f]{64}")


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
        """Raise CorruptArtifact unless every part is a regular file of its size and sha256."""
        for name, p in self.record["parts"].items():
            path = self.dir / p["file"]
            try:
                st = path.lstat()
            except OSError as e:
                raise CorruptArtifact(f"{self.dir}: part {name} unreadable: {e.strerror}") from None
            if not stat.S_ISREG(st.st_mode):
                raise CorruptArtifact(f"{path}: not a regular file")
            if st.st_size != p["size"]:
                raise CorruptArtifact(f"{path}: size {st.st_size} != recorded {p['size']}")
            try:
                digest = sha256_file(path)
            except OSError as e:
                raise CorruptArtifact(f"{path}: unreadable: {e.strerror}") from None
            if digest != p["sha256"]:
                raise CorruptArtifact(f"{path}: sha256 differs from its record")

    def check_loadable(self, allow_unsafe_dirs: bool = False) -> None:
        """What every loader checks before dlopen, in this order: a real kernel (not a test
        stub), on a path no other user can alter (unless allowed), every part's sha256.
        Raises CorruptArtifact; a corrupt artifact is never opened."""
        if self.record.get("stub"):
            raise CorruptArtifact(f"{self.dir}: a test stub, not a kernel")
        why = None if allow_unsafe_dirs else self.unsafe_reason()
        if why:
            raise CorruptArtifact(
                f"refusing to load native code: {why} (set FA4AOT_ALLOW_UNSAFE_DIRS=1 to override)"
            )
        self.verify()

    def unsafe_reason(self) -> str | None:
        """Why dlopen'ing this artifact is unsafe: a part, or any directory above it, can be
        replaced by another user (see `unsafe_dir_reason`). Native code is only as trustworthy
        as every directory on its path."""
        paths = [self.part_path(n) for n in self.record["parts"]]
        d = Path(os.path.realpath(self.dir))  # the directories the code really sits in
        while True:
            paths.append(d)
            if d == d.parent:
                break
            d = d.parent
        for p in paths:
            why = unsafe_dir_reason(p)
            if why:
                return why
        return None


def record_digest(rec: dict[str, Any]) -> str:
    return hashlib.sha256(
        canonical_json({k: v for k, v in rec.items() if k != "record_sha256"}).encode()
    ).hexdigest()


def seal_record(rec: dict[str, Any]) -> dict[str, Any]:
    """`rec` with its own digest, checked by parse_record: any change to a record is corruption."""
    return {**rec, "record_sha256": record_digest(rec)}


def _part_ok(p: Any) -> bool:
    return (
        isinstance(p, dict)
        and isinstance(p.get("file"), str)
        and NAME_RE.fullmatch(p["file"]) is not None
        and p["file"] != RECORD
        and isinstance(p.get("sha256"), str)
        and _HEX64.fullmatch(p["sha256"]) is not None
        and type(p.get("size")) is int
        and p["size"] >= 0
    )


def parse_record(text: str | bytes, where: str) -> dict[str, Any]:
    """Record JSON -> dict, its own digest checked and the fields the loader relies on
    type-checked. Raises only CorruptArtifact, whatever the input."""
    if len(text) > MAX_RECORD_BYTES:
        raise CorruptArtifact(f"{where}: record is {len(text)} bytes, more than any real record")
    try:
        rec = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptArtifact(f"{where}: record is not valid JSON: {type(e).__name__}") from None
    if isinstance(rec, dict) and rec.get("format") != RECORD_FORMAT:
        raise CorruptArtifact(
            f"{where}: record format {rec.get('format')!r}, this fa4aot reads "
            f"{RECORD_FORMAT}; rebuild (fa4aot build replaces it)"
        )
    ok = (
        isinstance(rec, dict)
        and isinstance(rec.get("id"), str)
        and NAME_RE.fullmatch(rec["id"]) is not None
        and isinstance(rec.get("variant"), dict)
        and isinstance(rec.get("toolchain"), dict)
        and isinstance(rec.get("parts"), dict)
        and rec["parts"]
        and all(_part_ok(p) for p in rec["parts"].values())
        and len({p["file"] for p in rec["parts"].values()}) == len(rec["parts"])
        and isinstance(rec.get("record_sha256"), str)
    )
    if not ok:
        raise CorruptArtifact(f"{where}: record is missing fields or has wrong types")
    if record_digest(rec) != rec["record_sha256"]:
        raise CorruptArtifact(f"{where}: record differs from its own sha256 (edited or corrupted)")
    return rec


