"""Timing helpers shared by the benchmarks (CUDA events; see the device notes in docs/)."""

from __future__ import annotations

import statistics
import time

import torch


def capture(fn, calls: int):
    """`calls` calls of fn captured in one CUDA graph, after 3 warm-up calls on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def _events_us(launch, calls: int) -> float:
    """launch() (which issues `calls` calls) between two CUDA events: us per call."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    launch()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / calls


def replay_us(g, calls: int) -> float:
    """One replay of a graph of `calls` calls, timed with CUDA events: us per call."""
    return _events_us(g.replay, calls)


def graph_us(fn, calls: int = 20, replays: int = 30) -> float:
    """Device time per call: `calls` calls captured in one CUDA graph, median of `replays`
    replays timed with CUDA events. Host overhead is excluded by construction."""
    g = capture(fn, calls)
    return statistics.median(replay_us(g, calls) for _ in range(replays))


def stream_us(fn, calls: int = 20, repeats: int = 15) -> float:
    """Eager time per call: `calls` calls launched back to back between two CUDA events, no
    graph and no cache flush, median of `repeats`. For steps that read several times the L2
    (decode_ragged's): do_bench's flush zeroes 256 MB before each call, and the write-back of
    the dirty lines it leaves is then charged to the call. Includes host time wherever the
    host cannot keep ahead of the GPU."""
    def launch():
        for _ in range(calls):
            fn()

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return statistics.median(_events_us(launch, calls) for _ in range(repeats))


def eager_us(fn) -> float:
    """Eager time per call (triton's do_bench, median): includes host time when host-bound."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=30, rep=200, return_mode="median") * 1e3


def host_us(fn, n: int = 200, repeats: int = 15) -> tuple[float, list[float]]:
    """Host time per call: the GPU is first given ~100 ms of spinning (torch.cuda._sleep), so
    the calls' launches only queue behind it and the loop measures the host path alone."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(repeats):
        torch.cuda._sleep(200_000_000)
        t = time.perf_counter()
        for _ in range(n):
            fn()
        per.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per), per


def host_us_interleaved(fns: dict, n: int = 200, repeats: int = 31) -> dict:
    """host_us for several calls at once, round-robin: each repeat times every call once, so a
    slow phase of the (shared, virtualized) host hits every call alike instead of whichever was
    being measured then. -> {name: (median us per call, all repeats)}."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    per: dict = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            torch.cuda._sleep(200_000_000)
            t = time.perf_counter()
            for _ in range(n):
                fn()
            per[k].append((time.perf_counter() - t) / n * 1e6)
            torch.cuda.synchronize()
    return {k: (statistics.median(v), v) for k, v in per.items()}


def interleaved_medians(cols: dict, rounds: int, before=None, after=None) -> tuple[dict, dict]:
    """Eager (eager_us) and CUDA-graph (graph_us, 5 calls x 10 replays) medians of each column's
    call over `rounds` rounds, the columns in order and reversed every other round, so a slow
    phase of the (shared) machine hits every column alike. cols: {name: call}; before(name)
    runs before a column is timed, after() once it has been (e.g. swapping kernels in and
    out). -> ({name: eager us}, {name: graph us})."""
    names = list(cols)
    eager: dict = {c: [] for c in names}
    graph: dict = {c: [] for c in names}
    for i in range(rounds):
        for c in (names if i % 2 == 0 else names[::-1]):
            if before is not None:
                before(c)
            try:
                eager[c].append(eager_us(cols[c]))
                graph[c].append(graph_us(cols[c], 5, 10))
            finally:
                if after is not None:
                    after()
    return ({c: statistics.median(v) for c, v in eager.items()},
            {c: statistics.median(v) for c, v in graph.items()})


def print_columns(row: dict, names, width: int, notes: dict | None = None) -> None:
    """One line per timed column of a probe's row (interleaved_medians' medians in row["eager"]
    and row["graph"], a "cudnn" column among them): its eager and graph medians, each with its
    ratio to cuDNN's, its output's max difference (row["diff"]) where the probe took one, and
    the probe's own note on it (notes: {name: text}) where it has one."""
    ce, cg = row["eager"]["cudnn"], row["graph"]["cudnn"]
    for c in names:
        if c == "cudnn":
            continue
        e, g, d = row["eager"][c], row["graph"][c], row["diff"].get(c)
        print(f"   {c:{width}s} eager {e:8.1f} ({e / ce:.3f})  graph {g:8.1f} ({g / cg:.3f})"
              + (f"  diff {d:.1e}" if d is not None else "")
              + (f"  {notes[c]}" if notes and c in notes else ""), flush=True)


def decode_inputs(b: int, sk: int, hq: int = 32, hk: int = 8, d: int = 128, rows: int = 1):
    """Fresh random bf16 inputs of a decode step over a dense KV, in FA4's (b, s, h, d) layout:
    (q of `rows` query rows, k, v of sk keys, an empty out like q)."""
    q = torch.randn(b, rows, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    return q, k, v, torch.empty_like(q)


def at_split(setting: int, fn):
    """fn run with the runtime's split setting (FA4AOT_SPLIT_KV: -1 auto, 0 never, N chunks)
    set to `setting` for the call, then restored."""
    import fa4aot.runtime as R

    rt = R.default_runtime()

    def call():
        was, rt.split = rt.split, setting
        try:
            return fn()
        finally:
            rt.split = was

    return call


def decode_columns(q, k, v, out) -> dict:
    """The columns the decode benchmarks time on the same dense inputs (q, k, v in FA4's
    (b, s, h, d) layout): "fa4aot" as planned, "unsplit" (the same call with FA4AOT_SPLIT_KV=0,
    what FA4 itself runs) and "cudnn" (torch SDPA on the transposed views, returning its output;
    the caller picks the backend with sdpa_kernel)."""
    import fa4aot

    sdpa = torch.nn.functional.scaled_dot_product_attention
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def ours():
        fa4aot.flash_attn_func(q, k, v, causal=True, out=out)

    def cudnn():
        return sdpa(qt, kt, vt, enable_gqa=True)

    return {"fa4aot": ours, "unsplit": at_split(0, ours), "cudnn": cudnn}


def paged_call(q, k, v, out, page):
    """fa4aot.flash_attn_varlen_func on the dense inputs viewed as pages of `page` keys (a
    table in sequence order, seqused_k: every sequence full), writing `out`."""
    import fa4aot

    b, sk, hk, d = k.shape
    cu_q = torch.arange(b + 1, device=q.device, dtype=torch.int32)
    used = torch.full((b,), sk, device=q.device, dtype=torch.int32)
    table = torch.arange(b * sk // page, device=q.device, dtype=torch.int32).view(b, -1)
    kp, vp = k.view(-1, page, hk, d), v.view(-1, page, hk, d)
    qv, ov = q.view(b, *q.shape[2:]), out.view(b, *out.shape[2:])

    def call():
        fa4aot.flash_attn_varlen_func(qv, kp, vp, cu_seqlens_q=cu_q, max_seqlen_q=1,
                                      max_seqlen_k=sk, page_table=table, seqused_k=used,
                                      causal=True, out=ov)

    return call


def padded_call(q, k, v, out, seqlen=None):
    """fa4aot.flash_attn_varlen_func on the dense inputs as a KV cache in batch form with
    seqused_k (the `padded` layout: q packed, K/V (b, capacity, hk, d)), every sequence holding
    its first `seqlen` keys (default: the capacity, k.size(1)), writing `out`."""
    import fa4aot

    b, sk = k.shape[0], k.size(1) if seqlen is None else seqlen
    cu_q = torch.arange(b + 1, device=q.device, dtype=torch.int32)
    used = torch.full((b,), sk, device=q.device, dtype=torch.int32)
    qv, ov = q.view(b, *q.shape[2:]), out.view(b, *out.shape[2:])

    def call():
        fa4aot.flash_attn_varlen_func(qv, k, v, cu_seqlens_q=cu_q, max_seqlen_q=1,
                                      max_seqlen_k=sk, seqused_k=used, causal=True, out=ov)

    return call
