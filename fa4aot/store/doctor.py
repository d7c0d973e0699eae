"""`fa4aot doctor`: what this host has and what the runtime would serve from, in one report.

Reads package metadata, the GPU (if torch sees one) and the store layers; imports neither the
compiler nor any artifact. `problems` lists what stops serving here; an empty list means a call
the stores cover would be served.
"""

from __future__ import annotations

import platform
import sys
from typing import Any

from fa4aot import __version__, settings
from fa4aot.errors import Fa4aotError
from fa4aot.model import constraints as C
from fa4aot.store.layers import (
    Layer,
    find_serving_store,
    not_writable_reason,
    resolve_layers,
    scan_root,
)
from fa4aot.store.runtime_lib import find_runtime_lib
from fa4aot.store.toolchain import (
    _cutlass_libs,
    _version,
    mismatches,
    runtime_expectation,
    source_label,
)

PACKAGES = ("torch", "apache-tvm-ffi", "nvidia-cutlass-dsl", "flash-attn-4", "platformdirs")


def _gpu() -> dict[str, Any] | None:
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(0)
        return {
            "name": props.name,
            "arch": f"sm{props.major}{props.minor}",
            "num_sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "count": torch.cuda.device_count(),
            "cuda": torch.version.cuda,
        }
    except Exception:  # noqa: BLE001 - a broken driver is a finding, not a crash
        return None


def report(layers: list[Layer] | None = None) -> dict[str, Any]:
    """`layers`: the store layers to judge (default: what the runtime reads, resolve_layers)."""

    problems: list[str] = []
    setting_rows = settings.settings.report()
    problems += [r["error"] for r in setting_rows if "error" in r]
    versions = {"fa4aot": __version__, "python": platform.python_version()}
    versions.update({p: _version(p) for p in PACKAGES})
    versions["cutlass_libs"] = _cutlass_libs()
    try:
        runtime_lib: str | None = find_runtime_lib()
    except Fa4aotError as e:  # SettingError included
        runtime_lib = None
        problems.append(str(e))
    gpu = _gpu()
    expected = runtime_expectation(gpu["arch"], gpu["num_sms"]) if gpu else None
    # without a GPU, compatibility is judged on what this process fixes: versions and Python
    here = {k: v for k, v in runtime_expectation("", 0).items() if k not in ("arch", "num_sms")}
    if layers is None:
        try:
            layers = resolve_layers(None)
        except Fa4aotError as e:  # an invalid FA4AOT_CACHE_DIR: reported above
            layers = []
            if str(e) not in problems:
                problems.append(str(e))
    out_layers = []
    roots = [lay.root for lay in layers]
    for lay in layers:
        root = lay.root
        why = lay.problem()
        if why and (lay.explicit or root.exists()):
            problems.append(f"store layer {why}")
        stores, broken = scan_root(root)
        problems += [f"broken store {d}: {e}" for d, e in broken]
        layer = {
            "root": str(root),
            "source": lay.source,
            "exists": root.is_dir(),
            "writable": not_writable_reason(root) is None,
            "stores": [],
            "broken": [f"{d}: {e}" for d, e in broken],
        }
        for s in stores:
            row = _store_row(s, expected or here)
            problems += [f"corrupt artifact {c}" for c in row["corrupt"]]
            layer["stores"].append(row)
        out_layers.append(layer)
    serving: list[str] | None = None
    if gpu:
        try:
            serving = [str(s.dir) for s in find_serving_store(roots, expected)]
        except Fa4aotError as e:
            serving = []
            problems.append(str(e))
        if not serving and not problems:
            problems.append(
                f"no store for {gpu['arch']} with {gpu['num_sms']} SMs in any layer: "
                f"fa4aot build --arch {gpu['arch']} --num-sms {gpu['num_sms']}"
            )
        if gpu["arch"] not in C.RUNTIME_ARCHS:
            problems.append(
                f"the runtime serves {', '.join(C.RUNTIME_ARCHS)} only; this GPU is "
                f"{gpu['arch']}" + (f". {C.not_run_note(gpu['arch'])}"
                                    if gpu["arch"] in C.ARCHS else "")
            )
    return {
        "versions": versions,
        "platform": f"{platform.system()} {platform.machine()}",
        "executable": sys.executable,
        "runtime_lib": runtime_lib,
        "gpu": gpu,
        "layers": out_layers,
        "settings": setting_rows,
        "serving": serving,
        "compiler_installed": versions["flash-attn-4"] is not None,
        # the FA4 source whose stores this process serves (FA4AOT_KERNEL_SOURCE resolved)
        "kernel_source": (expected or here).get("fa4_abi", "any"),
        "problems": problems,
    }


def _store_row(s, expected: dict[str, Any]) -> dict[str, Any]:
    """One store of a layer as the report lists it, judged against `expected`."""
    arts = list(s.iter_artifacts())
    corrupt = _corrupt(arts)
    diff = mismatches(s.toolchain, expected)
    return {
        "dir": s.dir.name,
        "arch": s.toolchain.get("arch"),
        "num_sms": s.toolchain.get("num_sms"),
        "python": s.toolchain.get("python"),
        "fa4_source": source_label(s.toolchain),
        # the source by name, as --fa4 and FA4AOT_KERNEL_SOURCE take it
        "fa4_abi": s.fa4_abi,
        "artifacts": sum(not isinstance(a, Exception) for _, a in arts),
        "unreadable": sum(isinstance(a, Exception) for _, a in arts),
        "corrupt": [f"{d}: {e}" for d, e in corrupt],
        # split kernels an earlier fa4aot built (build.superseded): they serve, the slower
        # way, until `fa4aot build` replaces them
        "superseded": _superseded(arts),
        "compatible": not diff,
        "mismatches": diff,
        # sm100/sm103 stores: compiled and checked, never run (not a problem here: a build
        # host holds them for the Blackwell fleet)
        "not_run": C.not_run_note(s.toolchain.get("arch", "")),
    }


def _superseded(arts) -> int:
    """How many of `arts` are split kernels an earlier fa4aot built (build.superseded)."""
    from fa4aot.build.builder import superseded

    n = 0
    for _, a in arts:
        try:
            n += not isinstance(a, Exception) and superseded(a)
        except (KeyError, TypeError, ValueError):
            continue  # (an unreadable variant: _corrupt reports what is wrong with it)
    return n


def _corrupt(arts) -> list[tuple[str, str]]:
    """(artifact, why) for each artifact whose record or parts fail their checks: every part's
    sha256 is computed, as the runtime does before it loads one (a flipped byte is a problem)."""
    bad = []
    for vid, a in arts:
        if isinstance(a, Exception):
            bad.append((vid, str(a)))
            continue
        try:
            a.verify()
        except Fa4aotError as e:
            bad.append((str(a.dir), str(e)))
    return bad


def format_text(r: dict[str, Any]) -> str:
    lines = ["versions:"]
    lines += [
        f"  {k:<20}{v if v is not None else '(not installed)'}" for k, v in r["versions"].items()
    ]
    lines.append(f"runtime library:      {r['runtime_lib'] or '(not found)'}")
    g = r["gpu"]
    lines.append(
        f"gpu:                  {g['name']} {g['arch']} {g['num_sms']} SMs x{g['count']}"
        if g
        else "gpu:                  none visible to torch (building needs none)"
    )
    lines.append("settings:")
    for s in r["settings"]:
        shown = s.get("error") or (s["value"] if s["value"] is not None else "(unset)")
        lines.append(f"  {s['variable']:<26}{shown}  [{s['source']}]")
    lines.append(f"FA4 source served:    {r['kernel_source']} (FA4AOT_KERNEL_SOURCE)")
    lines.append("store layers (lookup order):")
    for layer in r["layers"]:
        flags = [layer["source"], "writable" if layer["writable"] else "read-only"]
        if not layer["exists"]:
            flags.append("absent")
        lines.append(f"  {layer['root']}  [{', '.join(flags)}]")
        for s in layer["stores"]:
            ok = "compatible" if s["compatible"] else "incompatible: " + "; ".join(s["mismatches"])
            if any(m.startswith("fa4_abi:") for m in s["mismatches"]):
                ok += f" (served with FA4AOT_KERNEL_SOURCE={s['fa4_abi']})"
            lines.append(f"    {s['dir']}: {s['artifacts']} artifacts, FA4 {s['fa4_source']}, "
                         f"{ok}")
            if s.get("not_run"):
                lines.append(f"    note: {s['not_run']}")
            if s.get("superseded"):
                lines.append(
                    f"    note: {s['superseded']} split kernels built by an earlier fa4aot: "
                    "they serve, with the older, slower split steps, until `fa4aot build` "
                    "replaces them"
                )
            lines += [f"    corrupt: {c}" for c in s["corrupt"]]
        lines += [f"    broken: {b}" for b in layer["broken"]]
    if r["serving"] is not None:
        lines.append("would serve from:     " + (", ".join(r["serving"]) or "(nothing)"))
    lines += [f"problem: {p}" for p in r["problems"]] or ["no problems found"]
    return "\n".join(lines)
