"""The per-shape state of split-KV decode steps, made once per (device, stream, shape) and
kept by the Runtime: SplitRun (a split), PackedRun (speculative rows packed), FoldRun (the
unsplit fold on the chunk kernel), and the cached constants they share."""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager

import torch

from fa4aot.model import constraints as C
from fa4aot.policy import split as S

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


class FoldRun:
    """A one-row decode step that the plan does not split, run on the split's chunk kernel
    with one chunk per sequence: the GQA fold (a KV head's r query heads as r rows of the 1:1
    kernel, q and out viewed, no copy) on the chunk kernel's 64-row M tile
    (constraints.split_tile_m), where FA4's decode kernel packs them into a 128-row tile: the
    same bits as FA4's kernel in less GPU time at every batch measured (docs/design.md, Tuned
    thresholds), for more host time per call (the views). With more (sequence, KV head) CTAs
    than SMs it may
    run on a wide fold kernel instead (`wide`, its part name; constraints.fold_kernel by how
    the CTAs fill the waves, forwards.trace_wide_fold: 64-key tiles, two CTAs per SM, or one
    for a packed K's long context).
    Not for a learnable sink (the chunk kernel has none), a head ratio over the tile's rows,
    or a chunk kernel with FA4's own tile (head dims over 128, Blackwell)."""

    fold = True
    packed = ragged = False
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

    fold = packed = ragged = False

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
        # a packed K's chunk bounds read by the kernel (forwards.trace_chunk_modes(bounds=True)),
        # and a dense K's at several rows a sequence; a wide plan's kernel has no bounds mode:
        # the metadata kernel writes them
        self.launch_bounds = (kern.launch_bounds if (kind == "varlen" or kind == "dense" and
                                                     rows > 1) and not sp.wide else None)
        self.cu_bounds_size = (b + 1, rows, sp.chunk, rows if causal else 1, 1)
        self.meta, self.meta_args = kern.chunk_meta, (sp.chunk, slots, rows, int(causal))
        # the kernel cuts a paged K's lengths into chunks (forwards.trace_chunk_modes)
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
        with `ffi`, tvm_ffi.Tensors made once, which a call passes on as they are (a torch
        tensor argument costs a conversion per call). Each call still passes at least one
        torch tensor (k and v; the
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
    (forwards.trace_chunk_modes(bounds=True)) on views of cu_seqlens_k: the chunks over
    (b + 1, 1, chunk, rows, 1), every packed row seeing all but the sequence's last rows - 1
    keys, and the tail over (b + 1, rows, chunk, rows, rows), anchored rows - 1 keys before
    each sequence's end: no metadata at all."""

    fold = False
    packed = True
    ragged = False
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
                 seqlen_k, kind, ffi=False, side=False):
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
        if sp.tail and side:
            # in a CUDA graph being captured, the tail's stream, forked from the caller's after
            # the chunks' launch and joined before the merge by the run's own two events (a
            # graph's branch costs nothing per replay; eagerly the fork and join cost the host
            # more than the overlap gains: see splitkv.TAIL_STREAM)
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
        kernel (kernels.trace_packed_meta), or element-wise torch kernels."""
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


def _dense_cu(rt, dev, b, seqlen_k, device):
    """A dense K's cu_seqlens_k as a packed one (b + 1,): a constant per shape."""
    return _const(rt, ("dense_cu_k", dev, b, seqlen_k), device, lambda: torch.arange(
        0, (b + 1) * seqlen_k, seqlen_k, dtype=torch.int32, device=device))


def _bounds(cu, size):
    """cu_seqlens_k (b + 1,) as the bounds mode reads it (forwards.trace_chunk_modes(bounds=
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
