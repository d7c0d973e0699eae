"""`fa4aot build` and `fa4aot specs`: what the specs need, and compiling it into the store."""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from pathlib import Path

import click

from fa4aot import settings
from fa4aot.build.builder import build as run_build
from fa4aot.build.builder import check_python, plan_for
from .app import main
from .common import (
    apply_gpu,
    cache_option,
    gpu_option,
    layers_for,
    loadable_artifacts,
    matching_stores,
)
from .output import Output, with_output
from fa4aot.errors import BuildError, Fa4SourceError
from fa4aot.fa4 import sources
from fa4aot.model import constraints as C
from fa4aot.model.needs import Need, Unsupported
from fa4aot.model.specs import resolve_specs
from fa4aot.store.layers import resolve_layers
from fa4aot.store.merge import parse_shard
from fa4aot.store.merge import shard as shard_ids
from fa4aot.store.misses import plan_misses, read_misses


class Progress:
    """Build progress on stderr, for humans. On a terminal: an opening line (variants, jobs,
    store), then one line rewritten in place with the count and an ETA. Elsewhere (a CI log,
    FA4AOT_PROGRESS=1 into a file): the opening line, then one newline-terminated line per
    finished variant, never a carriage return."""

    def __init__(self, enabled: bool, tty: bool, jobs: int, label: str = ""):
        self.enabled, self.tty, self.jobs, self.label = enabled, tty, jobs, label
        self.t0 = time.perf_counter()
        self.done = 0
        self.live = False  # a rewritten line is on screen

    @classmethod
    def for_command(cls, as_json: bool, jobs: int, label: str) -> Progress:
        mode = settings.progress()
        tty = sys.stderr.isatty()
        # auto: on for humans and for logs alike (a CI log got 6 minutes of silence), off
        # under --json, whose stdout a program reads
        enabled = mode == "1" or (mode == "auto" and not as_json)
        return cls(enabled, tty, jobs, label)

    def start(self, store, total: int, pending: int) -> None:
        self.t0 = time.perf_counter()
        if self.enabled:
            click.echo(
                f"{self.label}{total} variants ({pending} to build, {total - pending} cached) "
                f"with {self.jobs} jobs -> {store.dir}",
                err=True,
            )

    def __call__(self, i: int, n: int, r) -> None:
        self.done = i
        if not self.enabled:
            return
        mark = {"built": "+", "cached": "=", "failed": "!", "rebuilt": "~"}[r.status]
        line = f"[{self.label}{i}/{n}] {mark} {r.description} ({r.seconds:.1f}s)"
        if not self.tty:
            click.echo(line, err=True)
            return
        elapsed = time.perf_counter() - self.t0
        eta = f" eta {elapsed / i * (n - i):.0f}s" if i < n else ""
        line = f"{line}{eta}"[:120]
        keep = r.status == "failed" or i == n
        click.echo("\r" + line.ljust(120), err=True, nl=keep)
        self.live = not keep

    def close(self) -> None:
        if self.enabled and self.tty and self.live:
            click.echo("", err=True)
            self.live = False


@main.command()
@click.option(
    "--arch",
    "archs",
    multiple=True,
    type=click.Choice(sorted(C.ARCHS)),
    help="Target arch (repeatable: --arch sm90 --arch sm100). Default: sm90.",
)
@click.option(
    "--spec",
    "specs",
    multiple=True,
    help="Default spec name or TOML path (repeatable). Default: all shipped specs.",
)
@cache_option("write")
@click.option(
    "--jobs",
    "-j",
    default=max(1, (os.cpu_count() or 1)),
    show_default=True,
    type=click.IntRange(1, 256),
)
@click.option(
    "--num-sms",
    type=click.IntRange(1, 1024),
    help="SM count of the target GPU (default: 132 for sm90, 148 for sm100; required for sm103, "
    "or --gpu).",
)
@gpu_option()
@click.option(
    "--python", "python", help="Python minor of the serving runtime, e.g. 3.12 (default: this one)."
)
@click.option(
    "--from-misses",
    "misses",
    type=click.Path(dir_okay=False, exists=True),
    help="Also build the variants of a miss log (FA4AOT_MISS_LOG).",
)
@click.option(
    "--shard",
    help="Build only shard I of N (0-based, e.g. 2/8) of each arch's variants; join the "
    "shards' stores with `fa4aot merge`.",
)
@click.option(
    "--replace-spec",
    is_flag=True,
    help="Replace a stored spec index of the same name that records a different spec.",
)
@click.option(
    "--fa4",
    "fa4",
    default="upstream",
    show_default=True,
    help="The FA4 to compile: upstream (flash-attn-4), vllm (the copy an installed vLLM "
    "ships), sglang, or a path to a source tree's cute/ directory.",
)
@click.option("--dry-run", is_flag=True, help="List what would be built; compile nothing.")
@with_output
def build(
    archs, specs, cache, jobs, num_sms, gpu, python, misses, shard, replace_spec, fa4, dry_run,
    out,
):
    """Cross-compile every variant the specs need into the store (no GPU needed). Ctrl-C stops
    the workers and exits 130, leaving only complete artifacts."""


    try:
        check_python(python)
    except BuildError as e:
        raise click.BadParameter(str(e), param_hint="--python") from None
    if shard is not None:
        try:
            shard = parse_shard(shard)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--shard") from None
    archs, num_sms = apply_gpu(gpu, archs, num_sms, "archs")
    if num_sms is not None and len(set(archs)) > 1:
        raise click.BadParameter("--num-sms applies to one arch; build each arch separately")
    try:
        source = sources.resolve_for_build(fa4)
    except Fa4SourceError as e:
        raise click.BadParameter(str(e), param_hint="--fa4") from None
    spec_list = resolve_specs(list(specs)) if (specs or not misses) else []
    rows, unsup, stores, counts = [], [], [], {}
    t0 = time.perf_counter()
    archs = list(dict.fromkeys(archs or ("sm90",)))
    if num_sms is None:
        for arch in archs:  # before any arch is built: sm103 has no default SM count
            try:
                C.default_num_sms(arch)
            except ValueError as e:
                raise click.BadParameter(str(e), param_hint="--num-sms") from None
    layers = None if dry_run else layers_for(cache, out, wheels=False, verb="write", strict=False)
    for arch in archs:
        r, u, store, c = _build_arch(
            out,
            arch,
            spec_list,
            [lay.root for lay in layers] if layers else None,
            jobs,
            num_sms,
            python,
            misses,
            shard,
            dry_run,
            replace_spec,
            label=f"{arch}: " if len(archs) > 1 else "",
            source=source,
        )
        rows += r
        unsup += u
        if store is not None:  # not a dry run
            stores.append(store)
            counts = {k: counts.get(k, 0) + n for k, n in c.items()}
    servable = sum(counts.get(k, 0) for k in ("built", "rebuilt", "cached"))
    if out.as_json:
        extra = {"unsupported": unsup}
        if not dry_run:
            extra.update(
                stores=stores,
                store=stores[0] if len(stores) == 1 else None,
                counts=counts,
                wall_seconds=round(time.perf_counter() - t0, 2),
                serve=_serve_hint(stores) if servable else None,
            )
        out.table(rows, [], **extra)
    elif dry_run:
        out.table(rows, (["arch"] if len(archs) > 1 else []) + ["id", "variant", "spec"])
    elif servable:  # (a build whose every variant failed has nothing to serve)
        out.text(_serve_hint(stores))
    if counts.get("failed"):
        sys.exit(1)


def _serve_hint(stores: list[str]) -> str:
    """The last line of a build: how to point the runtime at what it built."""

    roots = list(dict.fromkeys(str(Path(s).parent.parent) for s in stores))
    read = {str(layer.root): layer.source for layer in resolve_layers(None)}
    if roots and all(r in read for r in roots):
        return "the runtime reads it already: " + ", ".join(f"{r} ({read[r]})" for r in roots)
    env = roots + [str(p) for p in settings.cache_dir() or [] if str(p) not in roots]
    return f"serve it with: export FA4AOT_CACHE_DIR={os.pathsep.join(env)}"


def _build_arch(
    out: Output, arch, spec_list, roots, jobs, num_sms, python, misses, shard, dry_run,
    replace_spec, label, source=None,
):  # fmt: skip
    """One arch of `fa4aot build`. -> (rows, unsupported, store dir, counts), the last two None
    on a dry run; prints the text report itself."""

    plan = plan_for(spec_list, arch, num_sms, source.abi if source else "upstream")
    if misses:
        todo, refused = plan_misses(read_misses(misses), arch, num_sms,
                                    source.abi if source else "upstream")
        plan.needs += [Need(v, call, "miss-log", Path(misses).name) for v, call in todo]
        plan.unsupported += [Unsupported("miss-log", Path(misses).name, r) for r in refused]
    unsup = [
        {
            "arch": arch,
            "spec": u.spec,
            "layer": u.layer,
            "reason": u.reason,
            "served_by": u.served_by,
        }
        for u in plan.unsupported
    ]
    if dry_run:
        return _dry_run_rows(plan, arch, num_sms, shard), unsup, None, None
    progress = Progress.for_command(out.as_json, jobs, label)
    t0 = time.perf_counter()
    try:
        store, plan, results = run_build(
            spec_list,
            arch=arch,
            layers=roots,
            num_sms=num_sms,
            python=python,
            jobs=jobs,
            progress=progress,
            plan=plan,
            shard=shard,
            replace_spec=replace_spec,
            on_start=lambda *a: (out.flush(), progress.start(*a)),
            fa4=None if source is None or source.name == "upstream" else str(source.cute_dir),
        )
    except KeyboardInterrupt:
        progress.close()
        out.error(
            f"interrupted: {progress.done} variants finished before Ctrl-C; workers stopped, "
            "every published artifact is complete; run the same command again to finish",
            130,
        )
    progress.close()
    wall = time.perf_counter() - t0
    counts = {
        s: sum(r.status == s for r in results) for s in ("built", "rebuilt", "cached", "failed")
    }
    rows = [
        {
            "arch": arch,
            "id": r.id,
            "status": r.status,
            "variant": r.description,
            "seconds": round(r.seconds, 2),
            "size": r.size,
            **({"error": r.error} if r.error else {}),
        }
        for r in results
    ]
    _report(out, arch, results, unsup, counts, store, shard, label, wall)
    return rows, unsup, str(store.dir), counts


def _dry_run_rows(plan, arch, num_sms, shard) -> list[dict]:
    """`build --dry-run`'s rows: what this arch (and shard) would build."""
    todo = plan.variants()
    keep = set(shard_ids(list(todo), *shard)) if shard else set(todo)
    return [
        {
            "arch": arch,
            "num_sms": num_sms or C.default_num_sms(arch),
            "id": vid,
            "variant": n.variant.describe(),
            "spec": f"{n.spec}/{n.layer}",
        }
        for vid, n in todo.items()
        if vid in keep
    ]


def _report(out, arch, results, unsup, counts, store, shard, label, wall) -> None:
    """The text report of one arch's build."""
    for r in results:
        if r.status == "failed":
            out.text(f"FAILED {r.id} {r.description}: {r.error}")
    for u in unsup:
        via = f"; served by {u['served_by']}" if u["served_by"] else ""
        out.text(f"unsupported: {u['spec']}/{u['layer']} on {arch}: {u['reason']}{via}")
    if shard:
        label += f"shard {shard[0]}/{shard[1]}: "
    if counts["built"] + counts["rebuilt"] + counts["failed"] == 0:
        # copies in lower layers (FA4AOT_CACHE_DIR=/node:/image) are counted per store
        target = str(store.dir)
        where = Counter(r.found_in or target for r in results)
        at = (
            f"in {target}"
            if set(where) <= {target}
            else "in the store layers: "
            + ", ".join(f"{where[d]} in {d}" for d in sorted(where, key=lambda d: d != target))
        )
        out.text(f"{label}nothing to build: all {counts['cached']} variants are {at}")
    else:
        out.text(
            f"{label}built {counts['built'] + counts['rebuilt']}, cached "
            f"{counts['cached']}, failed {counts['failed']} in {wall:.1f}s -> {store.dir}"
        )


@main.command("specs")
@click.option("--arch", default="sm90", show_default=True, type=click.Choice(sorted(C.ARCHS)))
@click.option("--spec", "specs", multiple=True)
@click.option(
    "--num-sms", type=click.IntRange(1, 1024), help="SM count of the GPU (default: the arch's)."
)
@gpu_option()
@cache_option("read")
@with_output
def specs_cmd(arch, specs, num_sms, gpu, cache, out):
    """Show what each spec needs on an arch: variants (STATUS: built when a store of the layers
    holds a loadable copy, else missing), and unsupported layers with the reason."""

    arch, num_sms = apply_gpu(gpu, arch, num_sms)
    layers = layers_for(cache, out, strict=False)
    num_sms = num_sms or C.default_num_sms(arch)
    stores = matching_stores(layers, arch, num_sms, None).stores
    found = loadable_artifacts(stores)
    held = {a.id for a in found.artifacts} | found.stub_ids  # stub builds: tests' stores
    rows = []
    for s in resolve_specs(list(specs)):
        if not s.serving.for_arch(arch):
            out.note(f"{s.name}: not built for {arch} ([serving] archs = "
                     f"{', '.join(s.serving.archs)})")
            continue
        plan = plan_for([s], arch, num_sms)
        for vid, n in plan.variants().items():
            rows.append(
                {
                    "spec": s.name,
                    "layer": n.layer,
                    "id": vid,
                    "variant": n.variant.describe(),
                    "status": "built" if vid in held else "missing",
                }
            )
        for u in plan.unsupported:
            via = f"; served by {u.served_by}" if u.served_by else ""
            rows.append(
                {
                    "spec": s.name,
                    "layer": u.layer,
                    "id": "",
                    "variant": "",
                    "status": f"unsupported: {u.reason}{via}",
                }
            )
    out.table(rows, ["spec", "layer", "id", "variant", "status"])
