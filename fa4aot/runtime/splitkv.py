"""Split-KV decode steps at run time (fa4aot/policy/split.py: the plan, the cost model, exactness),
and the fold of the one-row decode steps the plan leaves unsplit onto the same kernel
(FoldRun).

`split_step` serves a decode step split, or returns None (the caller runs it unsplit). Its
per-call work is what the inputs force: one cache lookup keyed by host-known sizes, the
kernel-facing views of the caller's tensors (q as it is, read through the chunk kernel's chunk
mode, forwards.trace_chunk_modes; in stores built before it, a stride-0 mode at one decode
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

from typing import NamedTuple

import torch

from fa4aot.model import constraints as C
from fa4aot.policy import ragged as RG
from fa4aot.policy import split as S
from fa4aot.runtime import ragged as RR
from fa4aot.runtime.abi import guard_page_table
from fa4aot.runtime.splitruns import (
    FoldRun,
    PackedRun,
    SplitRun,
    _bounds,
    _const,
    _is_capturing,
    _raw_stream,
    _tls,
)

_PLAN_KEYS = S.PLAN_KEYS
# SplitRuns kept (each holds scratch for one batch size / stream): bound what they hold
_MAX_RUNS = 16
_MAX_KEYS = 4096
# A causal packed step's tail (PackedRun) captured in a CUDA graph runs on a side stream,
# beside the chunks, on the SMs they leave (False: after them, on the caller's stream, as an
# eager step always does: there the fork, join and stream switches cost the host more than the
# overlap gains).
TAIL_STREAM = True


class Step(NamedTuple):
    """A decode step's host-known shape, as split_step takes it (the entry points pass a plain
    tuple in this order: no object built per call).

    kind: "dense" | "varlen" | "paged" | "padded" K (a KV cache in batch form, (b, capacity,
    hk, d), with seqused_k: FA2's flash_attn_with_kvcache layout, split as a page pool whose
    table is an arange) | "used" (a packed K with seqused_k: the ragged plan only);
    seqlen_k: a host bound on every KV length (a dense K's exact length);
    varlen_q: q is packed, (b * rows, hq, d), else (b, rows, hq, d)."""

    kind: str
    b: int
    rows: int
    hq: int
    hk: int
    d: int
    dv: int
    seqlen_k: int
    page_size: int | None
    causal: bool
    varlen_q: bool


def split_step(
    rt, dev: int, q, k, v, step: Step, cu_seqlens_k, seqused_k, page_table, sink,
    softmax_scale, out, lse, return_lse: bool,
):
    """Serve a decode step split-KV (the plan: split.plan_step's two steps, Runtime.split_for
    and _packed_plan), or one the plan does not split as one chunk per sequence on the same
    kernel (FoldRun), or return None (FA4's kernel).

    step: a Step, or a plain tuple in its order (the entry points': no object built per call);
    q: the caller's q; out / lse: the caller's buffers or None (lse laid out as the entry point
    returns it)."""
    kind, b, rows, hq, hk, d, dv, seqlen_k, page_size, causal, varlen_q = step
    dense_pages = padded = False
    if kind == "padded" or rows > 1 and kind != "paged":
        got = _as_pages(rt, dev, q.dtype, d, dv, kind, rows, seqlen_k, k.size(1))
        if got is None:
            return None
        kind, page_size, dense_pages, padded = got
    # keep nothing allocated here inside splitruns.fresh_scratch or while a graph is captured
    if q.is_cuda:
        capturing = _tls.fresh or _is_capturing()
        stream = _raw_stream(dev)
    else:  # (CPU tensors: the tests' stand-in kernels, never captured)
        capturing, stream = _tls.fresh, 0
    # a dense K's chunk bounds depend on its exact length; the rest on the plan's bucket
    key = (
        kind, dev, stream, q.dtype, b, rows, hq, hk, d, dv,
        seqlen_k if kind == "dense" else -(-seqlen_k // _PLAN_KEYS),
        page_size, causal, sink is not None, varlen_q, rt.split, rt.ragged,
        dense_pages,  # (a dense K as pages plans its packed rows with no metadata launch)
    )
    run = None if capturing else rt._split_runs.get(key)
    if run is None:
        run = _new_run(rt, dev, q, key, capturing, kind, b, rows, hq, hk, d, dv, seqlen_k,
                       page_size, causal, sink is not None, varlen_q, dense_pages)
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
    if run.fold:
        return _fold_step(run, q, k, v, kind, cu_seqlens_k, seqused_k, page_table,
                          softmax_scale, out, lse, return_lse)
    if run.packed:
        return _packed_step(run, rt, dev, q, k, v, cu_seqlens_k, seqused_k, page_table,
                            dense_pages, b, seqlen_k, softmax_scale, sink, out, lse, return_lse,
                            varlen_q)
    if run.ragged:
        return RR.ragged_step(run, q, k, v, cu_seqlens_k, seqused_k, page_table, sink,
                              softmax_scale, out, lse, return_lse)
    return _split_run_step(run, rt, dev, q, k, v, kind, cu_seqlens_k, seqused_k, page_table,
                           dense_pages, padded, b, rows, seqlen_k, page_size, causal, varlen_q,
                           sink, softmax_scale, out, lse, return_lse)


def _as_pages(rt, dev, dtype, d, dv, kind, rows, seqlen_k, capacity):
    """How split_step serves a KV cache in batch form ("padded") or a step of several rows
    over a K not paged: (kind, page_size, dense K as pages, padded cache as pages), or None
    (unsplit); once per shape."""
    key = ("as_pages", dev, dtype, d, dv, kind, rows > 1,
           capacity if kind == "padded" else seqlen_k if kind == "dense" else 0)
    got = rt._split_consts.get(key)
    if got is None:
        if len(rt._split_consts) > 256:  # (bounded as splitruns._const bounds it)
            rt._split_consts.clear()
        got = rt._split_consts[key] = _pages_of(rt, dev, dtype, d, dv, kind, seqlen_k, capacity)
    return got or None


def _pages_of(rt, dev, dtype, d, dv, kind, seqlen_k, capacity):
    """_as_pages' answer (False: unsplit)."""
    if kind == "padded":
        # the cache as its own page pool (page size: the first cached one dividing its
        # capacity), the caller's lengths: a paged K at any number of rows
        page = _dense_page(rt, dev, dtype, d, dv, capacity)
        return ("paged", page, False, True) if page else False
    # several rows a sequence: a dense K whose length a cached paged split kernel's page
    # size divides is its own page pool; else the rows run (packed into one chunk:
    # PackedRun, or unrolled) on the packed K's bounds mode, which gives each row its own
    # keys (forwards.trace_chunk_modes(bounds=True); a store built before it: unsplit)
    page = kind == "dense" and _dense_page(rt, dev, dtype, d, dv, seqlen_k)
    if page:
        return "paged", page, True, False
    kern = rt.split_kernel(dev, dtype, d, dv, None)
    if kern is None or kern.launch_bounds is None:
        return False
    return kind, None, False, False


def _new_run(rt, dev, q, key, capturing, kind, b, rows, hq, hk, d, dv, seqlen_k, page_size,
             causal, sink, varlen_q, dense_pages):
    """The run of a step whose key split_step has not seen (or any while capturing): a
    RaggedRun, PackedRun, SplitRun or FoldRun, or False (unsplit); kept unless capturing."""
    fold = not S.fold_refusal(arch=rt.device(dev)[0], head_dim=d, head_dim_v=dv,
                              ratio=hq // hk, rows=rows, sink=sink)
    # a batch over a paged or packed K (a caller's: not a dense K viewed as pages): split
    # by its real lengths (policy/ragged.py), where the store has the kernels and the bounds
    # say it matters, unless one row a sequence in short uniform chunks serves it
    # (RG.uniform_splits); a packed K with seqused_k ("used") by that plan or unsplit
    used = kind == "used"
    rk = (kind != "dense" and not dense_pages and rt.ragged
          and rt.split_kernel(dev, q.dtype, d, dv, page_size))
    rg = rk and RR.plan(rt, dev, q.dtype, b, rows, hk, d, dv, S.plan_bucket(seqlen_k),
                        page_size, sink, causal, rk, used=used)
    # (several rows keep the ragged plan: no uniform plan is weighed against it)
    sp = None if used or rg and rows > 1 else rt.split_for(
        dev, q.dtype, b * rows * hk, seqlen_k, d, dv, page_size, sink,
        b * rows, fold=fold, one_row=rows == 1)
    pk = rows > 1 and not rg and _packed_plan(rt, dev, q.dtype, b, rows, hq, hk, d, dv,
                                              seqlen_k, page_size, causal, sink, sp,
                                              not dense_pages)
    if rg and rows == 1:
        uniform, sp = RG.uniform_instead(
            sp, batch=b, kv_heads=hk, seqlen_k=S.plan_bucket(seqlen_k),
            bytes_per_key=(d + dv) * q.dtype.itemsize, num_sms=rt.device(dev)[1],
            max_slots=rk.max_slots, sink=sink, page_size=page_size, used=used)
        if uniform:
            rg = None
    if rg:
        no_sink = _const(rt, ("no_sink", dev, hq // hk, hk), q.device, lambda: torch.full(
            (hq // hk, hk), float("-inf"), dtype=torch.float32, device=q.device))
        run = RR.RaggedRun(rk, q, b, hq, hk, d, dv, rg, page_size, causal, varlen_q,
                           ffi=q.is_cuda, no_sink=no_sink, used=used)
    elif pk:
        # a graph being captured runs the tail on a side stream (TAIL_STREAM)
        side = TAIL_STREAM and q.is_cuda and _is_capturing()
        run = PackedRun(rt, dev, q, b, rows, hq, hk, d, dv, pk, page_size, causal,
                        varlen_q, seqlen_k, kind, ffi=q.is_cuda, side=side)
    elif sp is not None:
        run = SplitRun(rt, dev, q, b, rows, hq, hk, d, dv, kind, sp, page_size, causal,
                       seqlen_k, varlen_q, ffi=q.is_cuda)
    else:
        run = fold and not used and FoldRun.make(rt, dev, q, b, hq, hk, d, dv, kind,
                                                 page_size, seqlen_k, varlen_q)
    if not capturing:
        if len(rt._split_runs) > _MAX_KEYS or (run and rt._split_scratch >= _MAX_RUNS):
            rt._split_runs.clear()
            rt._split_scratch = 0
        rt._split_runs[key] = run
        rt._split_scratch += run is not False
    return run


def _split_run_step(run, rt, dev, q, k, v, kind, cu_seqlens_k, seqused_k, page_table,
                    dense_pages, padded, b, rows, seqlen_k, page_size, causal, varlen_q, sink,
                    softmax_scale, out, lse, return_lse):
    """Serve a split step on its SplitRun (see split_step; k, v and, for a dense K as pages,
    seqused_k and page_table as the kernels take them)."""
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
        # (forwards.trace_chunk_modes): q as (decode rows, r, hk, d), a view
        sr, sh = q.stride(0) if varlen_q or rows == 1 else q.stride(1), q.stride(-2)
        if not varlen_q and rows > 1 and q.stride(0) != rows * sr:
            q = q.reshape(run.q_rows_shape)  # (rows whose strides do not merge: one copy)
            sr, sh = q.stride(0), q.stride(1)
        kq = torch.as_strided(q, run.kq_size, (sr, sh, run.r * sh, 1))
    elif run.one_row:
        # one decode row: every chunk reads the same q through a stride-0 batch mode, no copy
        # (bit for bit the copied q's result on the GPU)
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
        # (forwards.trace_chunk_modes(bounds=True)); a dense K's cu: a constant
        launch = run.launch_bounds
        cu_seqlens_k = run.cu_k_f if kind == "dense" else torch.as_strided(  # (_bounds)
            cu_seqlens_k, run.cu_bounds_size, (cu_seqlens_k.stride(0), 0, 0, 0, 0))
    elif kind == "dense":
        cu_seqlens_k = run.cu_k_f
    elif kind == "varlen":
        # one row a sequence: the bounds written into scratch, no allocation, by one kernel
        # (kernels.trace_chunk_meta; a store whose bounds mode predates several rows, or a
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
        # kernel that cuts lengths into chunks itself (forwards.trace_chunk_modes) takes the
        # caller's at one decode row, and each unrolled row's (the metadata kernel's
        # meta_args say so: one chunk of 2**30 keys) at several
        if dense_pages:  # constants (_dense_meta): no metadata launch, no table copy
            seqused_k, page_table = _dense_meta(run, rt, dev, q, seqused_k, page_table, b,
                                                seqlen_k, page_size, rows, causal)
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
            if padded:  # the arange table's chunked form, kept by the run (_padded_table)
                pt = run.padded_pt
                page_table = (pt[1] if pt is not None and pt[0] is page_table
                              else _padded_table(run, rt, dev, q, page_table, page_size, rows))
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
    chunk modes (forwards.trace_chunk_modes) and packs the rows (split.packed_refusal); else
    None (unrolled, or unsplit)."""
    kern = rt.split_kernel(dev, dtype, d, dv, page_size)
    if kern is None:
        return None
    arch, sms = rt.device(dev)
    return S.plan_packed_rows(
        kern.facts, batch=b, rows=rows, kv_heads=hk, ratio=hq // hk,
        tile_m=C.split_tile_m(arch, d, dv), seqlen_k=S.plan_bucket(seqlen_k),
        bytes_per_key=(d + dv) * dtype.itemsize, page_size=page_size, sink=sink, causal=causal,
        num_sms=sms, setting=rt.split, unrolled=unrolled, meta=meta, model=rt.cost_model(dev),
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


def _padded_table(run, rt, dev, q, table, page_size, rows):
    """A padded cache's arange page table (_dense_as_pages) in its chunked form: a constant,
    which the run keeps for its later steps (a run made while a CUDA graph is captured finds
    the eager warm-up's, so the graph computes nothing for it)."""
    pt = run.padded_pt = (table, _const(
        rt, ("padded_table", dev, tuple(table.shape), page_size, rows, run.sp), q.device,
        lambda: guard_page_table(S.chunk_page_table(torch, table, run.sp, page_size, rows))))
    return pt[1]


def _dense_meta(run, rt, dev, q, used, table, b, seqlen_k, page_size, rows, causal):
    """A dense K viewed as pages (_dense_as_pages): its kernel-facing lengths and chunked page
    table, constants per shape (`_const`; the cache read first, with no closure made)."""
    key = ("dense_meta", dev, b, seqlen_k, page_size, rows, causal, run.sp, run.chunk_lengths)
    got = rt._split_consts.get(key)
    if got is None:
        got = _const(rt, key, q.device,
                     lambda: _dense_meta_make(run, used, table, b, rows, causal, page_size))
    return got


def _dense_meta_make(run, used, table, b, rows, causal, page_size):
    """The kernel-facing lengths and chunked page table (behind a guard, abi.GUARD_ALIGN:
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


def _packed_meta(run, used, table):
    """A PackedRun's metadata for constant lengths and page table (a dense K viewed as pages):
    (the chunks' lengths, their page table, the tail's page table and lengths), copies; the
    tables behind a guard (abi.GUARD_ALIGN), so that no call copies them."""
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


