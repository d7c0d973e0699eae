"""Tracing fa4aot's own CuTe-DSL kernels (their classes: fa4/cute_kernels.py, imported when
one compiles, so `cutlass` loads only then): the split-KV merge, the chunk metadata and the
packed-rows metadata kernels, and the ragged step's metadata and merge."""

from __future__ import annotations

from typing import Any

from fa4aot.fa4.forwards import COMBINE_LOG_MAX_SPLITS
from fa4aot.model import constraints as C
from fa4aot.model.variants import Variant

# fa4aot's merge kernel: its key is (name, version, dtype, head dim v, max splits, threads);
# bump the version (C.MERGE_VERSION, which build.superseded reads) when its code changes
MERGE_KEY = ("fa4aot_merge", C.MERGE_VERSION)


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

    from fa4aot.fa4 import cute_kernels as K

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
    kernel = K.SplitMerge(dt, dv, max_splits, threads, pdl)
    fn = cute.compile(
        kernel, *args, cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        options="--enable-tvm-ffi",
    )
    return [(key, fn)]



# fa4aot's chunk metadata kernel: (name, version, form); bump the version when its code changes
CHUNK_META_KEY = ("fa4aot_chunk_meta", 1)


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

    from fa4aot.fa4 import cute_kernels as K

    form = "lengths" if variant.paged else "bounds"
    sym = cute.sym_int
    i32 = cutlass.Int32
    b, m = sym(), sym()
    src = make_fake_tensor(i32, (b,), divisibility=1, leading_dim=None)  # (any stride)
    dst = make_fake_tensor(i32, (b if variant.paged else sym(), m), divisibility=1,
                           leading_dim=None)
    fn = cute.compile(
        K.ChunkMeta(variant.paged), src, dst, i32(0), i32(0), i32(0), i32(0),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi",
    )
    return [((*CHUNK_META_KEY, form), fn)]



# fa4aot's packed-rows metadata kernel: (name, version); bump the version when its code changes
PACKED_META_KEY = ("fa4aot_packed_meta", 1)


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

    from fa4aot.fa4 import cute_kernels as K

    if not variant.paged:
        raise RuntimeError("the packed-rows metadata kernel is for a paged K's split kernel")
    sym = cute.sym_int
    i32 = cutlass.Int32
    b, m = sym(), sym()

    def t(*shape):
        return make_fake_tensor(i32, shape, divisibility=1, leading_dim=None)  # (any stride)

    fn = cute.compile(
        K.PackedMeta(), t(b), t(b, sym()), t(b), t(m, 2), t(m), i32(0), i32(0),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi",
    )
    return [(PACKED_META_KEY, fn)]


# the ragged step's kernels (policy/ragged.py): (name, version, ...); bump the version when
# their code changes (build.superseded reads C.RAGGED_VERSION)
RAGGED_META_KEY = ("fa4aot_ragged_meta", C.RAGGED_VERSION)
RAGGED_MERGE_KEY = ("fa4aot_ragged_merge", C.RAGGED_VERSION)


def trace_ragged(variant: Variant) -> dict[str, list[tuple[Any, Any]]]:
    """Compile the ragged step's metadata kernel and merge for `variant` (an sm90 split chunk
    kernel whose head dim fa4aot's merge has a thread layout for), as parts `ragged_meta` and
    `ragged_merge`; {} otherwise. The runtime (runtime/ragged.py) calls them as

    - `ragged_meta(lengths, table, q, q_v, out_v, table_v, first, n, align, page, rows,
      causal)`: paged K: lengths the caller's seqused_k (b,), table its page table (b, P),
      out_v (entries,) each entry's keys, table_v (entries, pages); packed K (rows 1):
      lengths its cu_seqlens_k (b + 1,), out_v (entries + 1,) the entries' bounds, table and
      table_v None; packed K with seqused_k (part `ragged_meta_used`, rows 1): lengths its
      seqused_k (b,), table its cu_seqlens_k (b + 1,), out_v (entries,) each entry's first
      key, table_v (entries, 1) its keys; q (b * rows, hq, d) with 16-byte aligned rows, q_v (entries, rows, hk,
      hq / hk, d), first (b + 1,): int32 tensors (any strides but q's last), then five int32s
      (rows: query rows a sequence; causal 0 or 1);
    - `ragged_merge(out_partial, lse_partial, first, sink, out, lse, rows, tail)`: partials
      (entries, M * rows, heads, dv) in the variant's dtype and (entries, M * rows, heads)
      float32, first (b + 1,) int32, sink (M, heads) float32 (-inf: none), out (b * rows, M,
      heads, dv), lse (b * rows, M, heads) float32 (any strides but a contiguous dv), then
      rows and tail (the tail entries a sequence: rows when causal over several rows, else 0)."""
    v = variant
    max_splits = 1 << COMBINE_LOG_MAX_SPLITS
    threads = C.merge_threads(v.head_dim_v, max_splits)
    if v.arch != "sm90" or threads is None or v.head_dim % 8:
        return {}
    import cutlass
    import cutlass.cute as cute
    from quack.compile_utils import make_fake_tensor

    from fa4aot.fa4 import cute_kernels as K

    dt = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[v.dtype]
    sym, i32, f32 = cute.sym_int, cutlass.Int32, cutlass.Float32
    div = 128 // dt.width  # 16-byte aligned rows

    def ints(*shape):
        return make_fake_tensor(i32, shape, divisibility=1, leading_dim=None)

    b, w, hq = sym(), sym(), sym()
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)

    def compile_meta(lens, table, out_v, table_v, used=False):
        return cute.compile(
            K.RaggedMeta(bool(v.paged), dt, v.head_dim, used), lens, table,
            make_fake_tensor(dt, (sym(), hq, v.head_dim), divisibility=div),  # (b * rows)
            make_fake_tensor(dt, (w, sym(), sym(), sym(), v.head_dim), divisibility=div),
            out_v, table_v, ints(sym()), i32(0), i32(0), i32(0), i32(0), i32(0), stream,
            options="--enable-tvm-ffi",
        )

    used = None
    if v.paged:
        meta = compile_meta(ints(b), ints(b, sym()), ints(w), ints(w, sym()))
    else:
        meta = compile_meta(ints(sym()), None, ints(sym()), None)
        used = compile_meta(ints(b), ints(sym()), ints(w), ints(w, sym()), used=True)
    dv = v.head_dim_v
    e, bb, m, h = sym(), sym(), sym(), sym()
    merge = cute.compile(
        K.RaggedMerge(dt, dv, max_splits, threads),
        make_fake_tensor(dt, (e, sym(), h, dv), divisibility=div),  # (M * rows)
        make_fake_tensor(f32, (e, sym(), h), divisibility=1, leading_dim=None),
        ints(sym()), make_fake_tensor(f32, (m, h), divisibility=1, leading_dim=None),
        make_fake_tensor(dt, (bb, m, h, dv), divisibility=div),
        make_fake_tensor(f32, (bb, m, h), divisibility=1, leading_dim=None), i32(0), i32(0),
        stream, options="--enable-tvm-ffi",
    )
    form = "paged" if v.paged else "packed"
    out = {
        "ragged_meta": [((*RAGGED_META_KEY, form, v.dtype, v.head_dim), meta)],
        "ragged_merge": [((*RAGGED_MERGE_KEY, v.dtype, dv, max_splits, threads), merge)],
    }
    if used is not None:
        out["ragged_meta_used"] = [((*RAGGED_META_KEY, "used", v.dtype, v.head_dim), used)]
    return out
