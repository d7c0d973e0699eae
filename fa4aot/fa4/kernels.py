"""fa4aot's own CuTe-DSL kernels: the split-KV merge, the chunk metadata and the packed-rows
metadata kernels. Their classes are made on first use (`cutlass` loads only then)."""

from __future__ import annotations

import math
from typing import Any

from fa4aot.fa4.forwards import COMBINE_LOG_MAX_SPLITS
from fa4aot.model import constraints as C
from fa4aot.model.variants import Variant

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
    8:1) is one CTA reading 256 KB in 128 dependent steps. This kernel runs one CTA per row
    and spreads the chunks over thread groups, each thread loading 16 bytes per chunk (faster
    from ~16 chunks: docs/design.md, Tuned thresholds; outputs within bf16 rounding of FA4's
    combine). Merging follows FA4's combine: lse = log(sum_s exp(lse_s)) (-inf when every
    chunk is empty, the row's output then 0), and a chunk of scale 0 is skipped, so an empty
    chunk's unwritten partial is never read into the sum.

    pdl (the shipped form since C.MERGE_VERSION 2): launched as a programmatic dependent launch
    (the launch's programmatic stream serialization), so the GPU launches it as the chunk
    kernel's CTAs exit rather than after the grid completes, and it waits in
    griddepcontrol.wait, which returns once the chunk kernel's grid has completed and its
    writes are visible, before it reads a partial (C.MERGE_VERSION's measurement). A chunk
    kernel that also triggered its dependents (griddepcontrol.launch_dependents) at each CTA's
    first tile gained less: not shipped."""
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

    Why: a paged split step at one row spent its difference from the dense step (whose metadata
    is a constant) on the torch launches this kernel replaces."""
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
    (split.plan_packed, runtime/splitruns.PackedRun) for `variant`, a paged split chunk kernel:
    one launch where the step ran ten element-wise torch kernels (split.PACKED_META_TORCH_S).
    The runtime calls it as `packed_meta(used, table, used_a, tail_table,
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


