"""fa4aot's own CuTe-DSL kernels (the classes; fa4/kernels.py traces and compiles them): the
split-KV merge, the chunk and packed-rows metadata kernels, and the ragged step's metadata and
merge (policy/ragged.py). Imported only by fa4/kernels.py, when it compiles: this module imports
cutlass."""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

LOG2_E = math.log2(math.e)
VEC = 8  # columns per thread: one 16-byte load of 2-byte values

# (no annotations on the jit functions: under `from __future__ import annotations` the DSL
# would evaluate them as strings)

class SplitMerge:
    def __init__(self, dtype, dv: int, max_splits: int, threads: int, pdl: bool):
        self.dtype, self.dv, self.max_splits, self.threads = dtype, dv, max_splits, threads
        self.pdl = pdl
        self.lanes = dv // VEC
        self.groups = threads // self.lanes
        self.warps = threads // 32

    def smem_bytes(self) -> int:
        return 4 * (self.max_splits + 2 * self.warps + self.dv * self.groups) + 64

    @cute.jit
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
        lse = -Float32.inf
        if tidx < n:
            lse = mLp[tidx, b, m, h]
        self.merge_row(tidx, n, lse, lambda s: mOp[s, b, m, h, None], mO[b, m, h, None],
                       mLSE, (b, m, h))

    @cute.jit
    def merge_row(self, tidx, n, lse, partial, mO_row, mLSE, at):
        """Merge one output row from n partial rows by LSE: `lse` is this thread's term
        (thread s < n: partial s's; others an extra term with no output, or -inf), partial(s)
        the s-th partial row (dv,); writes mO_row and mLSE[at]."""
        smem = cutlass.memory.SmemAllocator()
        sScale = smem.allocate_tensor(Float32, cute.make_layout(self.max_splits),
                                      byte_alignment=16)
        sMax = smem.allocate_tensor(Float32, cute.make_layout(self.warps), byte_alignment=16)
        sSum = smem.allocate_tensor(Float32, cute.make_layout(self.warps), byte_alignment=16)
        sAcc = smem.allocate_tensor(Float32, cute.make_layout((self.dv, self.groups)),
                                    byte_alignment=16)
        # 1. the row's LSE over its partials, each partial's scale exp(lse_s - lse)
        mx = self.block_reduce(lse, sMax, tidx, True)
        mx_cur = 0.0 if mx == -Float32.inf else mx  # every partial empty
        e = cute.math.exp2(lse * LOG2_E - mx_cur * LOG2_E, fastmath=True)
        tot = self.block_reduce(e, sSum, tidx, False)
        inv = 0.0 if (tot == 0.0 or tot != tot) else 1.0 / tot
        if tidx < n:
            sScale[tidx] = e * inv
        if tidx == 0:
            mLSE[at] = cute.math.log(tot, fastmath=True) + mx
        cute.arch.sync_threads()
        # 2. thread (group g, lane l): columns [8l, 8l + 8) of partials g, g + groups, ...
        lane_c = tidx % self.lanes
        g = tidx // self.lanes
        acc = cute.make_rmem_tensor((VEC,), Float32)
        acc.fill(0.0)
        frag = cute.make_rmem_tensor((VEC,), self.dtype)
        for s in cutlass.range(g, n, self.groups, unroll=4):
            sc = sScale[s]
            cute.autovec_copy(cute.local_tile(partial(s), (VEC,), (lane_c,)), frag)
            if sc > 0.0:  # (an empty partial is not read into the sum)
                acc.store(acc.load() + sc * frag.load().to(Float32))
        for i in cutlass.range_constexpr(VEC):
            sAcc[lane_c * VEC + i, g] = acc[i]
        cute.arch.sync_threads()
        # 3. the groups' sums, a column per thread (dv may exceed the threads)
        for c in cutlass.range(tidx, self.dv, self.threads):
            o = sAcc[c, 0]
            for j in cutlass.range_constexpr(1, self.groups):
                o = o + sAcc[c, j]
            mO_row[c] = o.to(self.dtype)


class ChunkMeta:
    threads = 128

    def __init__(self, lengths: bool):
        self.lengths = lengths
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


class PackedMeta:
    threads = 128
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


class RaggedMerge(SplitMerge):
    """The ragged step's merge (policy/ragged.py): SplitMerge's arithmetic over a variable
    number of entries a decode row. Decode row b = i * rows + t, query row m (of M, the GQA
    fold) merges row m * rows + t of sequence i's body entries, first[i] .. first[i + 1] -
    tail - 1, then of its tail entry t (tail > 0: the `tail` = rows entries after the body,
    one a row), from partials (entry, M * rows, heads, dv) / (entry, M * rows, heads); sink (M,
    heads) is one more LSE term with no output (a learnable sink's logit, counted once as FA4
    does; -inf: none). Threads >= max_splits > a row's entries."""

    def __init__(self, dtype, dv: int, max_splits: int, threads: int):
        super().__init__(dtype, dv, max_splits, threads, pdl=True)

    @cute.jit
    def __call__(self, mOp, mLp, mFirst, mSink, mO, mLSE, rows, tail, stream):
        self.kernel(mOp, mLp, mFirst, mSink, mO, mLSE, rows, tail).launch(
            grid=[mO.shape[2], mO.shape[1], mO.shape[0]], block=[self.threads, 1, 1],
            smem=self.smem_bytes(), stream=stream, use_pdl=True,
        )

    @cute.kernel
    def kernel(self, mOp, mLp, mFirst, mSink, mO, mLSE, rows, tail):
        cute.arch.griddepcontrol_wait()  # (launched early, as SplitMerge: wait for the entries)
        tidx, _, _ = cute.arch.thread_idx()
        h, m, b = cute.arch.block_idx()  # one CTA per (head, row of M, decode row)
        i = b // rows
        t = b - i * rows
        s0 = mFirst[i]
        nb = cutlass.max(mFirst[i + 1] - s0 - tail, 0)
        n = nb + cutlass.min(tail, 1)
        mr = m * rows + t
        lse = -Float32.inf
        if tidx < n:  # term nb (with a tail): entry s0 + nb + t
            lse = mLp[s0 + tidx + t * cutlass.min(cutlass.max(tidx - nb + 1, 0), 1), mr, h]
        if tidx == n:
            lse = mSink[m, h]
        self.merge_row(
            tidx, n, lse,
            lambda s: mOp[s0 + s + t * cutlass.min(cutlass.max(s - nb + 1, 0), 1), mr, h, None],
            mO[b, m, h, None], mLSE, (b, m, h),
        )


class RaggedMeta:
    """The ragged step's metadata (policy/ragged.py: its docstring and entry_map are this
    kernel's arithmetic): one CTA per entry v, each reading every length (b of them) to find
    the chunk and its own (sequence, entry); it writes the entry's keys (paged: lengths[v];
    packed: its first key, cu_v[v], the entries tiling the packed K in order) and page-table
    row (paged), copies its q rows, and CTA 0 writes first[]. A sequence of `rows` query rows
    (rows > 1: paged only) is its body entries, chunks of the keys every row sees, all rows
    packed; with `causal`, its body is those keys rounded down to a page and `rows` tail
    entries follow, tail entry t holding row t over its keys past the body."""

    threads = 256
    warps = threads // 32

    def __init__(self, paged: bool, dtype, head_dim: int, used: bool = False):
        # used: a packed K with seqused_k (lengths: seqused_k; table: cu_seqlens_k; out_v:
        # each entry's first key; table_v: its keys, one column)
        self.paged, self.used, self.dtype, self.vecs = paged, used, dtype, head_dim // VEC

    @cute.jit
    def __call__(self, mLen, mTable, mQ, mQv, mOut, mTableV, mFirst, n, align, page, rows,
                 causal, stream):
        self.kernel(mLen, mTable, mQ, mQv, mOut, mTableV, mFirst, n, align, page, rows,
                    causal).launch(
            grid=[mQv.shape[0], 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=True,
        )

    @cute.jit
    def seq_len(self, mLen, i):
        """Sequence i's keys (negative lengths read as 0)."""
        if cutlass.const_expr(self.paged or self.used):
            x = mLen[i]
        else:
            x = mLen[i + 1] - mLen[i]
        return cutlass.max(x, 0)

    @cute.jit
    def body_len(self, mLen, i, rows, tail, page):
        """Sequence i's body: its keys, or (tail > 0) those its first row sees, rounded down
        to a page."""
        x = self.seq_len(mLen, i)
        if tail > 0:
            x = cutlass.max(x - rows + 1, 0) // page * page
        return x

    @cute.jit
    def block_scan(self, x, sbuf, tidx):
        """(exclusive prefix sum of x over the CTA's threads in thread order, their total)."""
        lane, warp = tidx % 32, tidx // 32
        inc = x
        for k in cutlass.range_constexpr(5):
            y = cute.arch.shuffle_sync_up(inc, 1 << k)
            if lane >= (1 << k):
                inc = inc + y
        if lane == 31:
            sbuf[warp] = inc
        cute.arch.sync_threads()
        base = Int32(0)
        total = Int32(0)
        for w in cutlass.range_constexpr(self.warps):
            s = sbuf[w]
            if w < warp:
                base = base + s
            total = total + s
        cute.arch.sync_threads()  # (sbuf is reused)
        return base + inc - x, total

    @cute.kernel
    def kernel(self, mLen, mTable, mQ, mQv, mOut, mTableV, mFirst, n, align, page, rows,
               causal):
        cute.arch.griddepcontrol_wait()  # (a dependent launch: the lengths' writers done)
        tidx, _, _ = cute.arch.thread_idx()
        v, _, _ = cute.arch.block_idx()
        entries = mQv.shape[0]
        smem = cutlass.memory.SmemAllocator()
        sbuf = smem.allocate_tensor(Int32, cute.make_layout(self.warps), byte_alignment=16)
        sres = smem.allocate_tensor(Int32, cute.make_layout(2), byte_alignment=16)
        b = mFirst.shape[0] - 1
        tail = Int32(0)
        if rows > 1 and causal != 0:
            tail = rows
        if tidx == 0:
            sres[0] = -1
            sres[1] = 0
        # each thread owns a contiguous run of sequences, so prefix sums follow thread order
        per = (b + self.threads - 1) // self.threads
        lo = cutlass.min(tidx * per, b)
        hi = cutlass.min(lo + per, b)
        keys = Int32(0)
        for i in cutlass.range(lo, hi):
            keys = keys + self.seq_len(mLen, i)
        _, total = self.block_scan(keys, sbuf, tidx)
        c = (total + n - 1) // n
        c = cutlass.max((c + align - 1) // align * align, align)
        if cutlass.const_expr(self.paged):
            c = cutlass.min(c, mTableV.shape[1] * page)  # (lengths over the host's bound)
        cnt = Int32(0)
        for i in cutlass.range(lo, hi):
            cnt = cnt + (self.body_len(mLen, i, rows, tail, page) + c - 1) // c + tail
        f, used = self.block_scan(cnt, sbuf, tidx)
        for i in cutlass.range(lo, hi):
            k = (self.body_len(mLen, i, rows, tail, page) + c - 1) // c + tail
            if v == 0:
                mFirst[i] = cutlass.min(f, entries)
            if v >= f and v < f + k:
                sres[0] = i
                sres[1] = v - f
            f = f + k
        if v == 0 and tidx == 0:
            mFirst[b] = cutlass.min(used, entries)
        cute.arch.sync_threads()
        seq = sres[0]
        u = sres[1]
        if seq >= 0:
            body = self.body_len(mLen, seq, rows, tail, page)
            nb = (body + c - 1) // c
            start = u * c
            keys_v = cutlass.min(body - start, c)
            r0 = Int32(0)
            nr = rows
            if u >= nb:  # tail entry t = u - nb: row t over the keys it sees past the body
                r0 = u - nb
                nr = Int32(1)
                start = body
                keys_v = cutlass.max(self.seq_len(mLen, seq) - rows + 1 + r0 - body, 0)
            if cutlass.const_expr(self.paged):
                if tidx == 0:
                    mOut[v] = keys_v
                # the pages of the entry's 128-key tiles (what the chunk kernel may read)
                col0 = start // page
                last = mTable.shape[1] - 1
                ncol = cutlass.min((keys_v + 127) // 128 * 128 // page, mTableV.shape[1])
                for x in cutlass.range(tidx, ncol, self.threads):
                    mTableV[v, x] = mTable[seq, cutlass.min(col0 + x, last)]
            elif cutlass.const_expr(self.used):
                if tidx == 0:
                    mOut[v] = mTable[seq] + start
                    mTableV[v, 0] = keys_v
            else:
                if tidx == 0:
                    mOut[v] = mLen[seq] + start
            # q rows r0 .. r0 + nr - 1 into the entry's (row, KV head, GQA group) slots
            hq = mQ.shape[1]
            r = mQv.shape[3]
            per_row = hq * self.vecs
            frag = cute.make_rmem_tensor((VEC,), self.dtype)
            for e in cutlass.range(tidx, nr * per_row, self.threads):
                tt = e // per_row
                h = (e - tt * per_row) // self.vecs
                col = e - tt * per_row - h * self.vecs
                kh = h // r
                tt = tt + r0
                cute.autovec_copy(cute.local_tile(mQ[seq * rows + tt, h, None], (VEC,),
                                                  (col,)), frag)
                cute.autovec_copy(frag, cute.local_tile(mQv[v, tt, kh, h - kh * r, None],
                                                        (VEC,), (col,)))
        else:
            if tidx == 0:
                if cutlass.const_expr(self.paged):
                    mOut[v] = 0
                elif cutlass.const_expr(self.used):
                    mOut[v] = 0
                    mTableV[v, 0] = 0
                else:
                    mOut[v] = mLen[b]
        if cutlass.const_expr(not self.paged and not self.used):
            if v == entries - 1 and tidx == 0:
                mOut[entries] = mLen[b]  # (the last entry's end)


class ChunkModes:
    """FA4's sm90 forward (`inner`) with q's batch mode broadcast over the virtual sequences, a
    paged K's lengths and a packed K's bounds viewed for ChunkLengths / RowChunks
    (forwards.trace_chunk_modes); `assume`: FA4's own alignment step, applied to the flat q."""

    def __init__(self, inner, assume):
        self.inner, self.assume = inner, assume

    @cute.jit
    def __call__(self, mQ, mK, mV, mO, mLSE, scale, cu_q, cu_k, used_q, used_k, pages,
                 wl, wr, sink, sparse, aux, cu_m, cu_sm, stream):  # FA4's sm90 order
        mQ = self.assume(mQ)  # (FA4's own first step, on the flat q)
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
