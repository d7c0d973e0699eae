"""Split-KV for decode steps: a plan that runs one long KV as many short ones, then merges them.

FA4 4.0.0b36 has no split-KV on sm90 (`num_splits != 1` asserts), so a decode step runs one CTA
per (sequence, KV head): a batch-1 step over a long context uses 8 of the H200's 132 SMs, and one
CTA streams K/V at about 50 GB/s (1334 us for 67 MB in the issue's table). The plan here needs
no new forward kernel. The KV of each sequence is cut into `n` chunks of `chunk` keys; chunk j of
sequence i becomes virtual sequence `i * slots + j` of a cached kernel that returns LSE, and
fa4aot's merge kernel (`kernels.trace_merge`, cross-compiled beside that kernel; in stores
built before it, FA4's own combine) merges the partial outputs by LSE into the caller's `out`
and `lse`.

Exactness, rule by rule (`split_refusal` refuses the rest):
- The chunk kernel is the non-causal 1:1 kernel with q in batch form: one query row sees every
  key of its chunk, which is what a non-last chunk must see, and a decode row (s_q == 1,
  causal or not) sees all of its sequence's keys. A step of s_q > 1 rows (speculative
  decoding) is unrolled into s_q decode rows, row t seeing `len - s_q + 1 + t` keys when
  causal (all of them otherwise). Over a paged KV (a dense one viewed as pages included:
  dense_page_size) the rows share pages with their own lengths, and may instead pack as rows
  of one chunk (plan_packed); over a packed KV, whose rows' ranges overlap (cu_seqlens_k
  ranges alone cannot), the chunk kernel's bounds mode reads each row's chunk bounds from
  cu_seqlens_k itself (forwards.trace_chunk_modes(bounds=True)).
- GQA is folded (`select.py`): the r query heads of a KV head are r query rows of the 1:1
  kernel, so one kernel serves every head ratio.
- Learnable sinks count once: the chunks run without them, and one extra, empty slot per
  sequence carries the sink as its LSE (its output is the kernel's zero for no keys).
- A window is not split (the kernel already reads only the window's keys; no chunk may see a
  key the window hides), nor a softcap (the chunk kernel has none).

Nothing here syncs the host: the split count comes from host-known sizes (batch, KV heads,
the max KV length), per-split lengths, cu_seqlens and page-table views are computed on the GPU
by a few torch ops, so a captured CUDA graph replays the plan.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

from fa4aot.model import constraints as C

# The merge kernel (and FA4's combine, in older stores) is compiled for at most 2**7 partials
# per row (FA4's combine asserts <= 256).
MAX_SLOTS = 128
# The chunk kernel runs each (sequence, row, slot) as a batch index of FA4's SingleTileScheduler,
# whose grid holds the batch in z: CUDA's limit on gridDim.z bounds a split's virtual sequences.
MAX_VIRTUAL_SEQS = 65535


@dataclass(frozen=True)
class CostModel:
    """Time of one decode step as a function of its split count (sm90, H200 figures).

    cta_bytes_per_s: how fast one CTA of the chunk kernel streams K/V, which with the 64-row
    tile (constraints.split_tile_m) also runs the unsplit step (the fold); hbm_bytes_per_s:
    what the whole chip streams; overhead_s: what a split adds to the step besides streaming,
    paid only when it splits: the merge's launch and its reads (and the metadata kernel's
    launch for packed or paged K). `benchmarks/decode_split.py` measures them
    (docs/design.md, Tuned thresholds)."""

    cta_bytes_per_s: float = 60e9
    hbm_bytes_per_s: float = 4.3e12
    overhead_s: float = 4e-6
    # how fast one CTA of FA4's own decode kernel streams K/V: the unsplit step where the fold
    # does not serve it (fold_refusal: a sink, several query rows, head dims over 128)
    fa4_cta_bytes_per_s: float = 42e9
    # what the chip streams over a step of fewer than short_bytes of K/V, where it differs
    # (None: hbm_bytes_per_s): model_for's cards other than the H200
    short_hbm_bytes_per_s: float | None = None
    short_bytes: float = 64e6
    # keys: one KV block, the shortest chunk (q is read in place, forwards.trace_chunk_modes)
    min_chunk: int = 128


DEFAULT_MODEL = CostModel()
# The model's figures are the H200's (HBM3e, 4.8 TB/s peak). Another sm90 card has the same SMs
# (the CTAs stream as fast) but streams as a whole in proportion to its peak; a short step
# reaches neither card's peak, so there the H200's figures hold (model_for).
H200_HBM_PEAK = 4.8e12


def model_for(hbm_peak: float | None) -> CostModel:
    """The cost model of a card whose HBM peaks at `hbm_peak` bytes/s (None: unknown, the
    H200's): the chip's streaming rate over steps of at least short_bytes scaled by its peak
    over the H200's (within 5%: the H200's model itself)."""
    if not hbm_peak or abs(hbm_peak / H200_HBM_PEAK - 1) < 0.05:
        return DEFAULT_MODEL
    return dataclasses.replace(
        DEFAULT_MODEL, hbm_bytes_per_s=DEFAULT_MODEL.hbm_bytes_per_s * hbm_peak / H200_HBM_PEAK,
        short_hbm_bytes_per_s=DEFAULT_MODEL.hbm_bytes_per_s)
# Most query rows per sequence a split takes: decode and speculative steps (a prefill chunk
# fills the SMs by itself).
MAX_ROWS = 16
# KV lengths at or below this never split (the entry points' first test, on the hot path of
# every short decode step): under the model a split first wins at about 600 keys for head dim
# 128 (one CTA streaming them ~ one 128-key chunk plus overhead_s).
NEVER_SPLIT_KEYS = 1023
# Plans are made for the KV bound rounded up to this many keys, so a decode loop whose KV
# grows a key a step replans once per PLAN_KEYS steps (the runtime and explain alike).
PLAN_KEYS = 256


def plan_bucket(seqlen_k: int) -> int:
    """The KV length a step's split is planned for: seqlen_k rounded up to PLAN_KEYS."""
    return -(-seqlen_k // PLAN_KEYS) * PLAN_KEYS


def chunk_keys(seqlen_k: int, n: int, align: int) -> int:
    """Keys per chunk for n chunks of a KV of seqlen_k keys, rounded up to `align`."""
    c = -(-max(seqlen_k, 1) // n)
    return -(-c // align) * align


def step_time(
    n: int,
    *,
    ctas: int,
    seqlen_k: int,
    bytes_per_key: int,
    num_sms: int,
    align: int,
    model: CostModel = DEFAULT_MODEL,
    fold: bool = True,
) -> float:
    """Modelled seconds of a decode step on n chunks; ctas: (sequence, KV head) pairs; fold:
    whether the unsplit step (n == 1) runs as the fold, on the chunk kernel (else FA4's)."""
    c = chunk_keys(seqlen_k, n, align)
    n_eff = -(-seqlen_k // c)
    waves = -(-ctas * n_eff // num_sms)
    rate = model.cta_bytes_per_s if n_eff > 1 or fold else model.fa4_cta_bytes_per_s
    total = ctas * seqlen_k * bytes_per_key
    hbm = model.hbm_bytes_per_s
    if model.short_hbm_bytes_per_s and total < model.short_bytes:
        hbm = model.short_hbm_bytes_per_s
    stream = max(waves * c * bytes_per_key / rate, total / hbm)
    return stream + (model.overhead_s if n_eff > 1 else 0.0)


def choose_splits(
    *,
    batch: int,
    kv_heads: int,
    rows: int,
    seqlen_k: int,
    bytes_per_key: int,
    num_sms: int,
    align: int = 128,
    max_splits: int = MAX_SLOTS,
    model: CostModel = DEFAULT_MODEL,
    fold: bool = True,
) -> int:
    """The split count that minimises `step_time` (1: do not split; `fold`: the unsplit step
    runs as the fold).

    rows: the virtual decode rows per sequence (1, or s_q for an unrolled speculative step);
    bytes_per_key: K + V bytes of one key of one KV head. A step splits only where the model
    says it wins. Within 3% of the best time, more CTAs in one wave win: the model's HBM
    term is a ceiling that more concurrent streams approach."""
    ctas = batch * rows * kv_heads
    min_chunk = model.min_chunk
    if seqlen_k <= min_chunk or ctas >= num_sms:
        return 1
    best_n, best_t = 1, None
    hi = min(max_splits, seqlen_k // min_chunk)  # every chunk >= min_chunk keys
    for n in range(1, hi + 1):
        c = chunk_keys(seqlen_k, n, align)
        if n > 1 and -(-seqlen_k // c) < n:
            continue  # rounding left fewer chunks: the same as a smaller n
        t = step_time(
            n, ctas=ctas, seqlen_k=seqlen_k, bytes_per_key=bytes_per_key, num_sms=num_sms,
            align=align, model=model, fold=fold,
        )
        if best_t is None or t < best_t * (1 - 1e-9):
            best_n, best_t = n, t
        elif n > 1 and best_n > 1 and t <= best_t * 1.03 and ctas * n <= num_sms:
            best_n = n
    return best_n


def fold_refusal(
    *, arch: str, head_dim: int, head_dim_v: int, ratio: int, rows: int, sink: bool,
) -> str | None:
    """Why a decode step the plan leaves unsplit does not run as the fold (one chunk per
    sequence on the chunk kernel: runtime/splitruns.FoldRun), or None (it does). Shared by the
    runtime and `fa4aot explain`."""

    tile_m = C.split_tile_m(arch, head_dim, head_dim_v)
    if tile_m is None:
        return f"the chunk kernel has FA4's own tile on {arch} at hd{head_dim}/{head_dim_v}"
    if rows != 1:
        return f"{rows} query rows (the fold takes one decode row per sequence)"
    if sink:
        return "a learnable sink (the chunk kernel has none)"
    if ratio > tile_m:
        return f"{ratio} query heads per KV head exceed the chunk kernel's {tile_m}-row tile"
    return None


def merge_part(parts: dict, dtype: str) -> tuple[str | None, dict]:
    """The part of a split chunk kernel's artifact that merges its chunks' partials of `dtype`:
    (name, its record) for fa4aot's merge kernel (`merge`) or, in artifacts built before it,
    FA4's combine (`combine`); (None, {}) when it has neither (the step then runs unsplit).
    Shared by the runtime (plan.Runtime.split_kernel) and `fa4aot explain`."""
    merge = parts.get("merge", {})
    if merge.get("partial_dtype") == dtype:
        return "merge", merge
    comb = parts.get("combine", {})
    if comb.get("partial_dtype") == dtype and comb.get("tile_m"):
        return "combine", comb
    return None, {}


def wide_path(page_size: int | None, paged_tma: bool, tma_part_bound: bool) -> str | None:
    """plan_split's `wide_paged` for a paged split step (None for a packed K): "tma" on FA4's
    TMA paged chunk kernel (paged_tma: pages of one 128-key tile), "cp.async" on its cp.async
    one, None where the step runs on the part fwd_tma (pages of 64: not measured wide)."""
    if page_size is None or tma_part_bound:
        return None
    return "tma" if paged_tma else "cp.async"


def tma_part(parts: dict, page_size: int | None) -> str | None:
    """The part of a paged split chunk kernel's artifact a split step over pages of
    `page_size` runs its chunks on instead of `fwd`: `fwd_tma` (constraints.tma_page), where
    its record's page size is the step's; None otherwise (other page sizes, a packed K,
    artifacts built before it). Shared by the runtime (plan.Runtime.split_kernel) and `fa4aot
    explain`."""
    if page_size is not None and parts.get("fwd_tma", {}).get("page_size") == page_size:
        return "fwd_tma"
    return None


def bounds_part(parts: dict) -> str | None:
    """The packed K's bounds-mode forward part the runtime loads: `fwd_bounds` in its current
    form (record `rows` == constraints.BOUNDS_FORM), else None (an earlier form: the runtime
    then writes one-row bounds with the metadata kernel and runs a step of several rows over
    a packed K unsplit)."""

    rec = parts.get("fwd_bounds", {})
    return "fwd_bounds" if rec.get("rows") == C.BOUNDS_FORM else None


def wide_part(parts: dict, variant) -> str | None:
    """The part of split chunk kernel `variant`'s artifact (record parts `parts`) a wide plan
    (Split.wide, wide_split) runs its chunks on: `fwd_wide_split`, where the artifact holds it
    and constraints.wide_split builds it for the variant (a store built before that rule may
    hold one for other head dims: unused); None otherwise (older artifacts). Shared by the
    runtime (plan.Runtime.split_kernel) and `fa4aot explain`."""

    v = variant
    w = C.wide_split(v.arch, v.head_dim, v.head_dim_v, v.tile_m, v.paged)
    return w.part if w is not None and w.part in parts else None


# Page sizes a dense KV of several query rows is viewed in (dense_page_size), largest first.
DENSE_PAGES = (128, 64, 16)


def dense_page_size(seqlen_k: int, have) -> int | None:
    """The page size a dense K of seqlen_k keys per sequence is split through when a step has
    several query rows, or None: the first of DENSE_PAGES that divides seqlen_k (so every
    sequence starts on a page: the K is its own page pool, the page table a constant) and
    for which `have(page_size)` (a paged split kernel is cached)."""
    for p in DENSE_PAGES:
        if seqlen_k % p == 0 and have(p):
            return p
    return None


def split_refusal(
    *,
    causal: bool,
    window: bool,
    seqlen_q: int | None,
    paged: bool,
    max_seqlen_q_known: bool,
    softcap: bool = False,
    row_bounds: bool = True,
) -> str | None:
    """Why a decode call cannot be split exactly (None: it can). The plan then runs unsplit.
    (The runtime's entry points test the same conditions inline, on their hot path.) paged:
    the KV is paged, or dense and viewed as pages (dense_page_size); row_bounds: the packed
    K's split kernel reads each row's chunk bounds itself (bounds_part), which a step of
    several rows over a packed K (or a dense one not viewed as pages) needs."""
    if window:
        return "windowed: the kernel already reads only the window's keys"
    if softcap:
        return "softcap: the split's chunk kernel has none"
    if seqlen_q is None or not max_seqlen_q_known:
        return "the query rows per sequence are not host-known (pass max_seqlen_q)"
    if seqlen_q > 1 and not paged and not row_bounds:
        return (
            f"{seqlen_q} query rows over a packed KV, or a dense one whose length no cached "
            f"paged split kernel's page size divides, and a packed-K split kernel built "
            f"before its bounds mode took several rows (unrolled into decode rows, "
            f"{'causal ones see different keys; ' if causal else ''}each row needs its own "
            "chunk bounds: `fa4aot build` rebuilds it)"
        )
    return None


@dataclass(frozen=True)
class Split:
    """One split plan: n chunks of `chunk` keys per (sequence, query row); `slots` = n, plus
    one for a learnable sink (and for `packed` causal rows one for their tail); `wide`: the
    chunks run on the wide split kernel (wide_split); `packed`: a step of several query rows
    a sequence runs them packed as rows of one chunk (plan_packed), not unrolled."""

    n: int
    chunk: int
    slots: int
    wide: bool = False
    packed: bool = False
    tail: bool = False

    def describe(self) -> str:
        s = f"split-KV: {self.n} chunks of {self.chunk} keys, merged by LSE"
        extra = []
        if self.tail:
            extra.append("+1 causal tail slot")
        if self.slots > self.n + self.tail:
            extra.append("+1 sink slot")
        if extra:
            s += f" ({', '.join(extra)})"
        return s


# A speculative step's packed plan (plan_packed) pays besides its chunks' streaming (and the
# merge, step_time's overhead_s): the q copy into packed rows, the causal tail's chunk kernel
# and its two copies into the merge's slot, and the empty CTAs of the tail's slot; for a
# caller's paged K the tail's metadata: one kernel (kernels.trace_packed_meta), or ten
# element-wise torch kernels in older stores (for a dense K viewed as pages, a constant).
# Unrolled rows take the one-row step's time about 1 + UNROLLED_ROW_COST * (rows - 1) times
# (L2 absorbs their repeated reads, the SMs' load rate does not). Measurements: docs/design.md.
PACKED_EXTRA_S = 18e-6
PACKED_META_KERNEL_S = 3e-6
PACKED_META_TORCH_S = 19e-6
UNROLLED_ROW_COST = 0.4


def packed_meta_s(paged: bool, kernel: bool) -> float:
    """plan_packed's `meta_s`: what a causal step's tail metadata costs a step: nothing for
    a dense K viewed as pages (constants) or a packed K (the bounds mode cuts the tail), else
    its kernel's launch or the torch kernels."""
    if not paged:
        return 0.0
    return PACKED_META_KERNEL_S if kernel else PACKED_META_TORCH_S


def packed_refusal(*, ratio: int, rows: int, tile_m: int | None,
                   page_size: int | None) -> str | None:
    """Why a step of several query rows a sequence cannot run them packed as rows of one
    chunk (plan_packed), or None: the chunk kernel's M tile holds ratio * rows rows, and over
    pages the causal tail (at most page_size - 1 + rows - 1 keys) lies in two pages (page_size
    None: a packed K, whose tail the bounds mode anchors at each sequence's end)."""
    if tile_m is None:
        return "the chunk kernel has FA4's own tile"
    if rows < 2:
        return "one query row"
    if ratio * rows > tile_m:
        return f"{ratio} query heads x {rows} rows exceed the chunk kernel's {tile_m}-row tile"
    if page_size is not None and rows > page_size + 1:
        return f"{rows} rows' causal tail spans more than two pages of {page_size}"
    return None


def plan_packed(
    *,
    batch: int,
    kv_heads: int,
    rows: int,
    seqlen_k: int,
    bytes_per_key: int,
    page_size: int | None,
    sink: bool,
    causal: bool,
    num_sms: int,
    setting: int,
    max_slots: int = MAX_SLOTS,
    unrolled: Split | None = None,
    meta_s: float = PACKED_META_KERNEL_S,
    model: CostModel = DEFAULT_MODEL,
) -> Split | None:
    """The packed plan of a decode step of `rows` query rows a sequence over a paged K (or a
    dense one viewed as pages), or a packed one (page_size None: the chunk kernel's bounds
    mode), or None (run it unrolled, `unrolled`, or unsplit where that is None). Packed: the
    rows of a KV head's query heads (ratio x rows) are the rows of one chunk of the 1:1 chunk
    kernel, so each chunk's keys stream once for every row, where unrolled rows stream them
    once a row. Causal rows see different keys only in their last rows - 1 keys: the chunks
    cover the keys every row sees (up to a page boundary over pages: T = the page-rounded
    len - rows + 1; over a packed K T = len - rows + 1), and a tail, the rows unrolled over
    the keys from T (at most two pages), fills one more slot (Split.tail). Auto: the cost
    model's split of batch * kv_heads CTAs, taken where
    its time (plus PACKED_EXTRA_S, and `meta_s` for a causal step's tail metadata,
    packed_meta_s) beats the unrolled rows' (UNROLLED_ROW_COST) or the unsplit kernel's;
    a forced count (setting > 0) always packs. Shared by the runtime and `fa4aot explain`."""
    if setting == 0:
        return None
    align = 128 if page_size is None else math.lcm(128, page_size)
    extra = int(causal) + int(sink)
    kw = dict(seqlen_k=seqlen_k, bytes_per_key=bytes_per_key, num_sms=num_sms, align=align,
              model=model)
    ctas = batch * kv_heads
    if setting > 0:
        n = setting
    else:
        # the one-row step's count: the tail's and a sink's slots are CTAs of the chunks' grid
        # too, but empty ones, which leave at once (measured faster than one wave: design.md)
        n = choose_splits(batch=batch, kv_heads=kv_heads, rows=1, fold=True, **kw)
        one = step_time(n, ctas=ctas, fold=True, **kw)  # the one-row step of this shape
        if n == 1 and extra:
            one += model.overhead_s  # one chunk still merges with its tail (or sink)
        t = one + PACKED_EXTRA_S + (meta_s if causal else 0.0)
        if unrolled is None:  # unsplit: FA4's kernel packs the rows itself
            alt = step_time(1, ctas=ctas, fold=False, **kw)
        else:
            alt = one * (1 + UNROLLED_ROW_COST * (rows - 1))
        if t >= alt:
            return None
    n = min(n, max_slots - extra, MAX_VIRTUAL_SEQS // max(batch, 1) - extra)
    if n < 1:
        return None
    sp = make_split(n, seqlen_k, page_size=page_size, sink=False, align=align)
    return Split(sp.n, sp.chunk, sp.n + extra, packed=True, tail=causal)


# split.wide_split: the shortest sequence of an unsplit one-wave step (the fold, which has no
# merge to pay) that goes wide; how many CTAs the wide plan aims at (about four waves of two CTAs
# per SM on 132 SMs); its shortest chunk. A plan of n > 1 one-wave chunks stays on the chunk
# kernel (128-key tiles, one CTA per SM). Measurements: docs/design.md, Tuned thresholds.
WIDE_MIN_FOLD_BYTES = 65536 * 512
WIDE_CTAS = 1024
WIDE_CHUNK_BYTES = 4096 * 512
# A fold of two waves or more (more (sequence, KV head) CTAs than SMs) over sequences of at least
# WIDE_MIN_FOLD_BYTES runs as WIDE_WAVES_N chunks each on the wide split kernel (12 chunks,
# not whole 64-key tiles, tied).
WIDE_WAVES_N = 16


def wide_split(
    n: int, *, ctas: int, seqlen_k: int, bytes_per_key: int, num_sms: int, max_slots: int,
    paged: str | None = None,
) -> int | None:
    """The chunk count of a packed K's decode step that runs on the wide split kernel
    (constraints.wide_split) instead of the plan's n chunks (1: unsplit) on the chunk kernel,
    or None (keep the plan): where the plan is the unsplit fold in one wave (ctas <= SMs) over
    at least WIDE_MIN_FOLD_BYTES a sequence, chunks of at least WIDE_CHUNK_BYTES for about
    WIDE_CTAS CTAs (a split plan, n > 1, keeps the chunk kernel). ctas:
    (sequence, KV head) pairs. An unsplit step of more CTAs than SMs (the fold in two waves or
    more) over at least WIDE_MIN_FOLD_BYTES a sequence: WIDE_WAVES_N chunks. paged: a paged
    K's chunk kernel's path (constraints.WIDE_SPLIT_PAGED): "cp.async" takes the one-wave
    rule only, "tma" (FA4's TMA paged kernel, pages of 128) the two-wave one only (each loses
    0.3-0.8% where the other gains)."""
    if ctas * n > num_sms:
        if (n == 1 and paged != "cp.async"
                and seqlen_k * bytes_per_key >= WIDE_MIN_FOLD_BYTES):
            return min(WIDE_WAVES_N, max_slots)
        return None
    if paged == "tma" or n > 1 or seqlen_k * bytes_per_key < WIDE_MIN_FOLD_BYTES:
        return None
    wide = min(-(-WIDE_CTAS // ctas), seqlen_k * bytes_per_key // WIDE_CHUNK_BYTES, max_slots)
    return wide if wide > n else None


def make_split(
    n: int, seqlen_k: int, *, page_size: int | None, sink: bool, align: int = 128
) -> Split:
    a = align if page_size is None else math.lcm(align, page_size)
    c = chunk_keys(seqlen_k, n, a)
    n_eff = -(-seqlen_k // c)
    return Split(n_eff, c, n_eff + (1 if sink else 0))


# -- the GPU-side metadata (torch ops; no host sync) ------------------------------------------
# (a packed K's chunk bounds and a paged K's chunk lengths are written per step into scratch by
# runtime/splitkv.py: two element-wise kernels each)


def dense_cu_seqlens_k(torch, batch: int, seqlen_k: int, sp: Split, device):
    """cu_seqlens_k of the virtual sequences over a dense K viewed as (batch * seqlen_k, ...):
    virtual sequence i * slots + j holds keys [i*sk + min(j*c, sk), i*sk + min((j+1)*c, sk))."""
    j = torch.arange(sp.slots, device=device, dtype=torch.int32)
    starts = (j * sp.chunk).clamp_(max=seqlen_k)
    rows = torch.arange(batch, device=device, dtype=torch.int32)[:, None] * seqlen_k + starts
    tail = torch.full((1,), batch * seqlen_k, device=device, dtype=torch.int32)
    return torch.cat([rows.flatten(), tail])


def chunk_page_table(torch, page_table, sp: Split, page_size: int, rows_per_seq: int = 1):
    """(b, P) page table -> (b * rows_per_seq * slots, chunk // page_size): row (i, t, j) holds
    sequence i's pages of chunk j. A view when the table is contiguous, holds exactly
    slots * pages-per-chunk pages and rows_per_seq == 1; else one copy."""
    b, p = page_table.shape
    pp = sp.chunk // page_size
    want = sp.slots * pp
    t = page_table
    if p < want:
        t = torch.nn.functional.pad(t, (0, want - p))
    elif p > want:
        t = t[:, :want]
    t = t.view(b, 1, sp.slots, pp) if t.is_contiguous() else t.reshape(b, 1, sp.slots, pp)
    if rows_per_seq > 1:
        t = t.expand(b, rows_per_seq, sp.slots, pp)
    return t.reshape(b * rows_per_seq * sp.slots, pp)


def plan_split(
    *,
    ctas: int,
    seqlen_k: int,
    bytes_per_key: int,
    page_size: int | None,
    sink: bool,
    num_sms: int,
    setting: int,
    max_slots: int = MAX_SLOTS,
    decode_rows: int = 1,
    fold: bool = True,
    wide: bool = False,
    wide_paged: str | None = None,
    model: CostModel = DEFAULT_MODEL,
) -> Split | None:
    """The runtime's split of a decode step (None: unsplit): `setting` is FA4AOT_SPLIT_KV
    (-1 auto: the cost model; 0 never; N forced), ctas the (sequence, row, KV head) triples,
    of which decode_rows (sequence, row) pairs; seqlen_k a bound on every KV length; fold:
    whether the step, unsplit, runs as the fold (fold_refusal); wide: a packed (dense or
    varlen) K, or a paged one whose chunk kernel's path is `wide_paged` ("cp.async", "tma":
    wide_split), with one row and no sink whose split kernel has the wide split part (auto
    only: wide_split). Auto and forced counts alike are cut to max_slots and to
    MAX_VIRTUAL_SEQS virtual sequences. Shared by the runtime and `fa4aot explain`."""
    if setting == 0:
        return None
    align = 128 if page_size is None else math.lcm(128, page_size)
    n = setting
    on_wide = False
    if n < 0:
        n = choose_splits(
            batch=decode_rows, kv_heads=ctas // decode_rows, rows=1, seqlen_k=seqlen_k,
            bytes_per_key=bytes_per_key, num_sms=num_sms, align=align, fold=fold, model=model,
        )
        if wide and fold and not sink and (page_size is None or wide_paged is not None):
            w = wide_split(n, ctas=ctas, seqlen_k=seqlen_k, bytes_per_key=bytes_per_key,
                           num_sms=num_sms, max_slots=max_slots,
                           paged=None if page_size is None else wide_paged)
            if w is not None:
                n, on_wide = w, True
    n = min(n, max_slots - sink, MAX_VIRTUAL_SEQS // decode_rows - sink)
    if n <= 1:
        return None
    sp = make_split(n, seqlen_k, page_size=page_size, sink=sink, align=align)
    if sp.n <= 1:
        return None
    return dataclasses.replace(sp, wide=True) if on_wide else sp



class KernelFacts(NamedTuple):
    """What a cached split chunk kernel (one page size) offers a plan: the runtime reads it off
    the kernel it loaded (plan.SplitKernel.facts), `fa4aot explain` off the artifact's record
    (kernel_facts); both then plan with plan_unrolled and plan_packed_rows (plan_step)."""

    max_slots: int  # partials its merge takes per row
    wide_split: bool  # part fwd_wide_split (one-row steps may run wide: wide_split)
    paged_tma: bool  # its forward may take FA4's TMA paged path (wide_path)
    tma_part: bool  # part fwd_tma serves this page size (wide_path)
    q_broadcast: bool  # its forward reads q through a chunk mode
    chunk_lengths: bool  # ... and cuts a paged K's lengths into chunks itself
    bounds: bool  # part fwd_bounds: a packed K's rows read their bounds from cu_seqlens_k
    packed_meta: bool  # part packed_meta: a causal packed step's tail metadata in one kernel


def kernel_facts(parts: dict, variant, page_size: int | None, dtype: str) -> KernelFacts | None:
    """KernelFacts of a split chunk kernel's artifact `parts` (its record's), None where the
    artifact cannot split (no merge kernel for `dtype`). variant: the kernel's Variant."""
    name, merge = merge_part(parts, dtype)
    if name is None:
        return None
    fwd = parts["fwd"]
    return KernelFacts(
        max_slots=int(merge.get("max_splits", MAX_SLOTS)),
        wide_split=wide_part(parts, variant) is not None,
        paged_tma=variant.paged_tma is not False,
        tma_part=tma_part(parts, page_size) is not None,
        q_broadcast=bool(fwd.get("q_broadcast")),
        chunk_lengths=bool(fwd.get("chunk_lengths")),
        bounds=bounds_part(parts) is not None,
        packed_meta="packed_meta" in parts,
    )


def plan_unrolled(
    facts: KernelFacts, *, ctas: int, seqlen_k: int, bytes_per_key: int, page_size: int | None,
    sink: bool, num_sms: int, setting: int, decode_rows: int, fold: bool, one_row: bool,
    model: CostModel,
) -> Split | None:
    """plan_split on a cached kernel, a step's rows unrolled (each query row a decode row);
    seqlen_k: the plan's bucket (plan_bucket)."""
    return plan_split(
        ctas=ctas, seqlen_k=seqlen_k, bytes_per_key=bytes_per_key, page_size=page_size,
        sink=sink, num_sms=num_sms, setting=setting, max_slots=facts.max_slots,
        decode_rows=decode_rows, fold=fold, wide=one_row and facts.wide_split,
        wide_paged=wide_path(page_size, facts.paged_tma, facts.tma_part), model=model,
    )


def plan_packed_rows(
    facts: KernelFacts, *, batch: int, rows: int, kv_heads: int, ratio: int,
    tile_m: int | None, seqlen_k: int, bytes_per_key: int, page_size: int | None, sink: bool,
    causal: bool, num_sms: int, setting: int, unrolled: Split | None, meta: bool,
    model: CostModel,
) -> Split | None:
    """plan_packed on a cached kernel whose chunk modes read q and cut a paged K's lengths (or
    a packed K's bounds: page_size None) for a step of several rows it can pack
    (packed_refusal), else None (the rows run unrolled, or unsplit); seqlen_k: the plan's
    bucket; meta: a causal step's tail needs metadata per call (a caller's paged K)."""
    if rows == 1 or not facts.q_broadcast or not (
            facts.chunk_lengths if page_size else facts.bounds):
        return None
    if packed_refusal(ratio=ratio, rows=rows, tile_m=tile_m, page_size=page_size):
        return None
    return plan_packed(
        batch=batch, kv_heads=kv_heads, rows=rows, seqlen_k=seqlen_k,
        bytes_per_key=bytes_per_key, page_size=page_size, sink=sink, causal=causal,
        num_sms=num_sms, setting=setting, max_slots=facts.max_slots, unrolled=unrolled,
        meta_s=packed_meta_s(meta and page_size is not None, facts.packed_meta), model=model,
    )


def plan_step(
    facts: KernelFacts | None, *, batch: int, rows: int, kv_heads: int, ratio: int,
    tile_m: int | None, seqlen_k: int, bytes_per_key: int, page_size: int | None, sink: bool,
    causal: bool, num_sms: int, setting: int, fold: bool, meta: bool, model: CostModel,
) -> Split | None:
    """The split plan of a decode step of `rows` query rows a sequence over at most seqlen_k
    keys on the cached kernel `facts` (None: not cached), or None (unsplit): the unrolled plan,
    and for several rows the packed one where it wins. The runtime takes the same two steps
    (Runtime.split_for, then runtime/splitkv._packed_plan); `fa4aot explain` calls this.
    fold: the unsplit step runs as the fold (fold_refusal)."""
    if facts is None:
        return None
    bucket = plan_bucket(seqlen_k)
    sp = plan_unrolled(
        facts, ctas=batch * rows * kv_heads, seqlen_k=bucket, bytes_per_key=bytes_per_key,
        page_size=page_size, sink=sink, num_sms=num_sms, setting=setting,
        decode_rows=batch * rows, fold=fold, one_row=rows == 1, model=model,
    )
    return plan_packed_rows(
        facts, batch=batch, rows=rows, kv_heads=kv_heads, ratio=ratio, tile_m=tile_m,
        seqlen_k=bucket, bytes_per_key=bytes_per_key, page_size=page_size, sink=sink,
        causal=causal, num_sms=num_sms, setting=setting, unrolled=sp, meta=meta, model=model,
    ) or sp
