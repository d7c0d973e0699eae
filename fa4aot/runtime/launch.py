"""Launchers: each loaded part bound, once, to the argument list `runtime.abi` spells for it.

`runtime.abi` is the one description of FA4's compiled-function ABIs (slot tables, what FA4
prepares before a call; tests/runtime/test_abi.py proves them FA4's). This module binds an artifact's
parts (tvm-ffi functions taking that signature positionally) through their arch's `Abi`
(`abi_for(variant.arch)`), so every call site uses one keyword-free, arch-neutral form:

    fwd(q, k, v, out, lse, scale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        page_table, window_left, window_right, learnable_sink, cu_total_m_blocks)
    tile_cumsum(out, cu_seqlens_q, seqused_q)
    combine(out_partial, lse_partial, out, lse)    (FA4's combine; fa4aot_merge: fa4aot's)

sm100/sm103 (`SM100`): the same arch-neutral form, plus the trailing keywords FA4's Blackwell
forward has slots for (`max_seqlen_q`, `descales`, `blocks_to_batch_idx`), passed on to
`abi.launch_sm100`; `blocks_to_batch(cu_total, out)` is the second batch > 256 helper, whose
output only the Blackwell forward takes; `mla_fwd` binds an absorbed-MLA forward
(`abi.launch_mla`; runtime/mla.py). The sm90 launchers write abi's slot order out inline: a
launcher is one Python frame (a closure over the kernel, built once per load), and
tests/runtime/test_abi.py checks what each passes against FA4's own call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from fa4aot.errors import UnsupportedVariant
from fa4aot.runtime import abi as A

_NO_AUX = (None, None)  # FA4's AuxData(tensors=None, scalars=None): a compile-time value

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


def _sm90_fwd(kernel: Any, guard: bool = True) -> Callable:
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
            page_table, window_left, window_right, learnable_sink, None, _NO_AUX,
            cu_total_m_blocks, None,
        )

    return fwd


def _sm90_tile_cumsum(kernel: Any) -> Callable:
    """FA4's `_compute_tile_cumsum` helper (varlen batch > 256): out (batch+1,) int32, then
    (unused) seqlen, cu_seqlens_q, seqused_q, and two compile-time Nones."""

    def tile_cumsum(out, cu_seqlens_q, seqused_q):
        kernel(out, None, cu_seqlens_q, seqused_q, None, None)

    return tile_cumsum


def _sm90_combine(kernel: Any) -> Callable:
    """FA4's `flash_fwd_combine` as the split-KV part `combine` is compiled: partial O (chunk,
    batch, seqlen, heads, dv), partial LSE (chunk, batch, seqlen, heads), out, lse, then
    cu_seqlens, seqused, num_splits_dynamic, semaphore and varlen batch index, all None."""

    def combine(out_partial, lse_partial, out, lse):
        kernel(out_partial, lse_partial, out, lse, None, None, None, None, None)

    return combine


def fa4aot_merge(kernel: Any) -> Callable:
    """fa4aot's split-KV merge (kernels.trace_merge; the part `merge` of a split chunk
    kernel's artifact): FA4's combine's four tensors, nothing else. Arch-neutral."""

    def combine(out_partial, lse_partial, out, lse):
        kernel(out_partial, lse_partial, out, lse)

    return combine


def fa4aot_chunk_meta(kernel: Any) -> Callable:
    """fa4aot's split-step chunk metadata kernel (kernels.trace_chunk_meta; the part
    `chunk_meta` of a split chunk kernel's artifact): two int32 tensors, four int32s."""

    def chunk_meta(src, dst, chunk, slots, rows, causal):
        kernel(src, dst, chunk, slots, rows, causal)

    return chunk_meta


def _sm100_fwd(kernel: Any, guard: bool = True) -> Callable:
    """FA4 4.0.0b36's sm100/sm103 forward (`abi.launch_sm100`: 25 slots). max_seqlen_q, when
    not given, is what FA4 passes for a call without a hint (`abi.max_seqlen_q_slot`): s_q for q
    in batch form, total_q for a packed q; the runtime's Blackwell path passes the caller's
    host hint (runtime/blackwell.py). q/k/v are what the kernel takes (uint8 views for FP8).
    guard: unused (the sm90 launcher's page-table guard is for FA4's sm90 TMA paged path)."""
    launch = A.launch_sm100

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


def _sm100_mla_fwd(kernel: Any, guard: bool = True) -> Callable:
    """FA4 4.0.0b36's absorbed-MLA forward (sm100/sm103, `abi.launch_mla`: 20 slots, another
    order than the dense forward's: q, qv, k, v, out, lse, scale, then the varlen tensors, the
    page table, the descales, the window, the sink; training and sparse slots None). Bound for a
    plan whose variant is an MLA kernel (runtime/mla.py calls it). guard: unused, as sm100's."""
    launch = A.launch_mla

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


def _blocks_to_batch(kernel: Any) -> Callable:
    """FA4's `_compute_blocks_to_batch` helper (varlen batch > 256, after the tile cumsum):
    `abi.blocks_to_batch_args`."""

    def blocks_to_batch(cu_total_blocks, blocks_to_batch_idx):
        kernel(*A.blocks_to_batch_args(cu_total_blocks, blocks_to_batch_idx))

    return blocks_to_batch


def _no_blocks_to_batch(kernel: Any) -> None:
    """sm90's forward has no slot for the blocks-to-batch index: the runtime never runs it."""
    return None


def _vllm_sm90_fwd(kernel: Any, guard: bool = True) -> Callable:
    """vLLM's FA4 copy's sm90 forward (21 slots: runtime/vllm_abi.py): the same arch-neutral
    form as _sm90_fwd, plus the FP8-KV descales (q, k, v) as a keyword. The copy's TMA paged path
    reads page_table[b, -1] as upstream's does: the same guard (GUARD_ALIGN)."""

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
            page_table, window_left, window_right, learnable_sink, None, _NO_AUX, descales,
            None, cu_total_m_blocks, None,
        )

    return fwd


def _vllm_combine(kernel: Any) -> Callable:
    """vLLM's copy's combine: upstream's nine slots and an output scale (None)."""

    def combine(out_partial, lse_partial, out, lse):
        kernel(out_partial, lse_partial, out, lse, None, None, None, None, None, None)

    return combine


def _sglang_sm90_fwd(kernel: Any, guard: bool = True) -> Callable:
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
            page_table, window_left, window_right, learnable_sink, None, _NO_AUX, None,
        )

    return fwd


@dataclass(frozen=True)
class Abi:
    """How one arch's artifacts are called: each field binds a loaded part to its launcher."""

    fwd: Callable[..., Callable]  # (kernel, guard=True): see _sm90_fwd
    tile_cumsum: Callable[[Any], Callable]
    combine: Callable[[Any], Callable]
    blocks_to_batch: Callable[[Any], Callable | None] = _no_blocks_to_batch
    blackwell: bool = False  # FA4's sm100 family: the entry points take runtime/blackwell.py
    mla_fwd: Callable[..., Callable] | None = None  # absorbed-MLA forwards (Blackwell only)


SM90 = Abi(_sm90_fwd, _sm90_tile_cumsum, _sm90_combine)
# The tile cumsum and the combine take the same slots on every arch (abi.TILE_CUMSUM, COMBINE)
SM100 = Abi(_sm100_fwd, _sm90_tile_cumsum, _sm90_combine, _blocks_to_batch, blackwell=True,
            mla_fwd=_sm100_mla_fwd)
_ABIS: dict[str, Abi] = {"sm90": SM90, "sm100": SM100, "sm103": SM100}
# stores built from vLLM's FA4 copy (toolchain fa4_abi "vllm"; its tile cumsum takes upstream's)
SM90_VLLM = Abi(_vllm_sm90_fwd, _sm90_tile_cumsum, _vllm_combine)
# stores built from SGLang's copy (fa4_abi "sglang"; its combine takes upstream's nine slots)
SM90_SGLANG = Abi(_sglang_sm90_fwd, _sm90_tile_cumsum, _sm90_combine)
_SOURCE_ABIS: dict[tuple[str, str], Abi] = {("sm90", "vllm"): SM90_VLLM,
                                            ("sm90", "sglang"): SM90_SGLANG}


def register(arch: str, abi: Abi) -> None:
    """Make `arch`'s artifacts callable (a module spelling that arch's ABI calls this)."""
    _ABIS[arch] = abi


def abi_for(arch: str, fa4_abi: str = "upstream") -> Abi:
    """How `arch`'s artifacts built from an FA4 source of ABI `fa4_abi` (the store's toolchain)
    are called."""
    if fa4_abi != "upstream":
        try:
            return _SOURCE_ABIS[arch, fa4_abi]
        except KeyError:
            raise UnsupportedVariant(
                f"the fa4aot runtime knows no {fa4_abi} FA4 kernel ABI for {arch}") from None
    try:
        return _ABIS[arch]
    except KeyError:
        raise UnsupportedVariant(
            f"the fa4aot runtime knows no kernel ABI for {arch} (known: {', '.join(_ABIS)})"
        ) from None
