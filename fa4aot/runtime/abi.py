"""FA4's compiled-function ABIs, per arch: the one description the compiler-free runtime calls.

FA4 (flash-attn-4 4.0.0b36, `flash_attn/cute/interface.py`) compiles each kernel with
`cute.compile(..., options="--enable-tvm-ffi")` and calls the result with positional
arguments; the exported tvm-ffi function takes exactly those (the CUDA stream is the
environment's: torch's current stream). This module spells those argument lists, and what
FA4 prepares before the call (output buffers, LSE layout, softmax scale, window resolution,
split-KV partial buffers, FP8 views, the `max_seqlen_q` scalar), so that the runtime
reproduces FA4 exactly. `tests/runtime/test_abi.py` proves every list equal to the one FA4 passes, slot
by slot, for every default variant (FA4 traced on the CPU under FakeTensorMode with a
recording stand-in for the compiled function).

Imports torch (and fa4aot.model.constraints) only: no cutlass, no flash_attn.

How the runtime calls it (`launcher(arch)` gives the launch function; its first 16
parameters are the runtime's bound launchers', runtime/launch.py; the Blackwell path is
runtime/blackwell.py):

    sm90 (runtime.launch.SM90, unchanged):
        abi.launch_sm90(fwd, q, k, v, out, lse, scale, cu_q, cu_k, used_q, used_k, pages,
                        window_left, window_right, sink, cu_total_m_blocks)
    sm100 / sm103:
        p = abi.fwd_prepare(arch, q, k, v, varlen_q=cu_q is not None, max_seqlen_q=hint,
                            softmax_scale=scale, causal=causal, window_left=wl,
                            window_right=wr, return_lse=return_lse, out=out, lse=lse,
                            num_splits=n)   # n > 1 only for a split-KV variant
        kw = {}
        if varlen q and batch > 256:   # both helpers; both outputs go to the forward
            h = abi.cu_hint_prepare(batch, total_q, tile_m, ratio, pack_gqa, device)
            tile_cumsum(*h.tile_cumsum_args(cu_q, used_q))
            blocks_to_batch(*h.blocks_to_batch_args())
            kw = h.fwd_kwargs(arch)
        if p.num_splits > 1 and varlen q:   # FA4's scheduler prepare kernel first
            m = abi.scheduler_prepare(p, batch, abi.max_seqlen_k_bound(v, pages, hint_k),
                                      cu_q, cu_k, used_q, used_k, semaphore=...)
            scheduler(*m.args)
            kw = m.fwd_kwargs()
        fwd(*p.args(arch, cu_q, cu_k, used_q, used_k, pages, sink, **kw))  # or launch_sm100
        if p.num_splits > 1:
            combine(*p.combine(cu_q, used_q, kw.get("num_splits_dynamic")))
            p.finish()
        return p.out, p.lse
    absorbed MLA (qv): the same prepare with qv=..., then
        abi.launch_mla(fwd, p.q, p.qv, p.k, p.v, p.kernel_out, p.kernel_lse, p.softmax_scale,
                       cu_q, cu_k, used_q, used_k, pages, p.window_left, p.window_right,
                       sink, p.descales)

Structured arguments: FA4 passes `AuxData(tensors, scalars)` and `DescaleTensors(q, k, v)`,
NamedTuples. tvm-ffi converts any Python tuple to an ffi Array (`tvm_ffi/cython/function.pxi`,
`isinstance(arg, tuple)` -> `TVMFFIPyArgSetterTuple_`), so plain tuples with the same members
are the same argument at the boundary; this module passes plain tuples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fa4aot.model.constraints import resolve_window

# -- slot tables (names only; the builders below are written out for the hot path, and
#    tests/runtime/test_abi.py checks that each builder fills exactly its table's order) -------------

# interface.py 1887-1936 (call_args), 1805-1836 (compile_args): arch // 10 in [8, 9, 12]
SM90_FWD = (
    "q", "k", "v", "out", "lse", "softmax_scale",
    "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "page_table",
    "window_left", "window_right", "learnable_sink",
    "block_sparse", "aux",
    "cu_total_m_blocks", "cu_total_splits_m_blocks",
)  # fmt: skip

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

    The first 14 are the runtime's bound launchers' (runtime/launch.py), in their order. q/k/v/qv/out/lse are what the
    kernel gets (`FwdPrep`: uint8 views for FP8; out_partial / lse_partial when split);
    window_left/right are FA4's resolved ones (`resolve_window`); descales is
    (q_descale, k_descale, v_descale) or None when all three are None (FA4 passes None then).
    max_seqlen_q (sm100 only, required there): the scalar FA4 passes last, `FwdPrep.max_seqlen_q`.

    sm90 (interface.py 1887-1936): 18 slots, block sparsity None, aux data (None, None),
    cu_total_m_blocks and cu_total_splits_m_blocks. Arguments the sm90 kernel has no slot
    for must be None (refused otherwise, rather than dropped).
    sm100/sm103: 25 slots (SM100_FWD); with qv the MLA kernels' 20 (SM100_MLA_FWD,
    interface.py 1864-1885: p, row_max, gather_kv_indices and o_lo are training / sparse-MLA
    slots, None for inference).
    """
    fam = _FAMILY.get(arch) or family(arch)
    # (written out, not table-driven: this runs on every call; tests/runtime/test_abi.py checks that
    # each list follows its table)
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


# -- what FA4 prepares before the call ----------------------------------------------------------

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class FwdPrep:
    """A forward call as FA4 lays it out for its kernel (`fwd_prepare`)."""

    q: torch.Tensor | None  # the kernel's q/k/v/qv: the caller's, or uint8 views for FP8
    k: torch.Tensor | None
    v: torch.Tensor
    qv: torch.Tensor | None
    out: torch.Tensor  # the caller's O (FA4's return value)
    lse: torch.Tensor | None  # the caller's LSE
    kernel_out: torch.Tensor  # the forward's out slot: out, or out_partial when split
    kernel_lse: torch.Tensor | None  # lse, lse_partial, or (MLA) its transposed view
    softmax_scale: float
    causal: bool  # resolved (resolve_window), as FA4's compile key holds them
    local: bool
    window_left: int | None
    window_right: int | None
    max_seqlen_q: int  # the sm100 forward's last slot
    descales: tuple | None
    num_splits: int
    out_partial: torch.Tensor | None = None
    lse_partial: torch.Tensor | None = None  # FA4's layout: (splits, *seqlen-last LSE)
    lse_combine: torch.Tensor | None = None  # the combine's lse slot (MLA: a staging buffer)

    @property
    def mla(self) -> bool:
        return self.qv is not None

    def args(self, arch: str, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
             seqused_k=None, page_table=None, learnable_sink=None, **scheduler) -> tuple:
        """fwd_args for this call; scheduler: fwd_args' keyword slots (cu_total_m_blocks...)."""
        return fwd_args(
            arch, self.q, self.k, self.v, self.kernel_out, self.kernel_lse, self.softmax_scale,
            cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, self.window_left,
            self.window_right, learnable_sink, qv=self.qv, descales=self.descales,
            max_seqlen_q=None if family(arch) == 9 else self.max_seqlen_q, **scheduler,
        )  # fmt: skip

    def combine(self, cu_seqlens_q=None, seqused_q=None, num_splits_dynamic=None,
                virtual_batch_idx=None) -> tuple:
        """combine_args after a split forward (interface.py 1937-1960): the partial LSE
        transposed to (splits, ..., s, h), the caller's LSE transposed likewise (MLA: a
        staging buffer, copied back by `finish`). num_splits_dynamic / virtual_batch_idx: the
        scheduler metadata's, when the forward had it."""
        if self.out_partial is None:
            raise ValueError("not a split-KV call (num_splits == 1): no combine")
        return combine_args(
            self.out_partial, self.lse_partial.transpose(-1, -2), self.out, self.lse_combine,
            cu_seqlens_q, seqused_q, num_splits_dynamic, virtual_batch_idx,
        )  # fmt: skip

    def finish(self) -> None:
        """After the combine: an MLA call's LSE comes back from its staging buffer
        (interface.py 1959-1960). Nothing to do otherwise."""
        if self.out_partial is not None and self.mla and self.lse is not None:
            self.lse.copy_(self.lse_combine)


def out_shape(q_shape, head_dim_v: int, varlen_q: bool) -> tuple:
    """O: (b, s_q, h, dv), or (total_q, h, dv) with cu_seqlens_q (interface.py 864, 872-875)."""
    return (*q_shape[: 1 if varlen_q else 2], q_shape[-2], head_dim_v)


def lse_shape(q_shape, varlen_q: bool, mla: bool) -> tuple:
    """float32 LSE (interface.py 866-870): (b, h, s_q) / (h, total_q); with qv heads last,
    (b, s_q, h) / (total_q, h)."""
    h = q_shape[-2]
    if varlen_q:
        return (q_shape[0], h) if mla else (h, q_shape[0])
    b, s = q_shape[0], q_shape[1]
    return (b, s, h) if mla else (b, h, s)


def max_seqlen_q_slot(q_shape, varlen_q: bool, max_seqlen_q) -> int:
    """The value FA4 passes in the sm100 forward's `max_seqlen_q` slot (interface.py 941-952):
    the caller's host integer hint, else s_q (q in batch form) or total_q (cu_seqlens_q).
    A tensor hint is never read on the host (FA4 drops it for varlen q); fa4aot callers pass
    ints. It is a run-time Int32 of the kernel, not part of the compile key (FA4's own cache
    reuses a kernel across values); the kernel sizes its tile grid's M extent from it
    (flash_fwd_sm100.py 726-735), so it must bound every sequence's query length of the call:
    rows past it would not be computed."""
    if max_seqlen_q is not None and not torch.is_tensor(max_seqlen_q):
        return int(max_seqlen_q)
    return int(q_shape[0] if varlen_q else q_shape[1])


def max_seqlen_k_bound(v, page_table=None, max_seqlen_k=None) -> int:
    """The host bound on KV lengths FA4 uses (interface.py 953-959), the scheduler prepare
    kernel's `max_seqlen_k` slot: the caller's integer hint, else the page table's capacity
    (pages per row x page size), else K's sequence mode (packed: total keys)."""
    if max_seqlen_k is not None and not torch.is_tensor(max_seqlen_k):
        return int(max_seqlen_k)
    if page_table is not None:
        return int(page_table.shape[1] * v.shape[1])
    return int(v.shape[-3])


def fwd_prepare(
    arch: str, q, k, v, *, qv=None, varlen_q: bool = False, max_seqlen_q: int | None = None,
    softmax_scale: float | None = None, causal: bool = False, window_left: int | None = None,
    window_right: int | None = None, return_lse: bool = False, out=None, lse=None,
    num_splits: int = 1, q_descale=None, k_descale=None, v_descale=None, out_partial=None,
    lse_partial=None,
) -> FwdPrep:
    """What `_flash_attn_fwd` does to a call before its kernel runs (interface.py 736-1080,
    1846-1856), for inference calls (no grad, no score/mask mod, no block sparsity):

    - softmax_scale defaults to 1/sqrt(d), or 1/sqrt(d + dv) with both q and qv (MLA);
    - the window is resolved (`resolve_window`): causal -> right 0 -> (None, None) + causal;
    - O is allocated (b, s, h, dv) / (total_q, h, dv), bf16 for FP8 inputs, else q's dtype;
      LSE (float32) when asked for, heads-first, or heads-last with qv (`lse_shape`);
    - split-KV (num_splits > 1, the count FA4's config settled on; sm100 only): float32
      partials out_partial (splits, *O's rows, h, dv) and lse_partial (splits, *LSE) (MLA:
      (splits, b, h, s) / (splits, h, total_q), its kernel takes the transposed view); the
      forward writes those, then the combine kernel (`FwdPrep.combine`) writes O and LSE;
    - FP8: q, k, v (and qv) go to the kernel as uint8 views (interface.py 1852-1856: FA4's
      workaround for exporting fp8 tensors), the descales as one (q, k, v) tuple, or None
      when all three are None;
    - sm100's `max_seqlen_q` slot (`max_seqlen_q_slot`).

    varlen_q: q is packed (cu_seqlens_q given). out_partial / lse_partial: the split's float32
    partial buffers, when the caller keeps them as scratch (the shapes above; else allocated).
    Not done here (the caller's, as FA4's
    maybe_contiguous does it): making inputs 16-byte aligned and unit-stride in the last dim.
    A caller's `out` must be 32-byte aligned when dv is 512 (MLA): FA4 compiles O with that
    alignment assumed (interface.py 884, 1543), 16 bytes otherwise.
    """
    fam = family(arch)
    base = q if q is not None else qv
    mla = qv is not None
    if mla and fam != 10:
        raise ValueError("absorbed MLA (qv) kernels exist on sm100/sm103 only")
    if num_splits > 1 and fam == 9:
        raise ValueError("FA4 4.0.0b36 has no split-KV on sm90 (interface.py 1631)")
    qs = tuple(base.shape)
    d, dv = qs[-1], v.shape[-1]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d if q is None or qv is None else d + dv)
    causal, local, wl, wr = resolve_window(causal, window_left, window_right)
    fp8 = v.dtype in _FP8
    out_dtype = torch.bfloat16 if fp8 else base.dtype
    if out is None:
        out = torch.empty(out_shape(qs, dv, varlen_q), dtype=out_dtype, device=v.device)
    if lse is None and return_lse:
        lse = torch.empty(lse_shape(qs, varlen_q, mla), dtype=torch.float32, device=v.device)
    descales = (
        None
        if q_descale is None and k_descale is None and v_descale is None
        else (q_descale, k_descale, v_descale)
    )
    kq, kk, kv, kqv = q, k, v, qv
    if fp8:
        kq, kk, kv, kqv = (None if t is None else t.view(torch.uint8) for t in (q, k, v, qv))
    prep = FwdPrep(
        q=kq, k=kk, v=kv, qv=kqv, out=out, lse=lse, kernel_out=out, kernel_lse=lse,
        softmax_scale=float(softmax_scale), causal=causal, local=local, window_left=wl,
        window_right=wr, max_seqlen_q=max_seqlen_q_slot(qs, varlen_q, max_seqlen_q),
        descales=descales, num_splits=num_splits,
    )  # fmt: skip
    if num_splits > 1:
        rows = qs[:1] if varlen_q else qs[:2]
        prep.out_partial = (
            torch.empty((num_splits, *rows, qs[-2], dv), dtype=torch.float32, device=v.device)
            if out_partial is None
            else out_partial
        )
        lp = lse_shape(qs, varlen_q, mla=False)  # seqlen-last, for the combine
        prep.lse_partial = (
            torch.empty((num_splits, *lp), dtype=torch.float32, device=v.device)
            if lse_partial is None
            else lse_partial
        )
        prep.kernel_out = prep.out_partial
        prep.kernel_lse = prep.lse_partial.transpose(-1, -2) if mla else prep.lse_partial
        if lse is not None:
            prep.lse_combine = (
                torch.empty(lse.transpose(-1, -2).shape, dtype=lse.dtype, device=lse.device)
                .transpose(-1, -2)
                if mla
                else lse.transpose(-1, -2)
            )
    return prep


# -- the helper kernels' buffers ----------------------------------------------------------------


@dataclass
class CuHint:
    """FA4's varlen scheduler aid for batch > 256 (interface.py 1389-1415): the tile cumsum's
    output, and the blocks-to-batch index FA4 computes from it. Both are forward arguments on
    sm100/sm103; sm90's forward takes the cumsum only (FA4 still runs the second helper)."""

    cu_total_m_blocks: torch.Tensor
    blocks_to_batch_idx: torch.Tensor

    def tile_cumsum_args(self, cu_seqlens_q=None, seqused_q=None) -> tuple:
        return tile_cumsum_args(self.cu_total_m_blocks, None, cu_seqlens_q, seqused_q)

    def blocks_to_batch_args(self) -> tuple:
        return blocks_to_batch_args(self.cu_total_m_blocks, self.blocks_to_batch_idx)

    def fwd_kwargs(self, arch: str) -> dict:
        if family(arch) == 9:
            return {"cu_total_m_blocks": self.cu_total_m_blocks}
        return {"cu_total_m_blocks": self.cu_total_m_blocks,
                "blocks_to_batch_idx": self.blocks_to_batch_idx}  # fmt: skip


def cu_hint_prepare(
    batch: int, total_q: int, tile_m: int, qhead_per_kvhead: int, pack_gqa: bool, device
) -> CuHint:
    """The buffers FA4 allocates for the batch > 256 aid (int32, uninitialized: the helpers
    write them). tile_m and pack_gqa are the forward kernel's (its compile key's)."""
    n = blocks_to_batch_size(total_q, batch, tile_m, qhead_per_kvhead, pack_gqa)
    return CuHint(
        torch.empty(batch + 1, dtype=torch.int32, device=device),
        torch.empty(n, dtype=torch.int32, device=device),
    )


@dataclass
class SchedulerMeta:
    """The scheduler metadata FA4 computes for a split-KV call with a varlen q
    (`_get_scheduler_metadata`, interface.py 4603-4700), before its forward."""

    num_m_blocks: torch.Tensor
    num_splits_dynamic: torch.Tensor
    num_nheads_in_l2: torch.Tensor | None  # causal calls only
    tile_count_semaphore: torch.Tensor | None  # absent with FA4's CLC scheduler
    args: tuple  # the prepare kernel's (scheduler_args)

    def fwd_kwargs(self) -> dict:
        return {"num_splits_dynamic": self.num_splits_dynamic,
                "tile_count_semaphore": self.tile_count_semaphore,
                "num_nheads_in_l2": self.num_nheads_in_l2}  # fmt: skip


def scheduler_prepare(
    prep: FwdPrep, batch: int, max_seqlen_k: int, cu_seqlens_q=None, cu_seqlens_k=None,
    seqused_q=None, seqused_k=None, *, semaphore: bool = True,
) -> SchedulerMeta:  # fmt: skip
    """Buffers and prepare-kernel arguments as FA4 makes them for `prep` (a split call):
    int32 (batch,) block counts and split counts, (batch,) heads-in-L2 for a causal call, a
    (1,) tile semaphore unless the kernel uses the CLC scheduler (`semaphore`: the compile
    key's tile_count_semaphore). max_seqlen_k: `max_seqlen_k_bound`. The combine then takes
    num_splits_dynamic (`FwdPrep.combine(..., num_splits_dynamic=meta.num_splits_dynamic)`)."""
    dev = prep.v.device

    def i32(n):
        return torch.empty(n, dtype=torch.int32, device=dev)

    nmb, dyn = i32(batch), i32(batch)
    l2 = i32(batch) if prep.causal else None
    sem = i32(1) if semaphore else None
    args = scheduler_args(
        prep.max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        batch, prep.num_splits, sem, nmb, dyn, l2,
    )  # fmt: skip
    return SchedulerMeta(nmb, dyn, l2, sem, args)
