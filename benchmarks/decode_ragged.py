"""Ragged decode batches as a serving engine sees them (issue 38): fa4aot's split plan and the
unsplit kernel against the HBM limit of the K/V bytes the step actually reads, eager and in a
CUDA graph, side by side in one process (H200).

    FA4AOT_CACHE_DIR=<store> python benchmarks/decode_ragged.py [--json ragged.json]
    python benchmarks/decode_ragged.py --dry          # no GPU: the cases, their lengths and bytes
    python benchmarks/decode_ragged.py --plot ragged.json docs/decode-ragged.png  # (matplotlib)

Each batch: paged K/V (bf16), pages shuffled over the pool (a random page table), causal,
seqused_k, max_seqlen_k passed (the longest length), s_q query rows a sequence (cu_seqlens_q).
Lengths are drawn per distribution from one seed (the same lengths at every page size):
- a: long-tailed, batch 32, log-uniform in [100, 131072], one zero-length and one one-token
  sequence among them;
- b: one long among short, batch 8: one 131072, one 65536, the rest uniform in [1000, 30000];
- c: all short, batch 64, uniform in [100, 4000];
- d: two long, batch 2 at 8:1 heads: 131072 and 100000;
- u: uniform, batch 16, all 16384 (no raggedness: what the ragged plan costs there);
- h: half at the bound, batch 32: 16 of 4096, 16 uniform in [100, 1000];
- t: two long, two short, batch 4: 2 of 32768, 2 uniform in [100, 1000]. The uniform plan
  serves h and t in chunks of at most 2 MiB (policy/ragged.uniform_splits): its worst
  cases among one-row batches of >= 256 MB.
Columns: MB read = sum of min(len, window + s_q) * kv_heads * (d + dv) * 2 bytes, plus q and o;
limit = those bytes / the copy bandwidth measured at start (a device-to-device copy, bytes read
+ written over its time; --hbm-tbs to give it); `today` = the call as the runtime plans it (the
ragged plan, policy/ragged.py, where it applies); `uniform` = the same call with the ragged plan
off (the runtime's `ragged` False: one chunk count a sequence from the batch size and the
longest length); `unsplit` = FA4's kernel: the runtime's split setting at 0
(FA4AOT_SPLIT_KV=0) and FA4's own M tile (Runtime.set_small_tile(False)); each set on the
process runtime for its column only. eager: 20 calls launched back to back between two CUDA
events (`_timing.stream_us`: every row of the target reads several times the L2, so no flush);
`dobench`: triton's do_bench, whose L2 flush zeroes 256 MB before each call and so charges the
write-back of up to an L2 of dirty lines to it (kept beside eager, in --json and in the
`today do_bench` column); graph: each column captured once per case (5 calls, after warm-up),
replays timed with CUDA events; the columns alternate over --rounds rounds, medians. Rows
marked * read >= 256 MB: the issue's target (within 1.3x of the limit) applies to them.
Correctness (each case, before timing): fresh random inputs, NaN-poisoned outputs, relative
error of both columns against an fp32 reference computed one sequence at a time; `today` fails
if its error exceeds ERR_SLACK x the unsplit kernel's, either column if it writes a non-finite
value or its error exceeds ERR_MAX. Then the
captured `today` graph is replayed at new, shorter lengths and must equal the eager call bit for
bit. FAIL lines come last; the exit status is 1 if any.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
from dataclasses import asdict, dataclass

BIG_MB = 256  # the target applies to batches reading at least this much K/V
TARGET = 1.3  # ... within this factor of the HBM limit
# both kernels round once to bf16 and differ in the order of fp32 sums; a chunk read wrong or
# twice gives errors of order 1e-1, far beyond this margin over the unsplit kernel's ~4e-3
ERR_SLACK = 1.5
ERR_MAX = 2e-2  # either column beyond this is wrong outright (bf16 rounding gives ~4e-3)
CALLS = 5  # calls per captured graph
REPLAYS = 10  # replays timed per round
DISTS = {
    "a": "long-tailed: b32, log-uniform [100, 131072], one 0 and one 1",
    "b": "one long among short: b8, 131072 + 65536 + uniform [1000, 30000]",
    "c": "all short: b64, uniform [100, 4000]",
    "d": "two long at 8:1: b2, 131072 + 100000",
    "u": "uniform: b16, all 16384",
    "h": "half at the bound: b32, 16 x 4096 + 16 uniform [100, 1000]",
    "t": "two long, two short: b4, 2 x 32768 + 2 uniform [100, 1000]",
}
QUICK = ("b", 64)  # --quick: the headline batch at pages of 64


def lengths(dist: str, seed: int) -> list[int]:
    """The KV lengths of a distribution's batch, the same for a given seed on every machine
    (Python's random seeded with a string hashes it with SHA-512, not the per-process hash)."""
    rng = random.Random(f"decode_ragged/{dist}/{seed}")
    if dist == "a":
        lo, hi = math.log(100), math.log(131072)
        lens = [round(math.exp(rng.uniform(lo, hi))) for _ in range(32)]
        i, j = rng.sample(range(32), 2)
        lens[i], lens[j] = 0, 1  # the correctness edge cases, inside the timed batch
    elif dist == "b":
        lens = [131072, 65536] + [rng.randint(1000, 30000) for _ in range(6)]
        rng.shuffle(lens)
    elif dist == "c":
        lens = [rng.randint(100, 4000) for _ in range(64)]
    elif dist == "d":
        lens = [131072, 100000]
    elif dist == "u":
        lens = [16384] * 16
    elif dist == "h":
        lens = [4096] * 16 + [rng.randint(100, 1000) for _ in range(16)]
        rng.shuffle(lens)
    elif dist == "t":
        lens = [32768] * 2 + [rng.randint(100, 1000) for _ in range(2)]
        rng.shuffle(lens)
    else:
        raise ValueError(f"no distribution {dist!r} (one of {', '.join(DISTS)})")
    return lens


@dataclass(frozen=True)
class Case:
    dist: str
    lens: tuple[int, ...]
    hq: int
    hk: int
    d: int
    sq: int
    page: int
    window: int | None

    @property
    def name(self) -> str:
        w = f" w{self.window}" if self.window is not None else ""
        return (f"{self.dist} b{len(self.lens)} {self.hq}:{self.hk} hd{self.d} sq{self.sq} "
                f"p{self.page}{w}")

    def keys_read(self, n: int) -> int:
        # a window bounds the keys of every query row: the last row reads window + 1, the
        # first window + 1 - (sq - 1) further back: window + sq keys at most in all
        return n if self.window is None else min(n, self.window + self.sq)

    @property
    def bytes_read(self) -> int:
        kv = sum(self.keys_read(n) for n in self.lens) * self.hk * 2 * self.d * 2
        qo = 2 * len(self.lens) * self.sq * self.hq * self.d * 2
        return kv + qo

    @property
    def pool_pages(self) -> int:
        # a zero-length sequence still gets one page: its table row then names a real page
        return sum(max(1, -(-n // self.page)) for n in self.lens)


def cases(a) -> list[Case]:
    dists = [QUICK[0]] if a.quick else a.dist
    pages = [QUICK[1]] if a.quick else a.pages
    out = []
    for dist in dists:
        lens = tuple(lengths(dist, a.seed))
        # d is defined at 8:1 (the "two long at 8:1"); the others at each --heads
        heads = [(8, 1)] if dist == "d" else a.heads
        for hq, hk in heads:
            for d in a.head_dim:
                for sq in a.sq:
                    for page in pages:
                        out.append(Case(dist, lens, hq, hk, d, sq, page, a.window))
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _heads(text: str) -> list[tuple[int, int]]:
    out = []
    for h in text.split(","):
        hq, hk = (int(x) for x in h.split(":"))
        if hq % hk:
            raise argparse.ArgumentTypeError(f"{h}: query heads must be a multiple of KV heads")
        out.append((hq, hk))
    return out


def _dists(text: str) -> list[str]:
    out = [x for x in text.split(",") if x]
    bad = [x for x in out if x not in DISTS]
    if bad:
        raise argparse.ArgumentTypeError(f"no distribution {bad} (one of {', '.join(DISTS)})")
    return out


def _summary_lens(lens) -> str:
    s = sorted(lens)
    return (f"min {s[0]} median {s[len(s) // 2]} max {s[-1]} sum {sum(s)} "
            f"(<2 keys: {sum(n < 2 for n in s)})")


def dry(cs: list[Case]) -> None:
    """The cases as they would run: lengths, pool and bytes read (no GPU, no torch)."""
    seen = set()
    for c in cs:
        if c.dist not in seen:
            seen.add(c.dist)
            print(f"{c.dist}: {DISTS[c.dist]}\n   lengths {_summary_lens(c.lens)}")
    print(f"{'case':34s} {'MB read':>8s} {'pages':>7s} {'table':>6s}")
    for c in cs:
        mb = c.bytes_read / 1e6
        print(f"{c.name:34s} {mb:8.1f}{'*' if mb >= BIG_MB else ' '} {c.pool_pages:7d} "
              f"{-(-max(c.lens) // c.page):6d}")
    print(f"{len(cs)} cases; * reads >= {BIG_MB} MB (the issue's target: within {TARGET}x)")


def _copy_tbs(torch, nbytes: int = 2 << 30) -> float:
    """The card's copy bandwidth: a device-to-device copy of nbytes, read + written bytes over
    its median time (do_bench), in TB/s."""
    from triton.testing import do_bench

    bufs = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")]
    bufs.append(torch.empty_like(bufs[0]))
    ms = do_bench(lambda: bufs[1].copy_(bufs[0]), warmup=25, rep=100, return_mode="median")
    bufs.clear()  # 4 GB back to the cases
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e12


def _reference(torch, q, kp, vp, table, lens, c: Case):
    """fp32 attention of every sequence, one at a time (the K/V of one 128K sequence in fp32
    at hd256 is 1 GB for 8 heads): bottom-right causal, the window's left edge, rows with no
    visible key 0. q (b*sq, hq, d) -> (b*sq, hq, dv) fp32."""
    g = c.hq // c.hk
    out = torch.zeros(q.shape[0], c.hq, vp.shape[-1], device=q.device, dtype=torch.float32)
    scale = 1.0 / math.sqrt(c.d)
    for i, n in enumerate(lens):
        if n == 0:
            continue
        pages = table[i, : -(-n // c.page)].long()
        k = kp[pages].reshape(-1, c.hk, c.d)[:n].float()
        v = vp[pages].reshape(-1, c.hk, vp.shape[-1])[:n].float()
        qi = q[i * c.sq : (i + 1) * c.sq].float().view(c.sq, c.hk, g, c.d)
        s = torch.einsum("qhgd,khd->hgqk", qi, k) * scale
        row = torch.arange(c.sq, device=q.device)[:, None] + (n - c.sq)  # each row's last key
        j = torch.arange(n, device=q.device)[None, :]
        mask = j > row
        if c.window is not None:
            mask = mask | (j < row - c.window)
        s = s.masked_fill(mask, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        out[i * c.sq : (i + 1) * c.sq] = torch.einsum("hgqk,khd->qhgd", p, v).reshape(
            c.sq, c.hq, -1)
    return out


def _err(o, ref) -> dict:
    o = o.float()
    finite = bool(o.isfinite().all())
    rel = ((o - ref).norm() / ref.norm().clamp_min(1e-6)).item() if finite else float("nan")
    return {"rel_err": rel, "max_abs": (o - ref).abs().max().item() if finite else None,
            "nonfinite": int((~o.isfinite()).sum().item())}


def run_case(torch, fa4aot, rt, c: Case, seed: int, rounds: int, tbs: float) -> dict:
    """One case: build its paged batch, check both columns, time them, replay at new lengths."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import capture, eager_us, replay_us, stream_us

    dev, dt = torch.device("cuda"), torch.bfloat16
    row = {"case": c.name, **asdict(c), "lens": list(c.lens), "mb_read": c.bytes_read / 1e6,
           "limit_us": c.bytes_read / (tbs * 1e12) * 1e6, "big": c.bytes_read / 1e6 >= BIG_MB}
    pool_bytes = c.pool_pages * c.page * c.hk * c.d * 2 * 2
    free = torch.cuda.mem_get_info()[0]
    if 2 * pool_bytes + (4 << 30) > free:  # the pool, the reference's fp32 K/V, graphs
        row["skipped"] = f"pool {pool_bytes / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
        return row
    b, lens = len(c.lens), list(c.lens)
    gen = torch.Generator().manual_seed(seed)
    npg = [max(1, -(-n // c.page)) for n in lens]
    perm = torch.randperm(c.pool_pages, generator=gen, dtype=torch.int64).to(torch.int32)
    width = max(npg)
    table = torch.zeros(b, width, dtype=torch.int32)
    at = 0
    for i, n in enumerate(npg):
        table[i, :n] = perm[at : at + n]
        at += n
    table = table.to(dev)
    torch.manual_seed(seed)
    kp = torch.randn(c.pool_pages, c.page, c.hk, c.d, device=dev, dtype=dt)
    vp = torch.randn_like(kp)
    q = torch.randn(b * c.sq, c.hq, c.d, device=dev, dtype=dt)
    out = torch.empty_like(q)
    used = torch.tensor(lens, device=dev, dtype=torch.int32)
    cu_q = torch.arange(0, b * c.sq + 1, c.sq, device=dev, dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu_q, max_seqlen_q=c.sq, max_seqlen_k=max(lens), page_table=table,
              seqused_k=used, causal=True,
              window_size=(c.window, 0) if c.window is not None else (None, None))
    today_split = rt.split

    def today(o=out):
        fa4aot.flash_attn_varlen_func(q, kp, vp, out=o, **kw)

    def unsplit(o=out):
        was, was_tile, rt.split = rt.split, rt.small_tile, 0
        rt.set_small_tile(False)
        try:
            today(o)
        finally:
            rt.split = was
            rt.set_small_tile(was_tile)

    def uniform(o=out):
        was, rt.ragged = rt.ragged, False
        try:
            today(o)
        finally:
            rt.ragged = was

    cols = {"today": today, "uniform": uniform, "unsplit": unsplit}
    # correctness first, on these fresh inputs, into NaN-poisoned buffers
    outs = {}
    for name, fn in cols.items():
        o = torch.full_like(q, float("nan"))
        fn(o)
        outs[name] = o
    torch.cuda.synchronize()
    ref = _reference(torch, q, kp, vp, table, lens, c)
    row["check"] = {name: _err(o, ref) for name, o in outs.items()}
    del outs, ref

    graphs = {name: capture(fn, CALLS) for name, fn in cols.items()}
    eager: dict = {k: [] for k in cols}
    graph: dict = {k: [] for k in cols}
    dobench: dict = {k: [] for k in cols}
    for r in range(rounds):
        # the order reversed every other round: a slow phase of the shared host hits each alike
        for name in (list(cols) if r % 2 == 0 else list(cols)[::-1]):
            eager[name].append(stream_us(cols[name]))
            dobench[name].append(eager_us(cols[name]))
            graph[name].append(statistics.median(
                replay_us(graphs[name], CALLS) for _ in range(REPLAYS)))
    for name in cols:
        row[name] = statistics.median(eager[name])
        row[name + "_graph"] = statistics.median(graph[name])
        row[name + "_dobench"] = statistics.median(dobench[name])
        row[name + "_rounds"] = {"eager": eager[name], "graph": graph[name],
                                 "dobench": dobench[name]}

    # the captured plan at new lengths (each at most its old one, so the table still covers it)
    rng = random.Random(f"decode_ragged/replay/{seed}")
    new = [rng.randint(0, n) for n in lens]
    used.copy_(torch.tensor(new, dtype=torch.int32))
    q.normal_()
    graphs["today"].replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    out.fill_(float("nan"))
    today()
    torch.cuda.synchronize()
    row["replay_lens_sum"] = sum(new)
    row["replay_bit_identical"] = bool(torch.equal(replayed, out))
    row["replay_nonfinite"] = int((~replayed.isfinite()).sum().item())
    row["split_setting"] = today_split
    del graphs
    return row


def fails(row: dict) -> list[str]:
    """What is wrong with a case's outputs, one line each (empty: nothing)."""
    if "check" not in row:
        return []
    t, u = row["check"]["today"], row["check"]["unsplit"]
    out = []
    for name, e in row["check"].items():
        if e["nonfinite"]:
            out.append(f"{name}: {e['nonfinite']} non-finite values in the output")
    if not t["nonfinite"] and not u["nonfinite"] and t["rel_err"] > ERR_SLACK * u["rel_err"]:
        out.append(f"today: rel err {t['rel_err']:.2e} > {ERR_SLACK} x unsplit's "
                   f"{u['rel_err']:.2e}")
    for name, e in row["check"].items():
        if not e["nonfinite"] and e["rel_err"] > ERR_MAX:
            out.append(f"{name}: rel err {e['rel_err']:.2e} > {ERR_MAX}")
    if not row["replay_bit_identical"]:
        out.append(f"graph replay at new lengths differs from eager "
                   f"({row['replay_nonfinite']} non-finite)")
    return [f"FAIL {row['case']}: {m}" for m in out]


def summary(rows: list[dict]) -> dict:
    """The issue's target over the rows that read >= BIG_MB, counted from the rows."""
    big = [r for r in rows if r.get("big") and "today" in r]
    out = {"rows": len(rows), "timed": sum("today" in r for r in rows), "big_rows": len(big)}
    for col in ("today", "uniform", "unsplit"):
        for mode in ("", "_graph", "_dobench"):
            x = [r[col + mode] / r["limit_us"] for r in big]
            key = col + (mode or "_eager")
            out[f"{key}_within_{TARGET}x"] = sum(v <= TARGET for v in x)
            out[f"{key}_worst_x"] = round(max(x), 3) if x else None
    return out


def _line(r: dict) -> str:
    if "skipped" in r:
        return f"{r['case']:34s} skipped: {r['skipped']}"
    lim = r["limit_us"]
    cells = "".join(f" {r[k]:9.1f} {r[k] / lim:5.2f}x" for k in
                    ("today", "today_graph", "uniform", "uniform_graph", "unsplit",
                     "unsplit_graph", "today_dobench"))
    ck = r["check"]
    return (f"{r['case']:34s} {r['mb_read']:8.1f}{'*' if r['big'] else ' '} {lim:8.1f}{cells}"
            f"  {ck['today']['rel_err']:.1e}/{ck['unsplit']['rel_err']:.1e}")


HEADER = (f"{'case':34s} {'MB read':>8s}  {'limit us':>8s} {'today eager':>16s} "
          f"{'today graph':>16s} {'uniform eager':>16s} {'uniform graph':>16s} "
          f"{'unsplit eager':>16s} {'unsplit graph':>16s} {'today do_bench':>16s}"
          f"  err today/unsplit")


def bench(a, cs: list[Case]) -> dict:
    import torch

    import fa4aot

    rt = fa4aot.reset()  # the process runtime, settings read now; its `split` is the knob
    from fa4aot.policy import ragged

    if a.ragged_ctas:
        ragged.RAGGED_CTAS_PER_SM = a.ragged_ctas
    if a.ragged_rows:
        ragged.RAGGED_ROWS = a.ragged_rows
    if a.hbm_tbs:
        tbs, how = a.hbm_tbs, "given (--hbm-tbs)"
    else:
        tbs, how = _copy_tbs(torch), "measured (device-to-device copy, read + written)"
    print(f"# {torch.cuda.get_device_name()}; HBM {tbs:.2f} TB/s {how}; runtime split setting "
          f"{rt.split} (-1: auto); ragged plan {ragged.RAGGED_CTAS_PER_SM} CTAs per SM, "
          f"rows <= {ragged.RAGGED_ROWS}; {len(cs)} cases", flush=True)
    if rt.split == 0:
        print("# FA4AOT_SPLIT_KV=0: the `today` column runs unsplit too", flush=True)
    rows = []
    for i, c in enumerate(cs):
        torch.cuda.empty_cache()
        try:
            r = run_case(torch, fa4aot, rt, c, a.seed * 1000 + i, a.rounds, tbs)
        # a layout the store lacks (ArtifactMissing) or FA4 refuses skips its row, not the run
        except (fa4aot.Fa4aotError, torch.OutOfMemoryError, RuntimeError, ValueError) as e:
            r = {"case": c.name, **asdict(c), "lens": list(c.lens),
                 "skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
        rows.append(r)
        print(_line(r), flush=True)
    bad = [f for r in rows for f in fails(r)]
    res = {"device": torch.cuda.get_device_name(), "hbm_tbs": tbs, "hbm_source": how,
           "split_setting": rt.split, "args": {k: v for k, v in vars(a).items()},
           "rows": rows, "summary": summary(rows), "fails": bad}
    print(f"\nlimit: bytes read / {tbs:.2f} TB/s; x: time / limit; * reads >= {BIG_MB} MB "
          f"(target: today within {TARGET}x, eager and graph); err: rel err vs fp32")
    print(HEADER)
    for r in rows:
        print(_line(r))
    s = res["summary"]
    if s["big_rows"]:
        print(f"rows >= {BIG_MB} MB: {s['big_rows']}; today within {TARGET}x: eager "
              f"{s[f'today_eager_within_{TARGET}x']}, graph {s[f'today_graph_within_{TARGET}x']}"
              f" (worst {s['today_eager_worst_x']}x / {s['today_graph_worst_x']}x); uniform "
              f"within: {s[f'uniform_eager_within_{TARGET}x']}, worst "
              f"{s['uniform_eager_worst_x']}x; unsplit worst {s['unsplit_eager_worst_x']}x / "
              f"{s['unsplit_graph_worst_x']}x; today under do_bench within: "
              f"{s[f'today_dobench_within_{TARGET}x']} (worst {s['today_dobench_worst_x']}x)")
    else:
        print(f"no timed row reads >= {BIG_MB} MB")
    for f in bad:
        print(f)
    return res


def plot(path: str, png: str) -> None:
    """A bar chart of --json's rows: time over the HBM limit of each column, eager, per case,
    the target's line at TARGET (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.load(open(path))
    rows = [r for r in res["rows"] if "today" in r]
    cols = (("today", "ragged plan (today)"), ("uniform", "uniform plan"),
            ("unsplit", "unsplit (FA4's kernel)"))
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(rows)), 5))
    w = 0.8 / len(cols)
    for k, (col, label) in enumerate(cols):
        ys = [r[col] / r["limit_us"] if col in r else 0 for r in rows]
        ax.bar([i + (k - 1) * w for i in range(len(rows))], ys, w, label=label)
    ax.axhline(TARGET, color="k", ls="--", lw=1, label=f"target: {TARGET}x the limit")
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), [r["case"].replace(" hd128 sq1", "") + ("*" if r["big"]
                                     else "") for r in rows], rotation=60, ha="right",
                  fontsize=8)
    ax.set_ylabel("time / HBM limit of the bytes read (eager)")
    ax.set_title(f"ragged decode batches, {res['device']} (* reads >= {BIG_MB} MB)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dist", type=_dists, default=list(DISTS),
                    help="distributions, comma-separated (default a,b,c,d,u): " + "; ".join(
                        f"{k}: {v}" for k, v in DISTS.items()))
    ap.add_argument("--pages", type=_ints, default=[16, 64, 128], help="page sizes (16,64,128)")
    ap.add_argument("--head-dim", type=_ints, default=[128], help="head dims, d = dv (128)")
    ap.add_argument("--heads", type=_heads, default=[(32, 8)],
                    help="hq:hk list for a-c (32:8); d is always 8:1")
    ap.add_argument("--sq", type=_ints, default=[1], help="query rows a sequence (1; 1,4: "
                    "speculative)")
    ap.add_argument("--window", type=int, default=None,
                    help="sliding window (left keys), causal; default none")
    ap.add_argument("--seed", type=int, default=0, help="lengths and inputs (0)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating timing rounds (3)")
    ap.add_argument("--hbm-tbs", type=float, default=None,
                    help="HBM bandwidth for the limit, TB/s (default: measured by a copy)")
    ap.add_argument("--quick", action="store_true",
                    help=f"distribution {QUICK[0]} at pages of {QUICK[1]} only")
    ap.add_argument("--ragged-ctas", type=int, default=None,
                    help="the ragged plan's CTAs per SM (policy/ragged.RAGGED_CTAS_PER_SM; "
                         "default: fa4aot's), to tune it")
    ap.add_argument("--ragged-rows", type=int, default=None,
                    help="the most query rows a sequence the ragged plan takes "
                         "(policy/ragged.RAGGED_ROWS; default: fa4aot's), to tune it")
    ap.add_argument("--json", metavar="PATH", help="write every number here")
    ap.add_argument("--plot", nargs=2, metavar=("JSON", "PNG"),
                    help="no GPU: draw a --json file's rows as a bar chart and stop")
    ap.add_argument("--dry", action="store_true",
                    help="no GPU: print the cases (lengths, MB read) and stop")
    a = ap.parse_args()
    if a.plot:
        plot(*a.plot)
        return 0
    cs = cases(a)
    if a.dry:
        dry(cs)
        return 0
    try:
        import torch
    except ImportError:
        sys.exit("decode_ragged.py: torch is not installed (--dry runs without it)")
    if not torch.cuda.is_available():
        sys.exit("decode_ragged.py: no CUDA device (torch.cuda.is_available() is False): it "
                 "times kernels on a GPU with a store built for it (FA4AOT_CACHE_DIR); --dry "
                 "prints the cases without one")
    res = bench(a, cs)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if res["fails"] else 0


if __name__ == "__main__":
    sys.exit(main())
