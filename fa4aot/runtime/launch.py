"""Launching: which binders an artifact's parts get, and what FA4 does around a Blackwell call.

`abi_for(arch, fa4_abi)` gives the `Abi` of a store's artifacts: for each part, the binder
(`runtime/abi.py`, where every argument list is spelled) that closes the loaded tvm-ffi
function over its list once per load; by arch (FA4's sm90 and sm100 families) and by the FA4
source the store was built from (upstream, vLLM's copy, SGLang's copy).

The Blackwell path (runtime/blackwell.py) and absorbed MLA (runtime/mla.py) also reproduce
what FA4's `_flash_attn_fwd` prepares before its kernel runs and does after it:

    p = fwd_prepare(arch, q, k, v, varlen_q=cu_q is not None, max_seqlen_q=hint,
                    softmax_scale=scale, causal=causal, window_left=wl, window_right=wr,
                    return_lse=return_lse, out=out, lse=lse,
                    num_splits=n)   # n > 1 only for a split-KV variant
    kw = {}
    if varlen q and batch > 256:   # both helpers; both outputs go to the forward
        h = cu_hint_prepare(batch, total_q, tile_m, ratio, pack_gqa, device)
        tile_cumsum(*h.tile_cumsum_args(cu_q, used_q))
        blocks_to_batch(*h.blocks_to_batch_args())
        kw = h.fwd_kwargs(arch)
    if p.num_splits > 1 and varlen q:   # FA4's scheduler prepare kernel first
        m = scheduler_prepare(p, batch, max_seqlen_k_bound(v, pages, hint_k), cu_q, cu_k,
                              used_q, used_k, semaphore=...)
        scheduler(*m.args)
        kw = m.fwd_kwargs()
    fwd(*p.args(arch, cu_q, cu_k, used_q, used_k, pages, sink, **kw))  # or abi.launch_sm100
    if p.num_splits > 1:
        combine(*p.combine(cu_q, used_q, kw.get("num_splits_dynamic")))
        p.finish()
    return p.out, p.lse
absorbed MLA (qv): the same prepare with qv=..., then
    abi.launch_mla(fwd, p.q, p.qv, p.k, p.v, p.kernel_out, p.kernel_lse, p.softmax_scale,
                   cu_q, cu_k, used_q, used_k, pages, p.window_left, p.window_right, sink,
                   p.descales)

`tests/runtime/test_abi.py` checks these against FA4's own calls. Imports torch (and
fa4aot.model.constraints) only: no cutlass, no flash_attn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from fa4aot.errors import UnsupportedVariant
from fa4aot.model.constraints import resolve_window
from fa4aot.runtime import abi as A
from fa4aot.runtime.abi import (
    blocks_to_batch_args,
    blocks_to_batch_size,
    combine_args,
    family,
    fwd_args,
    scheduler_args,
    tile_cumsum_args,
)


@dataclass(frozen=True)
class Abi:
    """How one arch's artifacts are called: each field binds a loaded part to its launcher."""

    fwd: Callable[..., Callable]  # (kernel, guard=True): see A.bind_sm90_fwd
    tile_cumsum: Callable[[Any], Callable]
    combine: Callable[[Any], Callable]
    blocks_to_batch: Callable[[Any], Callable | None] = A.bind_no_blocks_to_batch
    blackwell: bool = False  # FA4's sm100 family: the entry points take runtime/blackwell.py
    mla_fwd: Callable[..., Callable] | None = None  # absorbed-MLA forwards (Blackwell only)


SM90 = Abi(A.bind_sm90_fwd, A.bind_tile_cumsum, A.bind_combine)
# The tile cumsum and the combine take the same slots on every arch (abi.TILE_CUMSUM, COMBINE)
SM100 = Abi(A.bind_sm100_fwd, A.bind_tile_cumsum, A.bind_combine, A.bind_blocks_to_batch,
            blackwell=True, mla_fwd=A.bind_mla_fwd)
_ABIS: dict[str, Abi] = {"sm90": SM90, "sm100": SM100, "sm103": SM100}
# stores built from vLLM's FA4 copy (toolchain fa4_abi "vllm"; its tile cumsum takes upstream's)
SM90_VLLM = Abi(A.bind_vllm_sm90_fwd, A.bind_tile_cumsum, A.bind_vllm_combine)
# stores built from SGLang's copy (fa4_abi "sglang"; its combine takes upstream's nine slots)
SM90_SGLANG = Abi(A.bind_sglang_sm90_fwd, A.bind_tile_cumsum, A.bind_combine)
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
