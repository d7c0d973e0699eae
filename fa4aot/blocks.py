"""The KV block-size contract, answered from what the store holds (not from a table).

An engine's KV-cache planner asks which page sizes a model's attention can be served with
(vLLM: `get_supported_kernel_block_sizes_for_config`). For FA4 on sm90 the answer has two
parts: the TMA paged kernel serves exactly page_size == its tile_n (fast; wrong results for
any other size, so fa4aot never routes another size to it), and the cp.async paged kernel
serves any page size (per-row page lookup).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from . import constraints as C
from .store import stores_at
from .variants import Variant


@dataclass(frozen=True)
class BlockSizes:
    tma: tuple[int, ...]  # page sizes served by the fast TMA paged kernel (== tile_n)
    any_size: bool  # True when a cp.async paged kernel is cached: every other page size works
    regimes: tuple[str, ...]  # paged regimes cached (decode/prefill, b>256)

    def serves(self, page_size: int) -> bool:
        return page_size in self.tma or (self.any_size and page_size > 0)


def _paged_variants(roots: list[Path], arch: str) -> list[Variant]:
    out = []
    for root in roots:
        for s in stores_at(root):
            if s.toolchain.get("arch") != arch:
                continue
            for _, a in s.iter_artifacts():
                if isinstance(a, Exception):
                    continue
                try:
                    v = Variant.from_dict(a.record["variant"])
                except (ValueError, TypeError):
                    continue
                if v.paged:
                    out.append(v)
    return out


def _roots(cache) -> list[Path]:
    if cache is None:
        from .store import default_roots

        return default_roots()
    if isinstance(cache, (str, Path)):
        return [Path(cache)]
    return [Path(c) for c in cache]


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
) -> BlockSizes:
    """KV page sizes the store can serve for this attention config."""
    head_dim_v = head_dim_v or head_dim
    causal_r, local, _, _ = C.resolve_window(causal, window, 0 if causal else None)
    tile = C.fwd_tile(arch, head_dim, head_dim_v, causal_r, local)
    tma, other, regimes = set(), False, set()
    for v in _paged_variants(_roots(cache), arch):
        if (
            v.dtype,
            v.head_dim,
            v.head_dim_v,
            v.qhead_per_kvhead,
            v.local,
            v.causal,
            v.sink_dtype,
        ) != (dtype, head_dim, head_dim_v, qhead_per_kvhead, local, causal_r, sink_dtype):
            continue
        if v.paged_tma:
            tma.add(tile.n)
        else:
            other = True
        regimes.add(f"{v.phase}{'/b>256' if v.cu_hint else ''}{'/tma' if v.paged_tma else ''}")
    return BlockSizes(tuple(sorted(tma)), other, tuple(sorted(regimes)))


def preferred_block_size(
    arch: str, dtype: str, head_dim: int, head_dim_v: int | None = None, **kw
) -> int | None:
    """The page size to allocate the KV cache with: the TMA kernel's tile_n when cached."""
    bs = supported_block_sizes(arch, dtype, head_dim, head_dim_v, **kw)
    return bs.tma[0] if bs.tma else None


def block_size_rows(root: Path) -> list[dict]:
    """Per spec layer indexed in a store: served and preferred page sizes (for `fa4aot ls`)."""
    rows = []
    for s in stores_at(root):
        idx = s.dir / "specs"
        if not idx.is_dir():
            continue
        for f in sorted(idx.glob("*.json")):
            try:
                spec = json.loads(f.read_text())["spec"]
            except (OSError, ValueError, KeyError):
                continue
            if "paged" not in spec.get("serving", {}).get("layouts", []):
                continue
            for att in spec["attention"]:
                arch = s.toolchain["arch"]
                if C.unsupported_reason(arch, att["dtype"], att["head_dim"], att["head_dim_v"]):
                    continue
                kw = dict(
                    qhead_per_kvhead=att["num_q_heads"] // att["num_kv_heads"],
                    causal=att["causal"],
                    window=att["window"],
                    sink_dtype="float32" if att["sinks"] else None,
                    cache=root,
                )
                bs = supported_block_sizes(
                    arch, att["dtype"], att["head_dim"], att["head_dim_v"], **kw
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
                        "tile_n": C.fwd_tile(
                            arch, att["head_dim"], att["head_dim_v"], causal_r, local
                        ).n,
                        "served_page_sizes": (
                            "any" if bs.any_size else ",".join(map(str, bs.tma)) or "none"
                        ),
                        "tma_page_size": ",".join(map(str, bs.tma)) or "-",
                        "preferred": bs.tma[0] if bs.tma else "-",
                    }
                )
    return rows
