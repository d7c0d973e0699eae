"""The only module that imports `cutlass` / `flash_attn`. Build side (and JIT fallback) only.

Cross-compiles FA4 kernels with no GPU: FA4's real entry points are driven under torch's
FakeTensorMode with the target arch and SM count set in the environment, so FA4 itself decides
the compile key and compiles it; we take the compiled function out of FA4's compile cache and
export it (`export_to_c`) as an object file with the cubin embedded.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import time
from pathlib import Path
from typing import Any

from . import constraints as C
from . import cubin
from .variants import Call, Variant

_CONFIGURED: tuple[str, int] | None = None


def configure(arch: str, num_sms: int) -> None:
    """Set the cross-compile target. Must run before the first FA4 import in this process."""
    global _CONFIGURED
    if _CONFIGURED is not None and _CONFIGURED != (arch, num_sms):
        raise RuntimeError(
            f"this process already targets {_CONFIGURED}; use one process per target"
        )
    if _CONFIGURED is None and "flash_attn.cute" in sys.modules:
        # FA4 fixes its target arch and its disk-cache setting when it is imported
        raise RuntimeError(
            "flash_attn.cute was imported before fa4aot.compiler.configure(): "
            "configure the cross-compile target first (one process per target)"
        )
    num = arch[2:]
    # FA4's own disk cache must stay off: trace() clears FA4's caches, which with it enabled
    # would delete the user's cached kernels, and keys could be served from disk unseen.
    os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "0"
    os.environ["FLASH_ATTENTION_ARCH"] = f"sm_{num}"
    os.environ["CUTE_DSL_ARCH"] = C.cubin_target(arch)
    os.environ["FLASH_ATTENTION_NUM_SMS"] = str(num_sms)
    # The DSL warns once per compile that AuxData is not a JitArgument (FA4 passes it as a
    # compile-time value on purpose); thousands of identical lines would bury real errors.
    import warnings

    warnings.filterwarnings("ignore", message=".*cannot be converted to a JitArgument.*")
    warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
    warnings.filterwarnings("ignore", message=".*Failed to initialize NumPy.*")
    _CONFIGURED = (arch, num_sms)


def _fa4():
    import flash_attn.cute as fa  # noqa: PLC0415 (heavy: ~6 s; only builders pay it)
    from flash_attn.cute import interface

    if _CONFIGURED is not None:
        _cross_hardware_info(_CONFIGURED[1])
    _record_softcaps()
    return fa, interface


# FA4 compiles softcap as a score_mod and keys it by a hash of that function (its source and
# the captured value), so a key does not say which softcap it was: the value is recorded here
# as FA4 makes the function, for variant_from_fa4_key (install()'s miss log). The hash is
# stable across processes (source + repr of the float).
SOFTCAP_BY_HASH: dict[str, float] = {}


def _record_softcaps() -> None:
    from flash_attn.cute import utils  # noqa: PLC0415

    make = utils.create_softcap_scoremod
    if getattr(make, "_fa4aot_recording", False):
        return

    def create_softcap_scoremod(softcap_val):
        fn = make(softcap_val)
        SOFTCAP_BY_HASH[utils.hash_callable(fn)] = float(softcap_val)
        return fn

    create_softcap_scoremod._fa4aot_recording = True
    utils.create_softcap_scoremod = create_softcap_scoremod


def softcap_hash(value: float) -> str:
    """The score_mod hash FA4 puts in its compile key for `softcap=value` (a float: FA4 hashes
    the value's repr, so softcap=30 and softcap=30.0 are two kernels to it)."""
    _fa4()
    from flash_attn.cute import utils  # noqa: PLC0415

    return utils.hash_callable(utils.create_softcap_scoremod(float(value)))


def _cross_hardware_info(num_sms: int) -> None:
    """FA4's sm100 static persistent scheduler sizes its grid at trace time with
    `cutlass.utils.HardwareInfo().get_device_multiprocessor_count()`, a CUDA driver query that
    fails with no GPU (DynamicLibNotFoundError). Cross-compiling, the target's SM count is the
    configured one (recorded in the store's fingerprint, checked at load): answer with it, and
    refuse every other driver query by name rather than guess."""
    import cutlass.utils  # noqa: PLC0415

    if getattr(cutlass.utils.HardwareInfo, "_fa4aot_cross", False):
        return

    class CrossCompileHardwareInfo:
        _fa4aot_cross = True

        def __init__(self, device_id: int = 0):
            self.device_id = device_id

        def get_device_multiprocessor_count(self) -> int:
            return num_sms

        def __getattr__(self, name: str):
            raise RuntimeError(
                f"HardwareInfo.{name} needs a GPU: fa4aot cannot cross-compile a kernel that "
                "queries it at trace time"
            )

    cutlass.utils.HardwareInfo = CrossCompileHardwareInfo


def _caches():
    _, I = _fa4()
    return {
        "fwd": I._flash_attn_fwd.compile_cache,
        "tile_cumsum": I._compute_tile_cumsum.compile_cache,
        "blocks_to_batch": I._compute_blocks_to_batch.compile_cache,
        "combine": I._flash_attn_fwd_combine.compile_cache,
    }


def key_repr(key: Any) -> str:
    """A readable, stable rendering of an FA4 compile key (it holds cutlass type objects)."""

    def r(x):
        if isinstance(x, tuple):
            return "(" + ", ".join(r(i) for i in x) + ("," if len(x) == 1 else "") + ")"
        if isinstance(x, type):
            return x.__name__
        return repr(x)

    return r(key)


def fake_call(call: Call):
    """Run FA4's public entry point for `call` under FakeTensorMode (compiles, runs nothing).

    Every layout goes through the entry point a caller would use: flash_attn_func for dense,
    flash_attn_varlen_func for the rest (q packed with cu_seqlens_q unless batch_q; seqused_q
    and seqused_k as the call says; K/V packed, in batch form, or paged)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    if call.qv is not None:  # absorbed MLA: FA4's varlen entry with qv (mla.MlaCall's form)
        from .mla import MlaCall

        return fake_mla_call(MlaCall(
            call.layout, call.batch, call.seqlen_q, call.seqlen_k, call.num_heads,
            call.head_dim, call.qv, call.dtype, call.causal, call.return_lse, call.page_size,
        ))
    fa, _ = _fa4()
    dt = getattr(torch, call.dtype)
    b, sq, sk = call.batch, call.seqlen_q, call.seqlen_k
    hq, hk, d, dv = call.num_heads, call.num_heads_kv, call.head_dim, call.head_dim_v
    with FakeTensorMode():
        dev = "cuda"

        def i32(n):
            return torch.empty(n, dtype=torch.int32, device=dev)

        kw: dict[str, Any] = dict(
            causal=call.causal,
            window_size=(call.window_left, call.window_right),
            return_lse=call.return_lse,
        )
        if call.sink_dtype:
            kw["learnable_sink"] = torch.empty(
                hq, dtype=getattr(torch, call.sink_dtype), device=dev
            )
        if call.softcap is not None:
            kw["softcap"] = call.softcap
        if call.pack_gqa is not None:
            kw["pack_gqa"] = call.pack_gqa
        if call.num_splits != 1:
            kw["num_splits"] = call.num_splits
        extra = {  # arguments only _flash_attn_fwd takes
            f"{t}_descale": torch.empty(b, hk, dtype=torch.float32, device=dev)
            for t in (call.descales or "")
        }
        if call.tile_m is not None:  # (FA4's entry points do not take tile_mn)
            # (modelled on sm90 only: variants.features refuses it elsewhere)
            tile = C.fwd_tile("sm90", d, dv, call.causal,
                              call.window_left is not None or call.window_right is not None)
            extra["tile_mn"] = (call.tile_m, tile.n)
        if call.layout == "dense":
            q = torch.empty(b, sq, hq, d, dtype=dt, device=dev)
            k = torch.empty(b, sk, hk, d, dtype=dt, device=dev)
            v = torch.empty(b, sk, hk, dv, dtype=dt, device=dev)
            if extra:
                _fwd_direct(q, k, v, kw, extra)
            else:
                fa.flash_attn_func(q, k, v, **kw)
            return
        if call.batch_q:
            q = torch.empty(b, sq, hq, d, dtype=dt, device=dev)
        else:
            q = torch.empty(b * sq, hq, d, dtype=dt, device=dev)
            kw.update(cu_seqlens_q=i32(b + 1), max_seqlen_q=sq)
        if call.seqused_q:
            kw["seqused_q"] = i32(b)
        if call.has_seqused_k:
            kw["seqused_k"] = i32(b)
        if call.layout == "varlen":
            k = torch.empty(b * sk, hk, d, dtype=dt, device=dev)
            v = torch.empty(b * sk, hk, dv, dtype=dt, device=dev)
            kw.update(cu_seqlens_k=i32(b + 1), max_seqlen_k=sk)
        elif call.layout == "padded":
            k = torch.empty(b, sk, hk, d, dtype=dt, device=dev)
            v = torch.empty(b, sk, hk, dv, dtype=dt, device=dev)
        else:
            p = call.page_size
            npages = -(-sk // p)
            k = torch.empty(b * npages, p, hk, d, dtype=dt, device=dev)
            v = torch.empty(b * npages, p, hk, dv, dtype=dt, device=dev)
            kw.update(page_table=torch.empty(b, npages, dtype=torch.int32, device=dev))
            kw["max_seqlen_k"] = sk
        if extra:
            _fwd_direct(q, k, v, kw, extra)
        else:
            fa.flash_attn_varlen_func(q, k, v, **kw)


def _fwd_direct(q, k, v, kw: dict, extra: dict) -> None:
    """FA4 4.0.0b36 takes FP8 descales and `tile_mn` only through `interface._flash_attn_fwd`
    (its public flash_attn_func / flash_attn_varlen_func have no such arguments): the same
    call, spelled with that function's keyword names."""
    _, I = _fa4()
    kw = dict(kw)
    wl, wr = kw.pop("window_size", (None, None))
    I._flash_attn_fwd(q, k, v, window_size_left=wl, window_size_right=wr, **kw, **extra)


def trace(call: Call, compiles: list | None = None) -> dict[str, list[tuple[Any, Any]]]:
    """Compile what FA4 compiles for `call`; -> {cache name: [(key, compiled fn)]} of new entries.

    FA4's in-process caches are cleared first, so what lands there is exactly this call's set.
    compiles: a list that receives the (args, kwargs) of every cute.compile FA4 makes.
    """
    import cutlass.cute as cute

    caches = _caches()
    for c in caches.values():
        c.clear()
    real = cute.compile
    if compiles is not None:
        def spy(*a, **k):
            compiles.append((a, k))
            return real(*a, **k)

        cute.compile = spy
    try:
        fake_call(call)
    finally:
        cute.compile = real
    return {n: list(c.cache.items()) for n, c in caches.items()}


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
    t0 = time.perf_counter()
    compiles: list = []
    got = trace(call, compiles)
    fwd = got["fwd"]
    if len(fwd) != 1:
        raise RuntimeError(
            f"expected one forward kernel for {variant.describe()}, FA4 compiled {len(fwd)}"
        )
    chunk_modes = variant.split_kernel and variant.arch == "sm90"
    bounds, wides, tma_page = [], {}, None
    if chunk_modes:  # the chunk kernel: FA4's, reading q and KV lengths in chunk modes, and
        # each of its kernels a programmatic dependent launch (_pdl_secondary)
        fwd = [(fwd[0][0], trace_chunk_modes(compiles, pdl=True))]
        if not variant.paged:  # and a packed K's chunk bounds (its own ABI: part fwd_bounds)
            bounds = [(fwd[0][0], trace_chunk_modes(compiles, bounds=True, pdl=True))]
        # and the fold's kernels for a full chip (parts fwd_wide, fwd_wide1)
        wides = {w.part: w for w in C.wide_folds(variant.arch, variant.head_dim,
                                                 variant.head_dim_v, variant.tile_m,
                                                 variant.paged)}
        # and, for a dense K's long split steps, fwd_wide through the chunk modes
        # (fwd_wide_split; split.wide_split)
        wide_split = C.wide_split(variant.arch, variant.head_dim, variant.head_dim_v,
                                  variant.tile_m, variant.paged)
        if wide_split:
            wides[wide_split.part] = wide_split
        # and, paged on FA4's cp.async path, one on its TMA path for pages of one tile (fwd_tma)
        tma_page = C.tma_page(variant.arch, variant.tile_m, variant.paged, variant.paged_tma)
    seconds = time.perf_counter() - t0
    modelled = variant.mla is not None or variant.two_cta is not None
    if modelled and variant_from_fa4_key(fwd[0][0], variant.arch) != variant:
        # an MLA variant comes from a model of FA4's route (variants.mla_features), an hd256
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
    for name, wide in wides.items():
        helpers[name] = [(fwd[0][0], trace_wide_fold(compiles, wide, variant.paged, pdl=True))]
    if tma_page:
        helpers["fwd_tma"] = [(fwd[0][0], trace_tma_page(compiles, tma_page, pdl=True))]
    for name, entries in [("fwd", fwd), *helpers.items()]:
        for key, fn in entries:
            obj = outdir / f"{name}.o"
            fn.export_to_c(object_file_path=str(obj), function_name=f"fa4aot_{name}")
            # a kernel compiled for another SM links and publishes fine, and fails only on
            # the GPU ("no kernel image"), or loads another chip's tuning: refuse it here
            problem = cubin.target_problem(obj, C.cubin_target(variant.arch))
            if problem:
                raise RuntimeError(f"{variant.describe()}: {problem}")
            parts[name] = {"object": str(obj), **part_record(name, key, variant.arch)}
            if name in wides:  # its occupancy took effect: ptxas held the registers
                wide = wides[name]
                regs = cubin.register_counts(obj)
                cap = min(255, 65536 // (256 * wide.ctas_per_sm))
                if not regs or max(regs) > cap:
                    raise RuntimeError(f"{variant.describe()}: the wide fold kernel has {regs} "
                                       f"registers per thread, not at most {cap}")
                parts[name].update(tile_n=wide.tile_n, ctas_per_sm=wide.ctas_per_sm,
                                   registers=max(regs))
                if wide.chunk_modes:  # (trace_chunk_modes)
                    parts[name]["q_broadcast"] = True
    if chunk_modes:  # (trace_chunk_modes)
        for name in ("fwd", "fwd_bounds", *wides, "fwd_tma"):
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


# split.MAX_SLOTS partials per row: FA4 derives log_max_splits from the partials' count
COMBINE_LOG_MAX_SPLITS = 7


def trace_combine(variant: Variant) -> list[tuple[Any, Any]]:
    """Compile FA4's split-KV combine kernel (flash_fwd_combine.py) for `variant`'s split
    plans (split.py): partials in the variant's own dtype, as its chunk kernel writes them
    (no converting copy), an LSE output, up to 2**COMBINE_LOG_MAX_SPLITS partials.

    Compiled through FA4's `_compile_fwd_combine` with our tile_m, not through its entry
    point: FA4 picks tile_m = 8 for head dim 128, which with 2-byte partials leaves its O
    copy tile (256 threads x 16 bytes: 16 rows) twice the block's rows, and the H200 returned
    wrong outputs (rel. error 0.06-0.86, LSE right; 2026-11-30). With tile_m equal to the
    copy tile's rows (16 for head dims over 64, 32 up to 64) the error is the bf16 rounding's,
    1.6e-3, as with FA4's own float32 partials. The head count in FA4's key only sizes its
    varlen scheduler: the batched kernel reads it at run time, so one kernel serves every
    head count (the GPU tests run several)."""
    import cutlass

    _, I = _fa4()
    dv = variant.head_dim_v
    k_block = 64 if dv <= 64 else 128
    tile_m = 16 if k_block % 128 == 0 else 32  # rows of one 16-byte-per-thread O copy pass
    dt = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[variant.dtype]
    # FA4's key positions: arch, dtype, partial dtype, head dim, heads, tile_m, k block,
    # log2 max splits, cu_seqlens, seqused, lse, virtual batch, dynamic splits, semaphore
    key = (90, dt, dt, dv, 1, tile_m, k_block, COMBINE_LOG_MAX_SPLITS,
           False, False, True, False, False, False)
    return [(key, I._compile_fwd_combine(*key))]


def _sm90_forward(compiles: list) -> tuple[Any, list, dict]:
    """The one sm90 forward FA4 compiled (`compiles`, from trace): (its kernel object, the
    compile's other positional arguments, its keywords); RuntimeError for anything else."""
    from flash_attn.cute import flash_fwd_sm90 as F90

    if len(compiles) != 1 or not isinstance(compiles[0][0][0], F90.FlashAttentionForwardSm90):
        raise RuntimeError(
            f"expected FA4 to compile one sm90 forward, it made {len(compiles)} compiles"
        )
    (fa_fwd, *args), kwargs = compiles[0]
    return fa_fwd, args, kwargs


@contextlib.contextmanager
def _pdl_secondary(on: bool):
    """While FA4's sm90 forward compiles (on: else nothing): its launch becomes a programmatic
    dependent launch (the launch's programmatic stream serialization) and griddepcontrol.wait
    precedes the kernel's first statement (FA4 4.0.0b36's flash_fwd_sm90.py: warp_idx =
    cute.arch.make_warp_uniform(...)), which every thread runs before any other, so no thread
    reads global memory before the grids ahead of it in the stream have completed and their
    writes are visible. The GPU may then launch the kernel, and place its CTAs, while the
    previous kernel drains. Raises RuntimeError where the compile did not go through both
    (FA4's kernel changed)."""
    if not on:
        yield
        return
    import cutlass.cute as cute
    from cutlass.cutlass_dsl.cutlass import CutlassBaseDSL

    launch, uniform = CutlassBaseDSL.__dict__["cuda_launch_func"], cute.arch.make_warp_uniform
    fired: list[str] = []

    def pdl_launch(*a, **kw):
        fired.append("launch")
        return launch.__func__(*a, **{**kw, "use_pdl": True})

    def wait_first(*a, **kw):
        if "wait" not in fired:
            cute.arch.griddepcontrol_wait()
            fired.append("wait")
        return uniform(*a, **kw)

    CutlassBaseDSL.cuda_launch_func = staticmethod(pdl_launch)
    cute.arch.make_warp_uniform = wait_first
    try:
        yield
    finally:
        CutlassBaseDSL.cuda_launch_func = launch
        cute.arch.make_warp_uniform = uniform
    if sorted(fired) != ["launch", "wait"]:
        raise RuntimeError(f"FA4's sm90 forward did not compile as one kernel whose first "
                           f"statement is make_warp_uniform ({fired}): no PDL launch")


def trace_chunk_modes(compiles: list, bounds: bool = False, kernel: Any = None,
                      pdl: bool = False) -> Any:
    """FA4's sm90 forward, compiled again from the arguments FA4 compiled it with (`compiles`,
    from trace), with two of its inputs read through chunk modes; otherwise FA4's kernel:

    - q: its batch mode becomes ((n, b):(0, q's batch stride)), n = out's batch // q's batch,
      so virtual sequence i * n + j reads q row i (record: `q_broadcast`);
    - seqused_k, where the kernel is paged: virtual sequence v of u = out's batch // the
      lengths' count sees clamp(seqused_k[v // u] - (v % u) * c, 0, c) keys, c = the page
      table's columns * page size (record: `chunk_lengths`);
    - with `bounds` (a packed K; the artifact's part `fwd_bounds`, its own ABI, record `rows`:
      C.BOUNDS_FORM): cu_seqlens_k comes as (b + 1, R, c, K, A) with strides (s, 0, 0, 0, 0)
      (past cu itself only the shape is read): R query rows a sequence, c the chunk's keys, K
      the causal shift (row t sees all but max(K - 1 - t, 0) of its sequence's last keys: K = R
      for causal unrolled rows, 1 for non-causal ones, s_q for the rows of a speculative step
      packed as one), A the anchor (A > 1: the chunks start A - 1 keys before the sequence's
      end, the causal tail of a packed step; 1: at its start). Virtual sequence v is chunk
      j = v % u of decode row r = v // u, row t = r % R of sequence i = r // R (u = out's
      batch // (b * R)); with L = cu[i + 1] - cu[i] and base = cu[i] + (A > 1) * max(L - A +
      1, 0), it starts at min(base + j * c, cu[i + 1]) and holds clamp(L - max(K - 1 - t, 0)
      - (base - cu[i]) - j * c, 0, c) keys (FA4 reads them as cu_seqlens_k[v] and
      seqused_k[v]): every row's chunk bounds with no metadata launch, including a speculative
      step's rows over a packed K, whose key ranges overlap, which cu_seqlens_k ranges alone
      cannot express.

    pdl: launched as a programmatic dependent launch, waiting first (_pdl_secondary).

    Why: a split step runs the chunks of sequence i as virtual sequences i * n .. i * n + n - 1
    of one kernel, and FA4 indexes q, O and the KV lengths by the same batch index, so the
    step first copied q over the chunks and wrote each chunk's length with a metadata kernel
    (two launches; at one decode row q went through a stride-0 mode). With the chunk modes it
    passes the caller's q and seqused_k as they are. Called in FA4's own form (q's, out's and
    the lengths' batches equal: u = n = 1, and c spans the page table), it is FA4's kernel
    exactly. The same compile key as FA4's. H200, 2026-12-01 (CUDA graph, 32:8 hd128, the
    chunk kernel with the q copy against it alone): b4/4K in 4 chunks 22.3 -> 18.7 us, b2/1K
    in 8 6.6 -> 4.7, b4/32K 126.2 -> 122.7; outputs and LSE bit-identical."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import flash_fwd as F80
    from flash_attn.cute import flash_fwd_sm90 as F90
    from flash_attn.cute.seqlen_info import SeqlenInfoQK

    fa_fwd, args, kwargs = _sm90_forward(compiles)
    if kernel is not None:  # another forward of FA4's ABI, compiled from the same arguments
        fa_fwd = kernel
    if len(args) != 19:
        raise RuntimeError(f"FA4's sm90 forward took {len(args)} arguments, fa4aot knows 19")
    assume, create = F90.assume_tensor_aligned, SeqlenInfoQK.create
    names = ("mCuSeqlensQ", "mCuSeqlensK", "mSeqUsedQ", "mSeqUsedK")
    missing = set(names) - set(inspect.signature(create).parameters)
    if missing:
        raise RuntimeError(f"FA4's SeqlenInfoQK.create has no {sorted(missing)}: fa4aot's "
                           "chunk-length mode reads seqused_k through it")
    paged = args[9] is not None and args[10] is not None  # seqused_k and a page table
    applied = []  # chunk-mode reads traced: a kernel that made none must not ship
    if bounds:
        if args[7] is None or paged:
            raise RuntimeError("the chunk-bounds mode is for a packed K's kernel")
        args = list(args)
        args[7] = cute.runtime.make_fake_tensor(  # cu_seqlens_k as (b + 1, R, c, K, A)
            cutlass.Int32, tuple(cute.sym_int() for _ in range(5)),
            stride=(cute.sym_int64(divisibility=1), 0, 0, 0, 0), assumed_align=4,
        )

    class ChunkModes:
        def __init__(self, inner):
            self.inner = inner

        # (no annotations: see _merge_class)
        @cute.jit
        def __call__(self, mQ, mK, mV, mO, mLSE, scale, cu_q, cu_k, used_q, used_k, pages,
                     wl, wr, sink, sparse, aux, cu_m, cu_sm, stream):  # FA4's sm90 order
            mQ = assume(mQ)  # (FA4's own first step, on the flat q)
            b = mQ.shape[0]
            n = mO.shape[0] // b  # out's batch: the virtual sequences
            layout = cute.make_layout(
                ((n, b), mQ.shape[1], mQ.shape[2], mQ.shape[3]),
                stride=((0, mQ.stride[0]), mQ.stride[1], mQ.stride[2], mQ.stride[3]),
            )
            if cutlass.const_expr(pages is not None and used_k is not None):
                bu = used_k.shape[0]
                used_k = cute.make_tensor(used_k.iterator, cute.make_layout(
                    ((mO.shape[0] // bu, bu), pages.shape[1] * mK.shape[1]),
                    stride=((0, used_k.stride[0]), 0),
                ))
            if cutlass.const_expr(cu_k is not None and cute.rank(cu_k) == 5):
                b1, rows = cu_k.shape[0], cu_k.shape[1]
                cu_k = cute.make_tensor(cu_k.iterator, cute.make_layout(
                    ((mO.shape[0] // ((b1 - 1) * rows), rows, b1), cu_k.shape[2],
                     cu_k.shape[3], cu_k.shape[4]),
                    stride=((0, 0, cu_k.stride[0]), 0, 0, 0),
                ))
            self.inner(cute.make_tensor(mQ.iterator, layout), mK, mV, mO, mLSE, scale, cu_q,
                       cu_k, used_q, used_k, pages, wl, wr, sink, sparse, aux, cu_m, cu_sm,
                       stream)

    class ChunkLengths:
        """What FA4's SeqlenInfoQK.create reads as seqused_k[v]: chunk v % u's keys."""

        def __init__(self, t):
            self.t = t

        def __getitem__(self, v):
            u, c = self.t.shape[0][0], self.t.shape[1]
            return cutlass.min(cutlass.max(self.t[v, 0] - (v % u) * c, 0), c)

    class RowChunks:
        """What FA4's SeqlenInfoQK.create reads as cu_seqlens_k[v] (`lengths` False: chunk
        v % u's first key) and as seqused_k[v] (True: its keys) in the bounds mode; t: cu as
        ((u, R, b + 1), c, K, A)."""

        def __init__(self, t, lengths):
            self.t, self.lengths = t, lengths

        def __getitem__(self, v):
            t = self.t
            u, rows, last = t.shape[0][0], t.shape[0][1], t.shape[0][2] - 1
            c, shift, anchor = t.shape[1], t.shape[2], t.shape[3]
            r = v // u  # the decode row; its sequence i, its row tt of the sequence's rows
            i = r // rows
            j = v - r * u
            start = t[i * rows * u, 0, 0, 0]
            nxt = t[cutlass.min(i + 1, last) * rows * u, 0, 0, 0]
            # the anchor: a causal tail's chunks start anchor - 1 keys before the end
            skip = cutlass.min(anchor - 1, 1) * cutlass.max(nxt - start - anchor + 1, 0)
            if cutlass.const_expr(not self.lengths):
                return cutlass.min(start + skip + j * c, nxt)
            back = cutlass.max(shift - 1 - (r - i * rows), 0)  # causal: row tt's keys
            return cutlass.min(cutlass.max(nxt - start - back - skip - j * c, 0), c)

    def assume_flat(t, **kw):  # FA4's alignment step takes flat strides: q's are done above
        if t is not None and any(isinstance(x, tuple) for x in t.stride):
            return t
        return assume(t, **kw)

    def create_chunked(*a, mCuSeqlensK=None, mSeqUsedK=None, **kw):
        if mSeqUsedK is not None and cute.rank(mSeqUsedK) == 2:  # the chunk-length mode
            mSeqUsedK = ChunkLengths(mSeqUsedK)
            applied.append(True)
        if mCuSeqlensK is not None and cute.rank(mCuSeqlensK) == 4:  # the chunk-bounds mode
            if mSeqUsedK is not None:
                raise RuntimeError("the chunk-bounds mode is for a packed K without seqused_k")
            mCuSeqlensK, mSeqUsedK = RowChunks(mCuSeqlensK, False), RowChunks(mCuSeqlensK, True)
            applied.append(True)
        return create(*a, mCuSeqlensK=mCuSeqlensK, mSeqUsedK=mSeqUsedK, **kw)

    F90.assume_tensor_aligned = F80.assume_tensor_aligned = assume_flat
    SeqlenInfoQK.create = staticmethod(create_chunked)
    try:
        with _pdl_secondary(pdl):
            fn = cute.compile(ChunkModes(fa_fwd), *args, **kwargs)
    finally:
        F90.assume_tensor_aligned = F80.assume_tensor_aligned = assume
        SeqlenInfoQK.create = staticmethod(create)
    if (paged or bounds) and not applied:
        # the runtime passes each sequence's length (or bounds), one per q row: a kernel
        # reading them per virtual sequence would read past them
        raise RuntimeError(
            f"FA4's {'paged' if paged else 'packed-K'} sm90 forward did not read "
            f"{'seqused_k' if paged else 'cu_seqlens_k'} through SeqlenInfoQK.create: the "
            "chunk mode cannot apply"
        )
    return fn


def trace_wide_fold(compiles: list, wide: "C.WideFold", paged: bool, pdl: bool = False) -> Any:
    """A decode fold's kernel for a chip full of CTAs (constraints.WideFold; a split chunk
    kernel's part `wide.part`, FA4's forward ABI): FA4's sm90 forward compiled again from the
    arguments FA4 compiled the chunk kernel with (`compiles`, from trace; its 64-row M tile),
    with N tiles of wide.tile_n keys (FA4's pipeline, two stages; for a paged K, FA4's non-TMA
    path, which takes any page size, as its TMA path takes only pages of one tile) and launched
    wide.ctas_per_sm CTAs per SM: the launch's minimum CTAs per SM (ptxas then holds each
    thread to 65536 / (threads * ctas_per_sm) registers at launch), a full shared-memory
    carveout, and the two warpgroups' setmaxnreg split rebalanced to fit (FA4's 256 / 56 for
    one MMA warpgroup assume one CTA per SM). FA4 4.0.0b36 takes neither through its
    interface (its launch spells min_blocks_per_mp=1; the register split is a table in
    __call__): the compile sets them for this kernel only. Values as FA4's kernel, but keys
    reduced in other blocks: not bit-identical to it (H200: max difference 9.8e-4 at 1K keys,
    error to an fp32 reference the same). wide.chunk_modes: compiled through the split's chunk
    modes (trace_chunk_modes), the chunk kernel's ABI: part `fwd_wide_split`
    (constraints.wide_split), which runs a split step's chunks. pdl: _pdl_secondary's launch."""
    import copy
    import dataclasses

    import cutlass.cute as cute
    from cutlass.cutlass_dsl.cutlass import CutlassBaseDSL

    fa_fwd, args, kwargs = _sm90_forward(compiles)
    if fa_fwd.tile_m != 64:
        raise RuntimeError(f"the wide fold builds on the 64-row chunk kernel, FA4 compiled "
                           f"tile_m={fa_fwd.tile_m}")

    class Wide(type(fa_fwd)):
        # FA4's __call__ assigns its register table's split: these hold the rebalanced one
        num_mma_regs = property(lambda self: wide.mma_regs, lambda self, v: None)
        num_producer_regs = property(lambda self: wide.producer_regs, lambda self, v: None)

    w = copy.copy(fa_fwd)
    w.__class__ = Wide
    w.tile_n = wide.tile_n
    if paged:  # FA4's TMA paged path takes pages of exactly one tile (64 keys here); the
        w.use_tma_KV = False  # artifact serves pages of 128 (or of every other size): cp.async
    launches = []
    attrs = CutlassBaseDSL._generate_kernel_attrs

    def occupancy(self, config):
        launches.append(config.min_blocks_per_mp)
        return attrs(self, dataclasses.replace(
            config, min_blocks_per_mp=wide.ctas_per_sm, preferred_smem_carveout=100))

    CutlassBaseDSL._generate_kernel_attrs = occupancy
    try:
        if wide.chunk_modes:
            fn = trace_chunk_modes(compiles, kernel=w, pdl=pdl)
        else:
            with _pdl_secondary(pdl):
                fn = cute.compile(w, *args, **kwargs)
    finally:
        CutlassBaseDSL._generate_kernel_attrs = attrs
    threads = getattr(w, "num_threads", None)
    regs = 128 * (wide.mma_regs + wide.producer_regs)  # two warpgroups: MMA and producer
    if launches != [1] or threads != 256 or regs > 65536 // wide.ctas_per_sm:
        # one kernel, which FA4 launched one CTA per SM, of two warpgroups whose split fits
        raise RuntimeError(
            f"FA4's sm90 forward no longer launches as the wide fold assumes (launch minimums "
            f"{launches}, {threads} threads)"
        )
    return fn


def trace_tma_page(compiles: list, page_size: int, pdl: bool = False) -> Any:
    """A paged split chunk kernel's part `fwd_tma` (constraints.tma_page; the chunk kernel's
    ABI and chunk modes, trace_chunk_modes): FA4's sm90 forward compiled again from the
    arguments FA4 compiled the paged chunk kernel with (`compiles`, from trace: its cp.async
    path, which takes any page size) with N tiles of `page_size` keys on FA4's TMA paged path,
    which reads one page per tile and so serves pages of exactly `page_size` keys (a kernel on
    it gets any other size wrong with no error: design.md). FA4 4.0.0b36 takes TMA only where
    the page size equals its tile_n, 128 at hd128 (its `paged_kv_non_tma`): the compile sets
    the tile for this kernel only. pdl: _pdl_secondary's launch."""
    import copy

    fa_fwd, _, _ = _sm90_forward(compiles)
    if getattr(fa_fwd, "use_tma_KV", True) or fa_fwd.tile_m != 64:
        raise RuntimeError(
            "the TMA page kernel builds on the 64-row chunk kernel of FA4's cp.async paged path, "
            f"FA4 compiled tile_m={fa_fwd.tile_m}, use_tma_KV={getattr(fa_fwd, 'use_tma_KV', None)}"
        )
    w = copy.copy(fa_fwd)
    w.tile_n, w.use_tma_KV = page_size, True
    return trace_chunk_modes(compiles, kernel=w, pdl=pdl)


# fa4aot's merge kernel: its key is (name, version, dtype, head dim v, max splits, threads);
# bump the version (C.MERGE_VERSION, which build.superseded reads) when its code changes
MERGE_KEY = ("fa4aot_merge", C.MERGE_VERSION)
_MERGE_CLASS = None


def trace_merge(variant: Variant, pdl: bool = True) -> list[tuple[Any, Any]]:
    """Compile fa4aot's split-KV merge for `variant`'s split plans, or [] where it has no
    thread layout for the head dim (C.merge_threads: FA4's combine then). The runtime calls it
    as `merge(out_partial, lse_partial, out, lse)` with FA4's combine's shapes: partials
    (chunk, batch, seqlen, heads, dv) in the variant's dtype and (chunk, batch, seqlen, heads)
    float32, out (batch, seqlen, heads, dv), lse (batch, seqlen, heads) float32; any strides
    but a contiguous dv, 16-byte aligned rows.

    Why not FA4's combine: it runs one CTA per 16 rows (a row: one query row and head) and
    walks that tile's chunks serially, so one decode row of 8 heads over 128 chunks (b1/128K at
    8:1) is one CTA reading 256 KB in 128 dependent steps, 10.9 us on the H200. This kernel
    runs one CTA per row and spreads the chunks over thread groups, each thread loading 16
    bytes per chunk (H200, 2026-12-01, in the split step, CUDA graph: b1/128K 8:1 31.1 ->
    24.2 us, b1/32K 8:1 17.7 -> 10.7, b1/8K 32:8 11.5 -> 10.7; the same within noise at 2-8
    chunks; errors against the fp32 reference unchanged, outputs within bf16 rounding of FA4's
    combine). Merging follows FA4's combine: lse = log(sum_s exp(lse_s)) (-inf when every
    chunk is empty, the row's output then 0), and a chunk of scale 0 is skipped, so an empty
    chunk's unwritten partial is never read into the sum.

    pdl (the shipped form since C.MERGE_VERSION 2): launched as a programmatic dependent launch
    (the launch's programmatic stream serialization), so the GPU launches it as the chunk
    kernel's CTAs exit rather than after the grid completes, and it waits in
    griddepcontrol.wait, which returns once the chunk kernel's grid has completed and its
    writes are visible, before it reads a partial. H200, 2026-12-02 (benchmarks/pdl_probe.py,
    one process, outputs bit-identical): eager 1.1-1.5 us less per split step at b1-b16 (b1/8K
    21.3 -> 20.1 us, b2/64K 136.1 -> 134.7, b16/64K 946.5 -> 943.8), CUDA graphs the same
    within the run's spread. A chunk kernel that also triggered its dependents
    (griddepcontrol.launch_dependents) at each CTA's first tile gained less (s17-a/b): not
    shipped."""
    dv = variant.head_dim_v
    max_splits = 1 << COMBINE_LOG_MAX_SPLITS
    threads = C.merge_threads(dv, max_splits)
    if threads is None:
        return []
    import cutlass
    import cutlass.cute as cute
    from quack.compile_utils import make_fake_tensor

    dt = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[variant.dtype]
    key = (*MERGE_KEY, variant.dtype, dv, max_splits, threads)
    sym = cute.sym_int
    ns, batch, seqlen, nh = sym(), sym(), sym(), sym()
    div = 128 // dt.width  # 16-byte aligned rows
    f32 = cutlass.Float32
    args = (
        make_fake_tensor(dt, (ns, batch, seqlen, nh, dv), divisibility=div),
        make_fake_tensor(f32, (ns, batch, seqlen, nh), divisibility=1, leading_dim=None),
        make_fake_tensor(dt, (batch, seqlen, nh, dv), divisibility=div),
        make_fake_tensor(f32, (batch, seqlen, nh), divisibility=1, leading_dim=None),
    )
    kernel = _merge_class()(dt, dv, max_splits, threads, pdl)
    fn = cute.compile(
        kernel, *args, cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        options="--enable-tvm-ffi",
    )
    return [(key, fn)]


def _merge_class():
    """The merge kernel's class, defined on first use (cutlass is imported only here)."""
    global _MERGE_CLASS
    if _MERGE_CLASS is not None:
        return _MERGE_CLASS
    import math

    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32

    log2_e = math.log2(math.e)
    vec = 8  # columns per thread: one 16-byte load of 2-byte partials

    class SplitMerge:
        def __init__(self, dtype, dv: int, max_splits: int, threads: int, pdl: bool):
            self.dtype, self.dv, self.max_splits, self.threads = dtype, dv, max_splits, threads
            self.pdl = pdl
            self.lanes = dv // vec
            self.groups = threads // self.lanes
            self.warps = threads // 32

        def smem_bytes(self) -> int:
            return 4 * (self.max_splits + 2 * self.warps + self.dv * self.groups) + 64

        @cute.jit
        # (no annotations: under `from __future__ import annotations` the DSL would evaluate
        # "cute.Tensor" in this module's globals, where cute is not imported)
        def __call__(self, mOp, mLp, mO, mLSE, stream):
            self.kernel(mOp, mLp, mO, mLSE).launch(
                grid=[mO.shape[2], mO.shape[1], mO.shape[0]], block=[self.threads, 1, 1],
                smem=self.smem_bytes(), stream=stream, use_pdl=self.pdl,
            )

        @cute.jit
        def block_reduce(self, x, sbuf, tidx, is_max: cutlass.Constexpr):
            """The max (is_max) or the sum of x over the CTA's threads: each warp's, through
            shared memory (sbuf: one slot per warp), combined in warp order by every thread."""
            warp, lane = tidx // 32, tidx % 32
            if cutlass.const_expr(is_max):
                w = cute.arch.warp_reduction_max(x)
            else:
                w = cute.arch.warp_reduction_sum(x)
            if lane == 0:
                sbuf[warp] = w
            cute.arch.sync_threads()
            r = sbuf[0]
            for i in cutlass.range_constexpr(1, self.warps):
                if cutlass.const_expr(is_max):
                    r = cute.arch.fmax(r, sbuf[i])
                else:
                    r = r + sbuf[i]
            return r

        @cute.kernel
        def kernel(self, mOp, mLp, mO, mLSE):
            if cutlass.const_expr(self.pdl):  # launched early: wait for the chunks' grid
                cute.arch.griddepcontrol_wait()
            tidx, _, _ = cute.arch.thread_idx()
            h, m, b = cute.arch.block_idx()  # one CTA per (head, query row, batch)
            n = mOp.shape[0]
            smem = cutlass.memory.SmemAllocator()
            sScale = smem.allocate_tensor(Float32, cute.make_layout(self.max_splits),
                                          byte_alignment=16)
            sMax = smem.allocate_tensor(Float32, cute.make_layout(self.warps), byte_alignment=16)
            sSum = smem.allocate_tensor(Float32, cute.make_layout(self.warps), byte_alignment=16)
            sAcc = smem.allocate_tensor(Float32, cute.make_layout((self.dv, self.groups)),
                                        byte_alignment=16)
            # 1. the row's LSE over its chunks, each chunk's scale exp(lse_s - lse)
            lse = -Float32.inf
            if tidx < n:
                lse = mLp[tidx, b, m, h]
            mx = self.block_reduce(lse, sMax, tidx, True)
            mx_cur = 0.0 if mx == -Float32.inf else mx  # every chunk empty
            e = cute.math.exp2(lse * log2_e - mx_cur * log2_e, fastmath=True)
            tot = self.block_reduce(e, sSum, tidx, False)
            inv = 0.0 if (tot == 0.0 or tot != tot) else 1.0 / tot
            if tidx < n:
                sScale[tidx] = e * inv
            if tidx == 0:
                mLSE[b, m, h] = cute.math.log(tot, fastmath=True) + mx
            cute.arch.sync_threads()
            # 2. thread (group g, lane l): columns [8l, 8l + 8) of chunks g, g + groups, ...
            lane_c = tidx % self.lanes
            g = tidx // self.lanes
            acc = cute.make_rmem_tensor((vec,), Float32)
            acc.fill(0.0)
            frag = cute.make_rmem_tensor((vec,), self.dtype)
            for s in cutlass.range(g, n, self.groups, unroll=4):
                sc = sScale[s]
                cute.autovec_copy(cute.local_tile(mOp[s, b, m, h, None], (vec,), (lane_c,)), frag)
                if sc > 0.0:  # (an empty chunk's partial is not read into the sum)
                    acc.store(acc.load() + sc * frag.load().to(Float32))
            for i in cutlass.range_constexpr(vec):
                sAcc[lane_c * vec + i, g] = acc[i]
            cute.arch.sync_threads()
            # 3. the groups' sums, a column per thread (dv may exceed the threads)
            for c in cutlass.range(tidx, self.dv, self.threads):
                o = sAcc[c, 0]
                for j in cutlass.range_constexpr(1, self.groups):
                    o = o + sAcc[c, j]
                mO[b, m, h, c] = o.to(self.dtype)

    _MERGE_CLASS = SplitMerge
    return SplitMerge


# fa4aot's chunk metadata kernel: (name, version, form); bump the version when its code changes
CHUNK_META_KEY = ("fa4aot_chunk_meta", 1)
_CHUNK_META_CLASS = None


def trace_chunk_meta(variant: Variant) -> list[tuple[Any, Any]]:
    """Compile the split step's chunk metadata kernel for `variant` (a split chunk kernel):
    one launch where the step ran two element-wise torch kernels. The runtime calls it as
    `chunk_meta(src, dst, chunk, slots, rows, causal)` (int32 tensors, then four int32s):

    - form "lengths" (paged K): src the caller's seqused_k (b,), dst (b, rows * slots): the
      keys each (query row, chunk) sees, clamp(len - j * chunk - back, 0, chunk), back =
      rows - 1 - row for a causal step of several rows (row r sees len - rows + 1 + r keys),
      else 0;
    - form "bounds" (packed K): src the caller's cu_seqlens_k (b + 1,), dst (b + 1, slots):
      chunk j of sequence i starts at min(cu[i] + j * chunk, cu[i + 1]); the last row holds
      cu[b] + j * chunk (its first entry ends the last chunk; rows and causal unused).

    The H200's split decode at one row (2026-12-01, paged b1/8K 32:8, page 128: 1.18x the dense
    step's graph time, whose metadata is a constant) spent its difference on those launches."""
    import cutlass
    import cutlass.cute as cute
    from quack.compile_utils import make_fake_tensor

    form = "lengths" if variant.paged else "bounds"
    sym = cute.sym_int
    i32 = cutlass.Int32
    b, m = sym(), sym()
    src = make_fake_tensor(i32, (b,), divisibility=1, leading_dim=None)  # (any stride)
    dst = make_fake_tensor(i32, (b if variant.paged else sym(), m), divisibility=1,
                           leading_dim=None)
    fn = cute.compile(
        _chunk_meta_class()(variant.paged), src, dst, i32(0), i32(0), i32(0), i32(0),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi",
    )
    return [((*CHUNK_META_KEY, form), fn)]


def _chunk_meta_class():
    """The chunk metadata kernel's class, defined on first use (cutlass is imported only here)."""
    global _CHUNK_META_CLASS
    if _CHUNK_META_CLASS is not None:
        return _CHUNK_META_CLASS
    import cutlass
    import cutlass.cute as cute

    class ChunkMeta:
        threads = 128

        def __init__(self, lengths: bool):
            self.lengths = lengths

        # (no annotations: see _merge_class)
        @cute.jit
        def __call__(self, mSrc, mDst, chunk, slots, rows, causal, stream):
            total = mDst.shape[0] * mDst.shape[1]
            self.kernel(mSrc, mDst, chunk, slots, rows, causal).launch(
                grid=[cute.ceil_div(total, self.threads), 1, 1], block=[self.threads, 1, 1],
                stream=stream,
            )

        @cute.kernel
        def kernel(self, mSrc, mDst, chunk, slots, rows, causal):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            idx = bidx * self.threads + tidx
            m = mDst.shape[1]
            if idx < mDst.shape[0] * m:
                i = idx // m
                t = idx - i * m
                if cutlass.const_expr(self.lengths):
                    r = t // slots
                    off = (t - r * slots) * chunk
                    if causal != 0:
                        off = off + rows - 1 - r
                    mDst[i, t] = cutlass.max(cutlass.min(mSrc[i] - off, chunk), 0)
                else:
                    v = mSrc[i] + t * chunk
                    if i < mDst.shape[0] - 1:
                        v = cutlass.min(v, mSrc[i + 1])
                    mDst[i, t] = v

    _CHUNK_META_CLASS = ChunkMeta
    return ChunkMeta


# fa4aot's packed-rows metadata kernel: (name, version); bump the version when its code changes
PACKED_META_KEY = ("fa4aot_packed_meta", 1)
_PACKED_META_CLASS = None


def trace_packed_meta(variant: Variant) -> list[tuple[Any, Any]]:
    """Compile the metadata kernel of a speculative step with its rows packed
    (split.plan_packed, runtime/splitkv.PackedRun) for `variant`, a paged split chunk kernel:
    one launch where the step ran ten element-wise torch kernels (H200, 2026-12-02, b1/64K s_q
    4 32:8 in a CUDA graph: 101.4 us over pages against 82.2 over the dense K, whose metadata is
    a constant). The runtime calls it as `packed_meta(used, table, used_a, tail_table,
    tail_len, rows, page_size)` (int32 tensors, any strides, then two int32s): for sequence i
    of length used[i] and row t < rows, x = used[i] - rows + 1 (the keys row 0 sees) and T =
    floor(max(x, 0) / page_size) * page_size:

    - used_a[i] = T: the keys every row sees, up to a page boundary (the chunks' part);
    - tail_table[i * rows + t] = table[i, T / page_size + (0, 1)], each clamped to the table's
      last column (a second page past it is never read);
    - tail_len[i * rows + t] = max(x + t - T, 0): the tail keys row t sees."""
    import cutlass
    import cutlass.cute as cute
    from quack.compile_utils import make_fake_tensor

    if not variant.paged:
        raise RuntimeError("the packed-rows metadata kernel is for a paged K's split kernel")
    sym = cute.sym_int
    i32 = cutlass.Int32
    b, m = sym(), sym()

    def t(*shape):
        return make_fake_tensor(i32, shape, divisibility=1, leading_dim=None)  # (any stride)

    fn = cute.compile(
        _packed_meta_class()(), t(b), t(b, sym()), t(b), t(m, 2), t(m), i32(0), i32(0),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi",
    )
    return [(PACKED_META_KEY, fn)]


def _packed_meta_class():
    """The packed-rows metadata kernel's class, defined on first use (cutlass is imported only
    here)."""
    global _PACKED_META_CLASS
    if _PACKED_META_CLASS is not None:
        return _PACKED_META_CLASS
    import cutlass
    import cutlass.cute as cute

    class PackedMeta:
        threads = 128

        # (no annotations: see _merge_class)
        @cute.jit
        def __call__(self, mUsed, mTable, mUsedA, mTT, mTL, rows, page, stream):
            self.kernel(mUsed, mTable, mUsedA, mTT, mTL, rows, page).launch(
                grid=[cute.ceil_div(mTL.shape[0], self.threads), 1, 1],
                block=[self.threads, 1, 1], stream=stream,
            )

        @cute.kernel
        def kernel(self, mUsed, mTable, mUsedA, mTT, mTL, rows, page):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            idx = bidx * self.threads + tidx
            if idx < mTL.shape[0]:
                i = idx // rows
                t = idx - i * rows
                x = mUsed[i] - (rows - 1)
                pg = cutlass.max(x, 0) // page
                tu = pg * page
                if t == 0:
                    mUsedA[i] = tu
                last = mTable.shape[1] - 1
                mTT[idx, 0] = mTable[i, cutlass.min(pg, last)]
                mTT[idx, 1] = mTable[i, cutlass.min(pg + 1, last)]
                mTL[idx] = cutlass.max(x + t - tu, 0)

    _PACKED_META_CLASS = PackedMeta
    return PackedMeta


def runtime_library_dirs() -> list[str]:
    """Directories of libcute_dsl_runtime.so and libtvm_ffi.so, for linking."""
    import tvm_ffi

    from . import runtime_lib

    return [
        str(Path(runtime_lib.find_runtime_lib()).parent),
        str(Path(tvm_ffi.__file__).parent / "lib"),
    ]


def jit_flash_attn_func(*args, **kwargs):
    """FA4's own JIT path (FA4AOT_ON_MISS=jit). Imports the compiler: seconds, first time."""
    fa, _ = _fa4()
    return fa.flash_attn_func(*args, **kwargs)


def jit_flash_attn_varlen_func(*args, **kwargs):
    fa, _ = _fa4()
    return fa.flash_attn_varlen_func(*args, **kwargs)


# -- drop-in for flash_attn.cute users -----------------------------------------------------------


class CompileAttempt(RuntimeError):
    """Raised by the compile monitor when FA4 tries to compile after install(on_miss="error")."""


class _Counters:
    def __init__(self):
        self.hits = 0
        self.compiles = 0
        self.misses: list[str] = []


class _StoreCache:
    """Stands in for one of FA4's JITCache objects: a key FA4 asks for is looked up (by its
    rendering, `key_repr`) among the store's records and loaded with tvm-ffi; FA4 then calls
    the loaded function with exactly the arguments it would pass its own compiled one."""

    def __init__(self, name: str, state: "_Installed"):
        self.name, self.state = name, state
        self.cache: dict = {}

    def __contains__(self, key) -> bool:
        pending = self.state.pending_helper
        if self.name in ("fwd", "tile_cumsum"):  # a forward call's first and last lookups
            self.state.pending_helper = None
        refuse = self.name == "fwd" and pending
        cached = self.cache.get(key)
        if cached is not None and cached is not _refused_helper and not refuse:
            return True
        hit = self.state.index.get((self.name, key_repr(key)))
        if hit is None and self.name == "combine":
            hit = self.state.combine_for(key)
        if hit is not None and not refuse:
            self.cache[key] = self.state.load(hit)
            self.state.counters.hits += 1
            return True
        if self.name in SHIPPED_HELPERS and self.state.on_miss == "error":
            # FA4 runs its batch > 256 helpers before it looks up the forward kernel: raising
            # here logged nothing (a helper key does not name a variant), so --from-misses
            # could not build what was missing (issue 13). A helper is shipped with every
            # forward that needs it, so its miss means the forward misses too: let FA4 go on
            # to the forward's key with a no-op helper, and refuse there, logging the variant.
            # The forward is refused even if found, so the no-op's output is never read.
            self.state.counters.misses.append(f"{self.name}: {key_repr(key)}")
            self.state.pending_helper = self.state.pending_helper or f"{self.name} {key_repr(key)}"
            self.cache[key] = _refused_helper
            return True
        self.state.miss(self.name, key, pending)
        return False

    def __getitem__(self, key):
        return self.cache[key]

    def __setitem__(self, key, fn) -> None:  # FA4 compiled it (on_miss warn/jit)
        self.cache[key] = fn

    def clear(self) -> None:
        self.cache.clear()


def _refused_helper(*args, **kwargs) -> None:
    """Stands in for a missing helper kernel until the forward lookup refuses the call."""


_CACHE_OWNERS = {  # FA4 function whose .compile_cache fa4aot serves -> record part name
    "_flash_attn_fwd": "fwd",
    "_compute_tile_cumsum": "tile_cumsum",
    "_compute_blocks_to_batch": "blocks_to_batch",
    "_flash_attn_fwd_combine": "combine",
}


_CUTE_DTYPES = {
    "BFloat16": "bfloat16", "Float16": "float16", "Float32": "float32",
    "Float8E4M3FN": "float8_e4m3fn", "Float8E5M2": "float8_e5m2",
}


def variant_from_fa4_key(key, arch: str) -> Variant | None:
    """FA4 (4.0.0b36) forward compile key -> our Variant, for the miss log of install().

    Positions follow `_flash_attn_fwd`'s compile_key tuple (one tuple for every arch);
    `tests/test_dropin.py` checks the mapping against every default sm90 variant's traced key,
    `tests/test_sm100_build.py` against the Blackwell FP8 and native split-KV variants,
    `tests/test_mla_build.py` against the MLA ones. None for keys outside what fa4aot models
    (MLA keys other than _mla_variant_from_key's, score/mask mods other than a softcap FA4 made
    in this process, block sparsity, broadcast (stride-0) descales, split-KV on sm90)."""
    try:
        if key[57]:  # qv: absorbed MLA
            return _mla_variant_from_key(key, arch)
        if key[0] or key[1] or key[10] or key[11]:
            return None
        split = bool(key[34])
        if split and (not C.is_blackwell(arch) or key[45] or any(key[48:51])):
            return None  # sm90 has none; packed-q splits take FA4's scheduler metadata
        descales = "".join(t for t, on in zip("qkv", key[25:28]) if on) or None
        if descales and any(p is not None and any(p) for p in key[13][5:8]):
            return None  # a stride-0 descale compiles its own kernel; fa4aot never makes one
        softcap = None
        if key[9]:
            softcap = SOFTCAP_BY_HASH.get(key[9])
            if softcap is None:  # a user score_mod, or a softcap made before install
                return None
        ratio = int(key[6])
        causal = bool(key[8])
        has_wl, has_wr = bool(key[22]), bool(key[23])
        local = not causal and (has_wl or has_wr)
        tile_m = None
        if arch == "sm90":  # an M tile other than FA4's default: asked for (`tile_mn`)
            dflt = C.fwd_tile(arch, int(key[4]), int(key[5]), causal, local)
            tile_m = None if int(key[30]) == dflt.m else int(key[30])
        sink = key[24]
        paged = bool(key[21])
        return Variant(
            arch=arch,
            dtype=_CUTE_DTYPES[key[3].__name__],
            head_dim=int(key[4]),
            head_dim_v=int(key[5]),
            qhead_per_kvhead=int(key[6]),
            causal=causal,
            local=local,
            has_window_left=has_wl,
            has_window_right=has_wr,
            return_lse=not key[16],
            sink_dtype=None if sink is None else _CUTE_DTYPES[sink.__name__],
            cu_seqlens_q=not key[17],
            cu_seqlens_k=not key[18],
            seqused_q=not key[19],
            seqused_k=not key[20],
            paged=paged,
            paged_tma=bool(key[37]) if paged else None,
            cu_hint=bool(key[51]),
            # a split kernel is never persistent: the field holds q_stage == 1 (Variant.split_kv)
            static_persistent=int(key[32]) == 1 if split else bool(key[55]),
            softcap=softcap,
            pack_gqa=None if bool(key[35]) == (ratio > 1) else bool(key[35]),
            descales=descales,
            split_kv=split,
            s_ping_pong=bool(key[44]) if split else None,
            tile_m=tile_m,
            # use_2cta_instrs, which only hd256 on Blackwell chooses by the batch (Variant.two_cta)
            two_cta=(bool(key[38]) if C.is_blackwell(arch) and not split
                     and int(key[4]) == int(key[5]) == 256 else None),
        )
    except (IndexError, KeyError, AttributeError, TypeError):
        return None


def _mla_variant_from_key(key, arch: str) -> Variant | None:
    """variant_from_fa4_key for FA4's MLA keys (key[57]: qv): the kernels variants.mla_features
    models (rope + latent q, one latent KV head, no FP8, split, sparsity, window, sink or
    score_mod; the inference rescale threshold). None for the rest."""
    if (
        not key[56] or key[58] or key[59] or key[61]  # q; p, row_max; sparse (key[60]: a dummy)
        or int(key[7]) != 1 or key[2] or key[9] or key[10] or key[11]  # one kv head; s_ahead; mods
        or key[22] or key[23] or key[24] is not None or any(key[25:28]) or key[34]
        or key[17] or not key[19] or float(key[46]) != 8.0  # packed q, no seqused_q
        or bool(key[35]) != (int(key[6]) > 1)  # FA4's default pack_gqa
    ):
        return None
    route = "1cta-kb64" if key[1] else "1cta" if key[0] else "2cta"
    paged = bool(key[21])
    return Variant(
        arch=arch, dtype=_CUTE_DTYPES[key[3].__name__], head_dim=int(key[4]),
        head_dim_v=int(key[5]), qhead_per_kvhead=int(key[6]), causal=bool(key[8]), local=False,
        has_window_left=False, has_window_right=False, return_lse=not key[16], sink_dtype=None,
        cu_seqlens_q=True, cu_seqlens_k=not key[18], seqused_q=False, seqused_k=not key[20],
        paged=paged, paged_tma=bool(key[37]) if paged else None, cu_hint=bool(key[51]),
        static_persistent=bool(key[55]), mla=route, mla_q_stage=int(key[32]),
    )


def _combine_fields(rendered: str):
    """A rendered FA4 combine key (interface.py 4480-4495: arch, dtype, partial dtype, head dim,
    num_head, tile_m, k_block, log_max_splits, then six flags: cu_seqlens, seqused, lse,
    virtual batch, dynamic splits, semaphore) -> (its fields less num_head and log_max_splits,
    log_max_splits), or None when it is not such a key or is varlen (cu_seqlens or seqused)."""
    f = rendered.strip("()").split(", ")
    if len(f) != 14 or f[8] != "False" or f[9] != "False" or not f[7].isdigit():
        return None
    return (*f[:4], *f[5:7], *f[8:]), int(f[7])


class _Installed:
    def __init__(self, roots, on_miss, counters, arch=None, num_sms=None):
        self.on_miss = on_miss
        self.counters = counters
        self.pending_helper: str | None = None  # a helper missed; the forward must refuse
        self.index: dict = {}
        self.combines: dict = {}  # combine_for's: (key less heads and splits) -> [(log, hit)]
        self.loaded: dict = {}
        from .store import find_serving_store, runtime_expectation

        if arch is None:
            arch, num_sms = _device_arch()
        self.arch = arch
        sms = num_sms
        for store in find_serving_store(roots, runtime_expectation(arch, sms)):
            for _, art in store.iter_artifacts():
                if isinstance(art, Exception) or art.record.get("stub"):
                    continue
                for part, p in art.record["parts"].items():
                    self.index.setdefault((part, p["key"]), (art, part))
                    if part == "combine":
                        f = _combine_fields(p["key"])
                        if f is not None:
                            self.combines.setdefault(f[0], []).append((f[1], (art, part)))
        for found in self.combines.values():
            found.sort(key=lambda e: e[0])

    def combine_for(self, key):
        """A stored combine that serves FA4's combine `key` though its key differs (None: none).
        FA4 keys its combine (interface.py 4480-4495) by the call's head count and
        log_max_splits = max(ceil(log2 num_splits), 4 or 5), so a `num_splits` call whose count
        or head count differs from the stored split kernel's representative call (128 splits)
        would miss. Neither changes what the compiled kernel computes for a call in batch form
        (flash_fwd_combine.py, FA4 4.0.0b36): the head count is read from the partials' shape
        (289, 430), the constructor's `num_head` reaches only the varlen scheduler (318, packed
        q or seqused: then FA4 takes its scheduler metadata, which fa4aot refuses), and
        max_splits sizes the LSE tile in shared memory, whose loads past the call's count are
        -inf (450-470). So a combine of the same dtypes, head dim, tiles and optional tensors
        with at least the asked log_max_splits serves it (the smallest such). fa4aot's runtime
        calls its one stored combine the same way for every count. Its sums may differ from the
        combine FA4 would compile for that count in the last bit (the reduction spans more,
        -inf, entries)."""
        f = _combine_fields(key_repr(key))
        if f is None:
            return None
        for log, hit in self.combines.get(f[0], ()):
            if log >= f[1]:
                return hit
        return None

    def load(self, hit):
        art, part = hit
        k = (art.id, part)
        if k not in self.loaded:
            import tvm_ffi

            from . import runtime_lib

            from . import settings

            art.check_loadable(settings.allow_unsafe_dirs())  # before dlopen
            from .store import read_toolchain

            runtime_lib.check_matches(read_toolchain(art.dir.parent.parent).get("runtime_lib"))
            runtime_lib.load_runtime_lib()
            self.loaded[k] = tvm_ffi.load_module(str(art.part_path(part)))[f"fa4aot_{part}"]
        return self.loaded[k]

    def miss(self, name, key, pending_helper: str | None = None):
        from .errors import ArtifactMissing

        rendered = key_repr(key)
        self.counters.misses.append(f"{name}: {rendered}")
        if pending_helper:
            rendered += f", and its helper kernel ({pending_helper})"
        if name == "fwd":
            from .missing import record_miss

            v = variant_from_fa4_key(key, self.arch)
            if v is not None:
                record_miss(v)
        if self.on_miss == "error":
            raise ArtifactMissing(
                f"fa4aot.install(on_miss='error'): FA4 needs a {name} kernel the store does not hold "
                f"(FA4 compile key {rendered}); nothing was compiled. Check coverage with: fa4aot "
                f"coverage --spec <your spec>; record misses with FA4AOT_MISS_LOG and rebuild"
            )
        if self.on_miss == "warn":
            import logging

            logging.getLogger("fa4aot").warning(
                "fa4aot: %s miss, FA4 compiles it: %s", name, rendered
            )


def _device_arch() -> tuple[str, int]:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}", torch.cuda.get_device_properties(0).multi_processor_count


class _CompileMonitor:
    """Wraps cute.compile: counts every compile FA4 starts after install, and with
    on_miss="error" refuses it, whatever code path asked (combine, scheduler metadata, bwd...)."""

    def __init__(self, inner, state):
        self.inner, self.state = inner, state

    def _check(self):
        self.state.counters.compiles += 1
        if self.state.on_miss == "error":
            raise CompileAttempt(
                "fa4aot.install(on_miss='error'): flash_attn.cute tried to compile a kernel; "
                "a serving process must not compile. Build it ahead of time (fa4aot build)."
            )

    def __call__(self, *args, **kwargs):
        self._check()
        return self.inner(*args, **kwargs)

    def __getitem__(self, opts):
        inner = self.inner[opts]
        mon = self

        class _Opt:
            def __call__(self, *args, **kwargs):
                mon._check()
                return inner(*args, **kwargs)

        return _Opt()

    def __getattr__(self, name):
        return getattr(self.inner, name)


_INSTALL: dict | None = None


def install(roots, on_miss: str, arch: str | None = None, num_sms: int | None = None) -> _Counters:
    """Serve flash_attn.cute's compile caches from the store and monitor compiles.

    arch/num_sms: the GPU to serve (default: device 0). Given explicitly (with
    `configure(arch, num_sms)` first) install works with no GPU, e.g. under FakeTensorMode."""
    global _INSTALL
    if _INSTALL is not None:
        uninstall()
    import cutlass.cute as cute
    from flash_attn.cute import interface as I

    _record_softcaps()  # so that a softcap miss names its variant in the miss log
    counters = _Counters()
    state = _Installed(roots, on_miss, counters, arch, num_sms)
    saved = {"compile": cute.compile, "caches": {}}
    for fn_name, part in _CACHE_OWNERS.items():
        fn = getattr(I, fn_name)
        saved["caches"][fn_name] = fn.compile_cache
        fn.compile_cache = _StoreCache(part, state)
    cute.compile = _CompileMonitor(saved["compile"], state)
    _INSTALL = {"saved": saved, "state": state}
    return counters


def uninstall() -> bool:
    global _INSTALL
    if _INSTALL is None:
        return False
    import cutlass.cute as cute
    from flash_attn.cute import interface as I

    saved = _INSTALL["saved"]
    cute.compile = saved["compile"]
    for fn_name, cache in saved["caches"].items():
        getattr(I, fn_name).compile_cache = cache
    _INSTALL = None
    return True


def trace_keys(calls: list[Call]) -> list[dict[str, list[str]]]:
    """FA4's compile keys (rendered) for each call, traced under FakeTensorMode with
    cute.compile stubbed: nothing is compiled (about 10 ms a call). For coverage checks."""
    return [
        {n: [key_repr(k) for k in keys] for n, keys in got.items()} for got in trace_raw_keys(calls)
    ]


def trace_raw_keys(calls: list[Call]) -> list[dict[str, list[Any]]]:
    """As trace_keys, with FA4's key tuples themselves (for variant_from_fa4_key)."""
    import cutlass.cute as cute

    class _Stub:
        def __call__(self, *a, **k):
            return None

    real = cute.compile
    cute.compile = lambda *a, **k: _Stub()
    try:
        out = []
        for c in calls:
            got = trace(c)
            out.append({n: [k for k, _ in entries] for n, entries in got.items()})
        return out
    finally:
        cute.compile = real
        for c in _caches().values():
            c.clear()


# -- absorbed MLA (qv) on Blackwell: fa4aot/mla.py -------------------------------------------------


def fake_mla_call(call) -> None:
    """FA4's varlen entry for an absorbed-MLA call (mla.MlaCall) under FakeTensorMode."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    fa, _ = _fa4()
    dt = getattr(torch, call.dtype)
    b, sq, sk, h = call.batch, call.seqlen_q, call.seqlen_k, call.num_heads
    d, dv = call.head_dim, call.head_dim_v
    with FakeTensorMode():
        dev = "cuda"

        def i32(n):
            return torch.empty(n, dtype=torch.int32, device=dev)

        q = torch.empty(b * sq, h, d, dtype=dt, device=dev)
        qv = torch.empty(b * sq, h, dv, dtype=dt, device=dev)
        kw: dict[str, Any] = dict(
            qv=qv, causal=call.causal, return_lse=call.return_lse,
            cu_seqlens_q=i32(b + 1), max_seqlen_q=sq,
        )
        if call.layout == "varlen":
            k = torch.empty(b * sk, 1, d, dtype=dt, device=dev)
            v = torch.empty(b * sk, 1, dv, dtype=dt, device=dev)
            kw.update(cu_seqlens_k=i32(b + 1), max_seqlen_k=sk)
        else:
            p = call.page_size
            npages = -(-sk // p)
            k = torch.empty(b * npages, p, 1, d, dtype=dt, device=dev)
            v = torch.empty(b * npages, p, 1, dv, dtype=dt, device=dev)
            kw.update(
                page_table=torch.empty(b, npages, dtype=torch.int32, device=dev),
                seqused_k=i32(b), max_seqlen_k=sk,
            )
        fa.flash_attn_varlen_func(q, k, v, **kw)


def trace_mla(calls, compile: bool = False, outdir: Path | None = None) -> list[tuple]:
    """(call, [rendered forward keys], FA4's refusal or None) per MLA call (mla.MlaCall),
    compile stubbed unless `compile`; with
    `compile` and `outdir`, each call's forward kernel is exported to outdir/<i>/fwd.o and its
    cubin target checked (as compile_variant does)."""
    import cutlass.cute as cute

    class _Stub:
        def __call__(self, *a, **k):
            return None

    real = cute.compile
    if not compile:
        cute.compile = lambda *a, **k: _Stub()
    try:
        out = []
        for i, c in enumerate(calls):
            caches = _caches()
            for cc in caches.values():
                cc.clear()
            try:
                fake_mla_call(c)
            except (AssertionError, ValueError, NotImplementedError) as e:
                # FA4 refuses the call itself (e.g. the 2CTA kernel's head ratio must divide
                # 128): a fact about the call, reported with the call, not a failed trace
                import traceback

                where = traceback.extract_tb(e.__traceback__)[-1]
                out.append((c, [], f"{type(e).__name__} {e} at {Path(where.filename).name}:"
                                   f"{where.lineno}: {where.line}"))
                continue
            fwd = list(caches["fwd"].cache.items())
            if compile and outdir is not None:
                for key, fn in fwd:
                    d = Path(outdir) / str(i)
                    d.mkdir(parents=True, exist_ok=True)
                    fn.export_to_c(object_file_path=str(d / "fwd.o"), function_name="fa4aot_fwd")
                    problem = cubin.target_problem(d / "fwd.o", C.cubin_target(_CONFIGURED[0]))
                    if problem:
                        raise RuntimeError(problem)
            out.append((c, [key_repr(k) for k, _ in fwd], None))
        return out
    finally:
        cute.compile = real
        for cc in _caches().values():
            cc.clear()
