"""`fa4aot pack`, `unpack`, `wheel`, `merge`: moving stores between machines."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .app import main
from .common import cache_option, existing, layers_for
from .output import with_output
from fa4aot.model import constraints as C
from fa4aot.store.archive import pack as run_pack
from fa4aot.store.archive import unpack as run_unpack
from fa4aot.store.layers import Layer, build_root, resolve_layers
from fa4aot.store.merge import merge as run_merge
from fa4aot.store.wheel import build_wheels


@main.command()
@click.argument("output", type=click.Path(dir_okay=False))
@cache_option("ship")
@click.option(
    "--store", "store_name", help="Fingerprint directory (or a prefix) when there are several."
)
@click.option("--spec", "specs", multiple=True, help="Only artifacts these specs asked for.")
@click.option("--arch", type=click.Choice(sorted(C.ARCHS)), help="The store of this arch.")
@with_output
def pack(output, cache, store_name, specs, arch, out):
    """Write one store to a tar archive (.tar, .tar.gz, .tar.xz) for `fa4aot unpack` elsewhere.
    Only artifacts that pass their checks go in; exit 1 if any was left out."""

    layers = layers_for(cache, out, wheels=False)
    res = run_pack(
        [lay.root for lay in existing(layers)] or [layers[0].root],
        Path(output),
        store_name,
        specs=list(specs) or None,
        arch=arch,
    )
    rows = [{"id": i, "status": "packed"} for i in res.artifacts] + [
        {"id": r["id"], "status": "skipped", "error": r["error"]} for r in res.skipped
    ]
    if out.as_json:
        out.table(rows, [], archive=str(res.path), store=res.store)
    else:
        for r in res.skipped:
            out.text(f"skipped {r['id']}: {r['error']}")
        out.text(f"packed {len(res.artifacts)} artifacts of {res.store} -> {res.path}")
    if res.skipped:
        sys.exit(1)


@main.command()
@click.argument("archive", type=click.Path(exists=True, dir_okay=False))
@cache_option("write")
@with_output
def unpack(archive, cache, out):
    """Import an archive from `fa4aot pack` into the first writable layer. Every member and
    checksum is checked first: an archive with anything else (links, devices, '..', absolute
    paths, bad checksums) imports nothing and exits 1."""

    layers = layers_for(cache, out, wheels=False, verb="write", strict=False)
    res = run_unpack(Path(archive), [lay.root for lay in layers])
    counts = {s: sum(r["status"] == s for r in res.rows) for s in ("added", "replaced", "present")}
    if out.as_json:
        out.table(res.rows, [], store=str(res.store), counts=counts)
    else:
        out.text(
            f"added {counts['added']}, replaced {counts['replaced']} (corrupt), "
            f"already present {counts['present']} -> {res.store}"
        )


@main.command()
@click.argument("sources", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option(
    "--cache",
    required=True,
    help="Store root to merge into (created if absent); ':'-separated layers: the first "
    "writable one.",
)
@with_output
def merge(sources, cache, out):
    """Merge store roots (e.g. the outputs of `fa4aot build --shard I/N` jobs) into one. Every
    artifact is checked first; a conflict (one variant id or spec name with different content)
    or a corrupt entry refuses the merge, writes nothing and exits 1."""

    dest_layers = resolve_layers(cache, wheels=False)
    out.read_layers([Layer(Path(s), "source") for s in sources] + dest_layers)
    dest = build_root([lay.root for lay in dest_layers])
    res = run_merge([Path(s) for s in sources], dest)
    counts = {s: sum(r["status"] == s for r in res.rows) for s in ("added", "replaced", "present")}
    if out.as_json:
        out.table(res.rows, [], dest=str(res.dest), counts=counts, specs=res.specs)
    else:
        out.text(
            f"merged {len(sources)} store roots: added {counts['added']}, replaced "
            f"{counts['replaced']} (corrupt), already present {counts['present']}, "
            f"{len(res.specs)} spec indexes -> {res.dest}"
        )


@main.command()
@click.argument("out_dir", default="dist", type=click.Path(file_okay=False))
@cache_option("ship")
@click.option("--spec", "specs", multiple=True, help="Only artifacts these specs asked for.")
@click.option("--arch", type=click.Choice(sorted(C.ARCHS)), help="Only stores of this arch.")
@click.option("--store", "store_name", help="Fingerprint directory (or a prefix).")
@click.option("--name", help="Wheel name: fa4aot-cache-<name> (default: arch and specs).")
@click.option(
    "--version",
    "version",
    help="Wheel version (default: 1.0.0+<fingerprint>.<content hash>, from the content).",
)
@with_output
def wheel(out_dir, cache, specs, arch, store_name, name, version, out):
    """Write one pip-installable cache wheel (fa4aot-cache-<name>) per store. Installed, its
    store is found through the `fa4aot.stores` entry point, after the $FA4AOT_CACHE_DIR layers;
    several cache wheels stack. Exit 1 if an artifact failed its checks and was left out."""

    layers = layers_for(cache, out, wheels=False)
    res = build_wheels(
        [lay.root for lay in existing(layers)] or [layers[0].root],
        Path(out_dir),
        name=name,
        specs=list(specs) or None,
        arch=arch,
        version=version,
        store=store_name,
    )
    rows = [
        {
            "dist": w.dist,
            "version": w.version,
            "path": str(w.path),
            "store": w.store,
            "artifacts": len(w.artifacts),
            "size": w.size,
            "skipped": w.skipped,
        }
        for w in res
    ]
    out.table(rows, ["dist", "version", "artifacts", "size", "path"])
    for w in res:
        for sk in w.skipped:
            out.text(f"skipped {sk['id']}: {sk['error']}")
    if any(w.skipped for w in res):
        sys.exit(1)
