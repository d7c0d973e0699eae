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
@click.option(
    "--cache",
    help="Store root (default: the first writable $FA4AOT_CACHE_DIR layer, else the user cache dir).",
)
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
    help="SM count of the target GPU (default: 132 for sm90, 148 for sm100).",
)
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
@click.option("--dry-run", is_flag=True, help="List what would be built; compile nothing.")
@click.option("--json", "as_json", is_flag=True)
def build(archs, specs, cache, jobs, num_sms, python, misses, shard, dry_run, as_json):
    """Cross-compile every variant the specs need into the store (no GPU needed)."""
    from .merge import parse_shard
    from .specs import resolve_specs

    if python is not None and not _valid_minor(python):
        raise click.BadParameter(
            f"expected MAJOR.MINOR such as 3.12, got {python!r}", param_hint="--python"
        )
    if shard is not None:
        try:
            shard = parse_shard(shard)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--shard") from None
    if num_sms is not None and len(set(archs)) > 1:
        raise click.BadParameter("--num-sms applies to one arch; build each arch separately")
    spec_list = resolve_specs(list(specs)) if (specs or not misses) else []
    rows, unsup, stores, counts = [], [], [], {}
    t0 = time.perf_counter()
    archs = list(dict.fromkeys(archs or ("sm90",)))
    for arch in archs:
        r, u, store, c = _build_arch(
            arch,
            spec_list,
            cache,
            jobs,
            num_sms,
            python,
            misses,
            shard,
            dry_run,
            as_json,
            label=f"{arch}: " if len(archs) > 1 else "",
        )
        rows += r
        unsup += u
        if store is not None:  # not a dry run
            stores.append(store)
            counts = {k: counts.get(k, 0) + n for k, n in c.items()}
    if as_json:
        extra = {"unsupported": unsup}
        if not dry_run:
            extra.update(
                stores=stores,
                store=stores[0] if len(stores) == 1 else None,
                counts=counts,
                wall_seconds=round(time.perf_counter() - t0, 2),
            )
        _emit(rows, True, [], extra)
    elif dry_run:
        _emit(rows, False, (["arch"] if len(archs) > 1 else []) + ["id", "variant", "spec"])
    if counts.get("failed"):
        sys.exit(1)


def _build_arch(
    arch, spec_list, cache, jobs, num_sms, python, misses, shard, dry_run, as_json, label
):
    """One arch of `fa4aot build`. -> (rows, unsupported, store dir, counts), the last two None
    on a dry run; prints the text report itself."""
    from .build import build as run_build
    from .build import plan_for
    from .merge import shard as shard_ids

    plan = plan_for(spec_list, arch)
    if misses:
        from .missing import read_misses
        from .variants import Need, Unsupported, representative_call

        for v in read_misses(misses):
            if v.arch == arch:
                try:
                    call = representative_call(v)
                except ValueError as e:  # the runtime meets input forms the builder cannot drive
                    plan.unsupported.append(
                        Unsupported("miss-log", Path(misses).name, f"{v.id}: {e}")
                    )
                    continue
                plan.needs.append(Need(v, call, "miss-log", Path(misses).name))
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
    root = Path(cache) if cache else None  # None: the first writable FA4AOT_CACHE_DIR layer
    if dry_run:
        todo = plan.variants()
        keep = set(shard_ids(list(todo), *shard)) if shard else set(todo)
        rows = [
            {
                "arch": arch,
                "id": vid,
                "variant": n.variant.describe(),
                "spec": f"{n.spec}/{n.layer}",
            }
            for vid, n in todo.items()
            if vid in keep
        ]
        return rows, unsup, None, None
    show = _progress_enabled(as_json)
    t0 = time.perf_counter()

    def progress(i, n, r):
        if show:
            mark = {"built": "+", "cached": "=", "failed": "!", "rebuilt": "~"}[r.status]
            click.echo(
                f"\r[{arch} {i}/{n}] {mark} {r.description} ({r.seconds:.1f}s)".ljust(100),
                err=True,
                nl=(r.status == "failed" or i == n),
            )

    store, plan, results = run_build(
        spec_list,
        arch=arch,
        root=root,
        num_sms=num_sms,
        python=python,
        jobs=jobs,
        progress=progress,
        plan=plan,
        shard=shard,
    )
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
    if not as_json:
        for r in results:
            if r.status == "failed":
                click.echo(f"FAILED {r.id} {r.description}: {r.error}")
        for u in unsup:
            via = f"; served by {u['served_by']}" if u["served_by"] else ""
            click.echo(f"unsupported: {u['spec']}/{u['layer']} on {arch}: {u['reason']}{via}")
        if shard:
            label += f"shard {shard[0]}/{shard[1]}: "
        if counts["built"] + counts["rebuilt"] + counts["failed"] == 0:
            from collections import Counter

            # copies in lower layers (FA4AOT_CACHE_DIR=/node:/image) are counted per store
            target = str(store.dir)
            where = Counter(r.found_in or target for r in results)
            at = (
                f"in {target}"
                if set(where) <= {target}
                else "in the store layers: "
                + ", ".join(f"{where[d]} in {d}" for d in sorted(where, key=lambda d: d != target))
            )
            click.echo(f"{label}nothing to build: all {counts['cached']} variants are {at}")
        else:
            click.echo(
                f"{label}built {counts['built'] + counts['rebuilt']}, cached "
                f"{counts['cached']}, failed {counts['failed']} in {wall:.1f}s -> {store.dir}"
            )
    return rows, unsup, str(store.dir), counts


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
    from .variants import Variant

    rows = []
    for s, vid, a, specs in _all_artifacts(_root(cache)):
        arch, where = s.toolchain.get("arch"), s.dir.name
        bad = {"id": vid, "arch": arch, "spec": ",".join(specs), "store": where}
        if isinstance(a, Exception):
            rows.append({**bad, "status": "corrupt", "error": str(a)})
            continue
        try:  # a sealed record of another fa4aot (other variant fields) is listed, not fatal
            v = Variant.from_dict(a.record["variant"])
            row = {
                "id": vid,
                "arch": v.arch,
                "spec": ",".join(specs) or a.record["requested_by"]["spec"],
                "dtype": v.dtype,
                "head_dims": f"{v.head_dim}/{v.head_dim_v}",
                "ratio": v.qhead_per_kvhead,
                "mask": v.mask,
                "regime": f"{v.layout}/{v.phase}" + ("/b>256" if v.cu_hint else ""),
                "page": ("tile_n=" + str(v.tile.n) if v.paged_tma else "other") if v.paged else "",
                "lse": "yes" if v.return_lse else "",
                "size": a.size,
                "store": s.dir.name,
            }
        except (Fa4aotError, ValueError, TypeError, KeyError, AttributeError, ArithmeticError) as e:
            row = {**bad, "status": "unreadable", "error": f"{type(e).__name__}: {e}"}
        rows.append(row)
    from .blocks import block_size_rows

    blocks = block_size_rows(_root(cache))
    columns = ["id", "arch", "spec", "dtype", "head_dims", "ratio", "mask", "regime", "page"]
    columns += ["lse", "size"] + (["status", "error"] if any("error" in r for r in rows) else [])
    _emit(rows, as_json, columns, {"block_sizes": blocks})
    if not as_json and blocks:
        click.echo("")
        _emit(
            blocks,
            False,
            [
                "spec",
                "layer",
                "arch",
                "head_dim",
                "tile_n",
                "served_page_sizes",
                "tma_page_size",
                "preferred",
            ],
        )


@main.command()
@click.argument("artifact_id")
@click.option("--cache", help="Store root.")
def inspect(artifact_id, cache):
    """Print an artifact's record (JSON)."""
    matches = [
        (s, a) for s, vid, a, _ in _all_artifacts(_root(cache)) if vid.startswith(artifact_id)
    ]
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
@click.option(
    "--cache", help="Store root (default: every $FA4AOT_CACHE_DIR layer, else the user cache dir)."
)
@click.option("--json", "as_json", is_flag=True)
def verify(cache, as_json):
    """Check every artifact's record and checksums; exit 1 on any problem. Reads only."""
    from .store import default_roots, verify_root

    rows = []
    for root in [Path(cache)] if cache else default_roots():
        rows += [{**r, "layer": str(root)} for r in verify_root(root)]
    bad = sum(r["status"] != "ok" for r in rows)
    _emit(
        rows, as_json, ["id", "store", "status", "error"], {"ok": len(rows) - bad, "corrupt": bad}
    )
    if not as_json:
        click.echo(f"{len(rows) - bad} ok, {bad} with problems")
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
            rows.append(
                {
                    "spec": s.name,
                    "layer": n.layer,
                    "id": vid,
                    "variant": n.variant.describe(),
                    "status": "needed",
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
    _emit(rows, as_json, ["spec", "layer", "id", "variant", "status"])


def _cached_artifacts(cache: str | None, arch: str, num_sms: int, python: str | None) -> list:
    """Artifacts of every layer's store built by this machine's toolchain for (arch, SM count),
    and for `python` when given (a build machine checks stores made for another interpreter)."""
    from .store import build_toolchain, default_roots, stores_at

    roots = [Path(p) for p in cache.split(os.pathsep)] if cache else default_roots()
    want = build_toolchain(arch, num_sms, python)
    keys = [
        k
        for k in ("fa4", "cutlass_dsl", "cutlass_libs", "tvm_ffi", "arch", "num_sms")
        if want.get(k)
    ]
    keys += ["python"] if python else []
    return [
        a
        for root in roots
        for s in stores_at(root)
        if all(s.toolchain.get(k) == want[k] for k in keys)
        for _, a in s.iter_artifacts()
        if not isinstance(a, Exception) and not a.record.get("stub")
    ]


@main.command()
@click.option("--arch", default="sm90", show_default=True, type=click.Choice(sorted(C.ARCHS)))
@click.option(
    "--num-sms", type=click.IntRange(1, 1024), help="SM count of the GPU (default: the arch's)."
)
@click.option(
    "--dtype", default="bfloat16", show_default=True, type=click.Choice(["bfloat16", "float16"])
)
@click.option("--heads", required=True, help="Query heads : KV heads, e.g. 20:1 or 32:8.")
@click.option("--head-dim", type=click.IntRange(1, 1024), required=True)
@click.option("--head-dim-v", type=click.IntRange(1, 1024))
@click.option(
    "--layout", default="dense", show_default=True, type=click.Choice(["dense", "varlen", "paged"])
)
@click.option("--batch", default=1, show_default=True, type=click.IntRange(1))
@click.option("--seqlen-q", default=1, show_default=True, type=click.IntRange(1))
@click.option("--page-size", type=click.IntRange(1), help="KV page size (paged layout).")
@click.option("--causal/--no-causal", default=True, show_default=True)
@click.option("--window", type=click.IntRange(0), help="Left sliding window (tokens).")
@click.option("--lse", is_flag=True, help="The call returns the LSE.")
@click.option("--sink", is_flag=True, help="The call passes float32 learnable sinks.")
@click.option("--no-padding", is_flag=True, help="As with FA4AOT_PADDING=deny.")
@click.option(
    "--cache", help="Store root(s), ':'-separated (default: FA4AOT_CACHE_DIR / user cache)."
)
@click.option("--json", "as_json", is_flag=True)
def explain(
    arch,
    num_sms,
    dtype,
    heads,
    head_dim,
    head_dim_v,
    layout,
    batch,
    seqlen_q,
    page_size,
    causal,
    window,
    lse,
    sink,
    no_padding,
    cache,
    as_json,
):
    """How the runtime would serve a call: its variant, then an exact hit, a decode fold, a
    padding plan (with its cost) or the refusal. Exit 1 when nothing can serve it."""
    from .select import choose, fold_from_env, nearest
    from .variants import Call, Variant, features

    try:
        hq, hk = (int(x) for x in heads.split(":"))
        assert hq > 0 and hk > 0 and hq % hk == 0
    except (ValueError, AssertionError):
        raise click.BadParameter(
            f"expected Q:KV with KV dividing Q, e.g. 32:8; got {heads!r}", param_hint="--heads"
        )
    if (layout == "paged") != (page_size is not None):
        raise click.BadParameter(
            "--page-size goes with --layout paged (and only with it)", param_hint="--page-size"
        )
    num_sms = num_sms or C.DEFAULT_NUM_SMS[arch]
    call = Call(
        layout=layout,
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_q,
        num_heads=hq,
        num_heads_kv=hk,
        head_dim=head_dim,
        head_dim_v=head_dim_v or head_dim,
        dtype=dtype,
        causal=causal,
        window_left=window,
        window_right=None if window is None else (0 if causal else window),
        return_lse=lse,
        sink_dtype="float32" if sink else None,
        page_size=page_size,
    )
    feat = call.feature_kwargs()
    want = features(arch=arch, **feat)
    avail = [
        Variant.from_dict(a.record["variant"])
        for a in _cached_artifacts(cache, arch, num_sms, None)
    ]
    why = C.unsupported_reason(
        arch, dtype, head_dim, head_dim_v or head_dim, qhead_per_kvhead=hq // hk
    )
    try:
        allow_fold = fold_from_env()  # as the runtime reads it
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    choices = choose(arch, feat, avail, allow_padding=not no_padding, allow_fold=allow_fold)
    doc = {
        "variant": want.to_dict(),
        "id": want.id,
        "description": want.describe(),
        "fa4_unsupported": why,
        "choices": [
            {
                "id": c.variant.id,
                "exact": c.exact,
                "ratio": c.ratio,
                "head_dim": c.head_dim,
                "head_dim_v": c.head_dim_v,
                "cost": round(c.cost, 3),
                "fold": c.fold,
                "plan": c.describe(want),
            }
            for c in choices
        ],
        "nearest": []
        if choices
        else [{"id": v.id, "description": v.describe()} for v in nearest(want, avail)],
    }
    if as_json:
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
    else:
        click.echo(f"call variant: {want.describe()} (id {want.id})")
        if why:
            click.echo(f"FA4 cannot run it exactly: {why}")
        if choices:
            click.echo(f"served by   : {choices[0].describe(want)}")
            for c in choices[1:4]:
                click.echo(f"alternative : {c.describe(want)}")
        else:
            click.echo("served by   : nothing cached (the runtime raises ArtifactMissing)")
            for v in nearest(want, avail):
                click.echo(f"nearest     : {v.describe()} ({v.id})")
    if not choices:
        sys.exit(1)


@main.command()
@click.option(
    "--spec",
    "specs",
    multiple=True,
    help="Default spec name or TOML path (repeatable). Default: all.",
)
@click.option("--arch", default="sm90", show_default=True, type=click.Choice(sorted(C.ARCHS)))
@click.option(
    "--num-sms",
    type=click.IntRange(1, 1024),
    help="SM count of the target GPU (default: the arch's).",
)
@click.option("--python", "python", help="Python minor of the serving runtime (default: any).")
@click.option(
    "--cache", help="Store root(s), ':'-separated (default: FA4AOT_CACHE_DIR / user cache)."
)
@click.option(
    "--trace/--no-trace",
    default=True,
    show_default=True,
    help="Also trace FA4's real entry points under fake tensors (no GPU, nothing compiled) "
    "and check the store holds FA4's exact compile keys (what fa4aot.install serves).",
)
@click.option("--json", "as_json", is_flag=True)
def coverage(specs, arch, num_sms, python, cache, trace, as_json):
    """Does the store cover the specs' serving envelopes? Each variant: hit, servable by padding
    (with its cost), or missing. Exit 1 if anything is missing: run it before shipping an image."""
    from .build import plan_for
    from .select import choose
    from .specs import resolve_specs
    from .variants import Variant

    num_sms = num_sms or C.DEFAULT_NUM_SMS[arch]
    arts = _cached_artifacts(cache, arch, num_sms, python)
    avail = [Variant.from_dict(a.record["variant"]) for a in arts]
    keys = {(part, p["key"]) for a in arts for part, p in a.record["parts"].items()}
    spec_list = resolve_specs(list(specs))
    rows, missing = [], 0
    for spec in spec_list:
        plan = plan_for([spec], arch)
        needs = list(plan.variants().values())
        traced = None
        if trace and needs:
            from . import compiler

            compiler.configure(arch, num_sms)
            traced = compiler.trace_keys([n.call for n in needs])
        for i, n in enumerate(needs):
            feat = n.call.feature_kwargs()
            ch = choose(arch, feat, avail)
            row = {
                "spec": spec.name,
                "layer": n.layer,
                "id": n.variant.id,
                "variant": n.variant.describe(),
            }
            if ch and ch[0].exact:
                row["status"] = "hit"
                if traced is not None:
                    absent = [
                        f"{name}"
                        for name, ks in traced[i].items()
                        for k in ks
                        if (name, k) not in keys
                    ]
                    if absent:
                        row["status"] = "missing"
                        row["detail"] = (
                            f"FA4 compile key(s) of {', '.join(absent)} not in the store"
                        )
            elif ch:
                row["status"] = "padding"
                row["detail"] = ch[0].describe(n.variant)
                row["cost"] = round(ch[0].cost, 3)
            else:
                row["status"] = "missing"
            missing += row["status"] == "missing"
            rows.append(row)
        for u in plan.unsupported:
            rows.append(
                {
                    "spec": spec.name,
                    "layer": u.layer,
                    "id": "",
                    "variant": "",
                    "status": "unsupported",
                    "detail": u.reason + (f"; served by {u.served_by}" if u.served_by else ""),
                }
            )
    counts = {
        k: sum(r["status"] == k for r in rows) for k in ("hit", "padding", "missing", "unsupported")
    }
    _emit(rows, as_json, ["spec", "layer", "id", "status", "variant", "detail"], {"counts": counts})
    if not as_json:
        click.echo(
            f"{counts['hit']} hit, {counts['padding']} by padding, {counts['missing']} missing, "
            f"{counts['unsupported']} unsupported by FA4"
        )
    if missing:
        sys.exit(1)


@main.command()
@click.option(
    "--enable", "action", flag_value="enable", help="Write the .pth hook into site-packages."
)
@click.option("--disable", "action", flag_value="disable", help="Remove it.")
@click.option(
    "--status", "action", flag_value="status", default=True, help="Show where it is (default)."
)
def hook(action):
    """Manage the site-packages hook that runs fa4aot.install() when FA4AOT_INSTALL is set."""
    import sysconfig

    from ._autoinstall import PTH_LINE, PTH_NAME

    path = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    if action == "enable":
        from .store import atomic_write

        atomic_write(path, PTH_LINE.encode())
        click.echo(
            f"enabled: {path} (set FA4AOT_INSTALL=error|warn|jit in the server's environment)"
        )
    elif action == "disable":
        existed = path.exists()
        path.unlink(missing_ok=True)
        click.echo(f"{'removed' if existed else 'not present'}: {path}")
    else:
        click.echo(f"{'enabled' if path.exists() else 'disabled'}: {path}")


@main.command()
@click.argument("output", type=click.Path(dir_okay=False))
@click.option("--cache", help="Store root (default: the $FA4AOT_CACHE_DIR layers, in order).")
@click.option(
    "--store", "store_name", help="Fingerprint directory (or a prefix) when there are several."
)
@click.option("--spec", "specs", multiple=True, help="Only artifacts these specs asked for.")
@click.option("--arch", type=click.Choice(sorted(C.ARCHS)), help="The store of this arch.")
@click.option("--json", "as_json", is_flag=True)
def pack(output, cache, store_name, specs, arch, as_json):
    """Write one store to a tar archive (.tar, .tar.gz, .tar.xz) for `fa4aot unpack` elsewhere.
    Only artifacts that pass their checks go in; exit 1 if any was left out."""
    from .archive import pack as run_pack
    from .store import default_roots

    res = run_pack(
        [Path(cache)] if cache else default_roots(wheels=False),
        Path(output),
        store_name,
        specs=list(specs) or None,
        arch=arch,
    )
    rows = [{"id": i, "status": "packed"} for i in res.artifacts] + [
        {"id": r["id"], "status": "skipped", "error": r["error"]} for r in res.skipped
    ]
    if as_json:
        _emit(rows, True, [], {"archive": str(res.path), "store": res.store})
    else:
        for r in res.skipped:
            click.echo(f"skipped {r['id']}: {r['error']}")
        click.echo(f"packed {len(res.artifacts)} artifacts of {res.store} -> {res.path}")
    if res.skipped:
        sys.exit(1)


@main.command()
@click.argument("archive", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--cache",
    help="Store root to import into (default: the first writable $FA4AOT_CACHE_DIR layer).",
)
@click.option("--json", "as_json", is_flag=True)
def unpack(archive, cache, as_json):
    """Import an archive from `fa4aot pack`. Every member and checksum is checked first: an
    archive with anything else (links, devices, '..', absolute paths, bad checksums) imports
    nothing and exits 1."""
    from .archive import unpack as run_unpack
    from .store import default_roots

    res = run_unpack(Path(archive), [Path(cache)] if cache else default_roots())
    counts = {s: sum(r["status"] == s for r in res.rows) for s in ("added", "replaced", "present")}
    if as_json:
        _emit(res.rows, True, [], {"store": str(res.store), "counts": counts})
    else:
        click.echo(
            f"added {counts['added']}, replaced {counts['replaced']} (corrupt), "
            f"already present {counts['present']} -> {res.store}"
        )


@main.command()
@click.argument("sources", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option(
    "--cache",
    required=True,
    type=click.Path(file_okay=False),
    help="Store root to merge into (created if absent).",
)
@click.option("--json", "as_json", is_flag=True)
def merge(sources, cache, as_json):
    """Merge store roots (e.g. the outputs of `fa4aot build --shard I/N` jobs) into one. Every
    artifact is checked first; a conflict (one variant id or spec name with different content)
    or a corrupt entry refuses the merge, writes nothing and exits 1."""
    from .merge import merge as run_merge

    res = run_merge([Path(s) for s in sources], Path(cache))
    counts = {s: sum(r["status"] == s for r in res.rows) for s in ("added", "replaced", "present")}
    if as_json:
        _emit(res.rows, True, [], {"dest": str(res.dest), "counts": counts, "specs": res.specs})
    else:
        click.echo(
            f"merged {len(sources)} store roots: added {counts['added']}, replaced "
            f"{counts['replaced']} (corrupt), already present {counts['present']}, "
            f"{len(res.specs)} spec indexes -> {res.dest}"
        )


@main.command()
@click.option("--cache", help="Store root (default: the first $FA4AOT_CACHE_DIR layer).")
@click.option("--dry-run", is_flag=True, help="Print the plan only.")
@click.option(
    "--keep-fingerprint",
    "keep",
    multiple=True,
    help="Keep only these stores: CURRENT (this installation's FA4/CuTe DSL/tvm-ffi versions) "
    "and/or fingerprint directory names (repeatable); the others are removed.",
)
@click.option("--max-size", help="Then evict artifacts until the root fits, e.g. 2G or 500M.")
@click.option("--json", "as_json", is_flag=True)
def prune(cache, dry_run, keep, max_size, as_json):
    """Remove other toolchains' stores, quarantined and corrupt entries, dead builders' scratch
    and (with --max-size) the least recently used artifacts. The plan is printed first."""
    from .prune import execute, parse_size
    from .prune import plan as make_plan

    try:
        max_bytes = parse_size(max_size) if max_size is not None else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--max-size") from None
    root = _root(cache)
    actions = make_plan(root, list(keep), max_bytes)
    freed = sum(a.bytes for a in actions)
    if not as_json:
        _emit([a.__dict__ for a in actions], False, ["kind", "bytes", "path", "reason"])
        click.echo(
            f"{'would free' if dry_run else 'freeing'} {freed} bytes in {len(actions)} entries"
        )
    if dry_run:
        if as_json:
            _emit(
                [dict(a.__dict__, status="planned") for a in actions],
                True,
                [],
                {"root": str(root), "bytes": freed, "executed": False},
            )
        return
    rows = execute(root, actions)
    skipped = [r for r in rows if r["status"] == "skipped"]
    if as_json:
        _emit(rows, True, [], {"root": str(root), "bytes": freed, "executed": True})
    else:
        for r in skipped:
            click.echo(f"skipped {r['path']}: {r['error']}")
        click.echo(f"removed {len(rows) - len(skipped)} entries")
    if skipped:
        sys.exit(1)


@main.command()
@click.option("--json", "as_json", is_flag=True)
def doctor(as_json):
    """Versions, GPU (arch, SM count), runtime library, visible store layers and whether each is
    compatible, and what the runtime would serve from. Exit 1 if something stops serving here."""
    from .doctor import format_text, report

    r = report()
    click.echo(json.dumps(r, indent=2, sort_keys=True) if as_json else format_text(r))
    if r["problems"]:
        sys.exit(1)


@main.command()
@click.argument("out_dir", default="dist", type=click.Path(file_okay=False))
@click.option(
    "--cache",
    help="Store root(s), ':'-separated (default: the $FA4AOT_CACHE_DIR layers, not installed "
    "cache wheels).",
)
@click.option("--spec", "specs", multiple=True, help="Only artifacts these specs asked for.")
@click.option("--arch", type=click.Choice(sorted(C.ARCHS)), help="Only stores of this arch.")
@click.option("--store", "store_name", help="Fingerprint directory (or a prefix).")
@click.option("--name", help="Wheel name: fa4aot-cache-<name> (default: arch and specs).")
@click.option("--version", "version", help="Wheel version (default 1.0.0).")
@click.option("--json", "as_json", is_flag=True)
def wheel(out_dir, cache, specs, arch, store_name, name, version, as_json):
    """Write one pip-installable cache wheel (fa4aot-cache-<name>) per store. Installed, its
    store is found through the `fa4aot.stores` entry point, after the $FA4AOT_CACHE_DIR layers;
    several cache wheels stack. Exit 1 if an artifact failed its checks and was left out."""
    from .store import default_roots
    from .wheel import DEFAULT_VERSION, build_wheels

    roots = (
        [Path(p) for p in cache.split(os.pathsep) if p] if cache else default_roots(wheels=False)
    )
    res = build_wheels(
        roots,
        Path(out_dir),
        name=name,
        specs=list(specs) or None,
        arch=arch,
        version=version or DEFAULT_VERSION,
        store=store_name,
    )
    rows = [
        {
            "dist": w.dist,
            "path": str(w.path),
            "store": w.store,
            "artifacts": len(w.artifacts),
            "size": w.size,
            "skipped": w.skipped,
        }
        for w in res
    ]
    if as_json:
        _emit(rows, True, [])
    else:
        _emit(rows, False, ["dist", "artifacts", "size", "path"])
        for w in res:
            for sk in w.skipped:
                click.echo(f"skipped {sk['id']}: {sk['error']}")
    if any(w.skipped for w in res):
        sys.exit(1)


if __name__ == "__main__":
    main()
