"""Per-artifact build locks that survive a killed holder, on local and network filesystems.

A lock only saves duplicate compiles: correctness never rests on it, because an artifact is
published by one rename(2) of a complete directory (see `build.publish`), which fails when
another builder got there first. So a lock that two processes both believe they hold costs a
compile, never a bad or half-written entry.

Two mechanisms, picked per store from the filesystem type in /proc/mounts:

- `flock` (local filesystems: ext4, xfs, btrfs, tmpfs, overlay, zfs...): fcntl.flock on a lock
  file. The kernel drops the lock when its holder dies, SIGKILL included, so the next builder
  takes over at once. Lock files stay in place: deleting one lets two processes hold locks on
  two inodes of one path.
- `marker` (NFS, SMB/CIFS, Lustre, GPFS, CephFS, FUSE, anything unknown): there, flock may
  be local to one client (NFS `nolock`/`local_lock=`, CIFS `nobrl`, many FUSE mounts) and
  "succeed" on two hosts at once. The lock is then a marker file created atomically
  (link(2) of a complete temp file, else O_EXCL) naming its holder. A marker is stale when
  its holder is on this machine (same hostname, boot id and pid namespace) and its pid is
  gone or was reused, or, for another machine, when its holder stopped refreshing its mtime
  for FA4AOT_LOCK_LEASE_S seconds (default 60; hosts need roughly synchronized clocks).

FA4AOT_LOCK=flock|marker overrides the choice (tests, or a filesystem known to be safe).

Why not the `filelock` package (an earlier dependency): its FileLock
is the same flock on local filesystems, and on the network filesystems above it can succeed
on two hosts at once; its SoftFileLock is a marker file with no notion of a dead holder, so a
builder killed mid-compile would block every later build of that artifact until someone
deletes the file by hand.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import os
import secrets
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from fa4aot import settings
from fa4aot.errors import BuildError

# How long a waiter holds on for an artifact's lock, by who waits: a builder (a compile takes
# seconds: a holder this slow is stuck, not working), an archive import (the same lock), prune
# (it skips what it cannot lock soon).
BUILD_TIMEOUT_S = 600
IMPORT_TIMEOUT_S = 600
PRUNE_TIMEOUT_S = 30

LOCAL_FS = frozenset(
    {
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "tmpfs",
        "ramfs",
        "zfs",
        "f2fs",
        "jfs",
        "reiserfs",
        "bcachefs",
        "nilfs2",
        "overlay",
        "devtmpfs",
        "hfsplus",
        "apfs",
        "ufs",
    }
)
# Object-store mounts emulate rename by copy + delete: a reader can see half a directory.
NO_ATOMIC_RENAME_FS = frozenset(
    {
        "fuse.s3fs",
        "fuse.gcsfuse",
        "fuse.goofys",
        "fuse.mountpoint-s3",
        "fuse.rclone",
        "fuse.blobfuse",
        "fuse.blobfuse2",
        "fuse.geesefs",
    }
)


class LockTimeout(BuildError):
    """Another live builder held the lock for longer than the timeout."""


def _unescape(field: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as octal
    for esc, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(esc, ch)
    return field


def fs_type(path: Path, mounts: str | None = None) -> str:
    """The filesystem type holding `path` (its nearest existing ancestor), or "unknown"."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return "unknown"
    p, rest = Path(path).absolute(), []
    while not p.exists() and p != p.parent:
        rest.insert(0, p.name)
        p = p.parent
    real = os.path.join(os.path.realpath(p), *rest)
    best, kind = -1, "unknown"
    for line in mounts.splitlines():
        f = line.split()
        if len(f) < 3:
            continue
        mnt = _unescape(f[1]).rstrip("/") or "/"
        if (real == mnt or real.startswith(mnt + "/") or mnt == "/") and len(mnt) > best:
            best, kind = len(mnt), f[2]
    return kind


def lock_mode(directory: Path) -> str:
    kind = settings.lock_kind()
    if kind != "auto":
        return kind
    return "flock" if fs_type(directory) in LOCAL_FS else "marker"


def write_refusal(directory: Path) -> str | None:
    """Why builds must not write under `directory` (None: they may)."""
    kind = fs_type(directory)
    if kind in NO_ATOMIC_RENAME_FS:
        return (
            f"{directory} is on {kind}, which has no atomic rename: readers could see "
            "half-published artifacts. Build on a local disk, then `fa4aot pack` / `unpack`."
        )
    return None


@contextmanager
def hold(path: Path, timeout: float, mode: str | None = None) -> Iterator[None]:
    """Hold the exclusive lock `path` (created if needed) for the duration of the block."""
    mode = mode or lock_mode(path.parent)
    with (_flock if mode == "flock" else _marker)(Path(path), timeout):
        yield


def _wait(deadline: float, delay: float, path: Path, holder: str = "") -> float:
    if time.monotonic() >= deadline:
        raise LockTimeout(
            f"{path}: still held{' by ' + holder if holder else ''}; "
            "another build is running or stuck (kill it, then retry)"
        )
    time.sleep(delay)
    return min(delay * 2, 0.1)


@contextmanager
def _flock(path: Path, timeout: float) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        deadline, delay = time.monotonic() + timeout, 0.002
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
            delay = _wait(deadline, delay, path)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# -- marker locks --------------------------------------------------------------------------


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


@functools.lru_cache(maxsize=None)
def _machine() -> str:
    """This kernel instance and pid namespace: where a holder's pid can be checked."""
    boot = _read("/proc/sys/kernel/random/boot_id").strip()
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{socket.gethostname()}/{boot}/{ns}"


def _start_time(pid: int) -> str:
    """A pid's start time in clock ticks since boot ("" if unknown): tells pid reuse apart."""
    stat = _read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
    return stat[19] if len(stat) > 19 else ""


def pid_alive(pid: int, start: str = "") -> bool:
    """Whether `pid` (started at `start`, if known) still runs on this machine. A zombie is dead:
    a killed builder's workers wait as zombies until their new parent reaps them."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    except (OverflowError, ValueError):
        return False
    stat = _read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
    if stat and stat[0] in ("Z", "X"):
        return False
    return not start or len(stat) <= 19 or stat[19] == start


def lease_s() -> float:
    return settings.lock_lease_s()


def holder_stale(text: str, mtime: float, now: float | None = None) -> bool:
    """Whether a marker's holder is gone: dead pid on this machine, else an expired lease."""
    now = time.time() if now is None else now
    try:
        h = json.loads(text)
        machine, pid, start = h["machine"], h["pid"], h["start"]
        if not (isinstance(machine, str) and type(pid) is int and isinstance(start, str)):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        return now - mtime > lease_s()  # torn or foreign: only age can tell
    if machine == _machine():
        return not pid_alive(pid, start)
    return now - mtime > lease_s()


def _try_create(path: Path, me: str) -> bool:
    tmp = f"{path}.{secrets.token_hex(6)}.new"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(me)
        try:
            os.link(tmp, path)  # atomic, never replaces, and the marker is never seen empty
            return True
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
        try:  # no hard links here: O_EXCL, then write (a torn marker ages out)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(me)
        return True
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _take_over(path: Path, seen: str) -> None:
    """Move a stale marker aside. If what moved was a new holder's marker (it replaced the stale
    one between our read and our rename), put it back without replacing anything."""
    aside = f"{path}.{secrets.token_hex(6)}.stale"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    try:
        if _read(aside) != seen:
            try:
                os.link(aside, path)
            except OSError:
                pass
    finally:
        try:
            os.unlink(aside)
        except OSError:
            pass


def clear_if_stale(path: Path) -> bool:
    """Remove a marker whose holder is gone (a builder killed while holding it, whose artifact
    someone else then built without needing the lock). Empty files are flock files: kept."""
    seen = _read(str(path))
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return False
    if not seen or not holder_stale(seen, mtime):
        return False
    _take_over(path, seen)
    return True


@contextmanager
def _marker(path: Path, timeout: float) -> Iterator[None]:
    me = json.dumps(
        {
            "machine": _machine(),
            "pid": os.getpid(),
            "start": _start_time(os.getpid()),
            "nonce": secrets.token_hex(8),
        }
    )
    deadline, delay = time.monotonic() + timeout, 0.002
    while not _try_create(path, me):
        seen = _read(str(path))
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            continue
        if holder_stale(seen, mtime):
            _take_over(path, seen)
            continue
        delay = _wait(deadline, delay, path, seen)
    stop = threading.Event()

    def heartbeat() -> None:  # keeps the lease of a live holder fresh for other machines
        while not stop.wait(lease_s() / 4):
            try:
                os.utime(path)
            except OSError:
                pass

    beat = threading.Thread(target=heartbeat, name="fa4aot-lock-heartbeat", daemon=True)
    beat.start()
    try:
        yield
    finally:
        stop.set()
        beat.join()
        if _read(str(path)) == me:  # never remove a marker that a takeover made someone else's
            try:
                os.unlink(path)
            except OSError:
                pass
