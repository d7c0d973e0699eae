"""What several commands share: the one `--cache` option, the layers it resolves to, and the
stores (of those layers) that would serve a given arch / SM count / Python."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import click

from fa4aot import settings
from fa4aot.errors import Fa4aotError, FingerprintMismatch
from fa4aot.model import constraints as C
from fa4aot.store.layers import Layer, Store, resolve_layers, scan_root
from fa4aot.store.toolchain import build_toolchain, source_label, source_name

CACHE_HELP = {
    "read": "Store layers to read, ':'-separated (default: the $FA4AOT_CACHE_DIR layers, else "
    "the user cache dir, then installed cache wheels).",
    "write": "Store layers, ':'-separated; writes go to the first writable one (default: the "
    "$FA4AOT_CACHE_DIR layers, else the user cache dir).",
    "ship": "Store layers to read, ':'-separated (default: the $FA4AOT_CACHE_DIR layers, else "
    "the user cache dir; not installed cache wheels).",
}


def cache_option(kind: str = "read"):
    return click.option("--cache", help=CACHE_HELP[kind])


def gpu_option():
    """`--gpu NAME`: the target GPU, which sets the arch and the SM count (constraints.GPUS)."""
    names = ", ".join(f"{g} {a}/{n}" for g, (a, n) in C.GPUS.items())
    return click.option(
        "--gpu", type=click.Choice(list(C.GPUS)),
        help=f"Target GPU: sets --arch and --num-sms (arch/SMs: {names}).",
    )


def apply_gpu(gpu: str | None, arch, num_sms: int | None, arch_param: str = "arch"):
    """(arch, num_sms) of a command given `--gpu`: the GPU's; an --arch or --num-sms given
    beside it must agree (a usage error otherwise). `arch`: the command's --arch value (a tuple
    for build's repeatable one); without --gpu both come back as they are."""
    if gpu is None:
        return arch, num_sms
    g_arch, g_sms = C.GPUS[gpu]
    ctx = click.get_current_context(silent=True)
    given = ctx is not None and (
        ctx.get_parameter_source(arch_param) == click.core.ParameterSource.COMMANDLINE
    )
    archs = arch if isinstance(arch, tuple) else (arch,)
    if given and set(archs) != {g_arch}:
        raise click.BadParameter(f"--gpu {gpu} is {g_arch}, not {'/'.join(archs)}",
                                 param_hint="--arch")
    if num_sms is not None and num_sms != g_sms:
        raise click.BadParameter(f"--gpu {gpu} has {g_sms} SMs, not {num_sms}",
                                 param_hint="--num-sms")
    return ((g_arch,) if isinstance(arch, tuple) else g_arch), g_sms


def fa4_option(what: str):
    """`--fa4 SOURCE`: the FA4 source whose stores a command reads (default FA4AOT_KERNEL_SOURCE)."""
    return click.option(
        "--fa4", "fa4",
        help=f"The FA4 source whose stores {what} (as FA4AOT_KERNEL_SOURCE picks them): upstream, "
        "vllm, sglang, or a path to a source tree's cute/ directory (its ABI is read from it). "
        "Default: FA4AOT_KERNEL_SOURCE.",
    )


def source_abi(fa4: str | None) -> str:
    """--fa4 -> the FA4 ABI whose stores count (None: FA4AOT_KERNEL_SOURCE); a path's ABI is
    read from its interface.py (sources.resolve; nothing imported)."""
    from fa4aot.errors import Fa4SourceError
    from fa4aot.fa4 import sources

    if fa4 is None:
        return settings.fa4_source()
    if fa4 in ("auto", *sources.NAMED):
        return fa4
    try:
        src = sources.resolve(fa4)
        src.require_modelled()
    except Fa4SourceError as e:
        raise click.BadParameter(str(e), param_hint="--fa4") from None
    return src.abi


def layers_for(
    cache: str | None, out, *, wheels: bool = True, verb: str = "read", strict: bool = True
) -> list[Layer]:
    """resolve_layers, named on `out`; with `strict`, a layer that cannot be read fails the
    command when it was named on the command line (--cache: a typo is not an empty store) or
    exists but is unreadable or not a directory; an absent FA4AOT_CACHE_DIR or default layer
    is normal (a node cache before its first build) and reads as empty."""
    layers = resolve_layers(cache, wheels=wheels)
    out.read_layers(layers, verb)
    if strict:
        for layer in layers:
            why = layer.problem()
            if why is None:
                continue
            if layer.explicit or layer.root.exists():
                raise Fa4aotError(f"store layer {why}")
    return layers


def existing(layers: list[Layer]) -> list[Layer]:
    return [layer for layer in layers if layer.problem() is None]


@dataclass
class Match:
    """Stores of the layers that serve (arch, num_sms, python) with this machine's toolchain,
    and the others (named when nothing matches)."""

    stores: list[Store] = field(default_factory=list)
    others: list[Store] = field(default_factory=list)
    want: dict = field(default_factory=dict)

    def describe_others(self) -> str:
        if not self.others:
            return "no store at all"
        return "stores there: " + "; ".join(
            f"{s.dir} ({s.toolchain.get('arch')}, {s.toolchain.get('num_sms')} SMs, python "
            f"{s.toolchain.get('python')}, FA4 {source_label(s.toolchain)})"
            for s in self.others
        )

    def require(self) -> None:
        """FingerprintMismatch unless some store matches, naming the stores that do exist."""
        if self.stores:
            return
        w = self.want
        py = w.get("python")
        src = w.get("fa4_abi")
        others = sorted({source_name(s.toolchain) for s in self.others} - {src or "upstream"})
        raise FingerprintMismatch(
            f"no store for {w['arch']} with {w['num_sms']} SMs"
            + (f", python {py}" if py else "")
            + (f", from {src}'s FA4 copy," if src and src != "upstream" else "")
            + f" built by this toolchain; {self.describe_others()}. Build it with: fa4aot build "
            f"--arch {w['arch']} --num-sms {w['num_sms']}"
            + (f" --python {py}" if py else "")
            + (f" --fa4 {src}" if src and src != "upstream" else "")
            + (f" (stores built from {', '.join(others)}'s FA4 copy are checked with --fa4 "
               f"{others[0]} or FA4AOT_KERNEL_SOURCE={others[0]})" if others else "")
        )


def matching_stores(
    layers: list[Layer], arch: str, num_sms: int, python: str | None, source: str | None = None
) -> Match:
    """Every layer's store built by this machine's toolchain for (arch, SM count), and for
    `python` when given (a build machine checks stores made for another interpreter).

    `source`: the FA4 source whose stores count (an ABI name, or auto as FA4AOT_KERNEL_SOURCE
    reads); None keeps the toolchain's own match (upstream's by flash-attn-4's version). An
    engine copy's store is matched by the ABI its toolchain records: its `fa4` names the copy."""
    want = build_toolchain(arch, num_sms, python)
    keys = [
        k
        for k in ("fa4", "cutlass_dsl", "cutlass_libs", "tvm_ffi", "arch", "num_sms")
        if want.get(k)
    ]
    keys += ["python"] if python else []
    if source == "auto":  # as the runtime: upstream where flash-attn-4 is installed, else any
        source = "upstream" if want.get("fa4") else None
    if source is not None:
        want["fa4_abi"] = source
        keys = [k for k in keys if k != "fa4" or source == "upstream"] + ["fa4_abi"]
    m = Match(want={**want, "python": python})
    for layer in existing(layers):
        for s in scan_root(Path(layer.root))[0]:
            ok = all(s.toolchain.get(k) == want[k] for k in keys)
            (m.stores if ok else m.others).append(s)
    return m


@dataclass
class Loadable:
    """Artifacts of some stores as the runtime would judge them before dlopen
    (Artifact.check_loadable: not a stub, a safe path, every part's sha256)."""

    artifacts: list = field(default_factory=list)
    corrupt: dict[str, str] = field(default_factory=dict)  # variant id -> why
    stub_ids: set[str] = field(default_factory=set)  # test stubs whose checksums hold


def loadable_artifacts(stores: list[Store]) -> Loadable:
    res = Loadable()
    unsafe_ok = settings.allow_unsafe_dirs()
    for s in stores:
        for vid, a in s.iter_artifacts():
            if isinstance(a, Exception):
                res.corrupt.setdefault(vid, str(a))
                continue
            if a.record.get("stub"):  # test builds: never served, never a finding
                try:
                    a.verify()
                    res.stub_ids.add(vid)
                except Fa4aotError as e:
                    res.corrupt.setdefault(vid, str(e))
                continue
            try:
                a.check_loadable(unsafe_ok)
            except Fa4aotError as e:
                res.corrupt.setdefault(vid, str(e))
                continue
            res.artifacts.append(a)
    # a good copy in another layer serves; the corrupt one is still a finding (reported)
    return res
