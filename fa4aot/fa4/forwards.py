"""fa4aot's forms of FA4's own forward kernel: the split-KV chunk kernel's chunk modes, the
wide fold kernels, the TMA page kernel, and FA4's combine compiled with fa4aot's tile."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from typing import Any

from fa4aot.fa4.driver import _fa4
from fa4aot.model import constraints as C
from fa4aot.model.variants import Variant

# split.MAX_SLOTS partials per row: FA4 derives log_max_splits from the partials' count
COMBINE_LOG_MAX_SPLITS = 7


def trace_combine(variant: Variant) -> list[tuple[Any, Any]]:
    """Compile FA4's split-KV combine kernel (flash_fwd_combine.py) for `variant`'s split
    plans (split.py): partials in the variant's own dtype, as its chunk kernel writes them
    (no converting copy), an LSE output, up to 2**COMBINE_LOG_MAX_SPLITS partials.

    Compiled through FA4's `_compile_fwd_combine` with our tile_m, not through its entry
    point: FA4 picks tile_m = 8 for head dim 128, which with 2-byte partials leaves its O
    copy tile (256 threads x 16 bytes: 16 rows) twice the block's rows, and the GPU returned
    wrong outputs (rel. error 0.06-0.86, LSE right). With tile_m equal to the
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
                      pdl: bool = False, used: bool = False) -> Any:
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

    used (a packed K's kernel; the artifact's part `fwd_used`): compiled with seqused_k beside
    cu_seqlens_k, so that sequence v holds seqused_k[v] keys from cu_seqlens_k[v]: the ragged
    step's entries over a packed K with seqused_k, which leave gaps between them.

    Why: a split step runs the chunks of sequence i as virtual sequences i * n .. i * n + n - 1
    of one kernel, and FA4 indexes q, O and the KV lengths by the same batch index, so the
    step first copied q over the chunks and wrote each chunk's length with a metadata kernel
    (two launches; at one decode row q went through a stride-0 mode). With the chunk modes it
    passes the caller's q and seqused_k as they are. Called in FA4's own form (q's, out's and
    the lengths' batches equal: u = n = 1, and c spans the page table), it is FA4's kernel
    exactly. The same compile key as FA4's; outputs and LSE bit-identical to the q copy's."""
    import cutlass.cute as cute
    from flash_attn.cute import flash_fwd as F80
    from flash_attn.cute import flash_fwd_sm90 as F90
    from flash_attn.cute.seqlen_info import SeqlenInfoQK

    from fa4aot.fa4 import cute_kernels as K

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
    args = _mode_args(args, paged, bounds, used)

    def assume_flat(t, **kw):  # FA4's alignment step takes flat strides: q's are done above
        if t is not None and any(isinstance(x, tuple) for x in t.stride):
            return t
        return assume(t, **kw)

    def create_chunked(*a, mCuSeqlensK=None, mSeqUsedK=None, **kw):
        if mSeqUsedK is not None and cute.rank(mSeqUsedK) == 2:  # the chunk-length mode
            mSeqUsedK = K.ChunkLengths(mSeqUsedK)
            applied.append(True)
        if mCuSeqlensK is not None and cute.rank(mCuSeqlensK) == 4:  # the chunk-bounds mode
            if mSeqUsedK is not None:
                raise RuntimeError("the chunk-bounds mode is for a packed K without seqused_k")
            mCuSeqlensK, mSeqUsedK = (K.RowChunks(mCuSeqlensK, False),
                                      K.RowChunks(mCuSeqlensK, True))
            applied.append(True)
        return create(*a, mCuSeqlensK=mCuSeqlensK, mSeqUsedK=mSeqUsedK, **kw)

    F90.assume_tensor_aligned = F80.assume_tensor_aligned = assume_flat
    SeqlenInfoQK.create = staticmethod(create_chunked)
    try:
        with _pdl_secondary(pdl):
            fn = cute.compile(K.ChunkModes(fa_fwd, assume), *args, **kwargs)
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


def _mode_args(args: list, paged: bool, bounds: bool, used: bool) -> list:
    """trace_chunk_modes' compile arguments: FA4's, with seqused_k added (`used`) or
    cu_seqlens_k as the bounds mode's (b + 1, R, c, K, A) (`bounds`)."""
    import cutlass
    import cutlass.cute as cute

    args = list(args)
    if used:
        if args[7] is None or paged or bounds or args[9] is not None:
            raise RuntimeError("seqused_k beside cu_seqlens_k is for a packed K's kernel")
        args[9] = cute.runtime.make_fake_tensor(
            cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    if bounds:
        if args[7] is None or paged:
            raise RuntimeError("the chunk-bounds mode is for a packed K's kernel")
        args[7] = cute.runtime.make_fake_tensor(  # cu_seqlens_k as (b + 1, R, c, K, A)
            cutlass.Int32, tuple(cute.sym_int() for _ in range(5)),
            stride=(cute.sym_int64(divisibility=1), 0, 0, 0, 0), assumed_align=4,
        )
    return args


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
    reduced in other blocks: not bit-identical to it (error to an fp32 reference the same). wide.chunk_modes: compiled through the split's chunk
    modes (trace_chunk_modes), the chunk kernel's ABI: part `fwd_wide_split`
    (constraints.wide_split), which runs a split step's chunks. pdl: _pdl_secondary's launch."""

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

    fa_fwd, _, _ = _sm90_forward(compiles)
    if getattr(fa_fwd, "use_tma_KV", True) or fa_fwd.tile_m != 64:
        raise RuntimeError(
            "the TMA page kernel builds on the 64-row chunk kernel of FA4's cp.async paged path, "
            f"FA4 compiled tile_m={fa_fwd.tile_m}, use_tma_KV={getattr(fa_fwd, 'use_tma_KV', None)}"
        )
    w = copy.copy(fa_fwd)
    w.tile_n, w.use_tma_KV = page_size, True
    return trace_chunk_modes(compiles, kernel=w, pdl=pdl)


