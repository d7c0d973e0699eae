"""The length-aware split of a ragged decode batch: equal chunks of keys over the whole batch.

The uniform plan (split.py) picks one chunk count per sequence from the batch size and the
longest length, so in a ragged batch the long sequence gets too few chunks and the short ones
get empty ones. Here the host fixes only bounds: `n` chunks of the batch's total keys (fewer
where the bound leaves chunks under RAGGED_MIN_CHUNK_BYTES), hence at
most `entries` = n + batch body entries (a sequence's last may be short), each at most
`pages * page_size` keys, plus, for a causal step of several query rows a sequence, `rows`
tail entries a sequence. The metadata kernel (part `ragged_meta`: fa4/kernels.trace_ragged)
then reads the real lengths on the GPU, sets the chunk to the total over n (rounded up to
`align`), maps each entry to its (sequence, first key, keys), gathers its q rows and
page-table row, and writes each sequence's first entry; the chunk kernel runs the entries as
its batch, and the ragged merge (part `ragged_merge`) merges a decode row's entries by LSE, a
learnable sink counted once. The grid depends on the bounds alone, so a CUDA graph captured
once replays for any lengths under them (docs/design.md, Ragged batches).

Several query rows a sequence (speculative decoding, over pages) are packed into each body
entry, so a chunk's keys stream once for all of them; the body is the keys every row sees,
rounded down to a page when causal, and tail entry t holds row t over the rest of its keys
(less than a page plus the rows), as PackedRun's tail does for the uniform plan.

`entry_map` is the metadata kernel's arithmetic in Python: the CPU tests' stand-in and the
GPU tests' reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fa4aot.model import constraints as C
from fa4aot.policy import split as S

# The chunk kernel's CTAs a ragged step aims at, per SM (n = this * SMs / KV heads): enough
# equal chunks that the pieces cut at sequence ends leave no long tail (docs/design.md, Tuned
# thresholds).
RAGGED_CTAS_PER_SM = 4
# K/V bytes a chunk of one KV head holds at least when every sequence is at the bound (4096
# keys at hd128 bf16): a batch near uniform keeps chunks as long as the uniform plan's, not 4
# CTAs an SM of short ones; at RAGGED_MIN_BYTES still 128 CTAs (docs/design.md, Tuned
# thresholds).
RAGGED_MIN_CHUNK_BYTES = 4096 * 512
# CTAs an SM up to which a one-row step the ragged plan would take keeps the uniform plan,
# its chunks cut to RAGGED_MIN_CHUNK_BYTES (uniform_splits; docs/design.md, Tuned thresholds).
RAGGED_UNIFORM_CTAS_PER_SM = 2
# K/V bytes (at the host's bound on every length) under which a step keeps the uniform plan:
# below it the uniform plan's tuned kernels win (two long sequences at 8:1, 134 MB at the
# bound: 1.3x the HBM limit against the ragged plan's 1.6x; docs/design.md, Tuned thresholds).
RAGGED_MIN_BYTES = 256 << 20
# The most query rows a sequence the plan takes (packed into one entry's rows, as the
# uniform plan's PackedRun takes them: a tail within two pages).
RAGGED_ROWS = 16
# The shortest bound on the KV lengths at which a step of several rows a sequence takes the
# plan: under it every sequence is short and the uniform plan's packed rows beat the b * rows
# tail entries (docs/design.md, Tuned thresholds).
RAGGED_ROWS_MIN_KEYS = 8192
# Keys of the shortest chunk: one 128-key tile of the chunk kernel.
MIN_CHUNK = 128


@dataclass(frozen=True)
class Ragged:
    """A ragged step's bounds: n chunks over the batch, chunks a multiple of align keys, each
    entry's page-table row `pages` columns (paged K; 0 packed); `rows` query rows a sequence,
    packed into each entry; entries = n + batch, plus rows * batch tail entries for a causal
    step of several rows (its rows' last keys, one row an entry)."""

    n: int
    entries: int
    align: int
    pages: int
    rows: int = 1

    def describe(self) -> str:
        rows = (f", the {self.rows} query rows a sequence packed into each entry (a causal "
                f"step adds one tail entry a row)" if self.rows > 1 else "")
        return (f"ragged split-KV: the batch's keys in {self.n} equal chunks (multiples of "
                f"{self.align} keys, set on the GPU from the real lengths){rows}, at most "
                f"{self.entries} entries, merged by LSE per decode row")


def ragged_parts(parts: dict) -> bool:
    """Whether a split chunk kernel's artifact (its record's parts) holds the ragged step's
    kernels at the version this fa4aot calls (constraints.RAGGED_VERSION)."""
    rec = parts.get("ragged_meta", {})
    return rec.get("version") == C.RAGGED_VERSION and "ragged_merge" in parts


def plan_ragged(
    *, batch: int, rows: int, kv_heads: int, seqlen_k: int, bytes_per_key: int,
    page_size: int | None, sink: bool, num_sms: int, setting: int, max_slots: int,
    max_entries: int = 65535, causal: bool = True,
) -> Ragged | None:
    """The ragged plan of a decode step of `rows` query rows a sequence, or None (the uniform
    plan decides): at least two sequences (one has no raggedness), the automatic split setting
    (a forced count keeps its meaning: that many chunks a sequence), at most RAGGED_ROWS rows
    (one over a packed K: its entries tile it; several over pages, from RAGGED_ROWS_MIN_KEYS
    keys at the bound), and K/V of at least RAGGED_MIN_BYTES at the bound seqlen_k; tail
    entries only for a causal step. Shared by the runtime and `fa4aot explain`."""
    if setting != -1 or batch < 2 or rows > RAGGED_ROWS or (rows > 1 and (
            page_size is None or seqlen_k < RAGGED_ROWS_MIN_KEYS)):
        return None
    if batch * kv_heads * seqlen_k * bytes_per_key < RAGGED_MIN_BYTES:
        return None
    # a decode row merges at most n body entries, its tail entry (several causal rows) and
    # the sink's LSE (-inf without one): within max_slots
    tail = rows > 1 and causal
    n = min(-(-RAGGED_CTAS_PER_SM * num_sms // kv_heads),
            -(-batch * seqlen_k * bytes_per_key // RAGGED_MIN_CHUNK_BYTES), max_slots - 1 - tail)
    entries = n + batch + (rows * batch if tail else 0)
    if n < 2 or entries > max_entries:
        return None
    align = MIN_CHUNK if page_size is None else math.lcm(MIN_CHUNK, page_size)
    pages = 0
    if page_size is not None:
        pages = chunk_bound(batch * seqlen_k, n, align) // page_size
        if tail:  # a tail entry's keys: under a page plus the rows, in 128-key tiles
            pages = max(pages, -(-(page_size + rows) // 128) * 128 // page_size)
    return Ragged(n, entries, align, pages, rows)


def uniform_splits(*, batch: int, kv_heads: int, seqlen_k: int, chunk: int,
                   bytes_per_key: int, num_sms: int, max_slots: int, sink: bool) -> int | None:
    """The chunks a sequence the uniform plan needs at least to serve a one-row step the ragged
    plan would take, or None (the ragged plan serves it). seqlen_k: the plan's bound; chunk:
    the uniform plan's chunk (unsplit: the bound). Chunks of at most RAGGED_MIN_CHUNK_BYTES
    (a KV head) leave no batch the ragged plan is for (RAGGED_MIN_BYTES read) a long tail, so
    the ragged step's extra launches buy nothing: 1 where the plan's own chunks hold no more,
    else the count that cuts them to it, where that is at most RAGGED_UNIFORM_CTAS_PER_SM CTAs
    an SM at the bound (beyond, the chunks of short sequences would run mostly empty). Shared
    by the runtime and `fa4aot explain`."""
    cap = max(RAGGED_MIN_CHUNK_BYTES // bytes_per_key, 1)
    if chunk <= cap:
        return 1
    n = -(-seqlen_k // cap)
    if batch * kv_heads * n > RAGGED_UNIFORM_CTAS_PER_SM * num_sms or n > max_slots - sink:
        return None
    return n


def uniform_instead(sp: S.Split | None, *, batch: int, kv_heads: int, seqlen_k: int,
                    bytes_per_key: int, num_sms: int, max_slots: int, sink: bool,
                    page_size: int | None, used: bool = False) -> tuple[bool, S.Split | None]:
    """Whether a one-row step the ragged plan would take keeps the uniform plan `sp` (None:
    unsplit) instead, and that plan cut to uniform_splits' count where it holds fewer chunks:
    (True, plan) or (False, sp). used: a packed K with seqused_k, which no uniform split reads
    (kept only unsplit). seqlen_k: the plan's bound. Shared by the runtime and `fa4aot
    explain`."""
    n = uniform_splits(batch=batch, kv_heads=kv_heads, seqlen_k=seqlen_k,
                       chunk=sp.chunk if sp else seqlen_k, bytes_per_key=bytes_per_key,
                       num_sms=num_sms, max_slots=max_slots, sink=sink)
    if n is None or used and n > 1:
        return False, sp
    if n > (sp.n if sp else 1):
        sp = S.make_split(n, seqlen_k, page_size=page_size, sink=sink)
    return True, sp


def chunk_bound(total: int, n: int, align: int) -> int:
    """The chunk of n chunks over `total` keys: ceil(total / n) rounded up to align, at least
    align (what the metadata kernel computes from the real total)."""
    c = -(-max(total, 1) // n)
    return max(-(-c // align) * align, align)


def entry_map(lengths: list[int], rg: Ragged, page_size: int | None = None,
              causal: bool = True):
    """The metadata kernel's map for these lengths: (first, entries, chunk), first[i] the
    first entry of sequence i (first[batch]: the entries used, each at most rg.entries),
    entries a list of (sequence, row, first key, keys) per entry, (-1, 0, 0, 0) where unused;
    row -1: a body entry (every row), else a tail entry, that row's keys past the body (a
    causal step of several rows: the body is the keys its first row sees, rounded down to a
    page)."""
    chunk = chunk_bound(sum(lengths), rg.n, rg.align)
    if page_size is not None:
        chunk = min(chunk, rg.pages * page_size)
    tail = rg.rows if rg.rows > 1 and causal else 0
    first, out = [], []
    for i, n in enumerate(lengths):
        first.append(min(len(out), rg.entries))
        body = max(n - rg.rows + 1, 0) // page_size * page_size if tail else n
        for j in range(-(-body // chunk)):
            out.append((i, -1, j * chunk, min(body - j * chunk, chunk)))
        for t in range(tail):
            out.append((i, t, body, max(n - rg.rows + 1 + t - body, 0)))
    first.append(min(len(out), rg.entries))
    out = out[: rg.entries]
    out += [(-1, 0, 0, 0)] * (rg.entries - len(out))
    return first, out, chunk
