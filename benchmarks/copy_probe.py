"""What the padded path's two copies cost (H200), copied as 8-byte words vs as 2-byte elements.

    python benchmarks/copy_probe.py --pad-store .gpu-store [--out f.json]

A 20:1 decode call (4 KV heads, hd128, dense K) served with the fold off, so q is padded per KV
group to the 32:1 variant and O cropped back. Side by side in one process, per shape:
  kernel32          the 32:1 kernel on q already padded (no copies)
  padded_wide       the padded path as shipped: the q pad and O crop moved as int64 words
                    (runtime.pad.copy_wide)
  padded_elem       the same path with copy_wide replaced by a plain bf16 copy_ (before)
  q_wide/q_elem, o_wide/o_elem: each copy alone
Device time per call from CUDA-graph replay (_timing.graph_us); host time per call of the three
calls interleaved (_timing.host_us_interleaved).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import graph_us, host_us_interleaved  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pad-store", required=True)
    ap.add_argument("--out")
    a = ap.parse_args()
    import fa4aot
    import fa4aot.runtime as R
    import fa4aot.runtime.pad as X

    R.reset(roots=[a.pad_store])
    R.default_runtime().fold = False
    wide = X.copy_wide

    def elem(dst, src):
        dst.copy_(src)

    dt, hk, r, r2, d = torch.bfloat16, 4, 20, 32, 128
    rows = []
    for b, sk in [(8, 4096), (32, 2048), (64, 1024)]:
        q = torch.randn(b, 1, hk * r, d, device="cuda", dtype=dt)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=dt)
        v = torch.randn_like(k)
        y = q.new_empty((b, 1, hk, r2, d))
        po = torch.randn_like(y)
        out = q.new_empty((b, 1, hk * r, d))
        qpad = y.view(b, 1, hk * r2, d)

        def kernel32():
            fa4aot.flash_attn_func(qpad, k, v, causal=True)

        def padded_with(copy):
            def call():
                X.copy_wide = copy
                try:
                    return fa4aot.flash_attn_func(q, k, v, causal=True)
                finally:
                    X.copy_wide = wide

            return call

        def copies(copy):
            return (
                lambda: copy(y[..., :r, :], q.view(b, 1, hk, r, d)),
                lambda: copy(out.view(b, 1, hk, r, d), po[..., :r, :]),
            )

        (qw, ow), (qe, oe) = copies(wide), copies(elem)
        o1, o2 = padded_with(wide)()[0], padded_with(elem)()[0]
        assert torch.equal(o1, o2), "the two copies differ"
        row = {"case": f"dense decode b{b} sk{sk}"}
        for name, fn in [
            ("kernel32", kernel32),
            ("padded_wide", padded_with(wide)),
            ("padded_elem", padded_with(elem)),
            ("q_wide", qw),
            ("q_elem", qe),
            ("o_wide", ow),
            ("o_elem", oe),
        ]:
            row[f"{name}_graph_us"] = graph_us(fn)
        host = host_us_interleaved(
            {
                "kernel32": kernel32,
                "padded_wide": padded_with(wide),
                "padded_elem": padded_with(elem),
            }
        )
        for name, (med, _) in host.items():
            row[f"{name}_host_us"] = med
        row["padded_wide_over_kernel32"] = row["padded_wide_graph_us"] / row["kernel32_graph_us"]
        row["padded_elem_over_kernel32"] = row["padded_elem_graph_us"] / row["kernel32_graph_us"]
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "gpu": torch.cuda.get_device_name()}, f, indent=2)


if __name__ == "__main__":
    main()
