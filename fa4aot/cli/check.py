"""`fa4aot coverage` and `fa4aot doctor`: will this host (or this image) serve, and if not,
why. Both fail (exit 1) on anything that would stop serving: a layer that cannot be read, a
corrupt artifact, no store for the target, an invalid setting, a missing variant, and (coverage,
unless --allow-unsupported) a layer FA4 cannot run."""

from __future__ import annotations

import importlib.util
import sys

import click

from fa4aot import settings
from fa4aot.build.builder import plan_for
from fa4aot.model import constraints as C
from fa4aot.model.specs import resolve_specs
from fa4aot.model.variants import Variant
from fa4aot.policy.select import choose
from fa4aot.store.doctor import format_text, report
from fa4aot.store.toolchain import source_label

from .app import main
from .common import (
    apply_gpu,
    cache_option,
    fa4_option,
    gpu_option,
    layers_for,
    loadable_artifacts,
    matching_stores,
    source_abi,
)
from .output import with_output


def compiler_missing() -> str | None:
    """Why FA4's entry points cannot be traced here (None: they can). Checked before importing
    anything: a serving image has neither cutlass nor flash_attn, by design."""
    for mod, dist in (("cutlass", "nvidia-cutlass-dsl"), ("flash_attn", "flash-attn-4")):
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"{mod} is not installed ({dist})"
    return None


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
@gpu_option()
@click.option("--python", "python", help="Python minor of the serving runtime (default: any).")
@fa4_option("are checked")
@cache_option("read")
@click.option(
    "--trace/--no-trace",
    default=True,
    show_default=True,
    help="Also trace FA4's real entry points under fake tensors (no GPU, nothing compiled) "
    "and check the store holds FA4's exact compile keys (what fa4aot.install serves). Skipped, "
    "with a warning, where the compiler is not installed.",
)
@click.option(
    "--allow-unsupported",
    is_flag=True,
    help="Exit 0 even if a spec has layers FA4 cannot run on the arch (they are still listed).",
)
@with_output
def coverage(specs, arch, num_sms, gpu, python, fa4, cache, trace, allow_unsupported, out):
    """Does the store cover the specs' serving envelopes? Each variant: hit, servable by padding
    (with its cost), or missing. Artifacts are checked as the runtime checks them before loading
    (checksums, ownership). Exit 1 if anything is missing or corrupt, no store matches the
    target, a setting is invalid, or a layer is unsupported (without --allow-unsupported): run
    it before shipping an image. A store built from an engine's FA4 copy (`fa4aot build --fa4
    vllm`) is checked under --fa4 vllm or FA4AOT_KERNEL_SOURCE=vllm, against what that copy
    runs."""

    settings.check()
    arch, num_sms = apply_gpu(gpu, arch, num_sms)
    num_sms = num_sms or C.default_num_sms(arch)
    layers = layers_for(cache, out)
    match = matching_stores(layers, arch, num_sms, python, source_abi(fa4))
    match.require()
    abis = sorted({s.fa4_abi for s in match.stores})
    if len(abis) > 1:  # (auto without flash-attn-4 matches every source; the runtime picks one)
        raise click.BadParameter(f"stores of several FA4 sources match ({', '.join(abis)}): "
                                 "name one with --fa4 or FA4AOT_KERNEL_SOURCE",
                                 param_hint="--fa4")
    found = loadable_artifacts(match.stores)
    arts = found.artifacts
    avail = [Variant.from_dict(a.record["variant"]) for a in arts]
    keys = {(part, p["key"]) for a in arts for part, p in a.record["parts"].items()}
    spec_list = resolve_specs(list(specs))
    trace_skipped = None
    if trace:
        trace_skipped = compiler_missing()
        if trace_skipped:
            out.warning(
                f"--trace skipped: {trace_skipped}; FA4's compile keys were not checked "
                "(pip install 'fa4aot[build]' to check them, or pass --no-trace)"
            )
            trace = False
    fa4 = abis[0]
    if trace and fa4 != "upstream":
        out.warning(f"--trace skipped: the store is built from {fa4}'s FA4 copy (tests/fa4 "
                    "check its keys by name)")
        trace = False
    rows, missing = [], 0
    for spec in spec_list:
        plan = plan_for([spec], arch, num_sms, fa4)
        needs = list(plan.variants().values())
        traced = None
        if trace and needs:
            from fa4aot.fa4 import driver

            driver.configure(arch, num_sms)
            traced = driver.trace_keys([n.call for n in needs])
        for i, n in enumerate(needs):
            row = _coverage_row(spec, n, arch, avail, keys, None if traced is None else traced[i],
                                found.corrupt)
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
    counts["corrupt"] = len(found.corrupt)
    corrupt = [{"id": vid, "error": err} for vid, err in sorted(found.corrupt.items())]
    not_run = C.not_run_note(arch)
    if not_run:
        out.warning(not_run)  # a hit here is an artifact built and checked, never run
    out.table(
        rows,
        ["spec", "layer", "id", "status", "variant", "detail"],
        counts=counts,
        corrupt=corrupt,
        stores=[str(s.dir) for s in match.stores],
        fa4=fa4,
        fa4_sources=[source_label(s.toolchain) for s in match.stores],
        trace="skipped: " + trace_skipped if trace_skipped else trace,
        not_run=not_run,
    )
    for c in corrupt:
        out.text(f"corrupt: {c['id']}: {c['error']}")
    out.text("FA4 source: " + ("; ".join(source_label(s.toolchain) for s in match.stores)
                               or "no store"))
    out.text(
        f"{counts['hit']} hit, {counts['padding']} by padding, {counts['missing']} missing, "
        f"{counts['unsupported']} unsupported by FA4, {counts['corrupt']} corrupt"
    )
    fail_unsupported = counts["unsupported"] and not allow_unsupported
    if fail_unsupported:
        out.text(
            "unsupported layers fail the check: serve them another way, or pass "
            "--allow-unsupported to accept them"
        )
    if missing or found.corrupt or fail_unsupported:
        sys.exit(1)


def _coverage_row(spec, n, arch, avail, keys, traced, corrupt) -> dict:
    """One needed variant's coverage row: hit (and, with `traced`, FA4's keys all stored),
    servable by padding, or missing."""
    row = {"spec": spec.name, "layer": n.layer, "id": n.variant.id,
           "variant": n.variant.describe()}
    try:
        ch = choose(arch, n.call.features(), avail)
    except ValueError:  # an engine copy's split forward (vllm_copy.split_twin): exact or nothing
        ch = []
    if (ch and ch[0].exact) or any(v.id == n.variant.id for v in avail):
        row["status"] = "hit"
        if traced is not None:
            absent = [name for name, ks in traced.items() for k in ks if (name, k) not in keys]
            if absent:
                row["status"] = "missing"
                row["detail"] = f"FA4 compile key(s) of {', '.join(absent)} not in the store"
        return row
    if ch and not ch[0].exact:
        row["status"] = "padding"
        row["detail"] = ch[0].describe(n.variant)
        row["cost"] = round(ch[0].cost, 3)
    else:
        row["status"] = "missing"
    if n.variant.id in corrupt:
        row["detail"] = f"corrupt: {corrupt[n.variant.id]}"
    return row


@main.command()
@cache_option("read")
@with_output
def doctor(cache, out):
    """Versions, settings (value and source), GPU (arch, SM count), runtime library, visible
    store layers and whether each is compatible and intact, and what the runtime would serve
    from. Exit 1 if something stops serving here."""

    layers = layers_for(cache, out, strict=False)
    r = report(layers)
    if out.as_json:
        out.document(r)
    else:
        out.text(format_text(r))
    if r["problems"]:
        sys.exit(1)
