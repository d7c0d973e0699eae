"""`fa4aot ls`, `inspect`, `verify`, `prune`: reading, checking and trimming the store layers."""

from __future__ import annotations

import json
import sys

import click

from fa4aot import settings
from .app import main
from .common import cache_option, existing, layers_for
from .output import format_table, with_output
from fa4aot.errors import Fa4aotError
from fa4aot.model.variants import Variant
from fa4aot.policy.blocks import block_size_rows
from fa4aot.store.layers import Layer, build_root, stores_at, verify_root
from fa4aot.store.prune import execute, parse_size
from fa4aot.store.prune import plan as make_plan
from fa4aot.store.toolchain import source_label


def _all_artifacts(layers: list[Layer]):
    for layer in existing(layers):
        for s in stores_at(layer.root):
            spec_of: dict[str, list[str]] = {}
            idx = s.dir / "specs"
            if idx.is_dir():
                for f in sorted(idx.glob("*.json")):
                    try:
                        for vid in json.loads(f.read_text())["variants"]:
                            spec_of.setdefault(vid, []).append(f.stem)
                    except (OSError, ValueError, KeyError, TypeError):
                        continue
            for vid, a in s.iter_artifacts():
                yield layer, s, vid, a, spec_of.get(vid, [])


@main.command("ls")
@cache_option("read")
@with_output
def ls_cmd(cache, out):
    """List the artifacts of the store layers, and the KV block sizes each spec is served with."""

    layers = layers_for(cache, out)
    rows = []
    for layer, s, vid, a, specs in _all_artifacts(layers):
        arch, where = s.toolchain.get("arch"), s.dir.name
        bad = {"id": vid, "arch": arch, "spec": ",".join(specs), "store": where}
        bad["layer"] = str(layer.root)
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
                "kv": v.kv_dtype or "",
                "fa4": source_label(s.toolchain),
                "size": a.size,
                "store": s.dir.name,
                "layer": str(layer.root),
            }
        except (Fa4aotError, ValueError, TypeError, KeyError, AttributeError, ArithmeticError) as e:
            row = {**bad, "status": "unreadable", "error": f"{type(e).__name__}: {e}"}
        rows.append(row)
    blocks = [r for layer in existing(layers) for r in block_size_rows(layer.root)]
    columns = ["id", "arch", "spec", "dtype", "head_dims", "ratio", "mask", "regime", "page"]
    columns += ["lse", "kv", "fa4", "size"]
    columns += ["status", "error"] if any("error" in r for r in rows) else []
    if len({r["layer"] for r in rows}) > 1:
        columns.append("layer")
    out.table(rows, columns, block_sizes=blocks)
    if blocks:
        out.text("")
        out.text(
            format_table(
                blocks,
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
        )


@main.command()
@click.argument("artifact_id")
@cache_option("read")
@with_output
def inspect(artifact_id, cache, out):
    """Print an artifact's record (JSON), from the first layer that holds it."""
    layers = layers_for(cache, out)
    matches = [
        (layer, vid, a)
        for layer, s, vid, a, _ in _all_artifacts(layers)
        if vid.startswith(artifact_id)
    ]
    where = ", ".join(str(lay.root) for lay in layers)
    if not matches:
        out.error(f"no artifact {artifact_id!r} in {where}", 1)
    ids = {vid for _, vid, _ in matches}  # one id in several layers or stores is one artifact
    if len(ids) > 1:
        out.error(f"{artifact_id!r} is ambiguous ({len(ids)} artifacts)", 2)
    layer, _, a = matches[0]
    if isinstance(a, Exception):
        out.error(str(a), 1)
    doc = {"dir": str(a.dir), "layer": str(layer.root), **a.record}
    if out.as_json:
        out.document(doc)
    else:
        out.text(json.dumps(doc, indent=2, sort_keys=True))


@main.command()
@cache_option("read")
@with_output
def verify(cache, out):
    """Check every artifact's record and checksums in every store layer; exit 1 on any
    problem, including a layer that cannot be read and no layer at all. Reads only."""

    settings.check()
    layers = layers_for(cache, out)
    readable = existing(layers)
    if not readable:
        raise Fa4aotError(
            "no store layer to verify: "
            + "; ".join(lay.problem() or str(lay.root) for lay in layers)
            + ". Name one with --cache DIR or FA4AOT_CACHE_DIR"
        )
    rows = []
    for layer in readable:
        rows += [{**r, "layer": str(layer.root)} for r in verify_root(layer.root)]
    bad = sum(r["status"] != "ok" for r in rows)
    out.table(rows, ["id", "store", "status", "error"], ok=len(rows) - bad, corrupt=bad)
    out.text(f"{len(rows) - bad} ok, {bad} with problems in {len(readable)} layers")
    if bad:
        sys.exit(1)


@main.command()
@cache_option("write")
@click.option("--dry-run", is_flag=True, help="Print the plan only.")
@click.option(
    "--keep-fingerprint",
    "keep",
    multiple=True,
    help="Keep only these stores: CURRENT (this installation's FA4/CuTe DSL/tvm-ffi versions) "
    "and/or fingerprint directory names (repeatable); the others are removed.",
)
@click.option("--max-size", help="Then evict artifacts until the root fits, e.g. 2G or 500M.")
@with_output
def prune(cache, dry_run, keep, max_size, out):
    """Remove other toolchains' stores, quarantined and corrupt entries, dead builders' scratch
    and (with --max-size) the least recently used artifacts of the first writable layer. The
    plan is printed first."""

    try:
        max_bytes = parse_size(max_size) if max_size is not None else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--max-size") from None
    layers = layers_for(cache, out, wheels=False, verb="prune", strict=False)
    root = build_root([lay.root for lay in layers])
    actions = make_plan(root, list(keep), max_bytes)
    freed = sum(a.bytes for a in actions)
    if not out.as_json:
        out.table([a.__dict__ for a in actions], ["kind", "bytes", "path", "reason"])
        out.text(f"{'would free' if dry_run else 'freeing'} {freed} bytes in {len(actions)} entries")
    if dry_run:
        if out.as_json:
            out.table(
                [dict(a.__dict__, status="planned") for a in actions],
                [],
                root=str(root),
                bytes=freed,
                executed=False,
            )
        return
    rows = execute(root, actions)
    skipped = [r for r in rows if r["status"] == "skipped"]
    if out.as_json:
        out.table(rows, [], root=str(root), bytes=freed, executed=True)
    else:
        for r in skipped:
            out.text(f"skipped {r['path']}: {r['error']}")
        out.text(f"removed {len(rows) - len(skipped)} entries")
    if skipped:
        sys.exit(1)
