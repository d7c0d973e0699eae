"""Gemma-4's full-attention layers (hd512, 32:4) on an H100/H200: fa4aot (a store built from
vLLM's FA4 copy) vs vLLM's copy run by JIT vs torch SDPA (cuDNN), per call and to first call.

    fa4aot build --fa4 vllm --arch sm90 --spec gemma-4            (once, on any CPU)
    FA4AOT_CACHE_DIR=<store> FA4AOT_ENGINE_SRC=<dir holding vllm/> \
        python benchmarks/gemma4_sm90.py [--cases a,b] [--out f.json]

Per call: device time (`_timing.graph_us`: calls captured in a CUDA graph, median of replays).
fa4aot runs at its own split count (the `splits` column: the cost model's, 1 where it runs
unsplit) and, for the long-context decode rows (`gemma4_cases.LONG_CASES`), also unsplit
(FA4AOT_SPLIT_KV=0); vLLM's copy runs at fa4aot's count (bit-identical column) and, on those
rows, at num_splits=0 (its own heuristic, what vLLM passes by default). The long rows measure
no first call (the decode rows above them do).
To first call: a fresh process per (mode, case), from the parent's clock before spawning to
the child's first output synchronized (imports, loading or compiling, the call); torch and CUDA
initialisation is measured alone (mode `torch`) so the attention share can be read off.
SDPA runs on the same K/V gathered into (b, hk, s, d) (it has no paged form); where cuDNN
refuses hd512 the table says so. Every output is checked against fa4aot's (rel err printed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# serve the stores built from vLLM's copy even where flash-attn-4 is installed (the children too)
os.environ.setdefault("FA4AOT_KERNEL_SOURCE", "vllm")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

CASES = ("bf16_p64_decode", "bf16_p16_decode", "fp8_p64_decode", "bf16_p64_prefill",
         "fp8_p64_prefill", "bf16_varlen_prefill", "bf16_p64_long_b1", "bf16_p64_long_b4",
         "fp8_p64_long_b1", "fp8_p64_long_b4")
MODES = ("torch", "fa4aot", "vllm-jit", "sdpa-cudnn")


def _case(name):
    import gemma4_cases as G

    return G, next(c for c in G.CASES + G.LONG_CASES if c.name == name)


def _fresh(**values):
    """A fresh default runtime (its split counts empty) under `values` (fa4aot settings)."""
    from fa4aot import settings
    from fa4aot.runtime import reset

    with settings.scope(**values):
        reset()


def sdpa_inputs(G, inp):
    """q (b, hq, sq, d) and K/V (b, hk, sk, d) bf16 for SDPA (FP8 dequantized), the longest
    sequence's shape for every sequence (SDPA has no varlen or paged form)."""
    import torch

    case = inp["case"]
    k, v = G.padded_kv(inp)
    b, sq = case.batch, max(inp["lq"])
    q = inp["q"] if case.layout == "dense" else inp["q"].new_zeros(b, sq, case.hq, case.d)
    if case.layout != "dense":
        for i, n in enumerate(inp["lq"]):
            s = int(inp["cu_seqlens_q"][i])
            q[i, :n] = inp["q"][s:s + n]
    bf = torch.bfloat16
    return (q.transpose(1, 2).contiguous(), k.to(bf).transpose(1, 2).contiguous(),
            v.to(bf).transpose(1, 2).contiguous())


def sdpa_fn(G, inp):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = sdpa_inputs(G, inp)
    causal = q.shape[2] > 1  # (decode: one row sees every key)

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=True)

    return run


def child(mode: str, name: str, t0: float) -> None:
    """One fresh process: initialise, make the case's inputs, run the mode's first call."""
    import torch

    torch.cuda.init()
    G, case = _case(name)
    inp = G.make(case, torch.Generator().manual_seed(0))
    torch.cuda.synchronize()
    t_inputs = time.time()
    if mode == "fa4aot":
        G.fa4aot_call(inp)
    elif mode == "vllm-jit":
        if G.vllm_copy() is None:
            print("@@" + json.dumps({"error": G.copy_skip_reason()}))
            return
        G.copy_call(inp)
    elif mode == "sdpa-cudnn":
        sdpa_fn(G, inp)()
    torch.cuda.synchronize()
    t = time.time()
    print("@@" + json.dumps({"first_s": round(t - t0, 3),
                             "attention_s": round(t - t_inputs, 3)}))


def first_call(mode: str, name: str) -> dict:
    t0 = time.time()
    r = subprocess.run([sys.executable, __file__, "--child", mode, name, repr(t0)],
                       capture_output=True, text=True, timeout=900)
    if "@@" not in r.stdout:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(r.stdout[r.stdout.index("@@") + 2:])


def per_call(name: str) -> dict:
    import torch
    from _timing import graph_us
    from reference import rel_err

    G, case = _case(name)
    long = case in G.LONG_CASES
    inp = G.make(case, torch.Generator().manual_seed(0))
    res: dict = {}
    _fresh()
    ref = G.fa4aot_call(inp)
    n = res["splits"] = G.runtime_splits()
    res["fa4aot_us"] = round(graph_us(lambda: G.fa4aot_call(inp)), 2)
    if long:
        _fresh(split_kv="0")
        res["fa4aot_unsplit_us"] = round(graph_us(lambda: G.fa4aot_call(inp)), 2)
        _fresh()
    if G.vllm_copy() is not None:
        got = G.copy_call(inp, num_splits=n)
        res["vllm_jit_us"] = round(graph_us(lambda: G.copy_call(inp, num_splits=n)), 2)
        res["vllm_equal"] = bool(torch.equal(got, ref))
        if long:
            res["vllm_jit_heuristic_us"] = round(
                graph_us(lambda: G.copy_call(inp, num_splits=0)), 2)
    else:
        res["vllm_jit_us"] = None
    try:
        fn = sdpa_fn(G, inp)
        o = fn().transpose(1, 2)
        if case.layout != "dense":
            o = torch.cat([o[i, :n] for i, n in enumerate(inp["lq"])])
        res["sdpa_rel_err"] = round(rel_err(o, ref), 5)
        res["sdpa_us"] = round(graph_us(fn), 2)
    except Exception as e:  # noqa: BLE001 (cuDNN's refusal is a result: printed in the table)
        res["sdpa_us"] = None
        res["sdpa_error"] = f"{type(e).__name__}: {str(e)[:120]}"
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "CASE", "T0"))
    a = ap.parse_args()
    if a.child:
        return child(a.child[0], a.child[1], float(a.child[2]))
    rows = {}
    for name in a.cases.split(","):
        row = {"per_call": per_call(name)}
        long = name in {c.name for c in _case(name)[0].LONG_CASES}
        row["first"] = {} if long else {m: first_call(m, name) for m in MODES}
        rows[name] = row
        print(name, json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)

    def fmt(x, unit=""):
        return "-" if x is None else f"{x}{unit}"

    print("\n| case | splits | fa4aot us | fa4aot unsplit us | vLLM JIT us (same splits) | "
          "vLLM JIT us (its heuristic) | SDPA cuDNN us | bit-identical | first call s: "
          "torch / fa4aot / vLLM JIT / SDPA |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        p, f = r["per_call"], r["first"]
        firsts = " / ".join(fmt(f[m].get("first_s")) if "error" not in f[m] else "err"
                            for m in f) or "-"
        sd = fmt(p.get("sdpa_us")) if p.get("sdpa_us") is not None else (
            "refused" if "sdpa_error" in p else "-")
        print(f"| {name} | {p['splits']} | {fmt(p['fa4aot_us'])} | "
              f"{fmt(p.get('fa4aot_unsplit_us'))} | {fmt(p['vllm_jit_us'])} | "
              f"{fmt(p.get('vllm_jit_heuristic_us'))} | {sd} | {fmt(p.get('vllm_equal'))} | "
              f"{firsts} |")


if __name__ == "__main__":
    main()
