"""`fa4aot pack` / `fa4aot unpack`: one store (a fingerprint directory) as a tar archive, and its
import into another store root.

An archive is untrusted input that ends up as native code, so unpack:
1. reads it as a stream and accepts only plain files and directories at the paths a store has
   (`<fp>/toolchain.json`, `<fp>/specs/<name>.json`, `<fp>/artifacts/<id>/<file>`), with names
   of [A-Za-z0-9._-]: no absolute path, no '..', no link, device, fifo or sparse member, no
   duplicate, within size limits; modes, owners and times in the archive are ignored;
2. writes them into a private staging directory (never following a link: it creates every path
   itself, O_EXCL);
3. checks the staged toolchain.json against its directory name, and every artifact's record
   (its own sha256) and parts (size, sha256, no extra file);
4. only then publishes each artifact with one rename under its lock, like a build; an entry
   already valid in the target is kept, a corrupt one is quarantined and replaced.
Any failure in 1-3 raises UnsafeArchive and imports nothing.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import os
import shutil
import tarfile
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from fa4aot.errors import BuildError, CorruptArtifact, UnsafeArchive
from fa4aot.store import locking
from fa4aot.store.files import (
    MAX_RECORD_BYTES,
    atomic_output,
    atomic_write,
    crash_point,
    fsync_dir,
    owner_tag,
)
from fa4aot.store.layers import (
    Store,
    build_root,
    first_spec_indexes,
    first_valid_copy,
    scan_root,
    spec_ids,
    sweep_temp,
)
from fa4aot.store.records import LAYOUT, NAME_RE, RECORD
from fa4aot.store.toolchain import read_toolchain

MAX_MEMBERS = 100_000
MAX_MEMBER_BYTES = 1 << 30
MAX_TOTAL_BYTES = 4 << 30  # a store of a few hundred ~100 KB artifacts is ~50 MB

_FILE_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE)


@dataclass
class PackResult:
    path: Path
    store: str
    artifacts: list[str] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # {"id", "error"}: corrupt, left out


@dataclass
class UnpackResult:
    store: Path
    rows: list[dict] = field(default_factory=list)  # {"id", "status": added|present|replaced}


def _compression(path: Path) -> str:
    name = path.name
    if name.endswith((".tar.gz", ".tgz")):
        return "gz"
    if name.endswith(".tar.xz"):
        return "xz"
    if name.endswith(".tar"):
        return ""
    raise UnsafeArchive(f"{path}: archive name must end in .tar, .tar.gz, .tgz or .tar.xz")


def pack(
    roots: list[Path],
    output: Path,
    store_name: str | None = None,
    specs: list[str] | None = None,
    arch: str | None = None,
) -> PackResult:
    """Write one store (`store_name`: its directory name or a prefix; `arch`: the store of that
    arch; needed when the layers hold several) to a tar archive, restricted to the artifacts
    `specs` asked for (and their spec indexes) if given. Only artifacts whose checks pass go in.
    When several layers hold that store, the archive is their union: of each artifact and spec
    index, the first layer's valid copy."""
    output = Path(output)
    mode = _compression(output)
    stores = [
        s
        for r in roots
        for s in scan_root(r)[0]
        if (store_name is None or s.dir.name.startswith(store_name))
        and (arch is None or s.toolchain.get("arch") == arch)
    ]
    names = sorted({s.dir.name for s in stores})
    if not stores:
        raise UnsafeArchive(
            f"no store{' ' + repr(store_name) if store_name else ''} in "
            f"{', '.join(map(str, roots))}"
        )
    if len(names) > 1:
        raise UnsafeArchive("several stores; pick one with --store: " + ", ".join(names))
    store = stores[0]  # layers hold this fingerprint in several roots: pack their union
    wanted = None
    if specs:
        wanted = set().union(*(spec_ids(stores, sp) for sp in specs))
        if not wanted:
            raise UnsafeArchive(f"no artifact of spec(s) {', '.join(specs)} in {store.dir}")
    indexes = first_spec_indexes(stores, specs)
    ids = sorted({vid for s in stores for vid, _ in s.iter_artifacts()})
    res = PackResult(output, store.dir.name)
    fp = store.dir.name
    with (
        atomic_output(output) as raw,
        tarfile.open(fileobj=raw, mode=f"w:{mode}", format=tarfile.PAX_FORMAT) as tf,
    ):

        def add_dir(name: str) -> None:
            ti = tarfile.TarInfo(name)
            ti.type, ti.mode = tarfile.DIRTYPE, 0o755
            tf.addfile(ti)

        def add_file(name: str, data: bytes) -> None:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode = len(data), 0o644
            tf.addfile(ti, io.BytesIO(data))

        add_dir(fp)
        add_file(f"{fp}/toolchain.json", (store.dir / "toolchain.json").read_bytes())
        if indexes:
            add_dir(f"{fp}/specs")
        for name in sorted(indexes):
            add_file(f"{fp}/specs/{name}", indexes[name].read_bytes())
        add_dir(f"{fp}/artifacts")
        for vid in ids:
            if wanted is not None and vid not in wanted:
                continue
            files, errors = first_valid_copy(stores, vid)
            if files is None:
                res.skipped.append({"id": vid, "error": "; ".join(errors)})
                continue
            add_dir(f"{fp}/artifacts/{vid}")
            for name in sorted(files):
                add_file(f"{fp}/artifacts/{vid}/{name}", files[name])
            res.artifacts.append(vid)
    return res


def member_problem(m: tarfile.TarInfo) -> str | None:
    """Why an archive member cannot be part of a store (None: it can, as far as its header goes)."""
    name = m.name
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return "absolute path"
    if "\\" in name or "\0" in name:
        return "backslash or NUL in name"
    parts = name[:-1].split("/") if name.endswith("/") else name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "empty, '.' or '..' path component"
    if m.type not in _FILE_TYPES and m.type != tarfile.DIRTYPE:
        kind = {
            tarfile.SYMTYPE: "symbolic link",
            tarfile.LNKTYPE: "hard link",
            tarfile.CHRTYPE: "character device",
            tarfile.BLKTYPE: "block device",
            tarfile.FIFOTYPE: "fifo",
        }.get(m.type, f"member type {m.type!r}")
        return f"{kind}: only regular files and directories are allowed"
    if m.type in _FILE_TYPES and m.sparse is not None:
        return "sparse file"
    if not all(NAME_RE.fullmatch(p) for p in parts):
        return "name outside [A-Za-z0-9._-]"
    is_dir = m.type == tarfile.DIRTYPE
    n = len(parts)
    ok = (
        (n == 1 and is_dir)
        or (n == 2 and parts[1] == "toolchain.json" and not is_dir)
        or (n == 2 and parts[1] in ("specs", "artifacts") and is_dir)
        or (n == 3 and parts[1] == "specs" and parts[2].endswith(".json") and not is_dir)
        or (n == 3 and parts[1] == "artifacts" and is_dir)
        or (n == 4 and parts[1] == "artifacts" and not is_dir)
    )
    if not ok:
        return "not a path a store holds"
    limit = MAX_RECORD_BYTES if parts[-1].endswith(".json") else MAX_MEMBER_BYTES
    if m.size < 0 or m.size > limit:
        return f"size {m.size} out of bounds"
    return None


class _Limited(io.RawIOBase):
    """A read-only stream that fails past `limit` bytes: tarfile buffers whole PAX and GNU
    long-name headers in memory, so the decompressed stream itself must be bounded."""

    def __init__(self, f, limit: int):
        self.f, self.left = f, limit

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.f.read(min(len(b), self.left + 1))
        self.left -= len(data)
        if self.left < 0:
            raise UnsafeArchive(f"archive expands to more than {MAX_TOTAL_BYTES} bytes")
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self.f.close()
        super().close()


def _open_limited(archive: Path) -> _Limited:
    with open(archive, "rb") as f:
        magic = f.read(6)
    opener = (
        gzip.open
        if magic[:2] == b"\x1f\x8b"
        else lzma.open
        if magic == b"\xfd7zXZ\x00"
        else bz2.open
        if magic[:3] == b"BZh"
        else open
    )
    return _Limited(opener(archive, "rb"), MAX_TOTAL_BYTES + (64 << 20))


def _stage(archive: Path, stage: Path) -> str:
    """Stream the archive's members into `stage`, checking each. -> the fingerprint dir name."""
    seen: set[str] = set()
    top: str | None = None
    total = 0
    try:
        stream = _open_limited(archive)
        tf = tarfile.open(fileobj=stream, mode="r|")
    except (tarfile.TarError, OSError, EOFError, zlib.error, lzma.LZMAError) as e:
        raise UnsafeArchive(f"{archive}: not a readable tar archive: {e}") from None
    with stream, tf:
        try:
            for m in tf:
                why = member_problem(m)
                if why:
                    raise UnsafeArchive(f"{archive}: member {m.name!r}: {why}")
                parts = m.name.rstrip("/").split("/")
                key = "/".join(parts)
                if key in seen:
                    raise UnsafeArchive(f"{archive}: member {m.name!r} appears twice")
                seen.add(key)
                if len(seen) > MAX_MEMBERS:
                    raise UnsafeArchive(f"{archive}: more than {MAX_MEMBERS} members")
                if top is None:
                    top = parts[0]
                elif parts[0] != top:
                    raise UnsafeArchive(f"{archive}: holds several stores ({top}, {parts[0]})")
                dest = stage.joinpath(*parts)
                dest.parent.mkdir(parents=True, exist_ok=True)
                if m.type == tarfile.DIRTYPE:
                    dest.mkdir(exist_ok=True)
                    continue
                total += m.size
                if total > MAX_TOTAL_BYTES:
                    raise UnsafeArchive(f"{archive}: more than {MAX_TOTAL_BYTES} bytes")
                src = tf.extractfile(m)
                fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                with os.fdopen(fd, "wb") as out:
                    n = 0
                    for chunk in iter(lambda: src.read(1 << 20), b""):
                        n += len(chunk)
                        out.write(chunk)
                    out.flush()
                    os.fsync(out.fileno())
                if n != m.size:
                    raise UnsafeArchive(f"{archive}: member {m.name!r} is truncated")
        except (tarfile.TarError, EOFError, OSError, ValueError, zlib.error, lzma.LZMAError) as e:
            raise UnsafeArchive(
                f"{archive}: unreadable or truncated: {type(e).__name__}: {e}"
            ) from None
    if top is None:
        raise UnsafeArchive(f"{archive}: empty archive")
    return top


def _check_staged(archive: Path, staged: Store) -> list[str]:
    """Every staged artifact's record and parts checked. -> their ids."""
    ids = []
    base = staged.dir / "artifacts"
    for d in sorted(base.iterdir()) if base.is_dir() else []:
        try:
            art = staged.get(d.name, verify=True)
        except CorruptArtifact as e:
            raise UnsafeArchive(f"{archive}: artifact {d.name}: {e}") from None
        if art is None:
            raise UnsafeArchive(f"{archive}: artifact {d.name} has no {RECORD}")
        named = {RECORD} | {p["file"] for p in art.record["parts"].values()}
        extra = {f.name for f in d.iterdir()} - named
        if extra:
            raise UnsafeArchive(
                f"{archive}: artifact {d.name} holds files its record does not "
                f"name: {', '.join(sorted(extra))}"
            )
        ids.append(d.name)
    for f in sorted((staged.dir / "specs").glob("*.json")):
        try:
            doc = json.loads(f.read_bytes())
        except (ValueError, UnicodeDecodeError, RecursionError):
            doc = None
        if not isinstance(doc, dict):
            raise UnsafeArchive(f"{archive}: specs/{f.name} is not a JSON object")
    return ids


def import_artifact(target: Store, vid: str, staged: Path) -> str:
    """Publish a complete, checked artifact directory `staged` (consumed) as `vid` of `target`,
    under the artifact's lock. -> added | replaced (a corrupt copy was quarantined) | present."""
    with locking.hold(target.lock_path(vid), timeout=locking.IMPORT_TIMEOUT_S):
        status = "added"
        try:
            if target.get(vid) is not None:
                return "present"
        except CorruptArtifact:
            target.move_aside(vid, "quarantine")
            status = "replaced"
        target.discard_unpublished(vid)
        fsync_dir(staged)
        return status if target.publish_dir(vid, staged) else "present"


def unpack(archive: Path, roots: list[Path]) -> UnpackResult:
    """Import an archive written by `pack` into the first writable of `roots` (see module doc)."""
    archive = Path(archive)
    root = build_root(roots)
    stage_root = Path(
        tempfile.mkdtemp(prefix=f".unpack.{owner_tag()}", suffix=".tmp", dir=_mkroot(root))
    )
    try:
        fp = _stage(archive, stage_root / LAYOUT)
        try:
            tc = read_toolchain(stage_root / LAYOUT / fp)
        except CorruptArtifact as e:
            raise UnsafeArchive(f"{archive}: {e}") from None
        staged = Store(stage_root, tc)
        ids = _check_staged(archive, staged)
        target = Store(root, tc)
        try:
            target.ensure()
        except OSError as e:
            raise BuildError(f"cannot write the store at {root}: {e.strerror or e}") from None
        sweep_temp(target)  # staging of an unpack or build killed earlier
        res = UnpackResult(target.dir)
        crash_point("unpack-staged")
        for vid in ids:
            res.rows.append(
                {"id": vid, "status": import_artifact(target, vid, staged.artifact_dir(vid))}
            )
            crash_point("unpack-imported-one")
        crash_point("unpack-indexes")
        for f in sorted((staged.dir / "specs").glob("*.json")):
            if not target.spec_index(f.stem).exists():  # a local index wins over an imported one
                atomic_write(target.spec_index(f.stem), f.read_bytes())
        return res
    finally:
        shutil.rmtree(stage_root, ignore_errors=True)


def _mkroot(root: Path) -> Path:
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildError(f"cannot write the store at {root}: {e.strerror or e}") from None
    return Path(root)
