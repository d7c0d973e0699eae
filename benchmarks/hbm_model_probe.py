"""The split plans' cost model on this card (split.model_for its HBM peak) against the H200's
figures (split.DEFAULT_MODEL), on the cells where the two plan differently, with FA4's unsplit
kernel and torch SDPA's cuDNN backend beside them: same inputs, one process.

    FA4AOT_CACHE_DIR=<store> python benchmarks/hbm_model_probe.py [--out results.json]

Cells: b:keys:rows (32:8 hd128 bf16, dense K, causal; rows > 1: a speculative step, row t
seeing len - rows + 1 + t keys; cuDNN unmasked, the same bytes read). Columns: `card model`
(the runtime's plan here), `h200 model`, `unsplit` (FA4AOT_SPLIT_KV=0), `cudnn`; eager and
CUDA-graph medians of three interleaved rounds (`_timing.interleaved_medians`), each plan's
output compared with the unsplit kernel's. On an H200 both models are the same one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

CELLS = "8:16384:4,8:32768:2,8:8192:2,8:16384:1,4:1024:1,1:65536:4,2:32768:4"


def main():
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import decode_columns, decode_inputs, interleaved_medians

    import fa4aot.runtime as R
    from fa4aot import split as S
    from fa4aot.runtime.plan import hbm_peak

    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--cells", default=CELLS, help="b:keys:rows,...")
    a = ap.parse_args()
    rt = R.default_runtime()
    card = rt.cost_model(0)
    peak = hbm_peak(torch.device("cuda", 0))
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: memory clock {getattr(props, 'memory_clock_rate', None)} kHz, bus "
          f"{getattr(props, 'memory_bus_width', None)} bits", flush=True)
    print(f"{torch.cuda.get_device_name()}: HBM peak {peak and peak / 1e12:.2f} TB/s, model "
          f"{card.hbm_bytes_per_s / 1e12:.2f} TB/s (H200's {S.DEFAULT_MODEL.hbm_bytes_per_s / 1e12:.2f})",
          flush=True)

    def use(c: str):
        rt._models[0] = S.DEFAULT_MODEL if c == "h200 model" else card
        rt._split_n.clear()
        rt._split_runs.clear()

    rows = []
    for b, sk, sq in (tuple(int(x) for x in c.split(":")) for c in a.cells.split(",")):
        torch.cuda.empty_cache()
        q, k, v, out = decode_inputs(b, sk, rows=sq)
        fns = decode_columns(q, k, v, out)
        cols = {"card model": fns["fa4aot"], "h200 model": fns["fa4aot"],
                "unsplit": fns["unsplit"], "cudnn": fns["cudnn"]}
        fns["unsplit"]()
        ref = out.clone()
        diff = {}
        for c in ("card model", "h200 model"):
            use(c)
            out.fill_(float("nan"))
            cols[c]()
            torch.cuda.synchronize()
            diff[c] = (out.float() - ref.float()).abs().max().item()
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            eager, graph = interleaved_medians(cols, 3, before=use, after=lambda: use("card"))
        row = {"b": b, "sk": sk, "sq": sq, "eager": eager, "graph": graph, "diff": diff}
        rows.append(row)
        print(f"b{b} sk{sk} sq{sq} 32:8", flush=True)
        for c in cols:
            e, g = eager[c], graph[c]
            print(f"   {c:11s} eager {e:8.1f} ({e / eager['cudnn']:.3f})  graph {g:8.1f} "
                  f"({g / graph['cudnn']:.3f})" + (f"  diff {diff[c]:.1e}" if c in diff else ""),
                  flush=True)
        del q, k, v, out, ref
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "hbm_peak": peak,
                       "model_hbm": card.hbm_bytes_per_s, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
