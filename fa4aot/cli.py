"""`fa4aot` command line. Commands build rows and hand them to one output sink (`--json` or a
table); progress goes to stderr and only when stderr is a terminal or FA4AOT_PROGRESS=1.
Exit codes: 0 ok, 1 failure (a variant failed, something missing or corrupt), 2 usage.
FA4AOT_DEBUG=1 shows tracebacks instead of one-line errors."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from . import constraints as C
from .errors import Fa4aotError


def _emit(rows, as_json: bool, columns: list[str], extra: dict | None = None) -> None:
    if as_json:
        doc = {"rows": rows, **(extra or {})}
        click.echo(json.dumps(doc, indent=2, sort_keys=True, default=str))
        return
    if not rows:
        click.echo("(nothing)")
        return
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    click.echo("  ".join(c.upper().ljust(widths[c]) for c in columns).rstrip())
    for r in rows:
        click.echo("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns).rstrip())


def _root(cache: str | None) -> Path:
    if cache:
        return Path(cache)
    from .store import default_roots

    return default_roots()[0]


class _Cli(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except Fa4aotError as e:
            if os.environ.get("FA4AOT_DEBUG"):
                raise
            click.echo(f"error: {e}", err=True)
            ctx.exit(1)


@click.group(cls=_Cli)
@click.version_option(package_name="fa4aot")
def main():
    """Ahead-of-time compiled FlashAttention-4 kernels: build on a CPU, serve with no compiler."""


def _progress_enabled(as_json: bool) -> bool:
    return os.environ.get("FA4AOT_PROGRESS") == "1" or (not as_json and sys.stderr.isatty())


@main.command()
@click.option("--arch", default="sm90", show_default=True, type=click.Choice(sorted(C.ARCHS)))
@click.option("--spec", "specs", multiple=True, help="Default spec name or TOML path (repeatable). Default: all shipped specs.")
@click.option("--cache", help="Store root (default: $FA4AOT_CACHE_DIR's first layer, else the user cache dir).")
@click.option("--jobs", "-j", default=max(1, (os.cpu_count() or 1)), show_default=True, type=click.IntRange(1, 256))
@click.option("--num-sms", type=click.IntRange(1, 1024), help="SM count of the target GPU (default: 132 for sm90, 148 for sm100).")
@click.option("--python", "python", help="Python minor of the serving runtime, e.g. 3.12 (default: this one).")
@click.option("--from-misses", "misses", type=click.Path(dir_okay=False), help="Also build the variants of a miss log (FA4AOT_MISS_LOG).")
@click.option("--dry-run", is_flag=True, help="List what would be built; compile nothing.")
@click.option("--json", "as_json", is_flag=True)
def build(arch, specs, cache, jobs, num_sms, python, misses, dry_run, as_json):
    """Cross-compile every variant the specs need into the store (no GPU needed)."""
    from .build import build as run_build, plan_for
    from .specs import resolve_specs

    if python is not None and not _valid_minor(python):
        raise click.BadParameter(f"expected MAJOR.MINOR such as 3.12, got {python!r}", param_hint="--python")
    spec_list = resolve_specs(list(specs)) if (specs or not misses) else []
    plan = plan_for(spec_list, arch)
    if misses:
        from .missing import read_misses
        from .variants import Need, representative_call

        for v in read_misses(misses):
            if v.arch == arch:
                plan.needs.append(Need(v, representative_call(v), "miss-log", Path(misses).name))
    root = _root(cache)
    if dry_run:
        rows = [{"id": vid, "variant": n.variant.describe(), "spec": f"{n.spec}/{n.layer}"}
                for vid, n in plan.variants().items()]
        unsup = [{"spec": u.spec, "layer": u.layer, "reason": u.reason} for u in plan.unsupported]
        _emit(rows, as_json, ["id", "variant", "spec"], {"unsupported": unsup})
        return
    show = _progress_enabled(as_json)
    t0 = time.perf_counter()

    def progress(i, n, r):
        if show:
            mark = {"built": "+", "cached": "=", "failed": "!", "rebuilt": "~"}[r.status]
            click.echo(f"\r[{i}/{n}] {mark} {r.description} ({r.seconds:.1f}s)".ljust(100), err=True,
                       nl=(r.status == "failed" or i == n))

    store, plan, results = run_build(spec_list, arch=arch, root=root, num_sms=num_sms, python=python,
                                     jobs=jobs, progress=progress, plan=plan)
    wall = time.perf_counter() - t0
    counts = {s: sum(r.status == s for r in results) for s in ("built", "rebuilt", "cached", "failed")}
    rows = [{"id": r.id, "status": r.status, "variant": r.description, "seconds": round(r.seconds, 2),
             "size": r.size, **({"error": r.error} if r.error else {})} for r in results]
    unsup = [{"spec": u.spec, "layer": u.layer, "reason": u.reason} for u in plan.unsupported]
    if as_json:
        _emit(rows, True, [], {"store": str(store.dir), "counts": counts, "unsupported": unsup,
                               "wall_seconds": round(wall, 2)})
    else:
        for r in results:
            if r.status == "failed":
                click.echo(f"FAILED {r.id} {r.description}: {r.error}")
        for u in unsup:
            click.echo(f"unsupported: {u['spec']}/{u['layer']} on {arch}: {u['reason']}")
        if counts["built"] + counts["rebuilt"] + counts["failed"] == 0:
            click.echo(f"nothing to build: all {counts['cached']} variants are in {store.dir}")
        else:
            click.echo(f"built {counts['built'] + counts['rebuilt']}, cached {counts['cached']}, "
                       f"failed {counts['failed']} in {wall:.1f}s -> {store.dir}")
    if counts["failed"]:
        sys.exit(1)


def _valid_minor(s: str) -> bool:
    parts = s.split(".")
    return len(parts) == 2 and all(p.isdigit() for p in parts)


def _all_artifacts(root: Path):
    from .store import stores_at

    for s in stores_at(root):
        spec_of = {}
        idx = s.dir / "specs"
        if idx.is_dir():
            for f in sorted(idx.glob("*.json")):
                try:
                    for vid in json.loads(f.read_text())["variants"]:
                        spec_of.setdefault(vid, []).append(f.stem)
                except (OSError, ValueError, KeyError, TypeError):
                    continue
        for vid, a in s.iter_artifacts():
            yield s, vid, a, spec_of.get(vid, [])


@main.command("ls")
@click.option("--cache", help="Store root.")
@click.option("--json", "as_json", is_flag=True)
def ls_cmd(cache, as_json):
    """List the artifacts of a store, and the KV block sizes each spec is served with."""
    from .errors import CorruptArtifact
    from .variants import Variant

    rows = []
    for s, vid, a, specs in _all_artifacts(_root(cache)):
        if isinstance(a, CorruptArtifact):
            rows.append({"id": vid, "arch": s.toolchain.get("arch"), "spec": ",".join(specs), "error": str(a)})
            continue
        v = Variant.from_dict(a.record["variant"])
        rows.append({
            "id": vid, "arch": v.arch, "spec": ",".join(specs) or a.record["requested_by"]["spec"],
            "dtype": v.dtype, "head_dims": f"{v.head_dim}/{v.head_dim_v}", "ratio": v.qhead_per_kvhead,
            "mask": v.mask, "regime": f"{v.layout}/{v.phase}" + ("/b>256" if v.cu_hint else ""),
            "page": ("tile_n=" + str(v.tile.n) if v.paged_tma else "other") if v.paged else "",
            "lse": "yes" if v.return_lse else "", "size": a.size, "store": s.dir.name,
        })
    from .blocks import block_size_rows

    blocks = block_size_rows(_root(cache))
    _emit(rows, as_json, ["id", "arch", "spec", "dtype", "head_dims", "ratio", "mask", "regime", "page", "lse", "size"],
          {"block_sizes": blocks})
    if not as_json and blocks:
        click.echo("")
        _emit(blocks, False, ["spec", "layer", "arch", "head_dim", "tile_n", "served_page_sizes", "tma_page_size", "preferred"])


@main.command()
@click.argument("artifact_id")
@click.option("--cache", help="Store root.")
def inspect(artifact_id, cache):
    """Print an artifact's record (JSON)."""
    matches = [(s, a) for s, vid, a, _ in _all_artifacts(_root(cache)) if vid.startswith(artifact_id)]
    if not matches:
        click.echo(f"error: no artifact {artifact_id!r} in {_root(cache)}", err=True)
        sys.exit(1)
    if len(matches) > 1:
        click.echo(f"error: {artifact_id!r} is ambiguous ({len(matches)} artifacts)", err=True)
        sys.exit(2)
    s, a = matches[0]
    if isinstance(a, Exception):
        click.echo(f"error: {a}", err=True)
        sys.exit(1)
    click.echo(json.dumps({"dir": str(a.dir), **a.record}, indent=2, sort_keys=True))


@main.command()
@click.option("--cache", help="Store root.")
@click.option("--json", "as_json", is_flag=True)
def verify(cache, as_json):
    """Check every artifact's record and checksums; exit 1 on any problem."""
    from .errors import CorruptArtifact

    rows = []
    for s, vid, a, _ in _all_artifacts(_root(cache)):
        if not isinstance(a, CorruptArtifact):
            try:
                a.verify()
            except CorruptArtifact as e:
                a = e
        rows.append({"id": vid, "store": s.dir.name, "status": "ok" if not isinstance(a, Exception) else "corrupt",
                     **({"error": str(a)} if isinstance(a, Exception) else {})})
    bad = sum(r["status"] != "ok" for r in rows)
    _emit(rows, as_json, ["id", "store", "status", "error"], {"ok": len(rows) - bad, "corrupt": bad})
    if not as_json:
        click.echo(f"{len(rows) - bad} ok, {bad} corrupt")
    if bad:
        sys.exit(1)


@main.command("specs")
@click.option("--arch", default="sm90", show_default=True, type=click.Choice(sorted(C.ARCHS)))
@click.option("--spec", "specs", multiple=True)
@click.option("--json", "as_json", is_flag=True)
def specs_cmd(arch, specs, as_json):
    """Show what each spec needs on an arch: variants, and unsupported layers with the reason."""
    from .build import plan_for
    from .specs import resolve_specs

    rows = []
    for s in resolve_specs(list(specs)):
        plan = plan_for([s], arch)
        for vid, n in plan.variants().items():
            rows.append({"spec": s.name, "layer": n.layer, "id": vid, "variant": n.variant.describe(), "status": "needed"})
        for u in plan.unsupported:
            rows.append({"spec": s.name, "layer": u.layer, "id": "", "variant": "", "status": f"unsupported: {u.reason}"})
    _emit(rows, as_json, ["spec", "layer", "id", "variant", "status"])


if __name__ == "__main__":
    main()
