"""`fa4aot wheel`: a store as a pip-installable wheel, found by the runtime with no configuration.

One wheel per store (fingerprint directory: one arch / SM count / toolchain / Python):

    fa4aot_cache_<name>/__init__.py                 ROOT = Path(__file__).parent / "store"
    fa4aot_cache_<name>/store/FA4AOT-WHEEL.TAG       builds never write into this root
    fa4aot_cache_<name>/store/v1/<fp>/...           a normal store (toolchain, specs, artifacts)
    fa4aot_cache_<name>-<ver>.dist-info/            METADATA, WHEEL, entry_points.txt, RECORD

The entry point `[fa4aot.stores] <name> = fa4aot_cache_<name>` is how `store.default_roots`
finds it. Artifacts are C shared objects for one Python minor (the store's fingerprint), so the
wheel is tagged `cp3XX-none-manylinux_<glibc>_<machine of the ELF parts>` and pip installs it
only there.

Written with zipfile (no setuptools/wheel needed), deterministically: fixed timestamps and modes,
sorted entries, so the same store gives a byte-identical wheel. Like `pack`, only artifacts whose
parts match their record's sha256 go in; the others are left out and reported.
"""

from __future__ import annotations

import base64
import hashlib
import re
import struct
import sysconfig
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from fa4aot import __version__
from fa4aot.errors import BuildError
from fa4aot.model import constraints as C
from fa4aot.store.files import atomic_output
from fa4aot.store.layers import (
    WHEEL_STORES,
    WHEEL_TAG,
    Store,
    first_spec_indexes,
    first_valid_copy,
    scan_root,
    spec_ids,
)
from fa4aot.store.records import LAYOUT

BASE_VERSION = "1.0.0"  # public part of a content-derived version (see content_version)
_DIST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,98}[A-Za-z0-9])?")
_ELF_MACHINES = {62: "x86_64", 183: "aarch64"}
_DATE = (1980, 1, 1, 0, 0, 0)
_TAG_TEXT = (
    "This store belongs to an installed fa4aot cache wheel: pip owns its files, so fa4aot never\n"
    "builds into it. Upgrade or remove it with pip.\n"
)


@dataclass
class WheelResult:
    path: Path
    dist: str  # distribution name, e.g. fa4aot-cache-sm90
    store: str  # fingerprint directory
    artifacts: list[str] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # {"id", "error"}: corrupt, left out
    size: int = 0  # bytes of the .whl
    version: str = ""


def check_version(version: str) -> str:
    """`version` in its PEP 440 normal form; BuildError if it is not one."""
    from packaging.version import InvalidVersion, Version

    try:
        return str(Version(version))
    except InvalidVersion:
        raise BuildError(
            f"invalid version {version!r}: use a PEP 440 version such as 1.0.0 or 1.0.0+local"
        ) from None


def content_version(fp: str, entries: dict[str, bytes]) -> str:
    """1.0.0+fp<fingerprint hash>.<content hash>: the toolchain and the exact artifacts and spec
    indexes in the wheel. Two different stores never share a version (pip would keep the first
    installed and call the second "already satisfied"), and one store always gives one version
    (rebuilding a wheel is reproducible)."""
    h = hashlib.sha256()
    for name in sorted(entries):
        h.update(name.encode() + b"\0" + hashlib.sha256(entries[name]).digest())
    fp_hash = fp.rsplit("-", 1)[-1][:8]
    return check_version(f"{BASE_VERSION}+fp{fp_hash}.{h.hexdigest()[:12]}")


def requirements(tc: dict) -> list[str]:
    """Requires-Dist of a cache wheel: the exact runtime it was built for. The parts link
    against libtvm_ffi.so and libcute_dsl_runtime.so of these versions, and the records are
    read by this fa4aot; pip then refuses an environment the store cannot serve."""

    reqs = [f"fa4aot=={__version__}"]
    if tc.get("tvm_ffi"):
        reqs.append(f"apache-tvm-ffi=={tc['tvm_ffi']}")
    if tc.get("cutlass_libs") and tc.get("cutlass_dsl"):
        reqs.append(f"nvidia-cutlass-dsl-libs-{tc['cutlass_libs']}=={tc['cutlass_dsl']}")
    return reqs


def normalize_name(name: str) -> str:
    """PEP 503 form of a cache name (`Llama_3.1` -> `llama-3-1`); BuildError if not a valid
    distribution name."""
    if not _DIST_NAME.fullmatch(name):
        raise BuildError(
            f"invalid wheel name {name!r}: use letters, digits, '.', '_' and '-', starting and "
            "ending with a letter or digit (at most 100 characters)"
        )
    return re.sub(r"[-_.]+", "-", name).lower()


def _default_name(tc: dict, specs: list[str] | None) -> str:
    parts = [tc["arch"]]
    if tc["num_sms"] != C.DEFAULT_NUM_SMS.get(tc["arch"]):
        parts.append(f"{tc['num_sms']}sm")
    parts += sorted(specs or [])
    return re.sub(r"[^A-Za-z0-9]+", "-", "-".join(parts)).strip("-")[:100]


def _python_tag(tc: dict) -> str:
    m = re.fullmatch(r"3\.([0-9]+)", str(tc.get("python")))
    if not m:
        raise BuildError(f"store toolchain has python {tc.get('python')!r}, not a 3.X version")
    return f"cp3{m.group(1)}"


def glibc_needed(data: bytes) -> tuple[int, int] | None:
    """The newest GLIBC_x.y symbol version a 64-bit little-endian ELF object needs (its
    .gnu.version_r entries), None if it needs none; ValueError if the ELF is malformed."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF object")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    best = None
    for _name, typ, _flags, _addr, off, _size, link, info, _align, _entsize in sections:
        if typ != 0x6FFFFFFE:  # SHT_GNU_verneed: `info` Verneed entries, names in section `link`
            continue
        strtab = sections[link][4]
        pos = off
        for _ in range(info):
            _ver, cnt, _file, aux, nxt = struct.unpack_from("<HHIII", data, pos)
            apos = pos + aux
            for _ in range(cnt):
                _hash, _flags2, _other, name, anext = struct.unpack_from("<IHHII", data, apos)
                end = data.index(b"\0", strtab + name)
                m = re.fullmatch(rb"GLIBC_([0-9]+)\.([0-9]+)", data[strtab + name : end])
                if m:
                    best = max(best or (0, 0), (int(m.group(1)), int(m.group(2))))
                apos += anext
            pos += nxt
    return best


def _platform(files: dict[str, bytes]) -> str:
    """manylinux_<glibc>_<machine>: the ELF parts' machine and the newest glibc symbol version
    any of them needs, at least 2.17 (manylinux2014, the oldest tag indexes still take). The
    parts' other needs (libcute_dsl_runtime.so, libtvm_ffi.so) come from the cutlass-dsl and
    tvm-ffi wheels fa4aot depends on. Stub artifacts are not ELF: this machine's tag."""
    machine, glibc = None, (2, 17)
    for name in sorted(files):
        data = files[name]
        if data[:4] != b"\x7fELF" or len(data) < 64:
            continue
        m = int.from_bytes(data[18:20], "little" if data[5] == 1 else "big")
        if m not in _ELF_MACHINES:
            raise BuildError(f"{name}: ELF machine {m} has no wheel platform tag here")
        if machine not in (None, m):
            raise BuildError(f"{name}: ELF machine {m}, but other parts are {machine}")
        machine = m
        try:
            glibc = max(glibc, glibc_needed(data) or glibc)
        except (ValueError, struct.error, IndexError) as e:
            raise BuildError(f"{name}: unreadable ELF ({e})") from None
    if machine is None:
        return re.sub(r"[-.]", "_", sysconfig.get_platform())
    return f"manylinux_{glibc[0]}_{glibc[1]}_{_ELF_MACHINES[machine]}"


def _artifact_files(stores: list[Store], ids: set[str] | None, res: WheelResult) -> dict:
    """{"<id>/<file>": bytes} of every valid artifact (first valid layer copy), checked as read."""
    out: dict[str, bytes] = {}
    present = {vid for s in stores for vid, _ in s.iter_artifacts()}
    for vid in sorted(present if ids is None else present & ids):
        files, errors = first_valid_copy(stores, vid)
        if files is None:
            res.skipped.append({"id": vid, "error": "; ".join(errors)})
            continue
        res.artifacts.append(vid)
        out.update({f"{vid}/{n}": d for n, d in files.items()})
    return out


def _spec_files(stores: list[Store], specs: list[str] | None) -> dict[str, bytes]:
    return {n: f.read_bytes() for n, f in first_spec_indexes(stores, specs).items()}


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def _write_zip(path: Path, entries: dict[str, bytes], record_name: str) -> None:
    """Entries in sorted order with fixed metadata, dist-info last, RECORD computed here."""
    names = sorted(entries, key=lambda n: (".dist-info/" in n, n))
    record = "".join(_record_line(n, entries[n]) for n in names) + f"{record_name},,\n"
    with atomic_output(path) as f, zipfile.ZipFile(f, "w") as zf:
        for name, data in [*((n, entries[n]) for n in names), (record_name, record.encode())]:
            zi = zipfile.ZipInfo(name, date_time=_DATE)
            zi.create_system = 3  # unix: pip applies the mode below
            zi.external_attr = 0o100644 << 16
            zf.writestr(zi, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=6)


def _metadata(dist: str, version: str, tc: dict, fp: str, n: int, specs: list[str]) -> str:
    summary = (
        f"FlashAttention-4{' ' + str(tc['fa4']) if tc.get('fa4') else ''} kernels "
        "ahead-of-time compiled by fa4aot for "
        f"{tc['arch']} ({tc['num_sms']} SMs), Python {tc['python']}: {n} artifacts"
    )
    body = f"fa4aot store `{fp}`.\n\nToolchain:\n\n" + "".join(
        f"- {k}: {tc[k]}\n" for k in sorted(tc)
    )
    if specs:
        body += "\nSpecs: " + ", ".join(specs) + "\n"
    requires = "".join(f"Requires-Dist: {r}\n" for r in requirements(tc))
    return (
        f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\nSummary: {summary}\n"
        f"Requires-Python: =={tc['python']}.*\n{requires}"
        f"Description-Content-Type: text/markdown\n\n{body}"
    )


def _write_wheel(
    res: WheelResult,
    stores: list[Store],
    arts: dict,
    out_dir: Path,
    version: str | None,
    specs: list[str] | None,
) -> None:
    tc, fp = stores[0].toolchain, stores[0].dir.name
    ep = res.dist.removeprefix("fa4aot-cache-")
    pkg = f"fa4aot_cache_{ep.replace('-', '_')}"
    tag = f"{_python_tag(tc)}-none-{_platform(arts)}"
    base = f"{pkg}/store/{LAYOUT}/{fp}"
    spec_files = _spec_files(stores, specs)
    if version is None:
        version = content_version(fp, {**arts, **{f"specs/{n}": d for n, d in spec_files.items()}})
    res.version = version
    info = f"{res.dist.replace('-', '_')}-{version}.dist-info"
    init = (
        f'"""fa4aot cache wheel {res.dist}: the store {fp}.\n\n'
        f'fa4aot finds it through the {WHEEL_STORES} entry point."""\n\n'
        'from pathlib import Path\n\nROOT = Path(__file__).parent / "store"\n'
    )
    meta = _metadata(res.dist, version, tc, fp, len(res.artifacts), sorted(specs or []))
    entries = {
        f"{pkg}/__init__.py": init.encode(),
        f"{pkg}/store/{WHEEL_TAG}": _TAG_TEXT.encode(),
        f"{base}/toolchain.json": (stores[0].dir / "toolchain.json").read_bytes(),
        **{f"{base}/specs/{n}": d for n, d in spec_files.items()},
        **{f"{base}/artifacts/{n}": d for n, d in arts.items()},
        f"{info}/METADATA": meta.encode(),
        f"{info}/WHEEL": (
            f"Wheel-Version: 1.0\nGenerator: fa4aot\nRoot-Is-Purelib: false\nTag: {tag}\n"
        ).encode(),
        f"{info}/entry_points.txt": f"[{WHEEL_STORES}]\n{ep} = {pkg}\n".encode(),
    }
    res.path = Path(out_dir) / f"{res.dist.replace('-', '_')}-{version}-{tag}.whl"
    _write_zip(res.path, entries, f"{info}/RECORD")
    res.size = res.path.stat().st_size


def build_wheels(
    roots: list[Path],
    out_dir: Path,
    name: str | None = None,
    specs: list[str] | None = None,
    arch: str | None = None,
    version: str | None = None,
    store: str | None = None,
) -> list[WheelResult]:
    """Write one wheel per store found in `roots` into `out_dir` (layers: the same fingerprint
    directory in several roots is one store, the first layer's copy of an artifact winning).

    `specs`: only artifacts these specs asked for (each must match some); `arch`: only stores of
    that arch; `store`: only stores whose directory name starts with it (like `pack --store`).
    `name`: the cache name (dist `fa4aot-cache-<name>`); default arch[-<N>sm][-<spec>...].
    `version`: default content_version (1.0.0+fp<hash>.<content hash>, one per content).
    A store with no valid artifact to put in gets no wheel. Raises BuildError for no store, an
    invalid name or version, a spec matching nothing, two stores that would write the same wheel,
    or no wheel to write at all.
    """
    if version is not None:
        version = check_version(version)
    if name is not None:
        normalize_name(name)
    by_fp = _stores(roots, arch, store)
    wanted = {fp: _wanted(stores, specs) for fp, stores in by_fp.items()}
    for spec in specs or []:
        if not any(spec in w for w in wanted.values()):
            raise BuildError(f"spec {spec!r} matches no artifact in {', '.join(sorted(by_fp))}")
    plans, keys = [], {}
    for fp, stores in sorted(by_fp.items()):
        ids = set().union(*wanted[fp].values()) if specs else None
        if ids is not None and not ids:
            continue
        dist = "fa4aot-cache-" + normalize_name(
            _default_name(stores[0].toolchain, specs) if name is None else name
        )
        key = (dist, _python_tag(stores[0].toolchain))
        if key in keys:
            raise BuildError(
                f"stores {keys[key]} and {fp} would both be {dist} for {key[1]}; "
                "pick one with arch= or store=, or name each"
            )
        keys[key] = fp
        plans.append((WheelResult(Path(), dist, fp), stores, ids))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    results, empty = [], []
    for res, stores, ids in plans:
        arts = _artifact_files(stores, ids, res)
        if not arts:
            empty.append(f"{res.store}: " + (res.skipped[0]["error"] if res.skipped else "empty"))
            continue
        _write_wheel(res, stores, arts, out_dir, version, specs)
        results.append(res)
    if not results:
        raise BuildError("no valid artifact to put in a wheel:\n  " + "\n  ".join(empty))
    return results


def _stores(roots: list[Path], arch: str | None, store: str | None) -> dict[str, list[Store]]:
    by_fp: dict[str, list[Store]] = {}
    for r in roots:
        for s in scan_root(r)[0]:
            if (arch is None or s.toolchain["arch"] == arch) and (
                store is None or s.dir.name.startswith(store)
            ):
                by_fp.setdefault(s.dir.name, []).append(s)
    if not by_fp:
        what = " ".join(x for x in (arch, store and repr(store)) if x)
        raise BuildError(
            f"no {what + ' ' if what else ''}store in {', '.join(map(str, roots)) or '(no roots)'}"
        )
    return by_fp


def _wanted(stores: list[Store], specs: list[str] | None) -> dict[str, set[str]]:
    return {spec: ids for spec in specs or [] if (ids := spec_ids(stores, spec))}
