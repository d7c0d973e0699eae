"""Long-context decode: fa4aot's split-KV plan vs the unsplit kernel vs torch SDPA (cuDNN and
flash backends) vs the HBM limit, side by side in one process on the same inputs (H200).

    FA4AOT_CACHE_DIR=<store> python benchmarks/decode_split.py --out decode.json
    python benchmarks/decode_split.py --plot decode.json --png docs/decode-split-heatmap.png

bf16, hd128, one query row per sequence, 32:8 heads unless a row says otherwise. Times are
`triton.testing.do_bench` medians (eager; `graph` columns: CUDA-graph replays, host excluded);
fa4aot, the unsplit kernel and cuDNN are measured in alternation, ROUNDS times each (SHORT_ROUNDS
for cells of under 1 GB of KV, which take milliseconds: a slow phase of the shared host moves
their eager times most), and each column is the median of its rounds.
limit = K+V bytes / 4.8 TB/s. n: the plan's chunks ("w": on the wide split kernel,
split.wide_split). "unsplit" is the same fa4aot call with FA4AOT_SPLIT_KV=0 (what
FA4 itself runs). Every fa4aot output is checked against SDPA's before it is timed. Paged rows
also time the uniform plan alone ("uniform": Runtime.ragged off), in alternation with today's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HBM = 4.8e12
TABLE = [  # (batch, s_k, hq, hk): the table
    (1, 65536, 32, 8),
    (1, 131072, 8, 1),
    (2, 32768, 64, 8),
    (4, 32768, 32, 8),
    (32, 4096, 32, 8),
    (1, 8192, 32, 8),
]
GRID_B = (1, 2, 4, 8, 16, 32, 64, 128)
GRID_S = (1024, 4096, 16384, 65536, 131072)
ROUNDS = 3  # alternating measurements per column and cell (dense_case)
SHORT_ROUNDS = 5  # the same for cells of under 1 GB of KV
# a cell runs when its K and V fit the card with this much to spare (SDPA's workspace, the
# outputs); b128/128K (69 GB of KV) fits an H200's 140 GB. A
# cuDNN reference that runs out of memory skips the cell; the flash column is left empty with
# its error.
SPARE_BYTES = 8e9


def _bench(table_only=False, grid_only=False):
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import decode_columns, decode_inputs, eager_us, graph_us, host_us

    import fa4aot
    import fa4aot.runtime as R

    rt = R.default_runtime()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    sdpa = torch.nn.functional.scaled_dot_product_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def dense_case(b, sk, hq, hk, d=128, table=False):
        torch.cuda.empty_cache()  # the last case's tensors died with its frame
        kvb = b * sk * hk * 2 * d * 2
        free = torch.cuda.mem_get_info()[0]
        if kvb + SPARE_BYTES > free:
            return {"b": b, "sk": sk, "hq": hq, "hk": hk,
                    "skipped": f"KV {kvb / 1e9:.0f} GB, {free / 1e9:.0f} GB free"}
        q, k, v, out = decode_inputs(b, sk, hq, hk, d)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        row = {"b": b, "sk": sk, "hq": hq, "hk": hk, "kv_mb": kvb / 1e6, "limit": kvb / HBM * 1e6}
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                ref = sdpa(qt, kt, vt, enable_gqa=True).transpose(1, 2)
        except torch.OutOfMemoryError as e:
            return {"b": b, "sk": sk, "hq": hq, "hk": hk,
                    "skipped": "cuDNN: " + str(e).splitlines()[0][:80]}
        rt.split = -1
        sp = rt.split_for(0, dt, b * hk, sk, d, d, None, False, b, one_row=True)
        row["splits"] = sp.n if sp else 1
        row["wide"] = bool(sp and sp.wide)
        out.fill_(float("nan"))
        fa4aot.flash_attn_func(q, k, v, causal=True, out=out)
        row["err_vs_cudnn"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        rt.split = 0
        o1 = fa4aot.flash_attn_func(q, k, v, causal=True)[0]
        row["max_diff_vs_unsplit"] = (o1.float() - out.float()).abs().max().item()
        rt.split = -1
        cols = decode_columns(q, k, v, out)
        ours, unsplit, cudnn = cols["fa4aot"], cols["unsplit"], cols["cudnn"]
        # fa4aot, the unsplit kernel and cuDNN measured in alternation, ROUNDS times each (the
        # order reversed every other round), medians: the card's state drifts over a run, and
        # a difference between columns measured minutes apart would be that drift
        eager = {c: [] for c in cols}
        graph = {c: [] for c in ("fa4aot", "cudnn")}
        replays = 20 if table else 10
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            try:
                cudnn()
            except RuntimeError as e:
                row["cudnn_error"] = str(e).splitlines()[0][:120]
                del cols["cudnn"], eager["cudnn"], graph["cudnn"]
            for i in range(ROUNDS if kvb >= 1e9 else SHORT_ROUNDS):
                names = list(cols) if i % 2 == 0 else list(cols)[::-1]
                for c in names:
                    eager[c].append(eager_us(cols[c]))
                    if c in graph:
                        graph[c].append(graph_us(cols[c], calls=5, replays=replays))
        row["eager_rounds"] = {c: [round(x, 2) for x in t] for c, t in eager.items()}
        for c in cols:
            row[c] = statistics.median(eager[c])
            if c in graph:
                row[c + "_graph"] = statistics.median(graph[c])
        row.setdefault("cudnn", None)
        if table:
            row["host"] = host_us(ours, n=50, repeats=5)[0]
            row["host_unsplit"] = host_us(unsplit, n=50, repeats=5)[0]
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                sdpa(qt, kt, vt, enable_gqa=True)
                row["flash"] = eager_us(lambda: sdpa(qt, kt, vt, enable_gqa=True))
        except RuntimeError as e:
            row["flash"] = None
            row["flash_error"] = str(e).splitlines()[0][:120]
        return row

    def paged_case(b, sk, hq, hk, page, d=128):
        torch.cuda.empty_cache()
        npg = -(-sk // page)
        q = torch.randn(b, hq, d, device=dev, dtype=dt)
        kp = torch.randn(b * npg, page, hk, d, device=dev, dtype=dt)
        vp = torch.randn(b * npg, page, hk, d, device=dev, dtype=dt)
        table = torch.randperm(b * npg, device=dev, dtype=torch.int32).view(b, npg)
        used = torch.full((b,), sk, device=dev, dtype=torch.int32)
        cu_q = torch.arange(b + 1, device=dev, dtype=torch.int32)
        kw = dict(cu_seqlens_q=cu_q, max_seqlen_q=1, max_seqlen_k=sk, page_table=table,
                  seqused_k=used, causal=True)
        out = torch.empty_like(q)
        kd = kp[table.long()].reshape(b, npg * page, hk, d)[:, :sk]
        vd = vp[table.long()].reshape(b, npg * page, hk, d)[:, :sk]
        ref = fa4aot.flash_attn_func(q[:, None], kd, vd, causal=True)[0][:, 0]
        rt.split = -1
        out.fill_(float("nan"))
        fa4aot.flash_attn_varlen_func(q, kp, vp, out=out, **kw)
        row = {"b": b, "sk": sk, "hq": hq, "hk": hk, "page": page,
               "limit": b * sk * hk * 2 * d * 2 / HBM * 1e6,
               "max_diff_vs_dense": (out.float() - ref.float()).abs().max().item(),
               "nan": bool(out.isnan().any())}

        def step():
            fa4aot.flash_attn_varlen_func(q, kp, vp, out=out, **kw)

        # today's plan and the uniform plan alone (Runtime.ragged off), in alternation: the
        # ragged plan must not cost a uniform batch more than 3% (policy/ragged.py)
        times = {False: [], True: []}
        for _ in range(ROUNDS):
            for ragged in (False, True):
                rt.ragged = ragged
                rt._split_runs.clear()
                times[ragged].append((eager_us(step), graph_us(step, calls=5, replays=20)))
        for ragged, name in ((False, "uniform"), (True, "fa4aot")):
            row[name] = statistics.median(x[0] for x in times[ragged])
            row[name + "_graph"] = statistics.median(x[1] for x in times[ragged])
        rt.split = 0
        row["unsplit"] = eager_us(step)
        rt.split = -1
        return row

    res = {"device": torch.cuda.get_device_name(), "table": [], "grid": [], "paged": []}
    for b, sk, hq, hk in () if grid_only else TABLE:
        res["table"].append(dense_case(b, sk, hq, hk, table=True))
        print(_fmt(res["table"][-1]), flush=True)
        for page in (16, 64, 128):
            res["paged"].append(paged_case(b, sk, hq, hk, page))
            r = res["paged"][-1]
            print(f"  paged {page:>3}: fa4aot {r['fa4aot']:.1f} graph {r['fa4aot_graph']:.1f} "
                  f"uniform plan {r['uniform']:.1f} graph {r['uniform_graph']:.1f} "
                  f"unsplit {r['unsplit']:.1f} diff {r['max_diff_vs_dense']:.2e}", flush=True)
    if table_only:
        return res
    for b in GRID_B:
        for sk in GRID_S:
            res["grid"].append(dense_case(b, sk, 32, 8))
            print(_fmt(res["grid"][-1]), flush=True)
    res["summary"] = summary(res)
    print(json.dumps(res["summary"], indent=1))
    return res


def summary(res: dict) -> dict:
    """The issue's targets, counted from the rows (not by hand)."""
    out = {}
    cells = [r for r in res["grid"] if "skipped" not in r and r.get("cudnn")]
    for mode, a, c in (("eager", "fa4aot", "cudnn"), ("graph", "fa4aot_graph", "cudnn_graph")):
        rs = [r for r in cells if r.get(a) and r.get(c)]
        out[f"grid_{mode}_cells"] = len(rs)
        out[f"grid_{mode}_at_or_below_cudnn"] = sum(r[a] <= r[c] for r in rs)
        out[f"grid_{mode}_within_5pct"] = sum(r[a] <= 1.05 * r[c] for r in rs)
        out[f"table_{mode}_ratio"] = [
            round(r[a] / r[c], 3) for r in res["table"] if r.get(a) and r.get(c)
        ]
    big = [r for r in cells + res["table"] if r.get("kv_mb", 0) >= 256]
    out["hbm_cells_ge_256MB"] = len(big)
    out["hbm_within_1p5x_eager"] = sum(r["fa4aot"] <= 1.5 * r["limit"] for r in big)
    out["hbm_within_1p5x_graph"] = sum(r["fa4aot_graph"] <= 1.5 * r["limit"] for r in big)
    nosplit = [r for r in cells if r["splits"] == 1]
    out["nosplit_vs_unsplit"] = [round(r["fa4aot"] / r["unsplit"], 3) for r in nosplit]
    dense = {(r["b"], r["sk"], r["hq"], r["hk"]): r for r in res["table"]}
    out["paged_graph_vs_dense_graph"] = {
        f"b{p['b']} sk{p['sk']} page{p['page']}": round(
            p["fa4aot_graph"] / dense[(p["b"], p["sk"], p["hq"], p["hk"])]["fa4aot_graph"], 3
        )
        for p in res["paged"]
    }
    # today's plan over the uniform plan (the ragged plan where it applies)
    out["paged_vs_uniform_plan"] = {
        f"b{p['b']} sk{p['sk']} page{p['page']}": [
            round(p["fa4aot"] / p["uniform"], 3), round(p["fa4aot_graph"] / p["uniform_graph"], 3)]
        for p in res["paged"] if p.get("uniform")
    }
    return out


def _fmt(r):
    if "skipped" in r:
        return f"b{r['b']} sk{r['sk']} {r['hq']}:{r['hk']}: skipped ({r['skipped']})"
    f = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    return (
        f"b{r['b']:<3} sk{r['sk']:<6} {r['hq']}:{r['hk']} "
        f"n={str(r['splits']) + ('w' if r.get('wide') else ''):<4} limit {f(r['limit'])} "
        f"fa4aot {f(r['fa4aot'])} unsplit {f(r['unsplit'])} cudnn {f(r['cudnn'])} "
        f"flash {f(r['flash'])} graph {f(r.get('fa4aot_graph'))} cudnn_graph "
        f"{f(r.get('cudnn_graph'))} host {f(r.get('host'))}/"
        f"{f(r.get('host_unsplit'))} "
        f"err {r['err_vs_cudnn']:.1e} diff {r['max_diff_vs_unsplit']:.1e}"
    )


def _plot(path: str, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import numpy as np

    res = json.load(open(path))
    cells = {(r["b"], r["sk"]): r for r in res["grid"]}
    fig, axes = plt.subplots(1, 2, figsize=(13, 6))
    for ax, (mode, a, c) in zip(
        axes, (("eager", "fa4aot", "cudnn"), ("CUDA graph", "fa4aot_graph", "cudnn_graph"))
    ):
        arr = np.full((len(GRID_B), len(GRID_S)), np.nan)
        for i, b in enumerate(GRID_B):
            for j, sk in enumerate(GRID_S):
                r = cells.get((b, sk))
                if r and "skipped" not in r and r.get(c) and r.get(a):
                    arr[i, j] = r[c] / r[a]
        im = ax.imshow(arr, cmap="RdYlGn", vmin=0.5, vmax=2.0)
        for i in range(len(GRID_B)):
            for j in range(len(GRID_S)):
                txt = "skip" if np.isnan(arr[i, j]) else f"{arr[i, j]:.2f}"
                ax.text(j, i, txt, ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(GRID_S)), [f"{s // 1024}K" for s in GRID_S])
        ax.set_yticks(range(len(GRID_B)), [str(b) for b in GRID_B])
        ax.set_xlabel("context (keys)")
        ax.set_ylabel("batch")
        ax.set_title(f"{mode}: cuDNN time / fa4aot time")
    fig.suptitle("decode speedup of fa4aot over torch SDPA (cuDNN), bf16 hd128 32:8, H200")
    fig.colorbar(im, ax=axes, label="cuDNN time / fa4aot time")
    fig.savefig(png, dpi=110)


def tally(paths: list[str]) -> dict:
    """Over several runs' JSON (--out), per grid cell: the runs where fa4aot was at or below
    cuDNN, eager and in a graph, and the eager ratios' median, min and max; per run, the counts
    the summary gives, and which machine ran it: cuDNN's eager read rate at b16/64K in TB/s
    (K + V bytes over its time; None without that cell), which groups the runs by machine.
    -> {"runs": [(path, eager, graph, tbs)], "cells": {"b16/64K": {...}}}."""
    runs, cells = [], {}
    for path in paths:
        grid = [r for r in json.load(open(path))["grid"] if "skipped" not in r]
        ref = [r for r in grid if (r["b"], r["sk"]) == (16, 65536) and "kv_mb" in r]
        runs.append((path, sum(r["fa4aot"] <= r["cudnn"] for r in grid),
                     sum(r["fa4aot_graph"] <= r["cudnn_graph"] for r in grid),
                     ref[0]["kv_mb"] / ref[0]["cudnn"] if ref else None))
        for r in grid:
            c = cells.setdefault(f"b{r['b']}/{r['sk'] // 1024}K", {"eager": [], "graph": []})
            c["eager"].append(r["fa4aot"] / r["cudnn"])
            c["graph"].append(r["fa4aot_graph"] / r["cudnn_graph"])
    out = {}
    for name, c in cells.items():
        e, g = c["eager"], c["graph"]
        out[name] = {"runs": len(e), "eager_at_or_below": sum(x <= 1 for x in e),
                     "graph_at_or_below": sum(x <= 1 for x in g),
                     "eager_median": statistics.median(e), "eager_min": min(e),
                     "eager_max": max(e)}
    return {"runs": runs, "cells": out}


def _print_tally(t: dict) -> None:
    for path, e, g, tbs in t["runs"]:
        machine = f" (cuDNN reads {tbs:.2f} TB/s at b16/64K)" if tbs is not None else ""
        print(f"{path}: eager {e}, graph {g} cells at or below cuDNN{machine}")
    print(f"{'cell':10s} runs  eager<=  graph<=  eager ratio median [min, max]")
    for name, c in sorted(t["cells"].items(), key=lambda kv: -kv[1]["eager_median"]):
        print(f"{name:10s} {c['runs']:4d}  {c['eager_at_or_below']:6d}  "
              f"{c['graph_at_or_below']:7d}  {c['eager_median']:.3f} [{c['eager_min']:.3f}, "
              f"{c['eager_max']:.3f}]")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--plot")
    ap.add_argument("--png", default="docs/decode-split-heatmap.png")
    ap.add_argument("--table-only", action="store_true", help="the issue's six shapes only")
    ap.add_argument("--grid-only", action="store_true", help="the batch x context grid only")
    ap.add_argument("--tally", nargs="+", metavar="JSON",
                    help="no GPU: per grid cell, how many of these runs' --out files had "
                    "fa4aot at or below cuDNN")
    a = ap.parse_args()
    if a.tally:
        _print_tally(tally(a.tally))
        return
    if a.plot:
        _plot(a.plot, a.png)
        return
    res = _bench(a.table_only, a.grid_only)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
