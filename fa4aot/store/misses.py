"""The miss log: each distinct variant the runtime could not serve, for the next build.

FA4AOT_MISS_LOG names a JSON-lines file; each line is one variant's fields. Appends are one
`write` of one line on an O_APPEND descriptor (atomic for lines this short on local
filesystems), deduplicated per process and against the file, and the file is bounded
(FA4AOT_MISS_LOG_MAX lines, default 1000): a server in a miss storm cannot fill a disk.
`fa4aot build --from-misses FILE` reads it back.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from fa4aot import settings
from fa4aot.errors import SettingError
from fa4aot.model import constraints as C
from fa4aot.model.abis import source_reason
from fa4aot.model.compile_keys import Call, representative_call
from fa4aot.model.variants import Variant

_seen: set[str] = set()
_lock = threading.Lock()


def record_miss(variant: Variant, path: str | None = None) -> bool:
    """Append `variant` to the miss log if set and new. Never raises (a log must not fail a call):
    an invalid FA4AOT_MISS_LOG_MAX logs nothing and says so once."""
    try:
        path = path or settings.miss_log()
        limit = settings.miss_log_max() if path else 0
    except SettingError as e:
        settings.warn_once(f"fa4aot: miss log off: {e}")
        return False
    if not path:
        return False
    with _lock:
        if variant.id in _seen:
            return False
        _seen.add(variant.id)
        try:
            existing = read_misses(path)
            if variant.id in {v.id for v in existing} or len(existing) >= limit:
                return False
            line = (
                json.dumps({"id": variant.id, "variant": variant.to_dict()}, sort_keys=True) + "\n"
            )
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                # a writer killed mid-line left no newline: ours must not be glued to its tail
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    line = "\n" + line
                os.write(fd, line.encode())
            finally:
                os.close(fd)
            return True
        except OSError:
            return False


def read_misses(path: str | Path) -> list[Variant]:
    """Variants of a miss log; malformed lines (a torn write, an edit) are skipped."""
    out, ids = [], set()
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        try:
            v = Variant.from_dict(json.loads(line)["variant"])
        except (ValueError, KeyError, TypeError):
            continue
        if v.id not in ids:
            ids.add(v.id)
            out.append(v)
    return out


def plan_misses(
    variants: list[Variant], arch: str, num_sms: int | None = None, fa4: str = "upstream"
) -> tuple[list[tuple[Variant, Call]], list[str]]:
    """Logged variants of `arch` -> (variant, call) pairs to build for a GPU of num_sms SMs
    (None: the arch's default; Blackwell hd256 kernels depend on it), and one reason per variant
    refused. A variant is refused only when FA4 itself cannot run it (its reason, with the
    alternative) or no call to FA4 produces it (a hand-edited log): everything the runtime or
    install() logs is built in one round (issue 13: 43 logged variants could not be). fa4: the
    FA4 source's ABI the build compiles from (model/abis.py): what it can run decides."""
    build, refused = [], []
    for v in variants:
        if v.arch != arch:
            continue
        why = C.unsupported_reason(
            v.arch, v.dtype, v.head_dim, v.head_dim_v, qhead_per_kvhead=v.qhead_per_kvhead,
            fa4=fa4,
        )
        if not why and v.kv_dtype:
            why = C.kv_dtype_reason(v.arch, fa4, v.dtype, v.kv_dtype, v.head_dim, v.head_dim_v)
        if not why:
            why = source_reason(fa4, sink_dtype=v.sink_dtype, split_kv=v.split_kv)
        if why:
            refused.append(f"{v.id} ({v.describe()}): {why}")
            continue
        try:
            build.append((v, representative_call(v, num_sms)))
        except ValueError as e:
            refused.append(f"{v.id}: {e}")
    return build, refused
