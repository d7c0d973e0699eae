"""Planning: which loaded kernels serve a call, decided once per host-known call key.

A plan is one of
- exact: the call's own variant (`Plan.pad is None`);
- fold: a decode step on the non-causal kernel of a dividing head ratio, the call's query
  heads as query rows (`Plan.pad.fold > 1`, select.py), with no copies;
- pad: a cached variant with more query heads per KV head and/or larger head dims, O and LSE
  cropped back (`Plan.pad`, fold 1);
and, for decode steps, split-KV (`Runtime.split_for`, split.py) ahead of any of them: its
chunk kernel is itself a fold (GQA as rows of the 1:1 kernel), so fold + split is one plan; a
padded call splits when its padded re-entry does (pad + split), and a call whose head dims have
no split kernel runs unsplit (`split_kernel` is None).

Plans are cached in `Runtime._plans` by the entry points' key tuples (host-known values only:
dtypes, dims, head ratio, mask, layout flags, a clamped query length, the device), so a call
builds its `CallFeatures` and consults the store only the first time its key is seen. Split decisions are cached by `Runtime.split_for`; their scratch by `splitkv`.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from fa4aot import settings
from fa4aot.errors import ArtifactMissing, CorruptArtifact, UnsupportedVariant
from fa4aot.model import constraints as C
from fa4aot.model.compile_keys import CallFeatures, split_kernel_variant
from fa4aot.model.variants import MlaRefused, Variant
from fa4aot.policy import split as S
from fa4aot.policy.ragged import ragged_parts
from fa4aot.policy.select import (
    choose, fold_from_env, mla_padded_ratio, nearest, padded_features,
)
from fa4aot.runtime import abi as A
from fa4aot.runtime import launch as L
from fa4aot.runtime.blackwell import refusal
from fa4aot.runtime.validate import DTYPES
from fa4aot.settings import ON_MISS
from fa4aot.store import runtime_lib
from fa4aot.store.layers import Store, default_roots, find_serving_store
from fa4aot.store.misses import record_miss
from fa4aot.store.records import Artifact
from fa4aot.store.toolchain import fa4_abi, read_toolchain, runtime_expectation

log = logging.getLogger("fa4aot")



@dataclass(slots=True)
class SplitKernel:
    """A loaded split-KV chunk kernel (compile_keys.split_kernel_variant) and its merge kernel,
    bound to their ABI (`launch`, `merge`): fa4aot's merge (`fa4aot_merge`, the artifact's part
    `merge`) or, in artifacts built before it or for head dims it has no layout for, FA4's
    combine (part `combine`, the arch's ABI)."""

    fwd: Any
    combine: Any
    max_slots: int
    artifact: Artifact | None
    abi: L.Abi = L.SM90
    fa4aot_merge: bool = False
    meta: Any = None  # the chunk metadata kernel (part `chunk_meta`), None in older artifacts
    # the forward reads q through a chunk mode (forwards.trace_chunk_modes): no copy of q
    q_broadcast: bool = False
    # it cuts a paged K's lengths into chunks itself (the same): no metadata launch at one row
    chunk_lengths: bool = False
    # a packed K's: the forward that reads its chunks' bounds from cu_seqlens_k as (b + 1,
    # rows, chunk, causal shift, anchor) (part `fwd_bounds`, forwards.trace_chunk_modes(
    # bounds=True); split.bounds_part), None in older artifacts
    fwd_bounds: Any = None
    # the fold's kernels for a chip full of CTAs (parts `fwd_wide`, `fwd_wide1`: constraints.
    # WideFold, forwards.trace_wide_fold; FA4's ABI), None in older artifacts, for head dims
    # over 128 and (fwd_wide1) for a paged K
    fwd_wide: Any = None
    fwd_wide1: Any = None
    # a paged K's split steps over pages of one tile of it, on FA4's TMA paged path (part
    # `fwd_tma`, constraints.tma_page, forwards.trace_tma_page; the chunk kernel's ABI): bound
    # where the step's page size is the part's, else None (and in older artifacts)
    fwd_tma: Any = None
    # long split steps on fwd_wide through the chunk modes (part `fwd_wide_split`:
    # constraints.wide_split, split.wide_split; the chunk kernel's ABI), None in older
    # artifacts
    fwd_wide_split: Any = None
    # whether its forward (part `fwd`) may take FA4's TMA paged path (its variant's paged_tma:
    # page size == tile_n), so its launcher guards the page table (abi.GUARD_ALIGN); the
    # part fwd_tma does, the wide parts run a paged K on the cp.async path
    paged_tma: bool = True
    # a paged K's packed-rows metadata kernel (part `packed_meta`: kernels.trace_packed_meta,
    # runtime/splitruns.PackedRun), None in older artifacts and for a packed K
    packed_meta: Any = None
    # the ragged step's metadata kernel and merge (parts `ragged_meta`, `ragged_merge`:
    # kernels.trace_ragged, runtime/ragged.py), None in older artifacts; called as they are
    ragged_meta: Any = None
    ragged_merge: Any = None
    # a packed K's ragged entries with seqused_k: their forward (part `fwd_used`: forwards.
    # trace_chunk_modes(used=True)) and metadata kernel (part `ragged_meta_used`), else None
    fwd_used: Any = None
    ragged_meta_used: Any = None
    launch: Callable = field(init=False)
    merge: Callable = field(init=False)
    chunk_meta: Callable | None = field(init=False)
    launch_bounds: Callable | None = field(init=False)
    launch_used: Callable | None = field(init=False)
    launch_wide: Callable | None = field(init=False)
    launch_wide1: Callable | None = field(init=False)
    launch_split: Callable = field(init=False)  # what a split step runs: fwd_tma, else fwd
    launch_wide_split: Callable | None = field(init=False)  # a wide split step's (Split.wide)
    facts: S.KernelFacts = field(init=False)  # what it offers a plan (split.plan_step)

    def __post_init__(self):
        fwd = self.abi.fwd
        self.launch = fwd(self.fwd, guard=self.paged_tma)
        self.launch_split = self.launch if self.fwd_tma is None else fwd(self.fwd_tma)
        self.launch_bounds = (None if self.fwd_bounds is None  # (a packed K: no page table)
                              else fwd(self.fwd_bounds, guard=False))
        self.launch_used = None if self.fwd_used is None else fwd(self.fwd_used, guard=False)
        self.launch_wide = None if self.fwd_wide is None else fwd(self.fwd_wide, guard=False)
        self.launch_wide1 = None if self.fwd_wide1 is None else fwd(self.fwd_wide1, guard=False)
        self.launch_wide_split = (None if self.fwd_wide_split is None  # (cp.async if paged)
                                  else fwd(self.fwd_wide_split, guard=False))
        self.merge = (A.bind_fa4aot_merge if self.fa4aot_merge else self.abi.combine)(self.combine)
        self.chunk_meta = None if self.meta is None else A.bind_fa4aot_chunk_meta(self.meta)
        self.facts = S.KernelFacts(
            max_slots=self.max_slots, wide_split=self.fwd_wide_split is not None,
            paged_tma=self.paged_tma, tma_part=self.fwd_tma is not None,
            q_broadcast=self.q_broadcast, chunk_lengths=self.chunk_lengths,
            bounds=self.fwd_bounds is not None, packed_meta=self.packed_meta is not None,
        )


@dataclass(slots=True)
class Plan:
    """Everything a call with these static features needs, resolved once."""

    variant: Variant | None
    fwd: Any
    tile_cumsum: Any  # helper kernel (varlen batch > 256) or None
    helper_cu: bool  # the helper was compiled to read cu_seqlens_q
    helper_seqused: bool  # ... and/or seqused_q
    artifact: Artifact | None
    window_left: int | None = None  # FA4's resolved window, passed to the kernel
    window_right: int | None = None
    pad: Any = None  # select.Choice when the call is served by padding (or a decode fold)
    # a sequence of at most one query row is one m-block for the helper: with max_seqlen_q == 1
    # its output equals cu_seqlens_q (see flash_attn_varlen_func)
    decode_blocks: bool = False
    abi: L.Abi = L.SM90
    # Blackwell only (runtime/blackwell.py): the blocks-to-batch helper and FA4's combine (a
    # native split kernel's part) as loaded, and the compile-time facts the call needs
    # (`fwd_facts`: tile_m, pack_gqa)
    blocks_to_batch: Any = None
    combine: Any = None
    facts: Any = None
    # the features of the call that made the plan (Blackwell's split variants)
    feat: CallFeatures | None = None
    launch: Callable = field(init=False)  # fwd bound to its ABI (an abi.bind_* launcher)
    tile: Callable | None = field(init=False)  # tile_cumsum bound, or None
    b2b: Callable | None = field(init=False)  # blocks_to_batch bound, or None
    # the entry points' one test before the exact sm90 launch: a fold / padding plan, or a
    # Blackwell plan (decided here, once per plan, so the sm90 exact path tests nothing new)
    special: bool = field(init=False)
    # Blackwell: native split decisions per (batch, rows, key blocks, setting)
    native: dict = field(init=False)

    def __post_init__(self):
        self.native = {}
        mla = self.variant is not None and self.variant.mla is not None
        # the page-table guard only where the kernel may take FA4's TMA paged path (GUARD_ALIGN)
        guard = self.variant is None or self.variant.paged_tma is not False
        self.launch = (self.abi.mla_fwd if mla else self.abi.fwd)(self.fwd, guard=guard)
        self.tile = None if self.tile_cumsum is None else self.abi.tile_cumsum(self.tile_cumsum)
        self.b2b = (
            None if self.blocks_to_batch is None else self.abi.blocks_to_batch(self.blocks_to_batch)
        )
        self.special = self.pad is not None or self.abi.blackwell


# What the Blackwell path needs of a forward kernel's compile key (FA4's key positions, as
# export.fwd_abi_record stores them in the artifact's record: parts.fwd.abi)
FACTS = ("tile_m", "pack_gqa", "split_kv", "cu_total_m_blocks", "blocks_to_batch_idx",
         "num_splits_dynamic", "virtual_batch_idx", "num_nheads_in_l2", "tile_count_semaphore",
         "cu_total_splits_m_blocks")  # fmt: skip


def fwd_facts(variant: Variant, art: Artifact | None) -> dict:
    """The compile-time facts of a Blackwell forward kernel that decide its call (the M tile
    the batch > 256 helpers size their buffer with, pack_gqa, whether it writes split partials,
    which scheduler slots it has). From the variant (what `features` models; tests/
    test_runtime_sm100.py checks it equal to FA4's key for every default sm100 variant), checked
    against the artifact's record of FA4's own key when the builder recorded it. A disagreement,
    or a kernel that takes FA4's varlen scheduler metadata (its prepare kernel is not shipped),
    is refused: calling it would pass the wrong slots."""
    mine = {
        "tile_m": variant.tile.m,
        "pack_gqa": variant.pack_gqa_effective,
        "split_kv": variant.split_kv,
        "cu_total_m_blocks": variant.cu_hint,
        "blocks_to_batch_idx": variant.cu_hint,
        # FA4's varlen scheduler metadata (split with a packed q) is not modelled: none of its
        # slots (the launcher passes None there)
        "num_splits_dynamic": False,
        "virtual_batch_idx": False,
        "num_nheads_in_l2": False,
        "tile_count_semaphore": False,
        "cu_total_splits_m_blocks": False,
    }
    rec = None if art is None else art.record.get("parts", {}).get("fwd", {}).get("abi")
    if rec is not None:
        for k in FACTS:
            if k in rec and rec[k] != mine[k]:
                raise UnsupportedVariant(
                    f"artifact {art.id} ({variant.describe()}): FA4's compile key says {k}="
                    f"{rec[k]!r}, the runtime's model of the variant {mine[k]!r}; refusing to "
                    "call it with slots laid out for the other"
                    + (" (FA4's varlen scheduler metadata: its prepare kernel is not shipped)"
                       if k == "num_splits_dynamic" else "")
                )
    return mine


def _arch_of(device: torch.device) -> tuple[str, int]:
    major, minor = torch.cuda.get_device_capability(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return f"sm{major}{minor}", sms


# HBM peaks (bytes/s) by device name, where torch reports no memory clock and bus width
_HBM_BY_NAME = (("H200", C.GPU_HBM["h200"]), ("H100 80GB HBM3", C.GPU_HBM["h100"]),
                ("H100 NVL", 3.9e12), ("H100 PCIe", C.GPU_HBM["h100-pcie"]))


def hbm_peak(device: torch.device) -> float | None:
    """The HBM peak of CUDA `device` in bytes/s: 2 x its memory clock x its bus width (as
    torch reports them), else by its name (_HBM_BY_NAME), else None (unknown, or no CUDA: the
    CPU tests' stand-in devices)."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    khz, bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if khz and bits:
        return 2 * khz * 1e3 * bits / 8
    return next((bw for name, bw in _HBM_BY_NAME if name in props.name), None)


class Runtime:
    """Serves calls from a layered store. Thread-safe; loads each artifact once per process."""

    def __init__(
        self,
        roots: list[Path] | None = None,
        on_miss: str | None = None,
        allow_unsafe_dirs: bool | None = None,
    ):
        self.roots = [Path(r) for r in roots] if roots else default_roots()
        # one snapshot of the settings (fa4aot.settings: a bad value raises SettingError,
        # naming the variable, here, when the runtime is built)
        self.on_miss = on_miss or settings.on_miss()
        if self.on_miss not in ON_MISS:
            raise ValueError(f"on_miss must be one of {ON_MISS}, got {self.on_miss!r}")
        if allow_unsafe_dirs is None:
            allow_unsafe_dirs = settings.allow_unsafe_dirs()
        self.allow_unsafe_dirs = allow_unsafe_dirs
        self.padding = settings.allow_padding()
        self.fold = fold_from_env()  # serve s_q == 1 decode by folding heads into rows
        split = settings.split_kv()
        self.split = -1 if split == "auto" else split  # -1: the cost model chooses
        # one-row steps split by their real lengths where the store can (policy/ragged.py);
        # False: the uniform plan alone (benchmarks/decode_ragged.py compares the two)
        self.ragged = True
        # calls whose query rows fit a 64-row M tile run on its twin where cached
        # (constraints.small_m_tile); False: FA4's tile (set_small_tile)
        self.small_tile = True
        self._lock = threading.Lock()
        self._devices: dict[int, tuple[str, int]] = {}
        self._models: dict[int, S.CostModel] = {}
        self._lib_checked: set[Path] = set()
        self._split_kernels: dict[tuple, SplitKernel | None] = {}
        self._split_n: dict[tuple, S.Split | None] = {}
        self._split_consts: dict[tuple, Any] = {}
        # splitkv.split_step's cache: key -> SplitRun, or False (this step runs unsplit)
        self._split_runs: dict[tuple, Any] = {}
        self._split_scratch = 0  # SplitRuns (scratch holders) in _split_runs
        self._stores: dict[tuple[str, int], list[Store]] = {}
        self._fa4_abis: dict[Path, str] = {}  # store directory -> its toolchain's fa4_abi
        self._modules: dict[str, tuple[Any, Any, Artifact]] = {}
        self._plans: dict[tuple, Plan] = {}
        self._other_plans: dict[tuple, Plan] = {}  # the other small_tile setting's
        # Blackwell native split-KV: split kernels' plans by variant id, float32 partials
        self._native_plans: dict[str, Plan | None] = {}
        self._native_scratch: dict[tuple, Any] = {}

    def set_small_tile(self, on: bool) -> None:
        """Serve calls whose query rows fit a 64-row M tile on its twin (on, the default) or on
        FA4's tile (benchmarks compare them). Plans are kept per setting: switching back and
        forth replans nothing."""
        with self._lock:
            if bool(on) != self.small_tile:
                self._plans, self._other_plans = self._other_plans, self._plans
                self.small_tile = bool(on)

    # -- store and artifact resolution (once per variant) -------------------------------------
    def stores_for(self, arch: str, num_sms: int) -> list[Store]:
        key = (arch, num_sms)
        if key not in self._stores:
            self._stores[key] = find_serving_store(self.roots, runtime_expectation(arch, num_sms))
        return self._stores[key]

    def fa4_abi(self, arch: str, num_sms: int) -> str:
        """The FA4 ABI of the stores serving (arch, num_sms): their first's ("upstream" with
        none). What FA4 can run here follows it (constraints: hd512 and FP8-KV from vLLM's)."""
        stores = self.stores_for(arch, num_sms)
        return stores[0].fa4_abi if stores else "upstream"

    def abi_of(self, art: Artifact) -> str:
        """The FA4 ABI `art` was built for: its store's toolchain's (read once per store)."""
        d = art.dir.parent.parent  # <fingerprint dir>/artifacts/<id>
        got = self._fa4_abis.get(d)
        if got is None:
            known = [s for ss in self._stores.values() for s in ss if s.dir == d]
            if known:
                got = known[0].fa4_abi
            else:
                try:
                    got = fa4_abi(read_toolchain(d))
                except CorruptArtifact:  # (not in a store: a stand-in artifact, upstream's)
                    got = "upstream"
            self._fa4_abis[d] = got
        return got

    def find(self, variant: Variant, num_sms: int) -> Artifact | None:
        for store in self.stores_for(variant.arch, num_sms):
            art = store.get(variant.id, verify=False)
            if art is not None:
                return art
        return None

    def available(self, arch: str, num_sms: int) -> list[Variant]:
        """Every variant the serving stores hold (read on misses only: one JSON per artifact)."""
        out = []
        for store in self.stores_for(arch, num_sms):
            for _, a in store.iter_artifacts():
                if isinstance(a, Exception) or a.record.get("stub"):
                    continue
                try:
                    out.append(Variant.from_dict(a.record["variant"]))
                except (ValueError, TypeError):
                    continue
        return out

    def _load(self, art: Artifact, *names: str | None) -> list[Any]:
        """The named parts of `art` (None for a part it lacks, or for a name of None), after one
        check of the whole artifact: every part's sha256 is hashed once per load, not per part."""
        art.check_loadable(self.allow_unsafe_dirs)  # stub, unsafe dirs, sha256: before any dlopen

        self._check_runtime_lib(art)
        runtime_lib.load_runtime_lib()
        import tvm_ffi

        parts = art.record["parts"]
        return [
            tvm_ffi.load_module(str(art.part_path(n)))[f"fa4aot_{n}"] if n in parts else None
            for n in names
        ]

    def _check_runtime_lib(self, art: Artifact) -> None:
        """RuntimeLibraryMismatch unless the store holding `art` was built against the runtime
        library this process loads (once per store directory)."""

        d = art.dir.parent.parent  # <fingerprint dir>/artifacts/<id>
        if d not in self._lib_checked:
            runtime_lib.check_matches(read_toolchain(d).get("runtime_lib"))
            self._lib_checked.add(d)

    def device(self, index: int) -> tuple[str, int]:
        """(arch, SM count) of CUDA device `index`, queried once."""
        got = self._devices.get(index)
        if got is None:
            got = self._devices[index] = _arch_of(torch.device("cuda", index))
        return got

    def cost_model(self, dev: int) -> S.CostModel:
        """The split plans' cost model for CUDA device `dev` (split.model_for its HBM peak),
        made once."""
        got = self._models.get(dev)
        if got is None:
            got = self._models[dev] = S.model_for(hbm_peak(torch.device("cuda", dev)))
        return got

    def split_kernel(
        self, dev: int, dtype, head_dim: int, head_dim_v: int, page_size: int | None
    ) -> SplitKernel | None:
        """The split-KV chunk kernel (packed K when page_size is None) with its combine, or
        None when the stores lack it (the call then runs unsplit)."""
        key = (dev, dtype, head_dim, head_dim_v, page_size)
        if key in self._split_kernels:
            return self._split_kernels[key]
        arch, sms = self.device(dev)
        got = None
        # (Blackwell splits with FA4's own split kernels: runtime/blackwell.py)
        if (
            dtype in DTYPES
            and not C.is_blackwell(arch)
            and not C.runtime_unsupported_reason(arch)
            and not C.unsupported_reason(arch, DTYPES[dtype], head_dim, head_dim_v)
        ):
            v = split_kernel_variant(arch, DTYPES[dtype], head_dim, head_dim_v, page_size)
            with self._lock:
                art = self.find(v, sms)
                name, comb = S.merge_part(art.record["parts"] if art else {}, DTYPES[dtype])
                if name is not None:
                    tma = S.tma_part(art.record["parts"], page_size)
                    ws = S.wide_part(art.record["parts"], v)
                    bp = S.bounds_part(art.record["parts"])
                    parts = art.record["parts"]
                    rg = ("ragged_meta", "ragged_merge") if ragged_parts(parts) else (None,) * 2
                    used = (("fwd_used", "ragged_meta_used")
                            if rg[0] and "fwd_used" in parts and "ragged_meta_used" in parts
                            else (None, None))
                    if art.id in self._modules:  # the decode fold loaded it (same tile)
                        combine, meta, bounds, wide, wide1, tma, ws, pm, rm, rc, fu, mu = (
                            self._load(art, name, "chunk_meta", bp, "fwd_wide", "fwd_wide1",
                                       tma, ws, "packed_meta", *rg, *used))
                    else:
                        (fwd, helper, combine, meta, bounds, wide, wide1, tma, ws, pm, rm, rc,
                         fu, mu) = self._load(art, "fwd", "tile_cumsum", name, "chunk_meta",
                                              bp, "fwd_wide", "fwd_wide1", tma, ws,
                                              "packed_meta", *rg, *used)
                        self._modules[art.id] = (fwd, helper, art)
                    got = SplitKernel(
                        self._modules[art.id][0],
                        combine,
                        int(comb.get("max_splits", S.MAX_SLOTS)),
                        art,
                        L.abi_for(arch, self.abi_of(art)),
                        fa4aot_merge=name == "merge",
                        meta=meta,
                        q_broadcast=bool(art.record["parts"]["fwd"].get("q_broadcast")),
                        chunk_lengths=bool(art.record["parts"]["fwd"].get("chunk_lengths")),
                        fwd_bounds=bounds,
                        fwd_wide=wide,
                        fwd_wide1=wide1,
                        fwd_tma=tma,
                        fwd_wide_split=ws,
                        paged_tma=v.paged_tma is not False,
                        packed_meta=pm,
                        ragged_meta=rm,
                        ragged_merge=rc,
                        fwd_used=fu,
                        ragged_meta_used=mu,
                    )
        self._split_kernels[key] = got
        return got

    def split_for(
        self, dev: int, dtype, ctas: int, seqlen_k: int, d: int, dv: int,
        page_size: int | None, sink: bool, decode_rows: int = 1, fold: bool = True,
        one_row: bool = False,
    ) -> S.Split | None:
        """The split plan of a decode step with `ctas` (sequence, row, KV head) triples, of
        which `decode_rows` (sequence, row) pairs, over at most seqlen_k keys, or None (run it
        unsplit: the cost model says splitting loses, FA4AOT_SPLIT_KV=0, or the store lacks
        the split kernel). Planned for seqlen_k rounded up to 256 keys and cached, so a decode
        loop whose KV grows a key a step replans (and reallocates nothing) once per 256
        steps. fold: whether the step, unsplit, runs as the fold (split.fold_refusal); one_row:
        the step has one query row a sequence (its long steps may run on the wide split
        kernel, split.wide_split: a packed K, or a paged one by its chunk kernel's path)."""
        bucket = S.plan_bucket(seqlen_k)
        key = (dev, dtype, ctas, bucket, d, dv, page_size, sink, self.split, decode_rows, fold,
               one_row)
        try:
            return self._split_n[key]
        except KeyError:
            pass
        sp = None
        kern = self.split_kernel(dev, dtype, d, dv, page_size) if self.split else None
        if kern is not None:
            sp = S.plan_unrolled(
                kern.facts, ctas=ctas, seqlen_k=bucket, bytes_per_key=(d + dv) * dtype.itemsize,
                page_size=page_size, sink=sink, num_sms=self.device(dev)[1],
                setting=self.split, decode_rows=decode_rows, fold=fold, one_row=one_row,
                model=self.cost_model(dev),
            )
        if len(self._split_n) > 4096:
            self._split_n.clear()
        self._split_n[key] = sp
        return sp

    def plan(self, variant: Variant, num_sms: int) -> Plan | None:
        """Load the artifact serving `variant` (or None if the store has none)."""
        with self._lock:
            art = self.find(variant, num_sms)
            if art is None:
                return None
            abi = L.abi_for(variant.arch, self.abi_of(art))
            if not abi.blackwell:
                if art.id not in self._modules:
                    fwd, helper = self._load(art, "fwd", "tile_cumsum")
                    self._modules[art.id] = (fwd, helper, art)
                fwd, helper, art = self._modules[art.id]
                extra = {}
            else:
                facts = fwd_facts(variant, art)
                key = ("blackwell", art.id)
                if key not in self._modules:
                    self._modules[key] = tuple(
                        self._load(art, "fwd", "tile_cumsum", "blocks_to_batch", "combine")
                    )
                fwd, helper, b2b, comb = self._modules[key]
                if variant.cu_hint and (helper is None or b2b is None):
                    raise UnsupportedVariant(
                        f"artifact {art.id} ({variant.describe()}) lacks FA4's batch > 256 "
                        "helper kernels (tile_cumsum, blocks_to_batch)"
                    )
                if variant.split_kv and comb is None:
                    raise UnsupportedVariant(
                        f"artifact {art.id} ({variant.describe()}) lacks FA4's combine kernel"
                    )
                extra = dict(blocks_to_batch=b2b, combine=comb, facts=facts)
            hp = art.record["parts"].get("tile_cumsum", {})
            return Plan(
                variant,
                fwd,
                helper,
                bool(hp.get("cu_seqlens")),
                bool(hp.get("seqused")),
                art,
                decode_blocks=variant.qhead_per_kvhead <= variant.tile.m,
                abi=abi,
                **extra,
            )

    def miss(self, variant: Variant, num_sms: int, allow_padding: bool) -> None:
        record_miss(variant)
        near = nearest(variant, self.available(variant.arch, num_sms))
        near_s = "; ".join(f"{v.describe()} ({v.id})" for v in near) or "none (empty store?)"
        pad = "" if allow_padding else " (padding is denied: FA4AOT_PADDING=deny or padding=False)"
        raise ArtifactMissing(
            f"no artifact serves {variant.describe()} (variant id {variant.id}){pad}, not even by "
            f"padding. Nearest cached: {near_s}. Add it with: fa4aot build --arch {variant.arch} "
            f"--spec <a spec whose envelope covers this call>, or record misses with "
            f"FA4AOT_MISS_LOG=FILE and run fa4aot build --from-misses FILE"
        )


def hd256_class(rt: Runtime, dev: int, batch: int, hq: int, hk: int) -> int:
    """What of a head-dim-256 call's batch its plan depends on (a term of the entry points'
    plan keys): on Blackwell FA4 picks pack_gqa and the 2CTA kernel by 2 x batch x (query or
    KV) heads against the SM count (compile_keys.features, Variant.two_cta); elsewhere nothing (0),
    and 0 off CUDA (dev < 0: the entry point's CUDA check then refuses the call, typed)."""
    if dev < 0:
        return 0
    arch, sms = rt.device(dev)
    if not C.is_blackwell(arch):
        return 0
    return 1 + (2 * batch * hq <= sms) + 2 * (2 * batch * hk <= sms)


# q/k/v dtypes with no FP8 contract to check (validate.DTYPES' names)
_PLAIN_DTYPES = frozenset(DTYPES.values())


def resolve(rt: Runtime, key: tuple, dev: int, padding: bool, feat: CallFeatures) -> Plan | None:
    """The plan serving the call `feat` on CUDA device `dev` (exact, else, when `padding`
    allows it, the best fold or padding select.choose finds), cached under `key`; None when
    nothing serves it (the caller applies the miss policy). Raises UnsupportedVariant for an
    arch the runtime does not serve, or a call FA4 cannot run that no padded variant serves."""
    plan = rt._plans.get(key)
    if plan is not None:
        return plan
    arch, sms = rt.device(dev)
    why = C.runtime_unsupported_reason(arch)
    if why:
        raise UnsupportedVariant(why)
    if C.is_blackwell(arch) or feat.qv is not None:
        # hd256 and MLA's route: FA4's choice reads the SM count
        feat = replace(feat, num_sms=sms)
    if feat.dtype not in _PLAIN_DTYPES or C.is_blackwell(arch):
        why = refusal(arch, feat)
        if why:
            raise UnsupportedVariant(why)
    if feat.qv is not None:
        variant, why = _mla_variant(arch, feat)
    else:
        variant = feat.variant(arch)
        why = C.unsupported_reason(arch, feat.dtype, feat.head_dim, feat.head_dim_v,
                                   fa4=rt.fa4_abi(arch, sms))
    plan = None
    if not why:
        small = feat.small_tile_variant(arch) if rt.small_tile else None
        plan = (small is not None and rt.plan(small, sms)) or rt.plan(variant, sms)
    # FP8 (Blackwell only: refused above elsewhere) pads and folds as bf16 does: both keep the
    # batch and the KV heads, so the (batch, num_kv_heads) descales pass on unchanged, and the
    # bf16 O is cropped like any other (pad.padded, pad.folded)
    if plan is None and padding:
        choices = choose(arch, feat, rt.available(arch, sms), allow_fold=rt.fold)
        if choices:
            inner = rt.plan(choices[0].variant, sms)
            if inner is not None:
                plan = replace(inner, pad=choices[0])
                log.debug(
                    "fa4aot: %s served by %s", _describe(variant, feat),
                    choices[0].describe(variant, feat.ratio),
                )
    if plan is None and why:
        if variant is None and padding:
            return None  # an MLA ratio FA4 refuses: the miss names the padded kernel (_wanted)
        if variant is None:
            why += (f"; padding {feat.ratio} -> {mla_padded_ratio(feat.ratio)[0]} query heads "
                    "per latent head would serve it, but padding is denied (padding=False or "
                    "FA4AOT_PADDING=deny)")
        raise UnsupportedVariant(f"{_describe(variant, feat)}: {why}")
    if plan is None:
        return None  # caller decides (miss policy)
    _, _, plan.window_left, plan.window_right = C.resolve_window(
        feat.causal, feat.window_left, feat.window_right
    )
    if plan.abi.blackwell and plan.pad is None:
        plan.feat = feat
    rt._plans[key] = plan
    return plan


def _mla_variant(arch: str, feat: CallFeatures) -> tuple[Variant | None, str | None]:
    """An absorbed-MLA call's own variant (its route reads feat.num_sms, the device's SM count)
    and, when FA4 refuses the call at its head ratio (MlaRefused: the 2CTA kernel takes ratios
    dividing 128), (None, FA4's reason): padding serves it. Raises UnsupportedVariant for an MLA
    call fa4aot does not model (head dims, latent heads, layouts, FP8, windows, sinks...)."""
    try:
        return feat.variant(arch), None
    except MlaRefused as e:
        return None, str(e)
    except ValueError as e:
        raise UnsupportedVariant(str(e)) from None


def _describe(variant: Variant | None, feat: CallFeatures) -> str:
    if variant is not None:
        return variant.describe()
    return (f"absorbed MLA, {feat.ratio} query heads per latent head "
            f"(hd{feat.head_dim}/{feat.head_dim_v})")


def _wanted(arch: str, sms: int, feat: CallFeatures) -> Variant:
    """The variant a miss asks for: the call's own, or for an MLA call FA4 refuses at its
    ratio, the padded one the builder makes (select.mla_padded_ratio: 20 -> 32, 10 -> 16)."""
    feat = replace(feat, num_sms=sms)
    if feat.qv is None:
        return feat.variant(arch)
    variant, why = _mla_variant(arch, feat)
    if variant is None:
        r2, _ = mla_padded_ratio(feat.ratio)
        try:
            variant = padded_features(feat, r2, feat.head_dim, feat.head_dim_v).variant(arch)
        except MlaRefused:
            raise UnsupportedVariant(why) from None
    return variant


def on_miss(
    rt: Runtime, dev: int, padding: bool, feat: CallFeatures, jit_fn: str, args, kwargs,
    out=None, lse=None,
):  # fmt: skip
    """The miss policy for the call `feat` on device `dev`: error raises ArtifactMissing (logged
    to the miss log); warn and jit log the miss and run FA4's JIT (`fa4.driver.jit_*`), writing
    the caller's buffers if given."""
    arch, sms = rt.device(dev)
    variant = _wanted(arch, sms, feat)
    if rt.on_miss == "error":
        rt.miss(variant, sms, padding)
    if feat.descales:
        raise UnsupportedVariant(
            f"{variant.describe()}: no artifact, and FA4AOT_ON_MISS={rt.on_miss} cannot compile "
            "it: FA4's public entry points take no descales. Build it: fa4aot build --arch "
            f"{arch} --spec <a spec with this FP8 layer>"
        )

    record_miss(variant)
    if rt.on_miss == "warn":
        log.warning("fa4aot: no artifact for %s; compiling with FA4 (JIT)", variant.describe())
    from fa4aot.fa4 import driver

    o, lse_ = getattr(driver, jit_fn)(*args, **kwargs)
    if out is not None:  # FA4's public functions take no output buffers: honour the caller's
        out.copy_(o)
        o = out
    if lse is not None and lse_ is not None:
        lse.copy_(lse_)
        lse_ = lse
    return o, lse_
