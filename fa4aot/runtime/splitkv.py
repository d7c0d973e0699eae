"""Split-KV decode steps at run time (fa4aot/split.py: the plan, the cost model, exactness),
and the fold of the one-row decode steps the plan leaves unsplit onto the same kernel
(FoldRun).

`split_step` serves a decode step split, or returns None (the caller runs it unsplit). Its
per-call work is what the inputs force: one cache lookup keyed by host-known sizes, the
kernel-facing views of the caller's tensors (q as it is, read through the chunk kernel's chunk
mode, compiler.trace_chunk_modes; in stores built before it, a stride-0 mode at one decode
row, else one broadcast copy; a dense K as packed, or, at several query rows, as pages where
a cached page size divides its length), the chunk metadata from the caller's KV lengths (one
metadata kernel into scratch for a paged K at several rows; none for a dense K, nor for a
paged one at one row, nor for a packed one, whose kernel cuts the lengths or reads every
row's bounds itself through its bounds mode; in older stores the metadata kernel for every
packed and paged step, or two torch element-wise kernels), the chunk kernel, the sink slot,
the merge. Everything that depends only
on the step's sizes (the split, scratch buffers and every view of them, chunk offsets, a dense
K's chunk bounds or page table, output shapes, the default softmax scale, the bound launchers)
is made once per (device, stream, shape) in `SplitRun` (or as a cached constant).

No host sync; CUDA graphs: steps on one stream are ordered, so a step never overwrites
scratch an earlier one still reads. While a graph is captured nothing is reused or kept: the
graph gets scratch of its own, from its pool (constants made eagerly before, e.g. by the
warm-up call, are shared: nothing writes them).
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager

import torch

from .. import constraints as C
from .. import split as S
from .launch import guard_page_table

_PLAN_KEYS = S.PLAN_KEYS
# SplitRuns kept (each holds scratch for one batch size / stream): bound what they hold
_MAX_RUNS = 16
_MAX_KEYS = 4096
# A causal packed step's tail (PackedRun) captured in a CUDA graph runs on a side stream,
# beside the chunks, on the SMs they leave (False: after them, on the caller's stream, as an
# eager step always does). H200, 2026-12-02 (spec_decode.py, 32:8 hd128, side / serial, us):
# in a graph b1/64K s_q 4 81.0 / 82.3, b2/32K 82.9 / 84.4, b4/32K 148.1 / 151.3; eagerly
# the fork, the join and the stream switches cost the host 8-19 us a step (b1/64K 104.0 /
# 95.6, b1/8K 64.2 / 45.5), more than the overlap gains.
TAIL_STREAM = True
_SIDE: dict = {}

# (absent from CPU-only torch builds; called for CUDA tensors only)
_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class _Tls(threading.local):
    fresh = False  # (a class default: a thread that never entered fresh_scratch reads it fast)


_tls = _Tls()


@contextmanager
def fresh_scratch():
    """Inside: a split step keeps nothing it allocates (as while a graph is captured). For
    callers whose allocations may come from a CUDA-graph pool without a capture running:
    torch.compile's cudagraph trees run warm-up calls in the graph's pool and refuse any
    tensor there that outlives the call untracked (fa4aot.ops enters this)."""
    prev = _tls.fresh
    _tls.fresh = True
    try:
        yield
    finally:
        _tls.fresh = prev


def _keep_nothing(cuda: bool) -> bool:
    """Whether a split step must keep nothing it allocates: inside fresh_scratch, or while a
    CUDA graph is captured (CPU tensors: the tests' stand-in kernels, never captured)."""
    return _tls.fresh or (cuda and _is_capturing())


def split_step(
    rt, dev: int, q, k, v, kind: str, cu_seqlens_k, seqused_k, page_table,
    b: int, rows: int, hq: int, hk: int, d: int, dv: int, seqlen_k: int,
    page_size: int | None, causal: bool, sink, softmax_scale, out, lse, return_lse: bool,
    varlen_q: bool,
):
    """Serve a decode step split-KV (Runtime.split_for decides), or one the plan does not split
    as one chunk per sequence on the same kernel (FoldRun), or return None (FA4's kernel).

    q: the caller's q, (b, rows, hq, d) or packed (b * rows, hq, d) when varlen_q; kind:
    "dense" | "varlen" | "paged" | "padded" K (a KV cache in batch form, (b, capacity, hk, d),
    with seqused_k: FA2's flash_attn_with_kvcache layout, split as a page pool whose table is
    an arange); seqlen_k: a host bound on every KV length (a dense K's exact length); out /
    lse: the caller's buffers or None (lse laid out as the entry point returns it)."""
    dense_pages = padded = False
    if kind == "padded":
        # the cache as its own page pool (page size: the first cached one dividing its
        # capacity), the caller's lengths: a paged K at any number of rows
        page_size = _dense_page(rt, dev, q.dtype, d, dv, k.size(1))
        if not page_size:
            return None
        padded, kind = True, "paged"
    elif rows > 1 and kind != "paged":
        # several rows a sequence: a dense K whose length a cached paged split kernel's page
        # size divides is its own page pool; else the rows run (packed into one chunk:
        # PackedRun, or unrolled) on the packed K's bounds mode, which gives each row its own
        # keys (compiler.trace_chunk_modes(bounds=True); a store built before it: unsplit)
        page_size = kind == "dense" and _dense_page(rt, dev, q.dtype, d, dv, seqlen_k)
        if page_size:
            dense_pages, kind = True, "paged"
        else:
            page_size = None
            kern = rt.split_kernel(dev, q.dtype, d, dv, None)
            if kern is None or kern.launch_bounds is None:
                return None
    if q.is_cuda:
        capturing = _keep_nothing(True)
        stream = _raw_stream(dev)
    else:  # (CPU tensors: the tests' stand-in kernels)
        capturing, stream = _keep_nothing(False), 0
    # a dense K's chunk bounds depend on its exact length; the rest on the plan's bucket
    key = (
        kind, dev, stream, q.dtype, b, rows, hq, hk, d, dv,
        seqlen_k if kind == "dense" else -(-seqlen_k // _PLAN_KEYS),
        page_size, causal, sink is not None, varlen_q, rt.split,
        dense_pages,  # (a dense K as pages plans its packed rows with no metadata launch)
    )
    run = None if capturing else rt._split_runs.get(key)
    if run is None:
        fold = not S.fold_refusal(arch=rt.device(dev)[0], head_dim=d, head_dim_v=dv,
                                  ratio=hq // hk, rows=rows, sink=sink is not None)
        sp = rt.split_for(dev, q.dtype, b * rows * hk, seqlen_k, d, dv, page_size,
                          sink is not None, b * rows, fold=fold, one_row=rows == 1)
        pk = rows > 1 and _packed_plan(rt, dev, q.dtype, b, rows, hq, hk, d, dv, seqlen_k,
                                       page_size, causal, sink is not None, sp, not dense_pages)
        if pk:
            run = PackedRun(rt, dev, q, b, rows, hq, hk, d, dv, pk, page_size, causal,
                            varlen_q, seqlen_k, kind, ffi=q.is_cuda)
        elif sp is not None:
            run = SplitRun(rt, dev, q, b, rows, hq, hk, d, dv, kind, sp, page_size, causal,
                           seqlen_k, varlen_q, ffi=q.is_cuda)
        else:
            run = fold and FoldRun.make(rt, dev, q, b, hq, hk, d, dv, kind, page_size,
                                        seqlen_k, varlen_q)
        if not capturing:
            if len(rt._split_runs) > _MAX_KEYS or (run and rt._split_scratch >= _MAX_RUNS):
                rt._split_runs.clear()
                rt._split_scratch = 0
            rt._split_runs[key] = run
            rt._split_scratch += run is not False
    if run is False:
        return None
    if dense_pages or padded:
        k, v, page_table, used = _dense_as_pages(rt, dev, q, k, v, b, hk, d, dv, k.size(1),
                                                 page_size, dense_pages)
        if k is None:
            return None
        if dense_pages:
            seqused_k = used
    if kind == "dense":
        try:
            k, v = k.view(*run.k_shape), v.view(*run.v_shape)
        except RuntimeError:
            return None  # K/V strided across batch and sequence: no packed view
    if run.packed:
        return _packed_step(run, rt, dev, q, k, v, cu_seqlens_k, seqused_k, page_table,
                            dense_pages, b, seqlen_k, softmax_scale, sink, out, lse, return_lse,
                            varlen_q)
    if run.fold:
        return _fold_step(run, q, k, v, kind, cu_seqlens_k, seqused_k, page_table,
                          softmax_scale, out, lse, return_lse)
    if out is not None:
        if run.out_as_is:
            out_c = out  # (b, 1, hq, dv), any strides: the combine's own shape
        else:
            try:  # the combine writes the caller's out in place, as (decode rows, 1, hq, dv)
                out_c = out.view(*run.out_c_shape)
            except RuntimeError:
                return None  # a caller's out whose rows do not merge
    if run.q_broadcast:
        # the kernel reads decode row i's q for its chunks i * slots + j through a chunk mode
        # (compiler.trace_chunk_modes): q as (decode rows, r, hk, d), a view
        sr, sh = q.stride(0) if varlen_q or rows == 1 else q.stride(1), q.stride(-2)
        if not varlen_q and rows > 1 and q.stride(0) != rows * sr:
            q = q.reshape(run.q_rows_shape)  # (rows whose strides do not merge: one copy)
            sr, sh = q.stride(0), q.stride(1)
        kq = torch.as_strided(q, run.kq_size, (sr, sh, run.r * sh, 1))
    elif run.one_row:
        # one decode row: every chunk reads the same q through a stride-0 batch mode, no copy
        # (the kernel took it and matched the copied q bit for bit on the H200, 2026-11-30)
        sh = q.stride(-2)
        kq = torch.as_strided(q, run.kq_size, (0, sh, run.r * sh, 1))
    else:
        run.q_dst.copy_(q)  # q broadcast over the chunk slots
        kq = run.kq
    launch = run.launch
    if run.launch_bounds is not None:
        # chunk j of row t of sequence i starts at min(cu[i] + j*c, cu[i+1]) and holds
        # clamp(cu[i+1] - cu[i] - (causal: rows - 1 - t) - j*c, 0, c) keys: read by the kernel
        # itself from cu_seqlens_k passed as (b + 1, rows, c, causal shift, anchor 1)
        # (compiler.trace_chunk_modes(bounds=True)); a dense K's cu: a constant
        launch = run.launch_bounds
        cu_seqlens_k = (run.cu_k_f if kind == "dense" else _bounds(
            cu_seqlens_k, run.cu_bounds_size))
    elif kind == "dense":
        cu_seqlens_k = run.cu_k_f
    elif kind == "varlen":
        # one row a sequence: the bounds written into scratch, no allocation, by one kernel
        # (compiler.trace_chunk_meta; a store whose bounds mode predates several rows, or a
        # wide plan, whose kernel has no bounds mode), or two torch ones
        if run.meta is not None:
            run.meta(cu_seqlens_k, run.cu_buf_f, *run.meta_args)
            cu_seqlens_k = run.cu_flat_f
        else:
            torch.add(run.offs_col, cu_seqlens_k, out=run.cu_t)
            torch.minimum(run.cu_t_lo, cu_seqlens_k[1:], out=run.cu_t_lo)
            cu_seqlens_k = run.cu_flat_f
    else:
        # per-chunk lengths clamp(len - offset, 0, c), (sequence, row * slots), likewise; a
        # kernel that cuts lengths into chunks itself (compiler.trace_chunk_modes) takes the
        # caller's at one decode row, and each unrolled row's (the metadata kernel's
        # meta_args say so: one chunk of 2**30 keys) at several
        if dense_pages:
            # a dense K as pages (_dense_as_pages): its lengths and page table are constants,
            # and so are their chunked forms (no metadata launch, no table copy per call)
            seqused_k, page_table = _const(
                rt, ("dense_meta", dev, b, seqlen_k, page_size, rows, causal, run.sp,
                     run.chunk_lengths), q.device,
                lambda: _dense_meta(run, seqused_k, page_table, b, rows, causal, page_size),
            )
        else:
            if run.chunk_lengths and rows == 1:
                pass
            elif run.meta is not None:
                run.meta(seqused_k, run.len_buf_f, *run.meta_args)
                seqused_k = run.len_flat_f
            else:
                torch.sub(seqused_k, run.offs_col, out=run.len_t)
                run.len_buf.clamp_(0, run.chunk)
                seqused_k = run.len_flat_f
            if padded:
                # the arange table's chunked form: a constant, which the run keeps for its
                # later steps (a run made while a CUDA graph is captured finds the eager
                # warm-up's, so the graph computes nothing for it)
                pt = run.padded_pt
                if pt is None or pt[0] is not page_table:
                    table = page_table
                    pt = run.padded_pt = (table, _const(
                        rt, ("padded_table", dev, tuple(table.shape), page_size, rows, run.sp),
                        q.device, lambda: guard_page_table(
                            S.chunk_page_table(torch, table, run.sp, page_size, rows))))
                page_table = pt[1]
            elif run.pt_rows and page_table.size(1) == run.pt_cols and page_table.is_contiguous():
                page_table = page_table.view(*run.pt_shape)  # the chunks' pages: a view
            else:
                page_table = S.chunk_page_table(torch, page_table, run.sp, page_size, rows)
    launch(
        kq, k, v, run.ko_f, run.kl_f, run.scale if softmax_scale is None else float(softmax_scale),
        None, cu_seqlens_k, None, seqused_k, page_table,
    )
    if sink is not None:  # the empty last slot carries the sink: counted once, as FA4 does
        run.lp_sink.copy_(sink)
    if out is None:
        out = q.new_empty(*run.out_shape)
        out_c = out if run.out_as_is else out.view(*run.out_c_shape)
    if return_lse and lse is None:
        lse = q.new_empty(*run.lse_shape, dtype=torch.float32)
    if lse is not None and rows == 1:
        lse_c = torch.as_strided(lse, run.lse_c_size, run.lse_c_stride)
    else:
        lse_c = run.lse_scratch_f
    run.merge(run.op_c_f, run.lp_c_f, out_c, lse_c)
    if lse is not None and rows > 1:
        lse.copy_(run.lse_rows)
    return out, lse


def _packed_plan(rt, dev, dtype, b, rows, hq, hk, d, dv, seqlen_k, page_size, causal, sink,
                 unrolled, meta):
    """split.plan_packed for a step of several rows, where the chunk kernel reads q and cuts a
    paged K's lengths (or a packed K's bounds: page_size None, the bounds mode) through its
    chunk modes (compiler.trace_chunk_modes) and packs the rows (split.packed_refusal); else
    None (unrolled, or unsplit)."""
    kern = rt.split_kernel(dev, dtype, d, dv, page_size)
    if kern is None or not kern.q_broadcast or not (
            kern.chunk_lengths if page_size else kern.launch_bounds is not None):
        return None
    arch, sms = rt.device(dev)
    if S.packed_refusal(ratio=hq // hk, rows=rows, tile_m=C.split_tile_m(arch, d, dv),
                        page_size=page_size):
        return None
    return S.plan_packed(
        batch=b, kv_heads=hk, rows=rows, seqlen_k=S.plan_bucket(seqlen_k),
        bytes_per_key=(d + dv) * dtype.itemsize, page_size=page_size, sink=sink, causal=causal,
        num_sms=sms, setting=rt.split, max_slots=kern.max_slots, unrolled=unrolled,
        meta_s=S.packed_meta_s(meta and page_size is not None, kern.packed_meta is not None),
        model=rt.cost_model(dev),
    )


def _dense_page(rt, dev, dtype, d, dv, seqlen_k) -> int:
    """The page size a dense K of seqlen_k keys is split through at several query rows
    (split.dense_page_size over the cached paged split kernels), 0 for none; once per shape."""
    key = ("dense_page", dev, dtype, d, dv, seqlen_k)
    page = rt._split_consts.get(key)
    if page is None:
        page = S.dense_page_size(
            seqlen_k, lambda p: rt.split_kernel(dev, dtype, d, dv, p) is not None
        ) or 0
        rt._split_consts[key] = page
    return page


def _dense_as_pages(rt, dev, q, k, v, b, hk, d, dv, seqlen_k, page, used=True):
    """A dense K/V (b, seqlen_k, hk, .) as a paged one: (K and V as pages of `page` keys,
    views of the caller's; the page table, an arange; with `used`, seqused_k, all seqlen_k,
    else None: constants per shape), or (None,) * 4 when K/V do not view as pages."""
    n = b * seqlen_k // page
    try:
        k, v = k.view(n, page, hk, d), v.view(n, page, hk, dv)
    except RuntimeError:
        return None, None, None, None  # K/V strided across batch and sequence
    dvc = q.device
    table = _const(rt, ("dense_pages", dev, b, seqlen_k, page), dvc, lambda: torch.arange(
        n, dtype=torch.int32, device=dvc).view(b, seqlen_k // page))
    lens = None
    if used:
        lens = _const(rt, ("dense_used", dev, b, seqlen_k), dvc, lambda: torch.full(
            (b,), seqlen_k, dtype=torch.int32, device=dvc))
    return k, v, table, lens


def _dense_meta(run, used, table, b, rows, causal, page_size):
    """The kernel-facing lengths and chunked page table (behind a guard, launch.GUARD_ALIGN:
    no call copies it) of a dense K viewed as pages
    (_dense_as_pages: every sequence holds all its keys), computed in torch once per shape:
    what the metadata kernel (or its torch fallback) and split.chunk_page_table make per call
    for a caller's paged K, for these constant inputs. Lengths: each unrolled row's, (b *
    rows,), where the kernel cuts them into chunks itself (run.chunk_lengths), else each (row,
    chunk)'s, clamp(len - offset, 0, c), (b * rows * slots,)."""
    if run.chunk_lengths:
        back = torch.arange(rows - 1, -1, -1, dtype=torch.int32, device=used.device)
        lens = (used[:, None] - (back if causal else back * 0)).clamp_(min=0)
    else:
        lens = (used[:, None] - run.offs_col.view(1, -1)).clamp_(0, run.chunk)
    return (lens.reshape(-1).contiguous(),
            guard_page_table(S.chunk_page_table(torch, table, run.sp, page_size, rows)))


def _fold_step(run, q, k, v, kind, cu_seqlens_k, seqused_k, page_table, softmax_scale, out,
               lse, return_lse):
    """A one-row decode step the plan does not split, on the chunk kernel as one chunk per
    sequence (FoldRun): q, out and LSE as strided views of the caller's tensors, (b, r, hk, .)
    (one as_strided each: the entry points checked their last dims contiguous, a given LSE
    contiguous); the LSE of a packed q, laid out (hq, b), through scratch and one copy."""
    if out is None:
        out = q.new_empty(*run.out_shape)
    if lse is None and return_lse:
        lse = q.new_empty(*run.lse_shape, dtype=torch.float32)
    sh, oh, r = q.stride(-2), out.stride(-2), run.r
    kl = run.lse_scratch_f
    if lse is not None and run.lse_as_is:
        kl = torch.as_strided(lse, run.kl_shape, run.kl_stride)
    run.launch(
        torch.as_strided(q, run.q4, (q.stride(0), sh, r * sh, 1)), k, v,
        torch.as_strided(out, run.o4, (out.stride(0), oh, r * oh, 1)), kl,
        run.scale if softmax_scale is None else float(softmax_scale),
        None, run.cu_k_f if kind == "dense" else cu_seqlens_k, None, seqused_k, page_table,
    )
    if lse is not None and not run.lse_as_is:
        lse.copy_(run.lse_rows)
    return out, lse


class FoldRun:
    """A one-row decode step that the plan does not split, run on the split's chunk kernel
    with one chunk per sequence: the GQA fold (a KV head's r query heads as r rows of the 1:1
    kernel, q and out viewed, no copy) on the chunk kernel's 64-row M tile
    (constraints.split_tile_m), where FA4's decode kernel packs them into a 128-row tile. The
    same bits as FA4's kernel (H200, 2026-12-01: torch.equal at 18 shapes) in less GPU time at
    every batch measured: 32:8 hd128 in a CUDA graph, b2/1K 15.8 -> 11.9 us, b8/4K 49.4 ->
    37.6; in one decode run (2026-12-01-s7-e) against FA4's kernel, eager, b32/128K 4097 ->
    3843 us, b64/128K 9096 -> 7580, b128/64K 8153 -> 7600, b128/1K 145.6 -> 137.0. About 10 us
    more host time per call (the views). With more (sequence, KV head) CTAs than SMs it may
    run on a wide fold kernel instead (`wide`, its part name; constraints.fold_kernel by how
    the CTAs fill the waves, compiler.trace_wide_fold: 64-key tiles, two CTAs per SM, or one
    for a packed K's long context).
    Not for a learnable sink (the chunk kernel has none), a head ratio over the tile's rows,
    or a chunk kernel with FA4's own tile (head dims over 128, Blackwell)."""

    fold = True
    packed = False
    __slots__ = ("launch", "wide", "scale", "r", "q4", "o4", "k_shape", "v_shape", "cu_k",
                 "cu_k_f", "kl_shape", "kl_stride", "lse_as_is", "lse_scratch", "lse_scratch_f",
                 "lse_rows", "out_shape", "lse_shape")

    @classmethod
    def make(cls, rt, dev, q, b, hq, hk, d, dv, kind, page_size, seqlen_k, varlen_q):
        """The fold of a step split.fold_refusal accepts, or False (the stores lack the chunk
        kernel: run it on FA4's exact kernel)."""
        kern = rt.split_kernel(dev, q.dtype, d, dv, page_size)
        if kern is None:
            return False
        return cls(rt, dev, q, b, hq, hk, d, dv, kind, kern, seqlen_k, varlen_q)

    def __init__(self, rt, dev, q, b, hq, hk, d, dv, kind, kern, seqlen_k, varlen_q):
        r, dvc = hq // hk, q.device
        # a fold of more CTAs than SMs runs on a wide fold kernel, where cached and where its
        # waves fill the chip (constraints.fold_kernel, WideFold: 64-key tiles, two CTAs per
        # SM, or one for a packed K's long context); FA4's ABI, the same arguments
        wides = {"fwd_wide": kern.launch_wide, "fwd_wide1": kern.launch_wide1}
        self.wide = C.fold_part(b * hk, rt.device(dev)[1], kind == "paged",
                                S.plan_bucket(seqlen_k),
                                [n for n, f in wides.items() if f is not None])
        self.launch = wides[self.wide] if self.wide else kern.launch
        self.scale = float(1.0 / math.sqrt(d))
        self.r = r
        self.q4, self.o4 = (b, r, hk, d), (b, r, hk, dv)  # r query heads as rows of a 1:1 kernel
        self.k_shape, self.v_shape = (b * seqlen_k, hk, d), (b * seqlen_k, hk, dv)
        self.kl_shape, self.kl_stride = (b, hk, r), (hq, r, 1)
        # the entry points' LSE: (b, hq, 1) for q in batch form, a view of the kernel's; (hq, b)
        # for a packed q, which is not (its rows' stride is b): scratch, then one copy
        self.lse_as_is = not varlen_q or b == 1
        self.out_shape = (b, hq, dv) if varlen_q else (b, 1, hq, dv)
        self.lse_shape = (hq, b) if varlen_q else (b, hq, 1)
        self.lse_scratch = torch.empty(self.kl_shape, dtype=torch.float32, device=dvc)
        self.lse_rows = self.lse_scratch.view(b, hq).t() if varlen_q else None
        self.cu_k = None
        if kind == "dense":
            self.cu_k = _dense_cu(rt, dev, b, seqlen_k, dvc)
        conv = _to_ffi if q.is_cuda else (lambda t: t)
        self.lse_scratch_f = conv(self.lse_scratch)
        self.cu_k_f = None if self.cu_k is None else conv(self.cu_k)


class SplitRun:
    """What a split decode step of one shape needs besides its inputs: the bound kernels,
    scratch buffers, the kernel-facing views of them and every shape the step uses, made once
    per (device, stream, shape) and reused by later steps (see the module docstring)."""

    fold = False
    packed = False

    __slots__ = (
        "sp", "chunk", "launch", "merge", "scale", "r", "one_row", "q_broadcast", "q_rows_shape",
        "kq_size", "q_dst", "kq",
        "ko", "kl", "lp_sink", "op_c", "lp_c", "lse_scratch", "lse_rows", "k_shape",
        "v_shape", "cu_k", "offs_col", "cu_t", "cu_t_lo", "cu_flat", "len_buf", "len_t",
        "len_flat", "pt_rows", "pt_cols", "pt_shape", "out_as_is", "out_shape", "out_c_shape",
        "lse_shape", "lse_c_size", "lse_c_stride", "ko_f", "kl_f", "op_c_f", "lp_c_f",
        "lse_scratch_f", "cu_k_f", "cu_flat_f", "len_flat_f", "meta", "meta_args", "cu_buf",
        "cu_buf_f", "len_buf_f", "chunk_lengths", "launch_bounds", "cu_bounds_size",
        "padded_pt",
    )

    def __init__(self, rt, dev, q, b, rows, hq, hk, d, dv, kind, sp, page_size, causal,
                 seqlen_k, varlen_q, ffi=False):
        r, slots = hq // hk, sp.slots
        bb, nv = b * rows, b * rows * slots  # decode rows; virtual sequences (chunk fastest)
        dvc = q.device
        kern = rt.split_kernel(dev, q.dtype, d, dv, page_size)
        self.sp, self.chunk = sp, sp.chunk
        # (fwd_tma for its pages; fwd_wide_split for a wide plan: split.wide_split)
        self.launch = kern.launch_wide_split if sp.wide else kern.launch_split
        self.merge = kern.merge
        # a packed K's chunk bounds read by the kernel (compiler.trace_chunk_modes(bounds=True)),
        # and a dense K's at several rows a sequence; a wide plan's kernel has no bounds mode:
        # the metadata kernel writes them
        self.launch_bounds = (kern.launch_bounds if (kind == "varlen" or kind == "dense" and
                                                     rows > 1) and not sp.wide else None)
        self.cu_bounds_size = (b + 1, rows, sp.chunk, rows if causal else 1, 1)
        self.meta, self.meta_args = kern.chunk_meta, (sp.chunk, slots, rows, int(causal))
        # the kernel cuts a paged K's lengths into chunks (compiler.trace_chunk_modes)
        self.chunk_lengths = kind == "paged" and kern.chunk_lengths and self.meta is not None
        self.scale = float(1.0 / math.sqrt(d))
        self.r = r
        self.one_row = bb == 1
        self.q_broadcast = kern.q_broadcast
        self.q_rows_shape = (bb, hq, d)
        self.q_dst = self.kq = None
        if self.q_broadcast:
            self.kq_size = (bb, r, hk, d)  # GQA folded: r rows of a 1:1 kernel
        else:  # (stores built before the chunk mode: a stride-0 mode at one row, else a copy)
            self.kq_size = (slots, r, hk, d)
            qr = q.new_empty((bb, slots, hq, d))
            # the caller's q, (b, rows, hq, d) or (b*rows, hq, d), broadcast over the slots
            self.q_dst = (qr.view(bb, slots, hq, d).transpose(0, 1) if varlen_q
                          else qr.view(b, rows, slots, hq, d).permute(2, 0, 1, 3, 4))
            self.kq = qr.view(nv, hk, r, d).transpose(1, 2)
        op = q.new_empty((bb, slots, hq, dv))
        self.ko = op.view(nv, hk, r, dv).transpose(1, 2)
        lp = torch.empty((bb, slots, hq), dtype=torch.float32, device=dvc)
        self.kl = lp.view(nv, hk, r)
        self.lp_sink = lp[:, sp.n] if slots > sp.n else None
        # the combine's modes are (chunk, row, 1, hq, dv) for partial outputs and (chunk, row,
        # 1, hq) for partial LSE with the seqlen mode contiguous: views of the kernel's
        self.op_c = op.permute(1, 0, 2, 3).unsqueeze(2)
        self.lp_c = torch.as_strided(lp, (slots, bb, 1, hq), (hq, slots * hq, 1, 1))
        self.lse_scratch = torch.empty((bb, 1, hq), dtype=torch.float32, device=dvc)
        self.lse_rows = (self.lse_scratch.view(bb, hq).t() if varlen_q
                         else self.lse_scratch.view(b, rows, hq).transpose(1, 2))
        # outputs in the caller's layout, and the combine's (decode rows, 1, hq, dv) view
        self.out_shape = (bb, hq, dv) if varlen_q else (b, rows, hq, dv)
        self.out_c_shape = (bb, 1, hq, dv)
        self.out_as_is = not varlen_q and rows == 1
        self.lse_shape = (hq, bb) if varlen_q else (b, hq, rows)
        self.lse_c_size = (b, 1, hq)
        self.lse_c_stride = (1, 1, b) if varlen_q else (hq, 1, 1)
        self.k_shape, self.v_shape = (b * seqlen_k, hk, d), (b * seqlen_k, hk, dv)
        self.pt_rows = self.pt_cols = 0
        self.pt_shape = None
        # (a padded cache's arange page table, its chunked form): looked up by its first step
        self.padded_pt = None
        self.cu_k = self.cu_flat = self.len_flat = self.cu_buf = self.len_buf = None
        self._metadata(rt, dev, q, b, rows, kind, sp, page_size, causal, seqlen_k)
        self._bind(ffi)

    def _bind(self, ffi: bool) -> None:
        """The kernel-facing forms (`*_f`) of the scratch the two kernels take every step:
        with `ffi`, tvm_ffi.Tensors made once, which a call passes on as they are (the H200,
        2026-12-01: a torch tensor argument costs ~0.9 us of conversion per call, e.g. the
        chunk kernel's call 7.8 -> 5.1 us with its three scratch tensors pre-converted; results
        bit-identical). Each call still passes at least one torch tensor (k and v; the
        combine's out), from which tvm-ffi takes torch's current stream: a call of
        tvm_ffi.Tensors alone would run on the default stream. Without `ffi` (CPU tensors: the
        tests' stand-in kernels) the tensors themselves."""
        conv = _to_ffi if ffi else (lambda t: t)
        self.ko_f, self.kl_f = conv(self.ko), conv(self.kl)
        self.op_c_f, self.lp_c_f = conv(self.op_c), conv(self.lp_c)
        self.lse_scratch_f = conv(self.lse_scratch)
        self.cu_k_f = self.cu_k if self.cu_k is None else conv(self.cu_k)
        self.cu_flat_f = self.cu_flat if self.cu_flat is None else conv(self.cu_flat)
        self.len_flat_f = self.len_flat if self.len_flat is None else conv(self.len_flat)
        self.cu_buf_f = self.cu_buf if self.cu_buf is None else conv(self.cu_buf)
        self.len_buf_f = self.len_buf if self.len_buf is None else conv(self.len_buf)

    def _metadata(self, rt, dev, q, b, rows, kind, sp, page_size, causal, seqlen_k):
        """The chunk metadata's buffers and constants, per KV kind."""
        slots, dvc = sp.slots, q.device

        def const(key, make):  # (while capturing: the eager warm-up's, or made in the graph)
            return _const(rt, key, dvc, make)

        if kind == "dense" and self.launch_bounds is not None:  # the sequences' cu, as bounds
            self.cu_k = _bounds(_dense_cu(rt, dev, b, seqlen_k, dvc), self.cu_bounds_size)
            return
        if kind == "dense":
            self.cu_k = const(
                ("dense_cu", dev, b, seqlen_k, sp.chunk, slots),
                lambda: S.dense_cu_seqlens_k(torch, b, seqlen_k, sp, dvc),
            )
            return
        def offsets():  # the chunks' first keys (not needed where the kernel cuts lengths)
            return const(("offsets", dev, slots, sp.chunk), lambda: torch.arange(
                0, slots * sp.chunk, sp.chunk, dtype=torch.int32, device=dvc))

        if kind == "varlen":
            if self.launch_bounds is not None:
                return  # the kernel reads the chunk bounds from the caller's cu_seqlens_k
            cu = self.cu_buf = torch.empty((b + 1, slots), dtype=torch.int32, device=dvc)
            self.offs_col = offsets().view(slots, 1)
            self.cu_t = cu.t()
            self.cu_t_lo = self.cu_t[:, :b]
            self.cu_flat = cu.view(-1)[: b * slots + 1]
            return
        # split.chunk_page_table's free case: the table holds exactly slots * pages-per-chunk
        # pages per row (and one row per sequence)
        pp = sp.chunk // page_size
        self.pt_rows = int(rows == 1)
        self.pt_cols = slots * pp
        self.pt_shape = (b * slots, pp)
        if self.chunk_lengths:
            if rows > 1:  # each unrolled row's length (one chunk of 2**30 keys), (b, rows)
                self.meta_args = (1 << 30, 1, rows, int(causal))
                self.len_buf = torch.empty((b, rows), dtype=torch.int32, device=dvc)
                self.len_flat = self.len_buf.view(-1)
            return
        offs = offsets()
        if rows > 1:
            # unrolled row t of a causal step sees len - rows + 1 + t keys; a non-causal one
            # all of them: per (row, chunk) offsets
            back = torch.arange(rows - 1, -1, -1, dtype=torch.int32, device=dvc)
            offs = ((back[:, None] if causal else back[:, None] * 0) + offs).flatten()
        self.offs_col = offs.view(-1, 1)
        self.len_buf = torch.empty((b, rows * slots), dtype=torch.int32, device=dvc)
        self.len_t = self.len_buf.t()
        self.len_flat = self.len_buf.view(-1)


class PackedRun:
    """A decode step of several query rows a sequence (speculative decoding) over a paged K, or
    a dense one viewed as pages, with its rows packed (split.plan_packed): the r query heads of
    a KV head times the step's rows are the rows of the 1:1 chunk kernel, (head g, row t) at
    row g * rows + t, so each chunk's keys stream once for all of them (unrolled rows stream
    them once a row).

    Per step: q copied into that row order (`qs`, one copy); the chunk kernel over the chunks
    of the keys every row sees, [0, T) with T the page-rounded len - rows + 1 for a causal step
    (its chunk-length mode cuts T, passed per sequence, into chunks), every key for a
    non-causal one; for a causal step the tail, rows unrolled as decode rows (i, t) over the
    two pages from T, each seeing len - rows + 1 + t - T keys (the same chunk kernel, one chunk
    each), its output and LSE copied into the merge's tail slot; a sink's LSE into its slot;
    the merge, which writes the caller's out and LSE in place (its modes are (slot, sequence,
    row, head, dv)). The partials are laid out (sequence, slot, KV head, g, t, dv), which the
    chunk kernel writes as (virtual sequence, its rows, KV head) and the merge reads with the
    head mode h * r + g of stride rows * dv. A caller's paged K's tail metadata (T, the tail's
    page table and lengths) is one launch a step of the artifact's kernel (part packed_meta),
    or ten element-wise torch kernels in stores without it; a dense K's, constants.

    Over a packed K (page_size None; a dense K no cached page size divides included, as its
    constant cu_seqlens_k) both launches run the chunk kernel's bounds mode
    (compiler.trace_chunk_modes(bounds=True)) on views of cu_seqlens_k: the chunks over
    (b + 1, 1, chunk, rows, 1), every packed row seeing all but the sequence's last rows - 1
    keys, and the tail over (b + 1, rows, chunk, rows, rows), anchored rows - 1 keys before
    each sequence's end: no metadata at all."""

    fold = False
    packed = True
    __slots__ = (
        "bounds", "cu_main_size", "cu_tail_size", "cu_main_f", "cu_tail_f", "k_shape",
        "v_shape",
        "sp", "launch", "merge", "meta", "scale", "causal", "rows", "r", "page_size",
        "qs_dst", "q_src_shape", "kq", "kq_b_size", "ko", "kl", "op_c", "lp_c", "op_tail",
        "lp_tail", "ot_src", "lt_src", "kot", "klt", "lp_sink", "lse_scratch", "out_c_size",
        "lse_shape", "out_shape", "ar_pages", "ar_rows", "x", "lb", "pg", "t_used", "idx",
        "tail_table", "dx", "tail_len", "ko_f", "kl_f", "kot_f", "klt_f", "op_c_f", "lp_c_f",
        "side", "fork", "join",
    )

    def __init__(self, rt, dev, q, b, rows, hq, hk, d, dv, sp, page_size, causal, varlen_q,
                 seqlen_k, kind, ffi=False):
        kern = rt.split_kernel(dev, q.dtype, d, dv, page_size)
        r, slots, dvc = hq // hk, sp.slots, q.device
        f32 = torch.float32
        self.sp, self.causal, self.rows, self.r, self.page_size = sp, causal, rows, r, page_size
        self.bounds = page_size is None
        self.launch, self.merge = kern.launch_split, kern.merge
        self.meta = kern.packed_meta
        self.cu_main_f = self.cu_tail_f = None
        self.k_shape, self.v_shape = (b * seqlen_k, hk, d), (b * seqlen_k, hk, dv)
        if self.bounds:  # (a packed K, or a dense one as its constant cu)
            self.launch, self.meta = kern.launch_bounds, None
            self.cu_main_size = (b + 1, 1, sp.chunk, rows if causal else 1, 1)
            self.cu_tail_size = (b + 1, rows, sp.chunk, rows, rows)
            if kind == "dense":
                cu = _dense_cu(rt, dev, b, seqlen_k, dvc)
                conv = _to_ffi if ffi else (lambda t: t)
                self.cu_main_f = conv(_bounds(cu, self.cu_main_size))
                self.cu_tail_f = conv(_bounds(cu, self.cu_tail_size))
        self.scale = float(1.0 / math.sqrt(d))
        # q, (b, rows, hk, r, d) as the caller lays it out, into (b, r, rows, hk, d): rows
        # (g, t) of one stride for the kernel, which reads sequence i's for its chunks
        qs = q.new_empty((b, r, rows, hk, d))
        self.qs_dst = qs.permute(0, 2, 3, 1, 4)
        self.q_src_shape = (b, rows, hk, r, d)
        self.kq = qs.view(b, r * rows, hk, d)
        op = q.new_empty((b, slots, hk, r, rows, dv))
        lp = torch.empty((b, slots, hk, r, rows), dtype=f32, device=dvc)
        self.ko = op.view(b * slots, hk, r * rows, dv).transpose(1, 2)
        self.kl = lp.view(b * slots, hk, r * rows)
        x, y = hq * rows * dv, hq * rows
        self.op_c = torch.as_strided(op, (slots, b, rows, hq, dv), (x, slots * x, dv, rows * dv, 1))
        self.lp_c = torch.as_strided(lp, (slots, b, rows, hq), (y, slots * y, 1, rows))
        self.lp_sink = lp[:, slots - 1] if slots > sp.n + sp.tail else None  # (b, hk, r, rows)
        self.op_tail = self.lp_tail = self.ot_src = self.lt_src = self.kot = self.klt = None
        self.side = self.fork = self.join = None
        if sp.tail and dvc.type == "cuda" and TAIL_STREAM and _is_capturing():
            # in a CUDA graph being captured, the tail's stream, forked from the caller's after
            # the chunks' launch and joined before the merge by the run's own two events (a
            # graph's branch costs nothing per replay; eagerly the fork and join cost the host
            # more than the overlap gains: see TAIL_STREAM)
            self.side = _side_stream(dvc)
            self.fork, self.join = torch.cuda.Event(), torch.cuda.Event()
        if sp.tail:
            # the tail: decode rows (i, t), one chunk each, in scratch laid out as the caller's
            # rows (b, rows, hk, r), then copied into slot n
            self.op_tail, self.lp_tail = op[:, sp.n], lp[:, sp.n]
            ot = q.new_empty((b, rows, hk, r, dv))
            lt = torch.empty((b, rows, hk, r), dtype=f32, device=dvc)
            self.ot_src, self.lt_src = ot.permute(0, 2, 3, 1, 4), lt.permute(0, 2, 3, 1)
            self.kot = ot.view(b * rows, hk, r, dv).transpose(1, 2)
            self.klt = lt.view(b * rows, hk, r)
            self.kq_b_size = (b * rows, r, hk, d)
        if sp.tail and not self.bounds:
            # the tail's keys lie in two pages (rows - 1 keys past a page boundary, rows <= 16
            # <= the page size); per-step scratch for its metadata (tail_meta)
            i32 = dict(dtype=torch.int32, device=dvc)
            self.t_used = torch.empty(b, **i32)
            self.tail_table = torch.empty((b, 2 * rows), **i32)
            self.tail_len = torch.empty((b, rows), **i32)
            if self.meta is None:  # the torch kernels' operands
                self.ar_pages = torch.arange(2, **i32).repeat(rows)
                self.ar_rows = torch.arange(rows, **i32)
                self.x, self.lb, self.pg, self.dx = (torch.empty(b, **i32) for _ in range(4))
                self.idx = torch.empty((b, 2 * rows), dtype=torch.int64, device=dvc)
        self.lse_scratch = torch.empty((b, rows, hq), dtype=f32, device=dvc)
        self.out_shape = (b * rows, hq, dv) if varlen_q else (b, rows, hq, dv)
        self.lse_shape = (hq, b * rows) if varlen_q else (b, hq, rows)
        self.out_c_size = (b, rows, hq, dv)
        conv = _to_ffi if ffi else (lambda t: t)
        self.ko_f, self.kl_f = conv(self.ko), conv(self.kl)
        self.op_c_f, self.lp_c_f = conv(self.op_c), conv(self.lp_c)
        self.kot_f = self.kot if self.kot is None else conv(self.kot)
        self.klt_f = self.klt if self.klt is None else conv(self.klt)

    def tail_meta(self, used, table):
        """A causal step's metadata from the lengths `used` (b,) and page table: (the keys
        every row sees, page-rounded, (b,); the tail's page table, (b * rows, 2); each tail
        row's keys, (b * rows,)), into scratch (no host sync): one launch of the artifact's
        kernel (compiler.trace_packed_meta), or element-wise torch kernels."""
        p, rows = self.page_size, self.rows
        if self.meta is not None:
            tt, tl = self.tail_table.view(-1, 2), self.tail_len.view(-1)
            self.meta(used, table, self.t_used, tt, tl, rows, p)
            return self.t_used, tt, tl
        torch.sub(used, rows - 1, out=self.x)  # the keys row 0 sees (< 0: none)
        torch.clamp(self.x, min=0, out=self.lb)
        torch.div(self.lb, p, rounding_mode="floor", out=self.pg)
        torch.mul(self.pg, p, out=self.t_used)
        torch.add(self.pg[:, None], self.ar_pages, out=self.idx)
        self.idx.clamp_(max=table.size(1) - 1)  # (a second page past the table is not read)
        torch.gather(table, 1, self.idx, out=self.tail_table)
        torch.sub(self.x, self.t_used, out=self.dx)
        torch.add(self.dx[:, None], self.ar_rows, out=self.tail_len)
        self.tail_len.clamp_(min=0)  # row t sees len - rows + 1 + t - T keys of the tail
        return self.t_used, self.tail_table.view(-1, 2), self.tail_len.view(-1)


def _packed_meta(run, used, table):
    """A PackedRun's metadata for constant lengths and page table (a dense K viewed as pages):
    (the chunks' lengths, their page table, the tail's page table and lengths), copies; the
    tables behind a guard (launch.GUARD_ALIGN), so that no call copies them."""
    chunked = guard_page_table(S.chunk_page_table(torch, table, run.sp, run.page_size, 1))
    if not run.causal:
        return used, chunked, None, None
    used_a, table_t, len_t = run.tail_meta(used, table)
    return used_a.clone(), chunked, guard_page_table(table_t), len_t.clone()


def _packed_step(run, rt, dev, q, k, v, cu_seqlens_k, seqused_k, page_table, dense_pages, b,
                 seqlen_k, softmax_scale, sink, out, lse, return_lse, varlen_q):
    """Serve a speculative step on its PackedRun (see there)."""
    sp, page = run.sp, run.page_size
    scale = run.scale if softmax_scale is None else float(softmax_scale)
    try:
        run.qs_dst.copy_(q.view(*run.q_src_shape))
    except RuntimeError:
        run.qs_dst.copy_(q.reshape(*run.q_src_shape))
    if run.bounds:  # the chunks' and the tail's bounds: views of cu_seqlens_k (or constants)
        cm, ct = run.cu_main_f, run.cu_tail_f
        if cu_seqlens_k is not None:
            cm = _bounds(cu_seqlens_k, run.cu_main_size)
            ct = run.causal and _bounds(cu_seqlens_k, run.cu_tail_size)
        main_kv, tail_kv = (None, cm, None, None, None), (None, ct, None, None, None)
    elif dense_pages:  # constant lengths and table: the metadata made once per shape
        used_a, table_a, table_t, len_t = _const(
            rt, ("packed_meta", dev, b, seqlen_k, page, run.rows, run.causal, sp), q.device,
            lambda: _packed_meta(run, seqused_k, page_table),
        )
    else:
        used_a, table_t, len_t = seqused_k, None, None
        if run.causal:
            used_a, table_t, len_t = run.tail_meta(seqused_k, page_table)
        table_a = S.chunk_page_table(torch, page_table, sp, page, 1)
    if not run.bounds:
        main_kv = (None, None, None, used_a, table_a)
        tail_kv = (None, None, None, len_t, table_t)
    run.launch(run.kq, k, v, run.ko_f, run.kl_f, scale, *main_kv)
    if run.causal:
        # the tail: the caller's q as decode rows (b * rows, r, hk, d), no copy where its rows
        # merge into one stride; in a CUDA graph on a side stream (PackedRun.side), so its
        # small grid runs on the SMs the chunks leave (their empty tail slot's among them)
        qr = q if q.dim() == 3 else q.reshape(-1, *q.shape[2:])
        sr, sh = qr.stride(0), qr.stride(1)
        kq = torch.as_strided(qr, run.kq_b_size, (sr, sh, run.r * sh, 1))
        side = run.side
        if side is not None:
            cur = torch.cuda.current_stream(q.device)
            run.fork.record(cur)
            side.wait_event(run.fork)
            torch.cuda.set_stream(side)
        try:
            run.launch(kq, k, v, run.kot_f, run.klt_f, scale, *tail_kv)
            run.op_tail.copy_(run.ot_src)
            run.lp_tail.copy_(run.lt_src)
        finally:
            if side is not None:
                run.join.record(side)
                torch.cuda.set_stream(cur)
        if side is not None:
            cur.wait_event(run.join)
    if sink is not None:  # the empty last slot carries the sink: counted once, as FA4 does
        run.lp_sink.copy_(sink.view(-1, run.r, 1))
    if out is None:
        out = q.new_empty(*run.out_shape)
    if return_lse and lse is None:
        lse = q.new_empty(*run.lse_shape, dtype=torch.float32)
    s0 = out.stride(0)
    out_c = out if out.dim() == 4 else torch.as_strided(
        out, run.out_c_size, (run.rows * s0, s0, out.stride(1), 1))
    if lse is None:
        lse_c = run.lse_scratch
    elif varlen_q:  # (hq, b * rows) -> (b, rows, hq)
        lse_c = torch.as_strided(lse, run.lse_scratch.shape,
                                 (run.rows * lse.stride(1), lse.stride(1), lse.stride(0)))
    else:  # (b, hq, rows)
        lse_c = lse.transpose(1, 2)
    run.merge(run.op_c_f, run.lp_c_f, out_c, lse_c)
    return out, lse


def _dense_cu(rt, dev, b, seqlen_k, device):
    """A dense K's cu_seqlens_k as a packed one (b + 1,): a constant per shape."""
    return _const(rt, ("dense_cu_k", dev, b, seqlen_k), device, lambda: torch.arange(
        0, (b + 1) * seqlen_k, seqlen_k, dtype=torch.int32, device=device))


def _bounds(cu, size):
    """cu_seqlens_k (b + 1,) as the bounds mode reads it (compiler.trace_chunk_modes(bounds=
    True)): a zero-stride view of `size` = (b + 1, rows, chunk, causal shift, anchor)."""
    return torch.as_strided(cu, size, (cu.stride(0), 0, 0, 0, 0))


def _side_stream(device):
    """A second stream for the caller's current one on `device` (PackedRun's tail), made once
    per (device, caller's stream): two callers' streams never share one, nor does a stream
    being captured into a CUDA graph share one with eager work."""
    key = (device.index, _raw_stream(device.index))
    side = _SIDE.get(key)
    if side is None:
        side = _SIDE.setdefault(key, torch.cuda.Stream(device))
    return side


def _to_ffi(t):
    import tvm_ffi

    return tvm_ffi.from_dlpack(t)


def _const(rt, key: tuple, device, make):
    """A device tensor that depends only on host-known sizes (chunk offsets, a dense K's
    cu_seqlens_k): made once and cached, except while a CUDA graph is captured (a tensor made
    then holds nothing until the graph replays)."""
    t = rt._split_consts.get(key)
    if t is None:
        t = make()
        if not _keep_nothing(device.type == "cuda"):
            if len(rt._split_consts) > 256:
                rt._split_consts.clear()
            rt._split_consts[key] = t
    return t
