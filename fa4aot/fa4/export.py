"""Export a variant: compile its kernels through FA4 and write them as object files with the
cubin embedded (`export_to_c`), with the record fields the runtime binds them by."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fa4aot.fa4 import cubin, driver
from fa4aot.fa4.driver import trace
from fa4aot.fa4.forwards import trace_chunk_modes, trace_combine, trace_tma_page, trace_wide_fold
from fa4aot.fa4.kernels import trace_chunk_meta, trace_merge, trace_packed_meta, trace_ragged
from fa4aot.fa4.keys import _CUTE_DTYPES, key_repr, variant_from_fa4_key
from fa4aot.model import constraints as C
from fa4aot.model.compile_keys import Call
from fa4aot.model.variants import Variant

# Helper kernels FA4 compiles beside the forward for varlen batch > 256. The runtime calls
# tile_cumsum; blocks_to_batch's output is not an argument of the sm90 forward kernel, so only
# FA4's own code path (fa4aot.install) runs it: shipped for that.
SHIPPED_HELPERS = ("tile_cumsum", "blocks_to_batch")


def compile_variant(call: Call, variant: Variant, outdir: Path) -> dict[str, Any]:
    """Compile and export one variant: -> {"parts": {name: {"object": path, "key": str}}, ...}.

    Raises RuntimeError when FA4 compiles other than one forward kernel for the call: the
    runtime's feature model and FA4's compile key would then disagree, and shipping it would
    risk calling the wrong kernel.
    """
    src = driver.source()
    if src is not None and src.abi == "vllm":  # (its own calls, key names and parts)
        from fa4aot.fa4 import vllm_copy

        return vllm_copy.compile_variant(driver._fa4()[1], call, variant, outdir)
    if src is not None and src.abi == "sglang":
        from fa4aot.fa4 import sglang_copy

        return sglang_copy.compile_variant(driver._fa4()[1], call, variant, outdir)
    t0 = time.perf_counter()
    compiles: list = []
    got = trace(call, compiles)
    fwd = got["fwd"]
    if len(fwd) != 1:
        raise RuntimeError(
            f"expected one forward kernel for {variant.describe()}, FA4 compiled {len(fwd)}"
        )
    chunk_modes = variant.split_kernel and variant.arch == "sm90"
    bounds, used, wides, tma_page = [], [], {}, None
    if chunk_modes:
        fwd, bounds, used, wides, tma_page = _chunk_kernels(variant, compiles, fwd)
    seconds = time.perf_counter() - t0
    modelled = variant.mla is not None or variant.two_cta is not None
    if modelled and variant_from_fa4_key(fwd[0][0], variant.arch) != variant:
        # an MLA variant comes from a model of FA4's route (compile_keys.mla_features), an hd256
        # Blackwell one from a model of its batch-dependent 2CTA choice (features): a kernel
        # that is not the one its id names must not be stored under that id
        raise RuntimeError(
            f"FA4 compiled another kernel for {variant.describe()}: "
            f"{variant_from_fa4_key(fwd[0][0], variant.arch)}"
        )
    helpers = {n: got[n] for n in SHIPPED_HELPERS}
    for name, entries in helpers.items():
        if variant.cu_hint != bool(entries):
            raise RuntimeError(
                f"{name} helper presence disagrees with cu_hint for {variant.describe()}"
            )
    if variant.split_kernel:
        merge = trace_merge(variant)
        if merge:
            helpers["merge"] = merge
        else:  # head dims fa4aot's merge has no thread layout for (C.merge_threads)
            helpers["combine"] = trace_combine(variant)
        helpers["chunk_meta"] = trace_chunk_meta(variant)
        if variant.paged and variant.arch == "sm90":  # (split.plan_packed: the chunk modes)
            helpers["packed_meta"] = trace_packed_meta(variant)
        helpers.update(trace_ragged(variant))  # (policy/ragged.py)
    if variant.split_kv:
        # FA4's native split (Blackwell): its own entry compiled the combine for the call's
        # num_splits (the representative call's is the heuristic's maximum, 128)
        if len(got["combine"]) != 1:
            raise RuntimeError(
                f"expected FA4's combine kernel beside {variant.describe()}, it compiled "
                f"{len(got['combine'])}"
            )
        helpers["combine"] = got["combine"]
    parts: dict[str, Any] = {}
    if bounds:
        helpers["fwd_bounds"] = bounds
    if used:
        helpers["fwd_used"] = used
    for name, wide in wides.items():
        helpers[name] = [(fwd[0][0], trace_wide_fold(compiles, wide, variant.paged, pdl=True))]
    if tma_page:
        helpers["fwd_tma"] = [(fwd[0][0], trace_tma_page(compiles, tma_page, pdl=True))]
    for name, entries in [("fwd", fwd), *helpers.items()]:
        for key, fn in entries:
            parts[name] = _export_part(name, key, fn, variant, outdir, wides.get(name))
    if chunk_modes:  # (trace_chunk_modes)
        for name in ("fwd", "fwd_bounds", "fwd_used", *wides, "fwd_tma"):
            if name in parts:
                parts[name]["pdl"] = True  # (_pdl_secondary)
        parts["fwd"]["q_broadcast"] = True
        if variant.paged:
            parts["fwd"]["chunk_lengths"] = True
        else:  # (the bounds mode's form: C.BOUNDS_FORM)
            parts["fwd_bounds"]["rows"] = C.BOUNDS_FORM
    if tma_page:  # the page size (and tile) it serves
        parts["fwd_tma"]["page_size"] = tma_page
    return {"parts": parts, "compile_seconds": seconds, "fa4_key": parts["fwd"]["key"]}


def _chunk_kernels(variant: Variant, compiles: list, fwd: list):
    """A split chunk kernel's forwards: (FA4's, reading q and KV lengths in chunk modes; a
    packed K's chunk bounds (its own ABI: part fwd_bounds) and its entries with seqused_k
    (policy/ragged.py: part fwd_used); the fold's kernels for a full chip (parts fwd_wide,
    fwd_wide1) and, for a dense K's long split steps, fwd_wide through the chunk modes
    (fwd_wide_split; split.wide_split); paged on FA4's cp.async path, the page size of one on
    its TMA path (fwd_tma)), each a programmatic dependent launch (_pdl_secondary)."""
    fwd = [(fwd[0][0], trace_chunk_modes(compiles, pdl=True))]
    bounds, used = [], []
    if not variant.paged:
        bounds = [(fwd[0][0], trace_chunk_modes(compiles, bounds=True, pdl=True))]
        used = [(fwd[0][0], trace_chunk_modes(compiles, pdl=True, used=True))]
    wides = {w.part: w for w in C.wide_folds(variant.arch, variant.head_dim,
                                             variant.head_dim_v, variant.tile_m, variant.paged)}
    wide_split = C.wide_split(variant.arch, variant.head_dim, variant.head_dim_v,
                              variant.tile_m, variant.paged)
    if wide_split:
        wides[wide_split.part] = wide_split
    tma_page = C.tma_page(variant.arch, variant.tile_m, variant.paged, variant.paged_tma)
    return fwd, bounds, used, wides, tma_page


def _export_part(name: str, key, fn, variant: Variant, outdir: Path, wide) -> dict:
    """Export one compiled part as `name`.o and its record; wide: its WideFold, if one."""
    obj = outdir / f"{name}.o"
    fn.export_to_c(object_file_path=str(obj), function_name=f"fa4aot_{name}")
    # a kernel compiled for another SM links and publishes fine, and fails only on the GPU
    # ("no kernel image"), or loads another chip's tuning: refuse it here
    problem = cubin.target_problem(obj, C.cubin_target(variant.arch))
    if problem:
        raise RuntimeError(f"{variant.describe()}: {problem}")
    part = {"object": str(obj), **part_record(name, key, variant.arch)}
    if wide is not None:  # its occupancy took effect: ptxas held the registers
        regs = cubin.register_counts(obj)
        cap = min(255, 65536 // (256 * wide.ctas_per_sm))
        if not regs or max(regs) > cap:
            raise RuntimeError(f"{variant.describe()}: the wide fold kernel has {regs} "
                               f"registers per thread, not at most {cap}")
        part.update(tile_n=wide.tile_n, ctas_per_sm=wide.ctas_per_sm, registers=max(regs))
        if wide.chunk_modes:  # (trace_chunk_modes)
            part["q_broadcast"] = True
    return part


def part_record(name: str, key, arch: str) -> dict:
    """A part's record besides its object: FA4's compile key (rendered: what install() matches)
    and the compile-time facts the runtime calls it by."""
    rec: dict[str, Any] = {"key": key_repr(key)}
    if name == "fwd" and C.is_blackwell(arch):
        rec["abi"] = fwd_abi_record(key)
    if name == "tile_cumsum":
        # (tile, seqlen_q_multiplier, cu_seqlens?, seqused?, splits?, virtual batch?)
        rec["tile"], rec["seqlen_q_multiplier"] = int(key[0]), int(key[1])
        rec["cu_seqlens"], rec["seqused"] = bool(key[2]), bool(key[3])
    if name == "combine":
        rec["max_splits"] = 1 << int(key[7])
        rec["partial_dtype"] = _CUTE_DTYPES[key[2].__name__]
        rec["tile_m"] = int(key[5])
    if name == "merge":  # MERGE_KEY's fields
        rec["partial_dtype"], rec["max_splits"], rec["threads"] = key[2], int(key[4]), int(key[5])
        rec["version"] = int(key[1])
    if name == "chunk_meta":  # CHUNK_META_KEY's fields
        rec["form"] = key[2]
    if name == "packed_meta":  # PACKED_META_KEY's fields
        rec["version"] = int(key[1])
    if name == "ragged_meta":  # RAGGED_META_KEY's fields
        rec["version"], rec["form"] = int(key[1]), key[2]
    if name == "ragged_merge":  # RAGGED_MERGE_KEY's fields
        rec["version"], rec["partial_dtype"], rec["max_splits"] = int(key[1]), key[2], int(key[4])
    return rec


def fwd_abi_record(key) -> dict:
    """What the runtime's Blackwell path needs of a forward kernel's FA4 compile key (4.0.0b36
    positions), stored in its record as parts.fwd.abi: the M tile and Q stages the batch > 256
    helpers size their buffers with, pack_gqa, whether it writes split partials, and which
    optional scheduler slots it was compiled with (a tensor there is required, None refused).
    The runtime checks these against its model of the variant (runtime.plan.fwd_facts) and
    refuses the artifact on any difference (and any kernel taking FA4's varlen scheduler
    metadata, whose prepare kernel is not shipped). Not part of the variant id."""
    return {
        "tile_m": int(key[30]),
        "q_stage": int(key[32]),
        "split_kv": bool(key[34]),
        "pack_gqa": bool(key[35]),
        "num_splits_dynamic": bool(key[45]),
        "virtual_batch_idx": bool(key[48]),
        "num_nheads_in_l2": bool(key[49]),
        "tile_count_semaphore": bool(key[50]),
        "cu_total_m_blocks": bool(key[51]),
        "cu_total_splits_m_blocks": bool(key[52]),
        "blocks_to_batch_idx": bool(key[53]),
    }


