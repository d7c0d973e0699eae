"""The builder: spec variants -> cross-compiled, linked, checksummed artifacts in a store.

`build()` returns data (one BuildResult per variant); the CLI decides printing and exit codes.
Per artifact it follows FlashInfer's build_and_load shape: try_load -> lock -> try_load again
-> compile in tmp/ -> publish with one rename, so concurrent builders of one store compile each
artifact once (the lock) and publish it exactly once (the rename), and a builder killed at any
moment leaves scratch that the next build sweeps, never an entry a reader accepts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from fa4aot import settings
from fa4aot.build.enumerate import enumerate_variants, merge
from fa4aot.errors import BuildError, CorruptArtifact
from fa4aot.model import constraints as C
from fa4aot.model.compile_keys import Call
from fa4aot.model.abis import source_reason
from fa4aot.model.needs import Plan, Unsupported
from fa4aot.model.specs import Spec
from fa4aot.model.variants import Variant
from fa4aot.policy.split import MAX_SLOTS
from fa4aot.store import locking
from fa4aot.store.files import atomic_write, crash_point, fsync_dir, owner_tag, sha256_file
from fa4aot.store.layers import Store, build_root, default_roots, sweep_temp
from fa4aot.store.merge import shard as shard_ids
from fa4aot.store.records import RECORD, RECORD_FORMAT, seal_record
from fa4aot.fa4 import sources
from fa4aot.store.toolchain import build_toolchain


@dataclass(frozen=True)
class BuildResult:
    id: str
    description: str
    status: str  # built | cached | failed | rebuilt (was corrupt)
    seconds: float
    error: str | None = None
    size: int = 0
    found_in: str | None = None  # cached in another layer: that store's directory


def plan_for(specs: list[Spec], arch: str, num_sms: int | None = None,
             fa4: str = "upstream") -> Plan:
    """num_sms: the target's SM count (absorbed MLA's route reads it; None: the arch's); fa4:
    the FA4 source's ABI (enumerate_variants)."""
    return _source_limits(merge([enumerate_variants(s, arch, num_sms, fa4) for s in specs]), fa4)


def _source_limits(plan: Plan, fa4: str) -> Plan:
    """`plan` less the needs the source's forward refuses outright (abis.source_reason: SGLang's
    copy asserts bf16 sinks), each such layer reported unsupported once."""
    keep, seen = [], set()
    for n in plan.needs:
        why = source_reason(fa4, sink_dtype=n.variant.sink_dtype, split_kv=n.variant.split_kv)
        if why is None:
            keep.append(n)
        elif (n.spec, n.layer) not in seen:
            seen.add((n.spec, n.layer))
            plan.unsupported.append(Unsupported(n.spec, n.layer, why))
    plan.needs = keep
    return plan


def _link(obj: Path, so: Path, lib_dirs: list[str]) -> None:
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        raise BuildError(f"no C compiler/linker ({cc}) on PATH: needed to link artifacts")
    cmd = [cc, "-shared", "-o", str(so), str(obj)]
    for d in lib_dirs:
        cmd += [f"-L{d}"]
    cmd += ["-lcute_dsl_runtime", "-ltvm_ffi"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"link failed: {' '.join(cmd)}\n{r.stderr.strip()}")


def _compile_real(call: Call, variant: Variant, workdir: Path) -> dict[str, Any]:
    from fa4aot.fa4 import driver, export

    out = export.compile_variant(call, variant, workdir)
    lib_dirs = driver.runtime_library_dirs()
    for name, part in out["parts"].items():
        so = workdir / f"{name}.so"
        _link(Path(part.pop("object")), so, lib_dirs)
        part["file"] = so.name
    return out


def _compile_stub(call: Call, variant: Variant, workdir: Path) -> dict[str, Any]:
    """FA4AOT_STUB_COMPILER=1: a fake artifact, for tests of store concurrency and crash safety
    (compiling real kernels in 8 racing processes would take minutes). It mimics the real
    builder's file traffic: an object file written in chunks (export), then a shared object
    written from it (link). Never loadable: the runtime refuses records marked stub."""
    delay = settings.stub_delay()
    obj, so = workdir / "fwd.o", workdir / "fwd.so"
    for path, src, phase in ((obj, None, "export"), (so, obj, "link")):
        data = src.read_bytes() if src else f"stub {variant.id}\n".encode() * 1600
        with open(path, "wb") as f:
            for i in range(0, len(data), 4096):
                f.write(data[i : i + 4096])
                f.flush()
                time.sleep(delay / 2 / (len(data) / 4096))
                if i >= len(data) // 2:
                    crash_point(phase)
    return {
        "parts": {"fwd": {"file": "fwd.so", "key": "stub"}},
        "compile_seconds": delay,
        "fa4_key": "stub",
        "stub": True,
    }


# The minors a store can target: fa4aot's floor (requires-python) to the newest CPython release.
SERVING_PYTHONS = tuple(f"3.{m}" for m in range(11, 16))


def check_python(python: str | None) -> None:
    """Refuse a --python no fa4aot runtime can be: the store it would write loads nowhere."""
    if python is not None and python not in SERVING_PYTHONS:
        raise BuildError(
            f"--python {python!r}: the runtime serves Python {', '.join(SERVING_PYTHONS)} "
            "(MAJOR.MINOR of the serving interpreter, e.g. 3.12)"
        )


def _configure_compiler(arch: str, num_sms: int, fa4: str | None = None) -> None:
    if not settings.stub_compiler():
        from fa4aot.fa4 import driver

        driver.configure(arch, num_sms, fa4)


def _init_worker(arch: str, num_sms: int, overrides: dict | None = None,
                 fa4: str | None = None) -> None:
    # Ctrl-C at a terminal signals the whole process group. A worker that took it would only
    # fail its current variant and go on to the next (the pool reports a KeyboardInterrupt as
    # that task's result): the parent alone decides, and terminates the workers (build()).
    # Only pool workers ignore it: the parent of a -j 1 build must stay interruptible.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if overrides:  # the parent's settings.scope(...) holds in its workers too
        settings.settings.apply(overrides)
    _configure_compiler(arch, num_sms, fa4)


def _nothing_buildable(plan: Plan, arch: str) -> str:
    why = "; ".join(f"{u.spec}/{u.layer}: {u.reason}" for u in plan.unsupported[:4])
    more = f" (+{len(plan.unsupported) - 4} more)" if len(plan.unsupported) > 4 else ""
    return (
        f"nothing to build for {arch}: the specs need no variant it can run"
        + (f" ({why}{more})" if why else "")
        + "; see: fa4aot specs --arch " + arch
    )


def publish(store: Store, vid: str, workdir: Path, record: dict[str, Any]) -> bool:
    """Assemble parts and record in a staging directory, then rename it into place
    (Store.publish_dir): a process killed at any point leaves only scratch in tmp/, and when two
    builders race (a lock that did not exclude, on a filesystem that lies about flock), exactly
    one publishes. -> False when another builder published first."""
    stage = workdir / "publish"
    stage.mkdir()
    for p in record["parts"].values():
        src = workdir / "build" / p["file"]
        with open(src, "rb") as f:
            os.fsync(f.fileno())
        os.replace(src, stage / p["file"])
    crash_point("stage")
    with open(stage / RECORD, "wb") as f:
        f.write((json.dumps(record, indent=2, sort_keys=True) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(stage)
    crash_point("publish")
    won = store.publish_dir(vid, stage)
    crash_point("published")
    return won


def build_one(root: str, toolchain: dict, need: dict) -> dict:
    """Worker entry: build one variant into the store unless present. -> BuildResult fields."""
    store = Store(Path(root), toolchain)
    variant = Variant.from_dict(need["variant"])
    call = Call(**need["call"])
    vid = variant.id
    t0 = time.perf_counter()
    status = "built"
    try:
        with locking.hold(store.lock_path(vid), timeout=locking.BUILD_TIMEOUT_S):
            try:
                have = store.get(vid)
            except CorruptArtifact:
                store.move_aside(vid, "quarantine")
                have, status = None, "rebuilt"
            if have is not None and superseded(have):
                shutil.rmtree(store.move_aside(vid, "tmp"), ignore_errors=True)
                have, status = None, "rebuilt"
            if have is not None:
                return dict(
                    id=vid,
                    description=variant.describe(),
                    status="cached",
                    seconds=time.perf_counter() - t0,
                    size=have.size,
                )
            store.discard_unpublished(vid)
            workdir = Path(tempfile.mkdtemp(prefix=f"{vid}.{owner_tag()}", dir=store.dir / "tmp"))
            try:
                (workdir / "build").mkdir()
                stub = settings.stub_compiler()
                if need.get("same_kernel_as"):
                    out = _copy_kernel(store, need["same_kernel_as"], workdir / "build")
                else:
                    out = (_compile_stub if stub else _compile_real)(call, variant,
                                                                     workdir / "build")
                record = make_record(variant, call, out, workdir / "build", toolchain, need)
                if not publish(store, vid, workdir, record):
                    status = "cached"  # another builder published it first: keep theirs
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
            size = sum(p["size"] for p in record["parts"].values())
            return dict(
                id=vid,
                description=variant.describe(),
                status=status,
                seconds=time.perf_counter() - t0,
                size=size,
            )
    except Exception as e:  # noqa: BLE001 - reported per variant; the others still land
        msg = f"{type(e).__name__}: {e}".strip()
        return dict(
            id=vid,
            description=variant.describe(),
            status="failed",
            seconds=time.perf_counter() - t0,
            error=msg,
        )


def _copy_kernel(store: Store, vid: str, dest: Path) -> dict[str, Any]:
    """The parts of artifact `vid` of `store` (the same kernel as the variant being built)
    copied into `dest`, as a compile returns them. BuildError when `store` holds no valid
    `vid` (its compile failed: so would this one's; the next build retries both)."""
    try:
        art = store.get(vid)
    except CorruptArtifact:
        art = None
    if art is None:
        raise BuildError(f"the same kernel as {vid}, which was not built")
    parts = {}
    for name, p in art.record["parts"].items():
        shutil.copyfile(art.part_path(name), dest / p["file"])
        parts[name] = {k: v for k, v in p.items() if k not in ("sha256", "size")}
    return {"parts": parts, "compile_seconds": 0.0, "fa4_key": art.record["fa4_key"],
            "stub": bool(art.record.get("stub")), "same_kernel_as": vid}


def _same_kernels(args: list, todo: dict, held: set, source) -> tuple[list, list]:
    """(`args` to compile, `args` to copy): where the FA4 source compiles one kernel for several
    fa4aot variants (SGLang's copy: sglang_copy.kernel_id), one of them is compiled (or held:
    `held`, ids the target store holds) and the others copy its parts (build_one's
    need["same_kernel_as"])."""
    if source is None or source.abi != "sglang":
        return args, []
    from fa4aot.fa4.sglang_copy import kernel_id

    first = {kernel_id(todo[vid].variant): vid for vid in sorted(held)}
    compile_, copy_ = [], []
    for a in args:
        v = Variant.from_dict(a[2]["variant"])
        lead = first.setdefault(kernel_id(v), v.id)
        if lead == v.id:
            compile_.append(a)
        else:
            copy_.append((a[0], a[1], {**a[2], "same_kernel_as": lead}))
    return compile_, copy_


def make_record(
    variant: Variant, call: Call, out: dict, workdir: Path, toolchain: dict, need: dict
) -> dict[str, Any]:
    tile = variant.tile
    parts = {}
    for name, p in out["parts"].items():
        f = workdir / p["file"]
        parts[name] = {**p, "sha256": sha256_file(f), "size": f.stat().st_size}
    return seal_record(
        {
            "format": RECORD_FORMAT,
            "id": variant.id,
            "variant": variant.to_dict(),
            "description": variant.describe(),
            "contract": {
                # what a call must satisfy, beyond matching the variant's features
                "tile_m": tile.m,
                "tile_n": tile.n,
                "pack_gqa": variant.qhead_per_kvhead > 1,
                "page_size": ("== tile_n" if variant.paged_tma else "!= tile_n")
                if variant.paged
                else None,
                "alignment_bytes": 16,
                "last_dim_contiguous": True,
                "num_sms": toolchain["num_sms"],
                "devices": "all tensors on one CUDA device",
                "int_tensors": "int32, contiguous",
            },
            "parts": parts,
            # FA4 may bake the SM count into grids (persistent schedulers); no artifact claims
            # otherwise yet, so a GPU with another SM count is refused (Store.serve_num_sms).
            "sm_count_independent": False,
            "fa4_key": out["fa4_key"],
            "stub": bool(out.get("stub")),
            # the artifact whose kernel this one copies (one kernel, several variant ids)
            **({"same_kernel_as": out["same_kernel_as"]} if out.get("same_kernel_as") else {}),
            "compile_seconds": round(out["compile_seconds"], 3),
            "representative_call": call.to_dict(),
            "requested_by": {"spec": need["spec"], "layer": need["layer"]},
            "toolchain": toolchain,
            "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
    )


def write_spec_index(store: Store, spec: Spec, plan: Plan) -> None:
    ids = sorted({n.variant.id for n in plan.needs if n.spec == spec.name})
    doc = {
        "spec": spec.to_dict(),
        "variants": ids,
        "unsupported": [
            {"layer": u.layer, "reason": u.reason} for u in plan.unsupported if u.spec == spec.name
        ],
    }
    data = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
    path = store.spec_index(spec.name)
    try:
        if path.read_bytes() == data:
            return  # a no-op build leaves the store untouched (read-only layers, mtimes)
    except OSError:
        pass
    atomic_write(path, data)


def build(
    specs: list[Spec],
    *,
    arch: str,
    root: Path | None = None,
    layers: list[Path] | None = None,
    num_sms: int | None = None,
    python: str | None = None,
    jobs: int = 1,
    progress: Callable[[int, int, BuildResult], None] | None = None,
    plan: Plan | None = None,
    shard: tuple[int, int] | None = None,
    replace_spec: bool = False,
    on_start: Callable[[Store, int, int], None] | None = None,
    fa4: str | None = None,
) -> tuple[Store, Plan, list[BuildResult]]:
    """Build every variant the specs need that no layer holds. Never raises for one variant's
    failure (it is a `failed` result); raises BuildError when nothing can be built at all.

    `root` names the one store to build into; otherwise `layers` (default: FA4AOT_CACHE_DIR's)
    are searched in order and builds go to the first writable one (build_root). Nothing is
    written to any other layer.

    `shard` (I, N): build only shard I of N of the variants (merge.shard); the spec indexes
    still list every variant of each spec, so the shards' stores merge into the whole.

    A spec index of the same name recording a different spec refuses the build (BuildError)
    before anything is compiled, unless `replace_spec`. `on_start(store, total, to_build)` is
    called once the target and the work are known. `fa4`: the FA4 source to compile
    (fa4.sources.resolve: upstream, vllm, sglang or a path; None: upstream); one whose ABI fa4aot
    does not model raises Fa4SourceError before anything is planned.

    KeyboardInterrupt (Ctrl-C, or SIGTERM while workers run): pending variants are cancelled,
    worker processes terminated, and the interrupt re-raised. Nothing half-written is left where
    readers look: each artifact is published by one rename, and a killed worker's scratch is
    swept by the next build.
    """
    C.arch_number(arch)
    check_python(python)
    num_sms = num_sms or C.default_num_sms(arch)
    source = sources.resolve_for_build(fa4)
    plan = plan or plan_for(specs, arch, num_sms, source.abi if source else "upstream")
    if not plan.needs:
        raise BuildError(_nothing_buildable(plan, arch))
    toolchain = build_toolchain(arch, num_sms, python, source)
    roots = [Path(root)] if root is not None else [Path(r) for r in (layers or default_roots())]
    target = build_root(roots)
    store = Store(target, toolchain)
    try:
        store.ensure()
    except OSError as e:
        raise BuildError(f"cannot write the store at {target}: {e.strerror or e}") from None
    sweep_temp(store)
    if not replace_spec:
        for s in specs:
            _check_spec_index(store, s)
    others = [Store(r, toolchain) for r in roots if r != target]
    todo = plan.variants()
    if shard is not None:
        keep = set(shard_ids(list(todo), *shard))
        todo = {vid: n for vid, n in todo.items() if vid in keep}
    results, pending = _cached_or_pending(store, others, todo)
    total = len(todo)
    if on_start:
        on_start(store, total, len(pending))
    for r in results:
        if progress:
            progress(len(results), total, r)
    args = [
        (
            str(target),
            toolchain,
            {
                "variant": n.variant.to_dict(),
                "call": n.call.to_dict(),
                "spec": n.spec,
                "layer": n.layer,
            },
        )
        for n in pending
    ]
    if pending and not settings.stub_compiler() and not toolchain["fa4"]:
        raise BuildError(
            "the builder needs FA4 and the CuTe DSL compiler: pip install 'fa4aot[build]' "
            "(serving needs neither)"
        )
    if pending:
        # workers import the source by its directory (an engine's copy need not be on sys.path)
        where = None if source is None or source.name == "upstream" else str(source.cute_dir)
        held = {r.id for r in results if r.found_in is None}
        args, copies = _same_kernels(args, todo, held, source)
        _build_pending(args, arch, num_sms, jobs, results, total, progress, where)
        for a in copies:  # (in this process: a copy needs no compiler)
            results.append(BuildResult(**build_one(*a)))
            if progress:
                progress(len(results), total, results[-1])
    for s in specs:
        write_spec_index(store, s, plan)
    return store, plan, results


def _cached_or_pending(store: Store, others: list[Store], todo: dict) -> tuple[list, list]:
    """(results for the variants a layer already holds, the Needs left to build)."""
    results: list[BuildResult] = []
    pending = []
    for vid, need in todo.items():
        have, found_in = _target_copy(store, vid), None
        if have is not None and superseded(have):
            have = None  # (the worker replaces it)
        if have is None and not (store.artifact_dir(vid) / RECORD).exists():
            # only a miss in the target may fall through to a lower layer: a corrupt target copy
            # would shadow that layer's good one at serve time, so it is rebuilt (below)
            have = _valid_copy(others, vid)
            found_in = str(have.dir.parent.parent) if have is not None else None
        if have is not None:
            results.append(
                BuildResult(
                    vid, need.variant.describe(), "cached", 0.0, size=have.size, found_in=found_in
                )
            )
        else:
            pending.append(need)  # a corrupt copy in `store` is quarantined by the worker
    return results, pending


def _build_pending(args, arch, num_sms, jobs, results, total, progress, fa4=None) -> None:
    """Build `args` (build_one's) in this process (jobs <= 1) or a spawned pool, appending
    each BuildResult to `results` as it lands."""
    if jobs <= 1:
        _configure_compiler(arch, num_sms, fa4)
        for a in args:
            r = BuildResult(**build_one(*a))
            results.append(r)
            if progress:
                progress(len(results), total, r)
        return
    import multiprocessing as mp

    ex = ProcessPoolExecutor(
        max_workers=min(jobs, len(args)),
        mp_context=mp.get_context("spawn"),
        initializer=_init_worker,
        initargs=(arch, num_sms, settings.settings.overrides(), fa4),
    )
    restore = _sigterm_as_interrupt()
    try:
        futs = [ex.submit(build_one, *a) for a in args]
        for f in as_completed(futs):
            r = BuildResult(**f.result())
            results.append(r)
            if progress:
                progress(len(results), total, r)
    except BaseException:
        _stop_pool(ex)
        raise
    finally:
        restore()
    ex.shutdown(wait=True)


def _sigterm_as_interrupt():
    """While workers run, SIGTERM (a `kill`, a CI timeout, a container stop) stops the build as
    Ctrl-C does. Without it the parent died at once and its spawned workers, which ignore
    SIGINT, went on compiling as orphans (seen: two workers alive an hour after `pkill`).
    -> a function restoring the previous handler."""

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    prev = signal.signal(signal.SIGTERM, interrupt)
    return lambda: signal.signal(signal.SIGTERM, prev)


def _stop_pool(ex: ProcessPoolExecutor) -> None:
    """Cancel what has not started and terminate the workers now: leaving the `with` block of
    an executor waits for every running compile, which is what made the first Ctrl-C stop only
    the progress display while the workers went on for minutes."""
    procs = list((getattr(ex, "_processes", None) or {}).values())
    ex.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()


def _check_spec_index(store: Store, spec: Spec) -> None:
    """BuildError if the store's index of `spec.name` records another spec: one name must mean
    one spec in a store (ls, coverage and pack --spec read the index by name)."""
    try:
        held = json.loads(store.spec_index(spec.name).read_bytes()).get("spec")
    except (OSError, ValueError, AttributeError):
        return  # no index (or an unreadable one, which the build rewrites)
    if held is not None and held != json.loads(json.dumps(spec.to_dict())):
        raise BuildError(
            f"{store.spec_index(spec.name)} already records a different spec named "
            f"{spec.name!r}: rename one of them, or rebuild with --replace-spec to replace it"
        )


def superseded(art) -> bool:
    """A split chunk kernel's artifact that lacks a helper part this fa4aot builds beside it:
    fa4aot's merge kernel at its current version (C.MERGE_VERSION), where C.merge_threads has
    a layout for its head dim (FA4's combine otherwise), and the chunk metadata kernel
    (kernels.trace_merge, trace_chunk_meta), or, on sm90, whose forward does not read q (and
    a paged K's lengths, a packed K's chunk bounds for one or several rows a sequence: part
    `fwd_bounds`, record `rows` == C.BOUNDS_FORM) through chunk modes
    (forwards.trace_chunk_modes), or a 64-row one
    without a wide fold kernel its K takes (parts `fwd_wide`, `fwd_wide1`: constraints.WideFold,
    forwards.trace_wide_fold) or, for a packed K, without the wide split kernel (part
    `fwd_wide_split`: constraints.wide_split) or, paged on FA4's cp.async path, without the TMA
    page kernel (part `fwd_tma`: constraints.tma_page), or, paged on sm90, without the
    packed-rows metadata kernel (part `packed_meta`: kernels.trace_packed_meta), or, on sm90,
    without the ragged step's kernels at C.RAGGED_VERSION (parts `ragged_meta`, `ragged_merge`:
    kernels.trace_ragged), or whose
    kernels are not programmatic dependent launches (parts.fwd.pdl:
    forwards._pdl_secondary), i.e. built before them.
    `fa4aot build` replaces it, as it does a corrupt copy; until then the runtime serves it with
    what it has (FA4's combine, torch's element-wise kernels, a copy of q over the chunks, the
    metadata kernel, plain launches)."""
    rec = art.record
    if rec.get("stub"):
        return False  # (a placeholder: never loaded, nothing to supersede)
    v = Variant.from_dict(rec["variant"])
    if not v.split_kernel:
        return False
    merge = "merge" if C.merge_threads(v.head_dim_v, MAX_SLOTS) is not None else "combine"
    fwd = rec["parts"].get("fwd", {})
    parts = rec["parts"]
    kernels = {w.part for w in C.wide_folds(v.arch, v.head_dim, v.head_dim_v, v.tile_m, v.paged)}
    if C.tma_page(v.arch, v.tile_m, v.paged, v.paged_tma):
        kernels.add("fwd_tma")
    if C.wide_split(v.arch, v.head_dim, v.head_dim_v, v.tile_m, v.paged):
        kernels.add(C.WIDE_SPLIT.part)
    modes = (fwd.get("chunk_lengths") if v.paged
             else parts.get("fwd_bounds", {}).get("rows") == C.BOUNDS_FORM) and (
        kernels <= set(parts))
    if v.arch == "sm90" and not (fwd.get("q_broadcast") and modes and fwd.get("pdl")):
        return True
    if merge == "merge" and parts.get("merge", {}).get("version") != C.MERGE_VERSION:
        return True  # fa4aot's merge as an earlier fa4aot compiled it (C.MERGE_VERSION)
    want = {merge, "chunk_meta"} | ({"packed_meta"} if v.paged and v.arch == "sm90" else set())
    if v.arch == "sm90" and merge == "merge" and v.head_dim % 8 == 0:  # (kernels.trace_ragged)
        if parts.get("ragged_meta", {}).get("version") != C.RAGGED_VERSION:
            return True
        want.add("ragged_merge")
    return not want <= set(rec["parts"])


def _target_copy(store: Store, vid: str):
    """`vid`'s valid copy in the build target (a format-1 record resealed in place first), or
    None: absent, or corrupt (the worker then quarantines and rebuilds it)."""
    if store.record_format(vid) == 1:  # built before records were sealed
        with locking.hold(store.lock_path(vid), timeout=locking.BUILD_TIMEOUT_S):
            store.upgrade_record(vid)
    return _valid_copy([store], vid)


def _valid_copy(stores: list[Store], vid: str):
    for s in stores:
        try:
            have = s.get(vid)
        except CorruptArtifact:
            continue
        if have is not None:
            return have
    return None
