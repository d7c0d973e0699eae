"""The KV block-size contract, answered from what the store holds (not from a table).

An engine's KV-cache planner asks which page sizes a model's attention can be served with
(vLLM: `get_supported_kernel_block_sizes_for_config`). For FA4 the answer has two parts: the
TMA paged kernel serves exactly page_size == its tile_n (fast; wrong results for any other
size on sm90, so fa4aot never routes another size to it), and the cp.async paged kernel serves
any page size (per-row page lookup).

tile_n differs by arch (`kernel_page_sizes` states FA4's rule): on sm90 it follows the head
dim (128 up to hd128, 112/96 at hd192, 80 at hd256, 64 with a window at hd256); on Blackwell
(sm100, sm103) FA4's forward tiles 128 x 128 at every head dim it runs, so the TMA page is 128
for every layer. Absorbed-MLA (qv) layers, Blackwell only: `supported_block_sizes` answers from
the stored MLA kernels of the layer's head ratio and of the ratio the runtime pads it to
(runtime/mla.py), and `preferred_block_size` from FA4's rule (128: a TMA page on every MLA
route, which FA4 picks per call).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fa4aot import settings
from fa4aot.errors import FingerprintMismatch, UnsupportedVariant
from fa4aot.model import constraints as C
from fa4aot.model.specs import LAYOUTS, layout_forms
from fa4aot.model.variants import Variant
from fa4aot.policy.select import mla_padded_ratio
from fa4aot.store.layers import Store, default_roots, find_serving_store, stores_at
from fa4aot.store.toolchain import runtime_expectation


@dataclass(frozen=True)
class BlockSizes:
    tma: tuple[int, ...]  # page sizes served by the fast TMA paged kernel (== tile_n)
    any_size: bool  # True when a cp.async paged kernel is cached: every other page size works
    regimes: tuple[str, ...]  # paged regimes cached (decode/prefill, b>256)
    note: str = ""  # why nothing is cached when the store cannot hold such kernels (MLA)

    def serves(self, page_size: int) -> bool:
        return page_size in self.tma or (self.any_size and page_size > 0)


def _counts_stubs() -> bool:
    """Stub records (FA4AOT_STUB_COMPILER=1 test builds) are no kernels and the runtime refuses
    them; they count only in a process that builds stubs itself (the contract's own tests)."""

    return settings.stub_compiler()


def _paged_variants(stores: list[Store]) -> list[Variant]:
    out = []
    for s in stores:
        for _, a in s.iter_artifacts():
            if isinstance(a, Exception) or (a.record.get("stub") and not _counts_stubs()):
                continue  # corrupt, a stub, or not SM-count independent (fallback store)
            try:
                v = Variant.from_dict(a.record["variant"])
            except (ValueError, TypeError):
                continue
            if v.paged:
                out.append(v)
    return out


def _serving_stores(roots: list[Path], arch: str, num_sms: int) -> list[Store]:
    """The stores the runtime would serve (arch, num_sms) from in this process: its toolchain,
    Python and SM count (find_serving_store). A page size only another toolchain's store holds
    would be a miss at serve time, so other stores do not count."""
    try:
        return find_serving_store(roots, runtime_expectation(arch, num_sms))
    except FingerprintMismatch:
        return []  # stores only for other toolchains: none serves here


def _roots(cache) -> list[Path]:
    if cache is None:
        return default_roots()
    if isinstance(cache, (str, Path)):
        return [Path(cache)]
    return [Path(c) for c in cache]


def _block_sizes(
    variants: list[Variant],
    arch: str,
    dtype: str,
    head_dim: int,
    head_dim_v: int | None,
    qhead_per_kvhead: int,
    causal: bool,
    window: int | None,
    sink_dtype: str | None,
    softcap: float | None = None,
    kv_dtype: str | None = None,
) -> BlockSizes:
    head_dim_v = head_dim_v or head_dim
    causal_r, local, _, _ = C.resolve_window(causal, window, 0 if causal else None)
    tile = C.fwd_tile(arch, head_dim, head_dim_v, causal_r, local)
    tma, other, regimes = set(), False, set()
    for v in variants:
        if (
            v.arch,
            v.dtype,
            v.head_dim,
            v.head_dim_v,
            v.qhead_per_kvhead,
            v.local,
            v.causal,
            v.sink_dtype,
            v.softcap,
            v.kv_dtype,
        ) != (
            arch,
            dtype,
            head_dim,
            head_dim_v,
            qhead_per_kvhead,
            local,
            causal_r,
            sink_dtype,
            softcap,
            kv_dtype,
        ) or v.pack_gqa is not None:
            continue
        if v.paged_tma:
            tma.add(tile.n)
        else:
            other = True
        regimes.add(
            f"{v.phase}{'/b>256' if v.cu_hint else ''}{'/split' if v.split_kv else ''}"
            f"{'/tma' if v.paged_tma else ''}"
        )
    return BlockSizes(tuple(sorted(tma)), other, tuple(sorted(regimes)))


_MLA_PAGES_NOTE = (
    "absorbed MLA: the kernel (2CTA, 1CTA or 1CTA-kb64) and so its TMA page sizes are chosen per "
    "call from batch x heads against the SM count; page 128 is TMA on every route "
    "(blocks.kernel_page_sizes; kb64 loads any multiple of 64 by TMA). Answered from the stored "
    "MLA kernels of the layer's ratio and of its padded ratio; a call whose route has no kernel "
    "for its page size is a miss (ArtifactMissing names it)"
)


def _mla_block_sizes(
    variants: list[Variant], arch: str, dtype: str, head_dim: int, qv: int, ratio: int,
    causal: bool,
) -> BlockSizes:
    """The page sizes the stored absorbed-MLA kernels of this layer take: at its head ratio or
    at the ratio the runtime pads it to (select.mla_padded_ratio: 20 -> 32). A TMA kernel of
    the 2CTA or 1CTA route takes page 128; of the kb64 route any multiple of 64 (64 and 128
    listed); a cp.async one any size."""

    ratios = {ratio, mla_padded_ratio(ratio)[0]}
    tma, other, regimes = set(), False, set()
    for v in variants:
        if (
            v.mla is None
            or (v.arch, v.dtype, v.head_dim, v.head_dim_v, v.causal)
            != (arch, dtype, head_dim, qv, causal)
            or v.qhead_per_kvhead not in ratios
        ):
            continue
        if v.paged_tma:
            tma.update((64, 128) if v.mla == "1cta-kb64" else (128,))
        else:
            other = True
        regimes.add(f"{v.mla}/{v.phase}/ratio{v.qhead_per_kvhead}{'/tma' if v.paged_tma else ''}")
    return BlockSizes(tuple(sorted(tma)), other, tuple(sorted(regimes)), note=_MLA_PAGES_NOTE)


def supported_block_sizes(
    arch: str,
    dtype: str,
    head_dim: int,
    head_dim_v: int | None = None,
    *,
    qhead_per_kvhead: int = 1,
    causal: bool = True,
    window: int | None = None,
    sink_dtype: str | None = None,
    cache=None,
    num_sms: int | None = None,
    qv: int | None = None,
    kv_dtype: str | None = None,
) -> BlockSizes:
    """KV page sizes this process can serve for this attention config: answered from the
    stores the runtime would use for (arch, `num_sms`; default: the arch's; sm103 has none and
    raises NumSmsRequired), so a page size held only by a store of another toolchain, Python or
    SM count does not count.

    qv: an absorbed-MLA layer's latent dim (head_dim is then the rope part; qhead_per_kvhead
    its query heads per latent head). Raises UnsupportedVariant off Blackwell; on Blackwell
    answered from the stored MLA kernels (_mla_block_sizes), with a `note` on FA4's per-call
    route. kv_dtype: the KV cache's dtype where it is not `dtype` ("float8_e4m3fn": FP8-KV
    dequant, built from vLLM's FA4 copy on sm90; its kernel loads pages of its tile_n only, 64
    at head dim 512, as vLLM's `_get_sm90_fa4_fp8_kv_block_size` says)."""
    if kv_dtype in (None, "auto", dtype):
        kv_dtype = None
    if qv is not None and not C.is_blackwell(arch):
        raise UnsupportedVariant(C.mla_reason(arch))
    if num_sms is None and arch in C.ARCHS:
        num_sms = C.default_num_sms(arch)
    num_sms = num_sms or 0  # an unknown arch: no store, as before
    stores = _serving_stores(_roots(cache), arch, num_sms)
    if qv is not None:
        return _mla_block_sizes(
            _paged_variants(stores), arch, dtype, head_dim, qv, qhead_per_kvhead, causal
        )
    return _block_sizes(
        _paged_variants(stores),
        arch,
        dtype,
        head_dim,
        head_dim_v,
        qhead_per_kvhead,
        causal,
        window,
        sink_dtype,
        kv_dtype=kv_dtype,
    )


def preferred_block_size(
    arch: str, dtype: str, head_dim: int, head_dim_v: int | None = None, **kw
) -> int | None:
    """The page size to allocate the KV cache with: the TMA kernel's tile_n when cached (in a
    store this process serves from; `num_sms` as in supported_block_sizes). For an absorbed-MLA
    layer (`qv`, Blackwell), whose kernel is chosen per call, FA4's own rule answers: the page
    size every MLA route loads by TMA (kernel_page_sizes)."""
    if kw.get("qv") is not None:
        if not C.is_blackwell(arch):
            raise UnsupportedVariant(C.mla_reason(arch))
        return kernel_page_sizes(arch, head_dim, head_dim_v, qv=kw["qv"]).tma[0]
    bs = supported_block_sizes(arch, dtype, head_dim, head_dim_v, **kw)
    return bs.tma[0] if bs.tma else None


@dataclass(frozen=True)
class KernelPages:
    """FA4's own paged-KV rule for a layer on an arch (read from its source, 4.0.0b36; not from
    a store): what its kernels take, whatever fa4aot has built."""

    tile_n: int  # the forward kernel's key block
    tma: tuple[int, ...]  # page sizes loaded by TMA on every route FA4 may pick for the layer
    any_size: bool  # every other page size works through a cp.async kernel
    note: str


def kernel_page_sizes(
    arch: str,
    head_dim: int,
    head_dim_v: int | None = None,
    *,
    causal: bool = True,
    window: int | None = None,
    qv: int | None = None,
) -> KernelPages:
    """FA4's paged-KV rule: TMA iff page_size == tile_n (interface.py `paged_kv_tma`), any other
    page size through the cp.async loader (`paged_kv_non_tma`), on every arch.

    Blackwell (sm100/sm103): tile_n is 128 at every head dim (`_get_fwd_config`: FwdConfig(128,
    128); only a split with unequal head dims re-tiles to 64, which fa4aot does not build); the
    2CTA kernel also needs page 128 (`page_size in [None, 128]`). MLA (qv): the 2CTA and 1CTA
    kernels load pages of 128 by TMA and others by cp.async; the 1CTA-kb64 route (64-key
    blocks) loads any multiple of 64 by TMA. FA4 picks the route from batch x heads against
    the SM count at call time, so 128 is the one size that is TMA on every route.
    Raises UnsupportedVariant for MLA off Blackwell."""
    head_dim_v = head_dim_v or head_dim
    if qv is not None:
        if not C.is_blackwell(arch):
            raise UnsupportedVariant(C.mla_reason(arch))
        return KernelPages(
            128, (128,), True,
            "MLA: page 128 is TMA on the 2CTA, 1CTA and 1CTA-kb64 routes; multiples of 64 are "
            "TMA on the kb64 route only; any other size takes cp.async",
        )
    why = C.unsupported_reason(arch, "bfloat16", head_dim, head_dim_v)
    if why:
        raise UnsupportedVariant(why)
    causal_r, local, _, _ = C.resolve_window(causal, window, 0 if causal else None)
    tile = C.fwd_tile(arch, head_dim, head_dim_v, causal_r, local)
    where = "every head dim on Blackwell" if C.is_blackwell(arch) else "this head dim on sm90"
    return KernelPages(
        tile.n, (tile.n,), True,
        f"tile_n {tile.n} at {where}: page {tile.n} takes the TMA kernel, any other size the "
        "cp.async one",
    )


def block_size_rows(root: Path) -> list[dict]:
    """Per spec layer indexed in a store: the page sizes that store serves, and the preferred one
    (for `fa4aot ls`, which lists every store of a root, whatever its toolchain)."""
    rows = []
    for s in stores_at(root):
        idx = s.dir / "specs"
        if not idx.is_dir():
            continue
        variants = _paged_variants([s])
        for f in sorted(idx.glob("*.json")):
            try:
                rows += _spec_rows(s, json.loads(f.read_text())["spec"], variants)
            except (OSError, ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError):
                continue  # an index ls cannot read; its artifacts are still listed
    return rows


def _spec_rows(s: Store, spec: dict, variants: list[Variant]) -> list[dict]:
    layouts = [n for n in spec.get("serving", {}).get("layouts", []) if n in LAYOUTS]
    if not any(layout_forms(n)[1].startswith("paged") for n in layouts):
        return []
    rows = []
    arch = s.toolchain["arch"]
    for att in spec["attention"]:
        if C.unsupported_reason(arch, att["dtype"], att["head_dim"], att["head_dim_v"]):
            continue
        bs = _block_sizes(
            variants,
            arch,
            att["dtype"],
            att["head_dim"],
            att["head_dim_v"],
            att["num_q_heads"] // att["num_kv_heads"],
            att["causal"],
            att["window"],
            att.get("sink_dtype", "float32") if att["sinks"] else None,
            att.get("softcap"),
        )
        causal_r, local, _, _ = C.resolve_window(
            att["causal"], att["window"], 0 if att["causal"] else None
        )
        rows.append(
            {
                "spec": spec["name"],
                "layer": att["name"],
                "arch": arch,
                "head_dim": att["head_dim"],
                "tile_n": C.fwd_tile(arch, att["head_dim"], att["head_dim_v"], causal_r, local).n,
                "served_page_sizes": (
                    "any" if bs.any_size else ",".join(map(str, bs.tma)) or "none"
                ),
                "tma_page_size": ",".join(map(str, bs.tma)) or "-",
                "preferred": bs.tma[0] if bs.tma else "-",
            }
        )
    return rows
