"""What does the page-table guard cost a paged decode step? (H200)

    FA4AOT_CACHE_DIR=<store> python benchmarks/guard_probe.py [--cells 1:8192:16,...] [--out f.json]

FA4's TMA-paged sm90 kernel reads page_table[0, -1] when sequence 0 has no keys, so the runtime
hands a table that starts at a multiple of 64 KiB (where a GPU mapping may start) to the kernel
as a copy behind a 16-byte guard (`fa4aot/runtime/launch.py`, GUARD_ALIGN): one allocation and
one copy kernel per launch. A serving engine's block table is often one persistent tensor of
its own allocation, whose base is such a boundary, so every paged call would pay it. This
times, side by side in one process on the same pool and the same table contents, a paged
decode step (32:8 hd128, one row, causal; the plan as it runs it: split or not) with the table
at a 64 KiB boundary ("aligned": guarded) and 16 bytes past one ("offset": passed as it is),
3 interleaved rounds, eager and CUDA-graph medians, and counts the guard's copies per call.
Outputs must be bit-identical. FA4's source (flash_fwd_sm90.py, paged_kv.py) reads the table
out of bounds only on its TMA path (page size == tile_n, and fa4aot's `fwd_tma` for pages of
64); the cp.async path clamps the block and checks each row: this measures what restricting
the guard to the TMA path would save.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

CELLS = "1:8192:16,1:8192:64,1:8192:128,4:32768:16,4:32768:128,8:16384:16,32:4096:16,32:4096:128"
ROUNDS = 3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default=CELLS, help="batch:keys:page_size, comma-separated")
    ap.add_argument("--out")
    a = ap.parse_args()
    import torch

    import fa4aot
    from fa4aot.runtime import launch as L

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import interleaved_medians

    copies = [0]
    guard = L.guard_page_table

    def counted(t):
        copies[0] += 1
        return guard(t)

    L.guard_page_table = counted
    dev, dt, hq, hk, d = "cuda", torch.bfloat16, 32, 8, 128
    # one buffer for both tables: its base at a 64 KiB boundary inside the allocation (so the
    # bytes before "aligned" are mapped: only the runtime's test decides), "offset" 16 B further
    buf = torch.zeros(4 * L.GUARD_ALIGN, device=dev, dtype=torch.int32)
    at = (-buf.data_ptr() % L.GUARD_ALIGN) // 4 + L.GUARD_ALIGN // 4
    rows = []
    for cell in a.cells.split(","):
        b, sk, page = (int(x) for x in cell.split(":"))
        torch.cuda.empty_cache()
        npg = -(-sk // page)
        q = torch.randn(b, hq, d, device=dev, dtype=dt)
        kp = torch.randn(b * npg, page, hk, d, device=dev, dtype=dt)
        vp = torch.randn_like(kp)
        perm = torch.randperm(b * npg, device=dev, dtype=torch.int32)
        tables = {}
        # "offset": 128 KiB + 16 bytes past "aligned", in the same buffer
        for name, off in (("aligned", at), ("offset", at + L.GUARD_ALIGN // 2 + 4)):
            t = buf[off:off + b * npg].view(b, npg)
            t.copy_(perm.view(b, npg))
            tables[name] = t
        assert tables["aligned"].data_ptr() % L.GUARD_ALIGN == 0
        assert tables["offset"].data_ptr() % L.GUARD_ALIGN
        used = torch.full((b,), sk, device=dev, dtype=torch.int32)
        cu_q = torch.arange(b + 1, device=dev, dtype=torch.int32)
        outs = {n: torch.empty_like(q) for n in tables}

        def call(name):
            return lambda: fa4aot.flash_attn_varlen_func(
                q, kp, vp, cu_seqlens_q=cu_q, max_seqlen_q=1, max_seqlen_k=sk,
                page_table=tables[name], seqused_k=used, causal=True, out=outs[name])

        cols = {n: call(n) for n in tables}
        row = {"b": b, "sk": sk, "page": page, "copies_per_call": {}}
        for n, fn in cols.items():
            copies[0] = 0
            fn()
            torch.cuda.synchronize()
            row["copies_per_call"][n] = copies[0]
        row["bit_identical"] = torch.equal(outs["aligned"], outs["offset"])
        row["eager"], row["graph"] = interleaved_medians(cols, ROUNDS)
        rows.append(row)
        e, g = row["eager"], row["graph"]
        print(f"b{b} sk{sk} page {page}: guard copies/call aligned "
              f"{row['copies_per_call']['aligned']}, offset {row['copies_per_call']['offset']}; "
              f"eager {e['aligned']:.1f} / {e['offset']:.1f} us ({e['aligned'] - e['offset']:+.1f})"
              f"  graph {g['aligned']:.2f} / {g['offset']:.2f} us "
              f"({g['aligned'] - g['offset']:+.2f})  bit-identical {row['bit_identical']}",
              flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
