"""FA4's compiled-function ABIs: the one place that spells the argument lists the runtime passes.

FA4 (flash-attn-4 4.0.0b36, `flash_attn/cute/interface.py`) compiles each kernel with
`cute.compile(..., options="--enable-tvm-ffi")` and calls the result with positional
arguments; the exported tvm-ffi function takes exactly those (the CUDA stream is the
environment's: torch's current stream). This module holds
- the slot tables (names, in FA4's order: SM90_FWD, SM100_FWD, SM100_MLA_FWD, COMBINE,
  TILE_CUMSUM, BLOCKS_TO_BATCH, SCHEDULER);
- the argument-list builders (`fwd_args`, `combine_args`, ...), which the Blackwell path's
  `launch.FwdPrep` and the tests use;
- the launchers that pass the same lists straight to a kernel (`launch_sm90`, `launch_sm100`,
  `launch_mla`: no tuple built), and the binders (`bind_*`) that close a loaded part over its
  list once per load, so that every call site uses one keyword-free, arch-neutral form:

    fwd(q, k, v, out, lse, scale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        page_table, window_left, window_right, learnable_sink, cu_total_m_blocks)
    tile_cumsum(out, cu_seqlens_q, seqused_q)
    combine(out_partial, lse_partial, out, lse)    (FA4's combine; fa4aot's merge likewise)

  sm100/sm103 take the trailing keywords FA4's Blackwell forward has slots for
  (`max_seqlen_q`, `descales`, `blocks_to_batch_idx`); `blocks_to_batch(cu_total, out)` is the
  second batch > 256 helper, whose output only the Blackwell forward takes; the MLA binder
  takes qv after q. The sm90 binders write the slot order out inline: a launcher is one Python
  frame (a closure over the kernel), on the hot path.

`tests/runtime/test_abi.py` proves every list equal to the one FA4 passes, slot by slot, for
every default variant (FA4 traced on the CPU under FakeTensorMode with a recording stand-in
for the compiled function), and each builder and binder equal to its table. Which binders an
artifact gets (by arch and FA4 source), and what FA4 prepares around a call (buffers, LSE
layout, scale, window, split partials, FP8 views), is `runtime/launch.py`'s. Imports nothing
but the standard library.

Structured arguments: FA4 passes `AuxData(tensors, scalars)` and `DescaleTensors(q, k, v)`,
NamedTuples. tvm-ffi converts any Python tuple to an ffi Array (`tvm_ffi/cython/function.pxi`,
`isinstance(arg, tuple)` -> `TVMFFIPyArgSetterTuple_`), so plain tuples with the same members
are the same argument at the boundary; this module passes plain tuples.
"""

from __future__ import annotations

from typing import Any, Callable

from fa4aot.model.abis import UPSTREAM_SM90_FWD

# -- slot tables (names only; the builders below are written out for the hot path, and
#    tests/runtime/test_abi.py checks that each builder fills exactly its table's order) ----

# interface.py 1887-1936 (call_args), 1805-1836 (compile_args): arch // 10 in [8, 9, 12]
SM90_FWD = UPSTREAM_SM90_FWD

# the same call for arch // 10 in [10, 11]: a descale slot after the sink, and eight
# scheduler slots (ending with the max_seqlen_q scalar) instead of sm90's two
SM100_FWD = (
    "q", "k", "v", "out", "lse", "softmax_scale",
    "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "page_table",
    "window_left", "window_right", "learnable_sink",
    "descales",
    "block_sparse", "aux",
    "num_splits_dynamic", "tile_count_semaphore", "virtual_batch_idx", "num_nheads_in_l2",
    "cu_total_m_blocks", "cu_total_splits_m_blocks", "blocks_to_batch_idx",
    "max_seqlen_q",
)  # fmt: skip

# absorbed MLA (qv given; sm100/sm103 only): interface.py 1864-1885, another order entirely
SM100_MLA_FWD = (
    "q", "qv", "k", "v", "out", "lse", "softmax_scale", "p", "row_max",
    "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "gather_kv_indices",
    "page_table", "descales", "window_left", "window_right", "learnable_sink", "o_lo",
)  # fmt: skip

# _flash_attn_fwd_combine (interface.py 4504-4508): the same on every arch
COMBINE = (
    "out_partial", "lse_partial", "out", "lse", "cu_seqlens", "seqused",
    "num_splits_dynamic", "virtual_batch_idx", "semaphore_to_reset",
)  # fmt: skip

# helper kernels: _compute_tile_cumsum (interface.py 525-532), _compute_blocks_to_batch (565)
TILE_CUMSUM = (
    "cu_total_m_blocks", "cu_total_splits_m_blocks", "cu_seqlens", "seqused",
    "num_splits_dynamic", "virtual_batch_idx",
)  # fmt: skip
BLOCKS_TO_BATCH = ("cu_total_blocks", "blocks_to_batch_idx")

# _get_scheduler_metadata's prepare kernel (interface.py 4773-4791): split-KV with varlen q
SCHEDULER = (
    "max_seqlen_q", "max_seqlen_k", "seqlen_k_new", "cu_seqlens_q", "cu_seqlens_k",
    "cu_seqlens_k_new", "seqused_q", "seqused_k", "leftpad_k", "num_batch", "num_splits",
    "tile_count_semaphore", "num_m_blocks", "num_splits_dynamic", "virtual_batch_idx",
    "num_nheads_in_l2", "n_blocks_per_split",
)  # fmt: skip

# FA4's AuxData(tensors=None, scalars=None): no score_mod aux data (a compile-time value)
AUX_NONE = (None, None)


_FAMILY = {"sm90": 9, "sm100": 10, "sm103": 10}


def family(arch: str) -> int:
    """FA4's `arch // 10` for a fa4aot arch name: 9 (sm90) or 10 (sm100, sm103: FA4 runs its
    sm100 kernels, and their ABI, for `arch // 10 in [10, 11]`)."""
    fam = _FAMILY.get(arch)
    if fam is None:
        try:
            fam = int(arch.removeprefix("sm").rstrip("af")) // 10
        except ValueError:
            fam = None
        fam = 10 if fam == 11 else fam
        if fam not in (9, 10):
            raise ValueError(f"no FA4 forward ABI described for {arch}")
    return fam


def fwd_slots(arch: str, mla: bool = False) -> tuple[str, ...]:
    """The slot names of the forward kernel's argument list on `arch` (mla: qv given)."""
    fam = family(arch)
    if mla:
        if fam != 10:
            raise ValueError("absorbed MLA (qv) kernels exist on sm100/sm103 only")
        return SM100_MLA_FWD
    return SM90_FWD if fam == 9 else SM100_FWD


# -- argument lists -----------------------------------------------------------------------------


def fwd_args(
    arch: str,
    q,
    k,
    v,
    out,
    lse,
    softmax_scale: float,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    seqused_q=None,
    seqused_k=None,
    page_table=None,
    window_left: int | None = None,
    window_right: int | None = None,
    learnable_sink=None,
    *,
    qv=None,
    descales: tuple | None = None,
    num_splits_dynamic=None,
    tile_count_semaphore=None,
    virtual_batch_idx=None,
    num_nheads_in_l2=None,
    cu_total_m_blocks=None,
    cu_total_splits_m_blocks=None,
    blocks_to_batch_idx=None,
    max_seqlen_q: int | None = None,
) -> tuple:
    """The positional arguments of FA4's compiled forward on `arch`.

    The first 14 are the bound launchers' (the `bind_*` below), in their order.
    q/k/v/qv/out/lse are what the kernel gets (`launch.FwdPrep`: uint8 views for FP8;
    out_partial / lse_partial when split); window_left/right are FA4's resolved ones
    (`resolve_window`); descales is (q_descale, k_descale, v_descale) or None when all three
    are None (FA4 passes None then). max_seqlen_q (sm100 only, required there): the scalar FA4
    passes last, `launch.FwdPrep.max_seqlen_q`.

    sm90 (interface.py 1887-1936): 18 slots, block sparsity None, aux data (None, None),
    cu_total_m_blocks and cu_total_splits_m_blocks. Arguments the sm90 kernel has no slot
    for must be None (refused otherwise, rather than dropped).
    sm100/sm103: 25 slots (SM100_FWD); with qv the MLA kernels' 20 (SM100_MLA_FWD,
    interface.py 1864-1885: p, row_max, gather_kv_indices and o_lo are training / sparse-MLA
    slots, None for inference).
    """
    fam = _FAMILY.get(arch) or family(arch)
    # (written out, not table-driven: this runs on every call; tests/runtime/test_abi.py checks
    # that each list follows its table)
    sched = not (
        num_splits_dynamic is None and tile_count_semaphore is None
        and virtual_batch_idx is None and num_nheads_in_l2 is None
        and blocks_to_batch_idx is None
    )  # fmt: skip
    if qv is not None:
        if fam != 10:
            raise ValueError("absorbed MLA (qv) kernels exist on sm100/sm103 only")
        if sched or cu_total_m_blocks is not None or cu_total_splits_m_blocks is not None:
            raise ValueError("FA4's MLA kernels take no scheduler metadata (interface.py 1264)")
        return (
            q, qv, k, v, out, lse, softmax_scale, None, None,
            cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, None,
            page_table, descales, window_left, window_right, learnable_sink, None,
        )  # fmt: skip
    if fam == 9:
        if sched or descales is not None:
            raise ValueError(f"{arch}: FA4's sm90 forward has no descale or scheduler slots")
        return (
            q, k, v, out, lse, softmax_scale,
            cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
            window_left, window_right, learnable_sink,
            None, AUX_NONE,
            cu_total_m_blocks, cu_total_splits_m_blocks,
        )  # fmt: skip
    if max_seqlen_q is None:
        raise ValueError(f"{arch}: FA4's sm100 forward takes max_seqlen_q (FwdPrep.max_seqlen_q)")
    return (
        q, k, v, out, lse, softmax_scale,
        cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
        window_left, window_right, learnable_sink,
        descales,
        None, AUX_NONE,
        num_splits_dynamic, tile_count_semaphore, virtual_batch_idx, num_nheads_in_l2,
        cu_total_m_blocks, cu_total_splits_m_blocks, blocks_to_batch_idx,
        max_seqlen_q,
    )  # fmt: skip


# -- launchers: the same lists, passed straight to the kernel (the runtime's hot path) -------------
# Their first 16 parameters are the runtime's bound launchers', so a call site serves either arch by
# taking its launcher from `launcher(arch)`; tests/runtime/test_abi.py checks each against fwd_args.


def launch_sm90(
    fwd, q, k, v, out, lse, softmax_scale, cu_seqlens_q=None, cu_seqlens_k=None,
    seqused_q=None, seqused_k=None, page_table=None, window_left=None, window_right=None,
    learnable_sink=None, cu_total_m_blocks=None,
):  # fmt: skip
    """fwd(*fwd_args("sm90", ...)) without building the tuple."""
    return fwd(
        q, k, v, out, lse, softmax_scale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        page_table, window_left, window_right, learnable_sink, None, AUX_NONE,
        cu_total_m_blocks, None,
    )  # fmt: skip


def launch_sm100(
    fwd, q, k, v, out, lse, softmax_scale, cu_seqlens_q=None, cu_seqlens_k=None,
    seqused_q=None, seqused_k=None, page_table=None, window_left=None, window_right=None,
    learnable_sink=None, cu_total_m_blocks=None, max_seqlen_q=None, descales=None,
    blocks_to_batch_idx=None, num_splits_dynamic=None, tile_count_semaphore=None,
    num_nheads_in_l2=None, cu_total_splits_m_blocks=None,
):  # fmt: skip
    """fwd(*fwd_args("sm100", ...)) without building the tuple; max_seqlen_q is required
    (`FwdPrep.max_seqlen_q`; positional 17th is the fastest way to pass it). No
    virtual_batch_idx: FA4 fills it only for a batch sort it does not implement (asserted)."""
    if max_seqlen_q is None:
        raise ValueError("FA4's sm100 forward takes max_seqlen_q (FwdPrep.max_seqlen_q)")
    return fwd(
        q, k, v, out, lse, softmax_scale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        page_table, window_left, window_right, learnable_sink, descales, None, AUX_NONE,
        num_splits_dynamic, tile_count_semaphore, None, num_nheads_in_l2,
        cu_total_m_blocks, cu_total_splits_m_blocks, blocks_to_batch_idx, max_seqlen_q,
    )  # fmt: skip


def launch_mla(
    fwd, q, qv, k, v, out, lse, softmax_scale, cu_seqlens_q=None, cu_seqlens_k=None,
    seqused_q=None, seqused_k=None, page_table=None, window_left=None, window_right=None,
    learnable_sink=None, descales=None,
):  # fmt: skip
    """fwd(*fwd_args(arch, ..., qv=qv)) on sm100/sm103 without building the tuple."""
    return fwd(
        q, qv, k, v, out, lse, softmax_scale, None, None, cu_seqlens_q, cu_seqlens_k,
        seqused_q, seqused_k, None, page_table, descales, window_left, window_right,
        learnable_sink, None,
    )  # fmt: skip


def launcher(arch: str, mla: bool = False):
    """The launch function for `arch`'s forward kernels (mla: the absorbed-MLA ones)."""
    fam = family(arch)
    if mla:
        if fam != 10:
            raise ValueError("absorbed MLA (qv) kernels exist on sm100/sm103 only")
        return launch_mla
    return launch_sm90 if fam == 9 else launch_sm100


def combine_args(
    out_partial,
    lse_partial,
    out,
    lse=None,
    cu_seqlens=None,
    seqused=None,
    num_splits_dynamic=None,
    virtual_batch_idx=None,
    semaphore_to_reset=None,
) -> tuple:
    """FA4's split-KV combine kernel (`_flash_attn_fwd_combine`, interface.py 4413-4508): 9
    slots, the same on every arch. Layouts it takes: out_partial (splits, b, s, h, dv) or
    (splits, total_q, h, dv); lse_partial (splits, b, s, h) / (splits, total_q, h) with the
    seqlen mode contiguous (a transposed view of FA4's partial LSE); out as O; lse (b, s, h) /
    (total_q, h), seqlen-contiguous too, or None."""
    return (
        out_partial, lse_partial, out, lse, cu_seqlens, seqused,
        num_splits_dynamic, virtual_batch_idx, semaphore_to_reset,
    )  # fmt: skip


def tile_cumsum_args(
    cu_total_m_blocks,
    cu_total_splits_m_blocks=None,
    cu_seqlens=None,
    seqused=None,
    num_splits_dynamic=None,
    virtual_batch_idx=None,
) -> tuple:
    """`_compute_tile_cumsum`'s kernel (interface.py 462-536): outputs int32 (batch + 1,).
    With scheduler metadata FA4 feeds num_m_blocks through the seqused slot (interface.py 484)."""
    return (
        cu_total_m_blocks, cu_total_splits_m_blocks, cu_seqlens, seqused,
        num_splits_dynamic, virtual_batch_idx,
    )  # fmt: skip


def blocks_to_batch_args(cu_total_blocks, blocks_to_batch) -> tuple:
    """`_compute_blocks_to_batch`'s kernel (interface.py 545-566); blocks_to_batch is int32
    (blocks_to_batch_size(...),)."""
    return (cu_total_blocks, blocks_to_batch)


def blocks_to_batch_size(
    total_q: int, batch: int, tile_m: int, qhead_per_kvhead: int, pack_gqa: bool
) -> int:
    """interface.py 539-542: an upper bound on the M blocks of a varlen call."""
    mult = qhead_per_kvhead if pack_gqa and qhead_per_kvhead > 1 else 1
    return (total_q * mult + batch * (tile_m - 1)) // tile_m + 1


def scheduler_args(
    max_seqlen_q: int,
    max_seqlen_k: int,
    cu_seqlens_q,
    cu_seqlens_k,
    seqused_q,
    seqused_k,
    num_batch: int,
    num_splits: int,
    tile_count_semaphore,
    num_m_blocks,
    num_splits_dynamic,
    num_nheads_in_l2=None,
    n_blocks_per_split: int | None = None,
) -> tuple:
    """`_get_scheduler_metadata`'s prepare kernel (interface.py 4773-4791), as FA4's forward
    runs it for split-KV with a varlen q (no new K, no left padding, no batch sort)."""
    return (
        max_seqlen_q, max_seqlen_k, 0, cu_seqlens_q, cu_seqlens_k, None, seqused_q, seqused_k,
        None, num_batch, num_splits, tile_count_semaphore, num_m_blocks, num_splits_dynamic,
        None, num_nheads_in_l2, n_blocks_per_split,
    )  # fmt: skip


# -- binders: a loaded part closed over its list, once per load (the runtime's hot path) -------


# FA4 4.0.0b36's sm90 forward with TMA paged KV (page size == tile_n) reads
# page_table[b, n_block_max - 1] before its first K load, i.e. page_table[b, -1] for a sequence
# with no keys (flash_fwd_sm90.py: "TMA handles n_block=-1 gracefully"; the TMA load is, the
# table read is not). For b = 0 that is the int32 just before the table: harmless while those
# bytes are mapped, an illegal address when the table starts a GPU mapping (compute-sanitizer:
# "Invalid __global__ read of size 4 ... 4 bytes before the nearest allocation"). Mappings
# start at multiples of 64 KiB at the least: a table whose base is not one is passed as it is;
# one that is goes to the kernel as a copy behind a 16-byte guard (one small copy kernel).
# Only FA4's TMA paged path reads there: on its cp.async path (page size != tile_n) the kernel
# clamps that first block to 0 (flash_fwd_sm90.py, "cp.async would crash on out-of-bounds page
# table access") and PagedKVManager.load_page_table reads only rows below seqlen_k, so a
# launcher for a kernel known not to take the TMA path checks nothing (`guard=False`): a
# serving engine's block table is often one allocation of its own, whose base is such a
# boundary, and it would be copied at every call.
GUARD_ALIGN = 1 << 16


def guard_page_table(t):
    """`t`, or a copy of it that has 16 readable bytes before its first entry."""
    g = t.new_empty(4 + t.numel())
    out = g[4:].view(t.shape)
    out.copy_(t)
    return out


def bind_sm90_fwd(kernel: Any, guard: bool = True) -> Callable:
    """FA4 4.0.0b36's sm90 forward (tvm-ffi; the stream is torch's current one): q, k, v, out,
    lse, scale, cu_seqlens_q/k, seqused_q/k, page_table, window left/right, learnable_sink,
    block sparsity (unused), aux data (FA4 passes a compile-time empty pair), cu_total_m_blocks,
    cu_total_splits_m_blocks (unused on sm90). A function compiled with lse=None rejects a
    tensor there: whether LSE is returned is part of the variant. guard: whether the kernel may
    take FA4's TMA paged path, so a page table at a GUARD_ALIGN boundary goes behind a guard
    (False: a kernel with no page table or on the cp.async paged path; see GUARD_ALIGN)."""

    def fwd(
        q, k, v, out, lse, scale, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
        seqused_k=None, page_table=None, window_left=None, window_right=None,
        learnable_sink=None, cu_total_m_blocks=None,
    ):
        if page_table is not None and guard:
            ptr = page_table.data_ptr()  # (0: no storage, e.g. a FakeTensor while tracing)
            if ptr and not ptr % GUARD_ALIGN:
                page_table = guard_page_table(page_table)  # see GUARD_ALIGN
        kernel(
            q, k, v, out, lse, scale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
            page_table, window_left, window_right, learnable_sink, None, AUX_NONE,
            cu_total_m_blocks, None,
        )

    return fwd


def bind_tile_cumsum(kernel: Any) -> Callable:
    """FA4's `_compute_tile_cumsum` helper (varlen batch > 256): out (batch+1,) int32, then
    (unused) seqlen, cu_seqlens_q, seqused_q, and two compile-time Nones."""

    def tile_cumsum(out, cu_seqlens_q, seqused_q):
        kernel(out, None, cu_seqlens_q, seqused_q, None, None)

    return tile_cumsum


def bind_combine(kernel: Any) -> Callable:
    """FA4's `flash_fwd_combine` as the split-KV part `combine` is compiled: partial O (chunk,
    batch, seqlen, heads, dv), partial LSE (chunk, batch, seqlen, heads), out, lse, then
    cu_seqlens, seqused, num_splits_dynamic, semaphore and varlen batch index, all None."""

    def combine(out_partial, lse_partial, out, lse):
        kernel(out_partial, lse_partial, out, lse, None, None, None, None, None)

    return combine


def bind_fa4aot_merge(kernel: Any) -> Callable:
    """fa4aot's split-KV merge (kernels.trace_merge; the part `merge` of a split chunk
    kernel's artifact): FA4's combine's four tensors, nothing else. Arch-neutral."""

    def combine(out_partial, lse_partial, out, lse):
        kernel(out_partial, lse_partial, out, lse)

    return combine


def bind_fa4aot_chunk_meta(kernel: Any) -> Callable:
    """fa4aot's split-step chunk metadata kernel (kernels.trace_chunk_meta; the part
    `chunk_meta` of a split chunk kernel's artifact): two int32 tensors, four int32s."""

    def chunk_meta(src, dst, chunk, slots, rows, causal):
        kernel(src, dst, chunk, slots, rows, causal)

    return chunk_meta


def bind_sm100_fwd(kernel: Any, guard: bool = True) -> Callable:
    """FA4 4.0.0b36's sm100/sm103 forward (`launch_sm100`: 25 slots). max_seqlen_q, when
    not given, is what FA4 passes for a call without a hint (`launch.max_seqlen_q_slot`): s_q
    for q in batch form, total_q for a packed q; the runtime's Blackwell path passes the
    caller's host hint (runtime/blackwell.py). q/k/v are what the kernel takes (uint8 views for FP8).
    guard: unused (the sm90 launcher's page-table guard is for FA4's sm90 TMA paged path)."""
    launch = launch_sm100

    def fwd(
        q, k, v, out, lse, scale, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
        seqused_k=None, page_table=None, window_left=None, window_right=None,
        learnable_sink=None, cu_total_m_blocks=None, max_seqlen_q=None, descales=None,
        blocks_to_batch_idx=None,
    ):
        if max_seqlen_q is None:
            max_seqlen_q = q.shape[0] if cu_seqlens_q is not None else q.shape[1]
        launch(
            kernel, q, k, v, out, lse, scale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
            page_table, window_left, window_right, learnable_sink, cu_total_m_blocks,
            max_seqlen_q, descales, blocks_to_batch_idx,
        )

    return fwd


def bind_mla_fwd(kernel: Any, guard: bool = True) -> Callable:
    """FA4 4.0.0b36's absorbed-MLA forward (sm100/sm103, `launch_mla`: 20 slots, another
    order than the dense forward's: q, qv, k, v, out, lse, scale, then the varlen tensors, the
    page table, the descales, the window, the sink; training and sparse slots None). Bound for a
    plan whose variant is an MLA kernel (runtime/mla.py calls it). guard: unused, as sm100's."""
    launch = launch_mla

    def fwd(
        q, qv, k, v, out, lse, scale, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
        seqused_k=None, page_table=None, window_left=None, window_right=None,
        learnable_sink=None, descales=None,
    ):
        launch(
            kernel, q, qv, k, v, out, lse, scale, cu_seqlens_q, cu_seqlens_k, seqused_q,
            seqused_k, page_table, window_left, window_right, learnable_sink, descales,
        )

    return fwd


def bind_blocks_to_batch(kernel: Any) -> Callable:
    """FA4's `_compute_blocks_to_batch` helper (varlen batch > 256, after the tile cumsum):
    `blocks_to_batch_args`."""

    def blocks_to_batch(cu_total_blocks, blocks_to_batch_idx):
        kernel(*blocks_to_batch_args(cu_total_blocks, blocks_to_batch_idx))

    return blocks_to_batch


def bind_no_blocks_to_batch(kernel: Any) -> None:
    """sm90's forward has no slot for the blocks-to-batch index: the runtime never runs it."""
    return None


def bind_vllm_sm90_fwd(kernel: Any, guard: bool = True) -> Callable:
    """vLLM's FA4 copy's sm90 forward (21 slots: runtime/vllm_abi.py): the same arch-neutral
    form as bind_sm90_fwd, plus the FP8-KV descales (q, k, v) as a keyword. The copy's TMA
    paged path reads page_table[b, -1] as upstream's does: the same guard (GUARD_ALIGN)."""

    def fwd(
        q, k, v, out, lse, scale, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
        seqused_k=None, page_table=None, window_left=None, window_right=None,
        learnable_sink=None, cu_total_m_blocks=None, descales=None,
    ):
        if page_table is not None and guard:
            ptr = page_table.data_ptr()
            if ptr and not ptr % GUARD_ALIGN:
                page_table = guard_page_table(page_table)
        kernel(
            q, k, v, out, lse, scale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, None,
            page_table, window_left, window_right, learnable_sink, None, AUX_NONE, descales,
            None, cu_total_m_blocks, None,
        )

    return fwd


def bind_vllm_combine(kernel: Any) -> Callable:
    """vLLM's copy's combine: upstream's nine slots and an output scale (None)."""

    def combine(out_partial, lse_partial, out, lse):
        kernel(out_partial, lse_partial, out, lse, None, None, None, None, None, None)

    return combine


def bind_sglang_sm90_fwd(kernel: Any, guard: bool = True) -> Callable:
    """SGLang's FA4 copy's sm90 forward (17 slots: runtime/sglang_abi.py): upstream's through
    the aux data, then its relative-attention bias (None); no cu_total slots, so
    cu_total_m_blocks is taken and dropped. Its TMA paged path reads page_table[b, -1] as
    upstream's does: the same guard (GUARD_ALIGN)."""

    def fwd(
        q, k, v, out, lse, scale, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
        seqused_k=None, page_table=None, window_left=None, window_right=None,
        learnable_sink=None, cu_total_m_blocks=None,
    ):
        if page_table is not None and guard:
            ptr = page_table.data_ptr()
            if ptr and not ptr % GUARD_ALIGN:
                page_table = guard_page_table(page_table)
        kernel(
            q, k, v, out, lse, scale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
            page_table, window_left, window_right, learnable_sink, None, AUX_NONE, None,
        )

    return fwd
