"""`fa4aot prune`: a plan of what to delete from a store root, then its execution.

What a plan removes, each with its reason and size:
- with `keep` fingerprints (`--keep-fingerprint CURRENT` and/or directory names): every other
  fingerprint directory, unreadable ones included. CURRENT keeps the stores whose toolchain
  versions (FA4, CuTe DSL and its libs, tvm-ffi) are this installation's, for any arch, SM
  count or Python;
- quarantined entries, build scratch and temp files of dead processes (a live builder's are
  kept), artifact directories with no record (never served), corrupt artifacts;
- with `max_bytes`: then artifacts until the rest fits, those no spec index names first, then
  least recently used first (file access time, which only a kernel load moves: fa4aot reads
  records and parts with O_NOATIME; approximate on relatime mounts, absent on noatime ones).

Deletion never leaves a half-deleted entry where readers look: an artifact or a fingerprint
directory is first renamed out of the way (under the artifact's lock), then removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from fa4aot.errors import CorruptArtifact, Fa4aotError
from fa4aot.store import locking
from fa4aot.store.files import owner_tag, temp_is_orphaned
from fa4aot.store.layers import Store, scan_root
from fa4aot.store.records import LAYOUT, RECORD
from fa4aot.store.toolchain import build_toolchain, read_toolchain

VERSION_FIELDS = ("fa4", "cutlass_dsl", "cutlass_libs", "tvm_ffi")

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?", re.IGNORECASE)


@dataclass(frozen=True)
class Action:
    kind: str  # store | quarantine | scratch | incomplete | corrupt | evict
    path: str
    bytes: int
    reason: str


def parse_size(text: str) -> int:
    """'2G', '500M', '1.5GiB', '123' -> bytes (K/M/G/T are powers of 1024)."""
    m = _SIZE.fullmatch(str(text).strip())
    if not m:
        raise ValueError(f"expected a size such as 2G, 500M or 123456 (bytes), got {text!r}")
    return int(float(m.group(1)) * 1024 ** " KMGT".index((m.group(2) or " ").upper()))


def _du(path: Path) -> int:
    if path.is_symlink() or not path.is_dir():
        try:
            return path.lstat().st_size
        except OSError:
            return 0
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def _kept(tc: dict, keep: list[str], name: str) -> bool:
    if name in keep:
        return True
    if "CURRENT" in keep:
        here = build_toolchain(tc.get("arch", "sm90"), tc.get("num_sms", 0))
        return all(tc.get(k) == here[k] for k in VERSION_FIELDS)
    return False


def _last_use(art_dir: Path) -> float:
    try:
        return max(f.stat().st_atime for f in art_dir.iterdir())
    except (OSError, ValueError):
        return 0.0


def plan(root: Path, keep: list[str] | None = None, max_bytes: int | None = None) -> list[Action]:
    root = Path(root)
    actions: list[Action] = []
    stores, broken = scan_root(root)
    if keep:
        for d, e in broken:
            actions.append(Action("store", str(d), _du(d), f"unreadable fingerprint: {e}"))
    live: list[
        tuple[Path, int, bool]
    ] = []  # artifacts that stay (dir, bytes, named), for max_bytes
    for s in stores:
        if keep and not _kept(s.toolchain, keep, s.dir.name):
            why = (
                "not kept (" + ", ".join(f"{k}={s.toolchain.get(k)}" for k in VERSION_FIELDS) + ")"
            )
            actions.append(Action("store", str(s.dir), _du(s.dir), why))
            continue
        for sub, kind, reason in (
            ("quarantine", "quarantine", "quarantined: failed its checks earlier"),
            ("tmp", "scratch", "build scratch of a process that is gone"),
        ):
            try:
                entries = sorted((s.dir / sub).iterdir())
            except OSError:
                entries = []
            for e in entries:
                if kind == "scratch" and not temp_is_orphaned(e.name, e.lstat().st_mtime):
                    continue
                actions.append(Action(kind, str(e), _du(e), reason))
        named: set[str] = set()
        for f in (s.dir / "specs").glob("*.json"):
            try:
                named.update(json.loads(f.read_bytes()).get("variants", []))
            except (OSError, ValueError, AttributeError, UnicodeDecodeError):
                continue
        for vid, art in s.iter_artifacts():
            d = s.artifact_dir(vid)
            if isinstance(art, Exception):
                actions.append(Action("corrupt", str(d), _du(d), str(art)))
                continue
            try:
                art.verify()
            except CorruptArtifact as e:
                actions.append(Action("corrupt", str(d), _du(d), str(e)))
                continue
            live.append((d, _du(d), vid in named))
        base = s.dir / "artifacts"
        for d in sorted(base.iterdir()) if base.is_dir() else []:
            if d.is_dir() and not (d / RECORD).exists():
                actions.append(Action("incomplete", str(d), _du(d), "no record: never served"))
    if max_bytes is not None:
        total = sum(n for _, n, _ in live)
        for d, n, named in sorted(live, key=lambda x: (x[2], _last_use(x[0]))):
            if total <= max_bytes:
                break
            why = "over --max-size; " + ("named by a spec, " if named else "no spec names it, ")
            actions.append(Action("evict", str(d), n, why + "least recently used first"))
            total -= n
    return actions


def execute(root: Path, actions: list[Action]) -> list[dict]:
    """Carry out a plan. -> one row per action: removed, or skipped with the error."""
    rows = []
    for a in actions:
        p = Path(a.path)
        row = asdict(a)
        try:
            if a.kind in ("corrupt", "incomplete", "evict"):
                store = Store(p.parents[3], read_toolchain(p.parents[1]))  # root/v1/fp/artifacts/id
                with locking.hold(store.lock_path(p.name), timeout=locking.PRUNE_TIMEOUT_S):
                    gone = store.move_aside(p.name, "tmp")
                shutil.rmtree(gone)
            elif a.kind == "store":
                gone = p.parent / f".{p.name}.prune.{owner_tag()}.tmp"
                os.rename(p, gone)
                shutil.rmtree(gone)
            elif p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            row["status"] = "removed"
        except FileNotFoundError:
            row["status"] = "already gone"
        except (OSError, Fa4aotError) as e:  # e.g. a live builder holds the artifact's lock
            row.update(status="skipped", error=f"{type(e).__name__}: {e}")
        rows.append(row)
    if (Path(root) / LAYOUT).is_dir():
        for e in (Path(root) / LAYOUT).iterdir():  # a crashed earlier prune's renamed store
            if (
                e.name.startswith(".")
                and e.name.endswith(".tmp")
                and temp_is_orphaned(e.name, e.lstat().st_mtime)
            ):
                shutil.rmtree(e, ignore_errors=True)
    return rows
