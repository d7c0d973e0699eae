"""The on-disk store: versioned by toolchain fingerprint, one directory per artifact.

    <root>/CACHEDIR.TAG
    <root>/v1/<fingerprint dir>/toolchain.json          the fingerprint's fields
    <root>/v1/<fp>/artifacts/<variant id>/fwd.so ...    parts (shared objects)
    <root>/v1/<fp>/artifacts/<variant id>/record.json   what the parts are, with their sha256
    <root>/v1/<fp>/specs/<spec>.json                    what each spec asked for (ls, coverage)
    <root>/v1/<fp>/locks/<variant id>.lock              per-artifact build lock (locking.py)
    <root>/v1/<fp>/tmp/                                 build scratch of live builders
    <root>/v1/<fp>/quarantine/                          entries that failed their checks

An artifact directory appears whole or not at all: the builder assembles parts and record in
tmp/ and publishes them with one rename(2). Readers still trust an artifact only through its
record: the record carries its own sha256 and each part's, so a torn, truncated or bit-flipped
entry is CorruptArtifact and never loaded. Records are JSON; nothing on the load path unpickles.

Roots are layers (FA4AOT_CACHE_DIR=/srv/node:/opt/image-cache): lookups search them in order;
builds go to the first writable one. Nothing on a read path creates a file or directory, so a
store in a read-only image layer serves as-is. Installed cache wheels (wheel.py) add their
stores as read-only layers after these.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from fa4aot import settings
from fa4aot.errors import BuildError, CorruptArtifact, Fa4aotError, FingerprintMismatch
from fa4aot.store.files import (
    MAX_RECORD_BYTES,
    atomic_write,
    fsync_dir,
    owner_tag,
    read_quietly,
    temp_is_orphaned,
)
from fa4aot.store.locking import clear_if_stale, write_refusal
from fa4aot.store.records import (
    CACHEDIR_TAG,
    LAYOUT,
    NAME_RE,
    RECORD,
    RECORD_FORMAT,
    Artifact,
    parse_record,
    seal_record,
)
from fa4aot.store.toolchain import (
    fa4_abi,
    fingerprint_dir,
    mismatches,
    read_toolchain,
    store_value,
)


def default_roots(wheels: bool = True) -> list[Path]:
    """Store roots, in lookup order: FA4AOT_CACHE_DIR (':'-separated layers), else platformdirs;
    then (unless `wheels` is False) the read-only stores of installed cache wheels."""
    return [layer.root for layer in resolve_layers(None, wheels=wheels)]


@dataclass(frozen=True)
class Layer:
    """One store root in lookup order, and where it was named: `--cache`, `FA4AOT_CACHE_DIR`,
    `user cache dir` (platformdirs, the default) or `cache wheel <entry point>`."""

    root: Path
    source: str

    @property
    def explicit(self) -> bool:
        """Named on the command line: one that does not exist is a typo, not an empty store.
        (An absent FA4AOT_CACHE_DIR layer is normal: a node cache before its first build.)"""
        return self.source == "--cache"

    def problem(self) -> str | None:
        """Why this layer cannot be read: absent, not a directory, unreadable (None: it can)."""
        try:
            st = self.root.stat()
        except FileNotFoundError:
            return f"{self.root}: no such directory ({self.source})"
        except OSError as e:
            return f"{self.root}: unreadable: {e.strerror} ({self.source})"
        if not stat.S_ISDIR(st.st_mode):
            return f"{self.root}: not a directory ({self.source})"
        if not os.access(self.root, os.R_OK | os.X_OK):
            return f"{self.root}: not readable by uid {os.getuid()} ({self.source})"
        return None

    def describe(self) -> str:
        return f"{self.root} ({self.source})"


def resolve_layers(cache: str | os.PathLike | None, *, wheels: bool = True) -> list[Layer]:
    """The store layers a command reads, in lookup order; the one rule for every command.

    `cache` (a `--cache` value: ':'-separated directories) names the layers outright, and only
    those. Otherwise: the FA4AOT_CACHE_DIR layers, else the user cache dir; then, unless
    `wheels` is False, the stores of installed cache wheels. Commands that write use the first
    writable layer (build_root); commands that read search them all in this order."""

    if cache is not None and str(cache) != "":
        roots = [Path(p).expanduser() for p in str(cache).split(os.pathsep) if p.strip()]
        if not roots:
            raise Fa4aotError(f"--cache {str(cache)!r} names no directory")
        return _dedup([Layer(r, "--cache") for r in roots])
    env = settings.cache_dir()
    if env:
        layers = [Layer(r, "FA4AOT_CACHE_DIR") for r in env]
    else:
        import platformdirs

        layers = [Layer(Path(platformdirs.user_cache_dir("fa4aot")), "user cache dir")]
    if wheels:
        layers += [Layer(r, f"cache wheel {name}") for name, r in entry_point_stores()]
    return _dedup(layers)


def _dedup(layers: list[Layer]) -> list[Layer]:
    seen: set[Path] = set()
    out = []
    for layer in layers:
        if layer.root not in seen:
            seen.add(layer.root)
            out.append(layer)
    return out


WHEEL_STORES = "fa4aot.stores"  # entry point group of cache wheels (wheel.py writes them)
WHEEL_TAG = "FA4AOT-WHEEL.TAG"  # in a cache wheel's store root: pip owns it, builds never write


def entry_point_roots() -> list[Path]:
    """The store roots of installed cache wheels (`pip install fa4aot-cache-...`), by entry point
    name. Each entry point names a tiny module whose ROOT is its store; one that fails to load is
    skipped with a warning. FA4AOT_CACHE_WHEELS=0 turns discovery off."""
    return [root for _, root in entry_point_stores()]


def entry_point_stores() -> list[tuple[str, Path]]:
    """(entry point name, store root) of each installed cache wheel (entry_point_roots)."""

    if not settings.cache_wheels():
        return []

    log = logging.getLogger("fa4aot")
    roots: list[tuple[str, Path]] = []
    try:
        eps = sorted(metadata.entry_points(group=WHEEL_STORES), key=lambda e: (e.name, e.value))
    except Exception as e:  # noqa: BLE001 - a broken installation must not stop the runtime
        log.warning("fa4aot: cannot list cache wheels: %s: %s", type(e).__name__, e)
        return []
    for ep in eps:
        try:
            obj = ep.load()
            root = Path(getattr(obj, "ROOT", obj))
        except Exception as e:  # noqa: BLE001
            log.warning("fa4aot: skipping cache wheel %s (%s): %s", ep.name, ep.value, e)
            continue
        if not root.is_dir():
            log.warning("fa4aot: skipping cache wheel %s: %s is not a directory", ep.name, root)
        elif root not in [r for _, r in roots]:
            roots.append((ep.name, root))
    return roots


def not_writable_reason(root: Path) -> str | None:
    """Why builds cannot go into layer `root` (None: they can). Touches nothing: a root that does
    not exist yet is judged by the directory it would be created in."""

    if (Path(root) / WHEEL_TAG).exists():
        return "an installed cache wheel's store: pip owns it, upgrade it with pip"
    p = Path(root).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        return f"{p} is not a directory"
    try:
        if os.statvfs(p).f_flag & os.ST_RDONLY:
            return f"{p} is on a read-only filesystem"
    except OSError as e:
        return f"{p}: {e.strerror}"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p} is not writable by uid {os.getuid()}"
    return write_refusal(p)


def build_root(roots: list[Path]) -> Path:
    """The layer that receives builds: the first writable one. BuildError names each refusal."""
    why = []
    for r in roots:
        reason = not_writable_reason(r)
        if reason is None:
            return Path(r)
        why.append(f"{r}: {reason}")
    raise BuildError(
        "no writable store layer to build into:\n  "
        + "\n  ".join(why or ["(no layers)"])
        + "\nput a writable directory first in FA4AOT_CACHE_DIR (e.g. "
        "FA4AOT_CACHE_DIR=/var/cache/fa4aot:<read-only layers>) or pass --cache DIR"
    )


class Store:
    """One fingerprint directory of one root.

    `serve_num_sms`: set when this store was built for another SM count than the GPU it serves
    (find_serving_store's fallback); it then serves only artifacts whose record says
    `"sm_count_independent": true`, and refuses the others with FingerprintMismatch.
    """

    def __init__(self, root: Path, toolchain: dict[str, Any], serve_num_sms: int | None = None):
        self.root = Path(root)
        self.toolchain = toolchain
        self.dir = self.root / LAYOUT / fingerprint_dir(toolchain)
        self.serve_num_sms = serve_num_sms

    @property
    def fa4_abi(self) -> str:
        """The FA4 source ABI its artifacts were built for (toolchain.fa4_abi)."""
        return fa4_abi(self.toolchain)

    # paths
    def artifact_dir(self, vid: str) -> Path:
        return self.dir / "artifacts" / vid

    def lock_path(self, vid: str) -> Path:
        return self.dir / "locks" / f"{vid}.lock"

    def spec_index(self, spec: str) -> Path:
        return self.dir / "specs" / f"{spec}.json"

    def ensure(self) -> None:
        """Create the layout (writers only: no read path calls this)."""
        for d in ("artifacts", "locks", "tmp", "specs"):
            (self.dir / d).mkdir(parents=True, exist_ok=True)
        tag = self.root / "CACHEDIR.TAG"
        if not tag.exists():
            atomic_write(tag, CACHEDIR_TAG.encode())
        tc = self.dir / "toolchain.json"
        if not tc.exists():
            atomic_write(tc, (json.dumps(self.toolchain, indent=2, sort_keys=True) + "\n").encode())

    # writing (builders and importers, under the artifact's lock)
    def publish_dir(self, vid: str, staged: Path) -> bool:
        """Publish a complete, fsync'ed directory as artifact `vid` with one rename(2): readers
        see all of it or nothing, and rename onto a non-empty directory fails, so of two racing
        publishers exactly one wins. -> False when the entry was already published."""
        final = self.artifact_dir(vid)
        try:
            os.rename(staged, final)
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                return False
            raise
        fsync_dir(final.parent)
        return True

    def move_aside(self, vid: str, where: str = "quarantine") -> Path:
        """Take entry `vid` out of artifacts/ in one rename (readers see a miss, never half a
        deleted directory), into quarantine/ (kept for inspection) or tmp/ (to be removed)."""
        dest = self.dir / where / f"{vid}.{int(time.time())}.{owner_tag()}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.artifact_dir(vid), dest)
        return dest

    def discard_unpublished(self, vid: str) -> None:
        """Remove a record-less artifacts/<vid> (an old builder's or a hand copy: never served)."""

        if self.artifact_dir(vid).exists() and not (self.artifact_dir(vid) / RECORD).exists():
            shutil.rmtree(self.move_aside(vid, "tmp"), ignore_errors=True)

    # reading
    def get(self, vid: str, verify: bool = True) -> Artifact | None:
        """The published artifact `vid`, or None if absent. Corruption raises CorruptArtifact."""
        d = self.artifact_dir(vid)
        try:
            text = read_quietly(d / RECORD, MAX_RECORD_BYTES + 1)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise CorruptArtifact(f"{d / RECORD}: unreadable: {e.strerror}") from None
        art = Artifact(d, self.check_record(vid, text))
        if verify:
            art.verify()
        return art

    def check_record(self, vid: str, text: bytes, where: str | None = None) -> dict[str, Any]:
        """parse_record, plus: the record is the one of `vid`, built for this store's toolchain,
        and (SM-count fallback) proves SM-count independence."""
        d = self.artifact_dir(vid)
        rec = parse_record(text, where or str(d / RECORD))
        if rec["id"] != vid:
            raise CorruptArtifact(f"{d}: record id {rec['id']!r} does not match its directory")
        try:
            home = fingerprint_dir(rec["toolchain"])
        except (KeyError, TypeError, AttributeError):
            home = None
        if home != self.dir.name:
            raise CorruptArtifact(
                f"{d}: record was built for toolchain {home}, not {self.dir.name}"
            )
        if self.serve_num_sms is not None and rec.get("sm_count_independent") is not True:
            raise FingerprintMismatch(
                f"{d}: num_sms: built for {self.toolchain['num_sms']} SMs, this GPU has "
                f"{self.serve_num_sms}, and its record does not prove it SM-count independent. "
                f"Rebuild with: fa4aot build --arch {self.toolchain['arch']} "
                f"--num-sms {self.serve_num_sms}"
            )
        return rec

    def record_format(self, vid: str) -> Any:
        """The `format` field of vid's record, whatever else it holds (None if unreadable)."""
        try:
            rec = json.loads(read_quietly(self.artifact_dir(vid) / RECORD, MAX_RECORD_BYTES))
        except (OSError, ValueError, UnicodeDecodeError, RecursionError):
            return None
        return rec.get("format") if isinstance(rec, dict) else None

    def upgrade_record(self, vid: str) -> bool:
        """Reseal a format-1 record as format 2, in place and without recompiling, if it passes
        every format-2 check and every part still matches its sha256. Format 1 had no record
        digest, so this keeps the trust it had and protects the record from now on.
        Writers only, under the artifact's lock. -> whether it was upgraded."""
        d = self.artifact_dir(vid)
        try:
            rec = json.loads(read_quietly(d / RECORD, MAX_RECORD_BYTES))
        except (OSError, ValueError, UnicodeDecodeError, RecursionError):
            return False
        if not isinstance(rec, dict) or rec.get("format") != 1:
            return False
        rec = {k: v for k, v in rec.items() if k != "record_sha256"}
        rec.update(format=RECORD_FORMAT, sm_count_independent=False)
        sealed = seal_record(rec)
        data = (json.dumps(sealed, indent=2, sort_keys=True) + "\n").encode()
        try:
            Artifact(d, self.check_record(vid, data)).verify()
        except (CorruptArtifact, FingerprintMismatch):
            return False
        atomic_write(d / RECORD, data)
        return True

    def holds_artifacts(self) -> bool:
        try:
            with os.scandir(self.dir / "artifacts") as it:
                return next(it, None) is not None
        except OSError:
            return False

    def iter_artifacts(self) -> Iterator[tuple[str, Artifact | Fa4aotError]]:
        base = self.dir / "artifacts"
        if not base.is_dir():
            return
        for d in sorted(base.iterdir()):
            if not (d / RECORD).exists():
                continue  # unpublished: only an old builder left such a directory
            try:
                a = self.get(d.name, verify=False)
                yield d.name, a
            except (CorruptArtifact, FingerprintMismatch) as e:
                yield d.name, e


def scan_root(root: Path) -> tuple[list[Store], list[tuple[Path, CorruptArtifact]]]:
    """Every fingerprint directory under a root, and (dir, error) for those that are broken."""
    base = Path(root) / LAYOUT
    stores, bad = [], []
    try:
        entries = sorted(base.iterdir()) if base.is_dir() else []
    except OSError as e:
        return [], [(base, CorruptArtifact(f"{base}: unreadable: {e.strerror}"))]
    for d in entries:
        if not d.is_dir() or d.name.startswith("."):
            continue  # `.unpack-*`: the staging area of an import in progress
        try:
            stores.append(Store(Path(root), read_toolchain(d)))
        except CorruptArtifact as e:
            bad.append((d, e))
    return stores, bad


def stores_at(root: Path) -> list[Store]:
    """Every valid fingerprint directory under a root (for ls / verify / diagnostics)."""
    return scan_root(root)[0]


def find_serving_store(roots: list[Path], expected: dict[str, Any]) -> list[Store]:
    """The stores that may serve `expected`, in layer order.

    In each layer, the stores matching every field are used, those holding artifacts first (a
    failed build's empty store never shadows one that serves), and only those of the first's
    FA4 source; failing that, one that differs only by num_sms, restricted to artifacts that
    prove SM-count independence (Store.serve_num_sms). Raises FingerprintMismatch when no layer
    has either but some have stores: the message names each field that differs and the value
    expected, so version skew is never a silent miss.
    """
    found, skew, broken = [], [], []
    for root in roots:
        stores, bad = scan_root(root)
        broken += bad
        exact, near = [], None
        for s in stores:
            diff = [k for k, v in expected.items() if store_value(s.toolchain, k) != v]
            if not diff:
                exact.append(s)
                continue
            skew.append(f"{s.dir}: " + "; ".join(mismatches(s.toolchain, expected)))
            if diff == ["num_sms"] and near is None:
                near = s
        if exact:
            exact.sort(key=lambda s: not s.holds_artifacts())
            found += [s for s in exact if s.fa4_abi == exact[0].fa4_abi]
        elif near is not None:
            found.append(Store(near.root, near.toolchain, serve_num_sms=expected["num_sms"]))
    if not found and (skew or broken):
        raise FingerprintMismatch(
            "no store built for this toolchain/GPU:\n  "
            + "\n  ".join(skew + [str(e) for _, e in broken])
            + "\nrebuild with: fa4aot build --arch {a} --num-sms {n} --python {p}".format(
                a=expected.get("arch"), n=expected.get("num_sms"), p=expected.get("python")
            )
            + ("\n(a store built from another FA4 source, `fa4aot build --fa4`, is served with "
               "FA4AOT_KERNEL_SOURCE set to that source, e.g. FA4AOT_KERNEL_SOURCE=vllm)"
               if any("fa4_abi" in line for line in skew) else "")
        )
    return found


def spec_ids(stores: list[Store], spec: str) -> set[str]:
    """Artifacts asked for by `spec`: its index (`specs/<spec>.json` lists every variant, shared
    ones included) and records whose `requested_by` names it (their first requester)."""
    ids: set[str] = set()
    for s in stores:
        try:
            ids |= set(json.loads(s.spec_index(spec).read_bytes())["variants"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        for vid, a in s.iter_artifacts():
            by = {} if isinstance(a, Exception) else a.record.get("requested_by")
            if isinstance(by, dict) and by.get("spec") == spec:
                ids.add(vid)
    return ids


def first_valid_copy(stores: list[Store], vid: str) -> tuple[dict[str, bytes] | None, list[str]]:
    """The record and part bytes of `vid`'s first copy in layer order that passes its checks,
    the parts hashed again as read (a file changed after the check is caught): a corrupt copy in
    one layer falls through to a good one in a later layer (pack, wheel).
    -> (files or None, the errors of the copies passed over)."""
    errors: list[str] = []
    for s in stores:
        try:
            art = s.get(vid, verify=True)
            if art is None:
                continue
            files = {RECORD: read_quietly(art.dir / RECORD)}
            for p in art.record["parts"].values():
                files[p["file"]] = data = read_quietly(art.dir / p["file"])
                if hashlib.sha256(data).hexdigest() != p["sha256"]:
                    raise CorruptArtifact(f"{art.dir / p['file']}: changed while read")
            return files, errors
        except (Fa4aotError, OSError) as e:
            errors.append(str(e))
    return None, errors


def first_spec_indexes(stores: list[Store], specs: list[str] | None = None) -> dict[str, Path]:
    """Spec index files by file name, the first layer's of each (only `specs`' when given)."""
    out: dict[str, Path] = {}
    for s in stores:
        for f in sorted((s.dir / "specs").glob("*.json")):
            if NAME_RE.fullmatch(f.name) and (not specs or f.stem in specs):
                out.setdefault(f.name, f)
    return out


def verify_root(root: Path) -> list[dict[str, Any]]:
    """One row per artifact (and per broken fingerprint directory) of a root, every part's
    sha256 checked: status ok | corrupt | incomplete (a directory with no record)."""
    stores, bad = scan_root(root)
    rows = [{"id": "-", "store": d.name, "status": "corrupt", "error": str(e)} for d, e in bad]
    for s in stores:
        base = s.dir / "artifacts"
        for d in sorted(base.iterdir()) if base.is_dir() else []:
            row = {"id": d.name, "store": s.dir.name, "status": "ok"}
            try:
                if s.get(d.name, verify=True) is None:
                    row.update(
                        status="incomplete",
                        error="no record.json: never served; fa4aot build replaces it",
                    )
            except CorruptArtifact as e:
                row.update(status="corrupt", error=str(e))
            rows.append(row)
    return rows


def sweep_temp(store: Store) -> int:
    """Remove build scratch, temp files and lock markers left by dead processes. -> how many."""


    n = 0
    try:
        locks = [p for p in (store.dir / "locks").iterdir() if p.suffix == ".lock"]
    except OSError:
        locks = []
    n += sum(clear_if_stale(p) for p in locks)
    for d in (store.dir / "tmp", store.dir / "specs", store.dir, store.root, store.dir / "locks"):
        try:
            entries = list(d.iterdir())
        except OSError:
            continue
        for e in entries:
            if d != store.dir / "tmp" and not (
                e.name.startswith(".")
                and e.name.endswith(".tmp")
                or e.name.endswith((".new", ".stale"))
            ):
                continue
            try:
                if not temp_is_orphaned(e.name, e.lstat().st_mtime):
                    continue
                if e.is_dir() and not e.is_symlink():
                    shutil.rmtree(e, ignore_errors=True)
                else:
                    e.unlink()
                n += 1
            except OSError:
                continue
    return n
