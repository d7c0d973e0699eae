r"""Host time per call and kernel time: fa4aot vs flash_attn.cute, side by side (H200).

    FA4AOT_CACHE_DIR=<store> python benchmarks/host_overhead.py [--out results.json]
        [--baseline DIR]

--baseline DIR: DIR holds `fa4aot_base`, an earlier fa4aot (`git archive <rev> fa4aot`, renamed,
and its own imports rewritten: `sed -E 's/^(\s*)(from|import) fa4aot(\b|\.)/\1\2 fa4aot_base\3/'`,
else they load this checkout's modules); its calls are timed in the same rounds as this
checkout's, so a change's host cost is measured side by side (before/after), not across runs.
--baseline-cache: the store it serves from, where the store formats differ.

Host time: wall time of N back-to-back calls divided by N while the GPU is busy with a spin
kernel (launches only queue), median of R repeats; the headline figure
(`fa4aot_host_us_interleaved`) times all cases round-robin, 31 repeats, so the host's slow
phases hit every case alike. Device time: the same call captured 20 times
in a CUDA graph, median replay time per call (host excluded), for fa4aot and for FA4's JIT
kernels; they run the same kernel, so they should agree within noise.
Each case first checks fa4aot's output against FA4's (bitwise: same kernel, same inputs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import graph_us, host_us, host_us_interleaved  # noqa: E402


def cases(dev):
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*s):
        return torch.randn(*s, device=dev, dtype=dt, generator=g)

    out = []
    # dense, b=1 s=128, llama 32:8 hd128 causal
    q, k, v = r(1, 128, 32, 128), r(1, 128, 8, 128), r(1, 128, 8, 128)
    out.append(("dense b1 s128 32:8 hd128 causal", "flash_attn_func", (q, k, v), dict(causal=True)))
    # varlen decode, b=8, s_q=1, s_k=512
    b = 8
    cu_q = torch.arange(b + 1, device=dev, dtype=torch.int32)
    cu_k = torch.arange(b + 1, device=dev, dtype=torch.int32) * 512
    out.append(
        (
            "varlen decode b8 sk512 32:8",
            "flash_attn_varlen_func",
            (r(b, 32, 128), r(b * 512, 8, 128), r(b * 512, 8, 128)),
            dict(
                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1, max_seqlen_k=512, causal=True
            ),
        )
    )
    # paged decode, b=8, page 128 (TMA) and page 16
    for page in (128, 16):
        npg = 512 // page
        table = torch.randperm(b * npg, device=dev, dtype=torch.int32).reshape(b, npg)
        seqused = torch.full((b,), 512, device=dev, dtype=torch.int32)
        out.append(
            (
                f"paged decode b8 sk512 page{page} 32:8",
                "flash_attn_varlen_func",
                (r(b, 32, 128), r(b * npg, page, 8, 128), r(b * npg, page, 8, 128)),
                dict(
                    cu_seqlens_q=cu_q,
                    max_seqlen_q=1,
                    page_table=table,
                    seqused_k=seqused,
                    causal=True,
                ),
            )
        )
    # paged decode, b=300 (helper kernel path)
    b2 = 300
    cu_q2 = torch.arange(b2 + 1, device=dev, dtype=torch.int32)
    table = torch.randperm(b2 * 4, device=dev, dtype=torch.int32).reshape(b2, 4)
    out.append(
        (
            "paged decode b300 sk512 page128 32:8",
            "flash_attn_varlen_func",
            (r(b2, 32, 128), r(b2 * 4, 128, 8, 128), r(b2 * 4, 128, 8, 128)),
            dict(
                cu_seqlens_q=cu_q2,
                max_seqlen_q=1,
                page_table=table,
                seqused_k=torch.full((b2,), 512, device=dev, dtype=torch.int32),
                causal=True,
            ),
        )
    )
    # an unsplit one-row decode over more than 1023 keys, below half the SMs' (sequence, KV
    # head) pairs: the fold on the 64-row chunk kernel (splitkv.FoldRun)
    out.append(("fold dense decode b8 sk2048 32:8", "flash_attn_func",
                (r(8, 1, 32, 128), r(8, 2048, 8, 128), r(8, 2048, 8, 128)), dict(causal=True)))
    # split-KV decode steps (long context, small batch: the plan splits them on an H200;
    # FA4 runs these unsplit)
    q1, k1 = r(1, 1, 32, 128), r(1, 8192, 8, 128)
    out.append(("split dense decode b1 sk8192 32:8", "flash_attn_func", (q1, k1, r(1, 8192, 8, 128)),
                dict(causal=True)))
    b3, sk3 = 2, 16384
    cu_q3 = torch.arange(b3 + 1, device=dev, dtype=torch.int32)
    cu_k3 = torch.arange(b3 + 1, device=dev, dtype=torch.int32) * sk3
    out.append(
        (
            "split varlen decode b2 sk16384 32:8",
            "flash_attn_varlen_func",
            (r(b3, 32, 128), r(b3 * sk3, 8, 128), r(b3 * sk3, 8, 128)),
            dict(cu_seqlens_q=cu_q3, cu_seqlens_k=cu_k3, max_seqlen_q=1, max_seqlen_k=sk3,
                 causal=True),
        )
    )
    npg4 = 65536 // 128
    out.append(
        (
            "split paged decode b1 sk65536 page128 32:8",
            "flash_attn_varlen_func",
            (r(1, 32, 128), r(npg4, 128, 8, 128), r(npg4, 128, 8, 128)),
            dict(
                cu_seqlens_q=cu_q[:2],
                max_seqlen_q=1,
                max_seqlen_k=65536,
                page_table=torch.randperm(npg4, device=dev, dtype=torch.int32).reshape(1, npg4),
                seqused_k=torch.full((1,), 65536, device=dev, dtype=torch.int32),
                causal=True,
            ),
        )
    )
    # a KV cache in batch form with seqused_k (FA2's flash_attn_with_kvcache layout), split as
    # its own page pool (splitkv kind "padded")
    out.append(
        (
            "split padded decode b1 sk65536 32:8",
            "flash_attn_varlen_func",
            (r(1, 32, 128), r(1, 65536, 8, 128), r(1, 65536, 8, 128)),
            dict(cu_seqlens_q=cu_q[:2], max_seqlen_q=1, max_seqlen_k=65536,
                 seqused_k=torch.full((1,), 65536, device=dev, dtype=torch.int32), causal=True),
        )
    )
    return out


def _show(row: dict) -> None:
    """One case's row as a JSON line (floats rounded, the per-repeat lists left out)."""
    print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v)
                      for k, v in row.items() if not k.endswith("_all")}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument(
        "--no-fa4", action="store_true", help="fa4aot only (no compiler on this machine)"
    )
    ap.add_argument(
        "--cpu",
        type=int,
        default=max(os.sched_getaffinity(0)),
        help="pin the process to this CPU (default: the last one; -1: no pinning)",
    )
    ap.add_argument("--baseline", help="dir holding fa4aot_base, an earlier fa4aot, timed alongside")
    ap.add_argument("--baseline-cache", help="the store fa4aot_base serves from (one it built: "
                    "`python -m fa4aot_base.cli build --cache DIR`; default FA4AOT_CACHE_DIR)")
    a = ap.parse_args()
    if a.cpu >= 0:
        os.sched_setaffinity(0, {a.cpu})  # no migrations mid-measurement (the host is a VM)
    import fa4aot

    try:
        import torch_c_dlpack_ext  # noqa: F401  (fast DLPack exchange for tvm-ffi, if present)

        print("torch_c_dlpack_ext present")
    except ImportError:
        print("torch_c_dlpack_ext absent")

    fa4 = None
    if not a.no_fa4:
        import flash_attn.cute as fa4
    rows = []
    for name, fn_name, args, kw in cases("cuda"):
        ours = getattr(fa4aot, fn_name)
        row = {"case": name}
        o1 = ours(*args, **kw)[0]
        row["fa4aot_host_us"], row["fa4aot_host_us_all"] = host_us(lambda: ours(*args, **kw))
        row["fa4aot_device_us"] = graph_us(lambda: ours(*args, **kw))
        if fa4 is not None:
            theirs = getattr(fa4, fn_name)
            o2 = theirs(*args, **kw)[0]
            row["bitwise_equal"] = bool(torch.equal(o1, o2))
            row["fa4_host_us"], row["fa4_host_us_all"] = host_us(lambda: theirs(*args, **kw), n=500)
            try:
                row["fa4_device_us"] = graph_us(lambda: theirs(*args, **kw))
            except Exception as e:  # noqa: BLE001 - FA4's host path may not be capturable
                row["fa4_device_us"] = f"not capturable: {type(e).__name__}"
            row["host_speedup"] = row["fa4_host_us"] / row["fa4aot_host_us"]
        if name.startswith(("split", "fold")):
            # the split path's kernels are not plans: no floor / Python-path split for it (its
            # host time is the interleaved figure below)
            rows.append(row)
            _show(row)
            continue
        # The floor: each loaded kernel called directly with the arguments this call passed it
        # (captured once), so host time = bare tvm-ffi calls + the runtime's Python path.
        from dataclasses import replace

        from fa4aot.runtime import default_runtime

        rt = default_runtime()
        saved = dict(rt._plans)
        captured = []

        def capture(fn):
            def wrapped(*a):
                captured.append((fn, a))
                return fn(*a)

            return wrapped

        for key, p in saved.items():
            rt._plans[key] = replace(
                p, fwd=capture(p.fwd), tile_cumsum=p.tile_cumsum and capture(p.tile_cumsum)
            )
        ours(*args, **kw)
        calls = list(captured)

        def bare():
            for fn, a in calls:
                fn(*a)

        row["kernel_calls"] = len(calls)
        row["bare_tvm_ffi_call_us"], row["bare_tvm_ffi_call_us_all"] = host_us(bare)

        # the runtime's Python path alone: the same call with every loaded kernel a no-op
        def noop(*a):
            return None

        for key, p in saved.items():
            rt._plans[key] = replace(p, fwd=noop, tile_cumsum=p.tile_cumsum and noop)
        row["python_path_us"], row["python_path_us_all"] = host_us(lambda: ours(*args, **kw))
        rt._plans.update(saved)
        if fn_name == "flash_attn_func":
            q = args[0]
            row["torch_empty_us"], _ = host_us(
                lambda: torch.empty((1, 128, 32, 128), dtype=q.dtype, device=q.device)
            )
            row["new_empty_us"], _ = host_us(lambda: q.new_empty((1, 128, 32, 128)))
        rows.append(row)
        _show(row)
    # the headline figure: every case's fa4aot call timed round-robin, 31 repeats
    # (and FA4's, when present, in the same rounds)
    base = None
    if a.baseline:
        sys.path.insert(0, a.baseline)
        import fa4aot_base as base

        if a.baseline_cache:  # (an earlier fa4aot may not read this one's store format)
            base.reset(roots=[Path(a.baseline_cache)])
    fns = {}
    for name, fn_name, args, kw in cases("cuda"):
        fns[("fa4aot", name)] = lambda f=getattr(fa4aot, fn_name), a=args, k=kw: f(*a, **k)
        if base is not None:
            f = getattr(base, fn_name)
            # the same computation (split steps may differ in the last bf16 bit: the baseline
            # merges chunks with FA4's combine, fa4aot with its own merge kernel)
            ob, on = f(*args, **kw)[0].float(), getattr(fa4aot, fn_name)(*args, **kw)[0].float()
            assert (ob - on).abs().max() <= 1e-2 * on.abs().max(), name
            fns[("baseline", name)] = lambda f=f, a=args, k=kw: f(*a, **k)
        if fa4 is not None:
            fns[("fa4", name)] = lambda f=getattr(fa4, fn_name), a=args, k=kw: f(*a, **k)
    timed = host_us_interleaved(fns)
    for row in rows:
        out = {"case": row["case"]}
        for who in ("fa4aot", "baseline", "fa4"):
            if (who, row["case"]) in timed:
                med, allv = timed[(who, row["case"])]
                row[f"{who}_host_us_interleaved"], row[f"{who}_host_us_interleaved_all"] = med, allv
                out[f"{who}_host_us_interleaved"] = round(med, 2)
        print(json.dumps(out))
    env = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "python": sys.version.split()[0],
        "cpu_affinity": sorted(os.sched_getaffinity(0)),
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
