"""File primitives of the store: quiet reads, atomic writes, fsync, crash points for tests."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import socket
import stat
import tempfile
import time
from pathlib import Path

from fa4aot import settings
from fa4aot.store.locking import pid_alive

# the most bytes a reader takes of one JSON metadata file (record, toolchain, spec index)
MAX_RECORD_BYTES = 1 << 20


def open_quietly(path: Path):
    """Open for reading without updating the file's access time where the kernel allows it
    (O_NOATIME: the caller owns the file). fa4aot's own reads (records, checksums) must not count
    as use: `prune --max-size` evicts by access time, which only loading a kernel should move."""
    flags = os.O_RDONLY | getattr(os, "O_NOATIME", 0)
    try:
        fd = os.open(path, flags)
    except PermissionError:
        fd = os.open(path, os.O_RDONLY)  # not the owner: O_NOATIME is refused, read plainly
    return os.fdopen(fd, "rb")


def read_quietly(path: Path, limit: int = -1) -> bytes:
    with open_quietly(path) as f:
        return f.read(limit)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open_quietly(path) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def crash_point(point: str) -> None:
    """Crash-test hook: FA4AOT_FAULT=<point> SIGKILLs this process there (stub stores only)."""

    if settings.stub_compiler() and settings.fault() == point:
        os.kill(os.getpid(), signal.SIGKILL)


def owner_tag() -> str:
    """`host~pid~` for names of temporary files and dirs, so a sweep can tell whose they are."""
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"
    return f"{host}~{os.getpid()}~"


def temp_is_orphaned(name: str, mtime: float, max_age_s: float = 86400.0) -> bool:
    """A temp entry named with `owner_tag` whose process is gone (or, from another host, old)."""

    f = name.split("~")
    try:
        host, pid = f[-3].rsplit(".", 1)[-1], int(f[-2])
    except (IndexError, ValueError):
        return time.time() - mtime > max_age_s
    mine = owner_tag().split("~")[0]
    if host == mine:
        return not pid_alive(pid)
    return time.time() - mtime > max_age_s


@contextlib.contextmanager
def atomic_output(path: Path):
    """Yield a binary file in `path`'s directory; on success it is fsynced and renamed onto
    `path` (readers see all or nothing), on any failure removed. A process killed in between
    leaves only a `.<name>.<owner>.tmp` file, which builds sweep."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{owner_tag()}", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp's 0600 would hide shared stores
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write(path: Path, data: bytes) -> None:
    with atomic_output(path) as f:
        f.write(data)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


