"""The H200's memory ceiling as a decode step meets it: how fast does anything read K and V?

    python benchmarks/hbm_ceiling.py [--cells 16:65536,...] [--out f.json]

decode_split.py's "limit" column divides the K+V bytes by the 4.8 TB/s nominal bandwidth. This
measures what the card reaches, per cell (32:8 hd128 bf16, dense K/V of b * sk keys), side by
side in one process, do_bench medians (eager, L2 flushed between calls) and CUDA graphs:
  read      a Triton kernel that streams K and V once (16-byte loads, 32 KB per program, a
            float32 sum per program written out): bytes = K + V
  sum       torch.sum over K and over V (two reductions): bytes = K + V
  copy      K and V copied into preallocated buffers (torch copy_): bytes = 2 (K + V), read +
            written
  cudnn     torch SDPA's cuDNN backend on the decode step (one query row): bytes = K + V (q and
            out are under 0.1%)
With --streams, reads that try harder to reach the ceiling (is there bandwidth above cuDNN's?):
  wide      as read, 128 KB per program, 8 warps
  stream<P> P persistent programs per SM, each reading one contiguous range of K then of V in
            16 KB steps, software-pipelined 4 deep (Triton's tl.range num_stages)
  kv<P>     as stream, each step reading K and V at the same offsets (a decode's pattern)
  tma<P>    as kv, through TMA descriptors (64 keys x 128 columns per box, as FA4's 64-key
            tiles), pipelined 4 deep; skipped where this Triton lacks host tensor descriptors
Each reported as TB/s and as a share of 4.8 TB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

CELLS = "16:16384,16:65536,16:131072,32:65536,4:65536"


def kernels():
    """The Triton read kernels (a function, so the script parses --help and a CPU test
    compiles them without a GPU: tests/test_benchmarks.py)."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_first")
        tl.store(out_ptr + pid, tl.sum(x.to(tl.float32)))

    @triton.jit
    def stream_kernel(x_ptr, y_ptr, out_ptr, n, per, BLOCK: tl.constexpr, KV: tl.constexpr):
        # one contiguous range of `per` words per program (of x, then of y; or of both at once)
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * per
        acc = tl.zeros([BLOCK], tl.float32)
        for i in tl.range(0, per, BLOCK, num_stages=4):
            offs = base + i + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_first")
            acc += x.to(tl.float32)
            if KV:
                y = tl.load(y_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_first")
                acc += y.to(tl.float32)
        if not KV:
            for i in tl.range(0, per, BLOCK, num_stages=4):
                offs = base + i + tl.arange(0, BLOCK)
                y = tl.load(y_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_first")
                acc += y.to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc))

    @triton.jit
    def tma_kernel(kd, vd, out_ptr, rows, per, R: tl.constexpr, C: tl.constexpr):
        pid = tl.program_id(0)
        start = pid * per
        acc = tl.zeros([R, C], tl.float32)
        for r in tl.range(start, tl.minimum(start + per, rows), R, num_stages=4):
            acc += kd.load([r, 0]).to(tl.float32) + vd.load([r, 0]).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc))

    return read_kernel, stream_kernel, tma_kernel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default=CELLS)
    ap.add_argument("--out")
    ap.add_argument("--streams", action="store_true", help="also the persistent / TMA reads")
    a = ap.parse_args()
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import decode_inputs, eager_us, graph_us, parse_cells

    read_kernel, stream_kernel, tma_kernel = kernels()

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # an older Triton: the tma columns are skipped
        TensorDescriptor = None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block = 4096  # int64 words: 32 KB per program
    rows = []
    for b, sk in parse_cells(a.cells):
        torch.cuda.empty_cache()
        q, k, v, _ = decode_inputs(b, sk)
        kv_bytes = 2 * k.numel() * k.element_size()
        kw, vw = k.view(-1).view(torch.int64), v.view(-1).view(torch.int64)
        # int64 words summed as float32: the values are meaningless, the loads are real
        parts = torch.empty(2 * triton.cdiv(kw.numel(), block), device="cuda")
        grid = (triton.cdiv(kw.numel(), block),)
        half = grid[0]
        kc, vc = torch.empty_like(k), torch.empty_like(v)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        def read():
            read_kernel[grid](kw, parts, kw.numel(), BLOCK=block)
            read_kernel[grid](vw, parts[half:], vw.numel(), BLOCK=block)

        def tsum():
            k.sum(dtype=torch.float32)
            v.sum(dtype=torch.float32)

        def copy():
            kc.copy_(k)
            vc.copy_(v)

        def cudnn():
            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        cols = {"read": (read, 1), "sum": (tsum, 1), "copy": (copy, 2), "cudnn": (cudnn, 1)}
        if a.streams:
            n = kw.numel()
            wgrid = (triton.cdiv(n, 4 * block),)
            wparts = torch.empty(2 * wgrid[0], device="cuda")

            def wide():
                read_kernel[wgrid](kw, wparts, n, BLOCK=4 * block, num_warps=8)
                read_kernel[wgrid](vw, wparts[wgrid[0]:], n, BLOCK=4 * block, num_warps=8)

            cols["wide"] = (wide, 1)
            sblock = 2048  # int64 words: 16 KB a step
            for p in (1, 2, 4):
                g = sms * p
                per = triton.cdiv(triton.cdiv(n, g), sblock) * sblock
                sp = torch.empty(g, device="cuda")
                for kv in (False, True):
                    cols[f"{'kv' if kv else 'stream'}{p}"] = (
                        lambda g=g, per=per, sp=sp, kv=kv: stream_kernel[(g,)](
                            kw, vw, sp, n, per, BLOCK=sblock, KV=kv, num_warps=4), 1)
                if TensorDescriptor is not None:
                    rows_ = k.numel() // 128
                    k2, v2 = k.view(rows_, 128), v.view(rows_, 128)
                    kd = TensorDescriptor.from_tensor(k2, [64, 128])
                    vd = TensorDescriptor.from_tensor(v2, [64, 128])
                    tper = triton.cdiv(triton.cdiv(rows_, g), 64) * 64
                    cols[f"tma{p}"] = (
                        lambda g=g, tper=tper, sp=sp, kd=kd, vd=vd, rows_=rows_: tma_kernel[(g,)](
                            kd, vd, sp, rows_, tper, R=64, C=128, num_warps=4), 1)
        row = {"b": b, "sk": sk, "kv_gb": kv_bytes / 1e9, "cols": {}}
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            for rnd in range(2):  # two interleaved rounds: the second is reported
                for name, (fn, mult) in list(cols.items()):
                    try:
                        e, g = eager_us(fn), graph_us(fn, calls=5, replays=10)
                    except Exception as exc:  # noqa: BLE001 (a --streams column Triton refuses)
                        print(f"   {name}: skipped ({type(exc).__name__}: {str(exc)[:200]})")
                        del cols[name]
                        continue
                    row["cols"][name] = {
                        "eager_us": e, "graph_us": g,
                        "eager_tbs": mult * kv_bytes / e / 1e6, "graph_tbs": mult * kv_bytes / g / 1e6,
                    }
        rows.append(row)
        print(f"b{b} sk{sk} K+V {kv_bytes / 1e9:.2f} GB", flush=True)
        for name, x in row["cols"].items():
            print(f"   {name:6s} eager {x['eager_us']:9.1f} us {x['eager_tbs']:.3f} TB/s "
                  f"({x['eager_tbs'] / 4.8:.3f})   graph {x['graph_us']:9.1f} us "
                  f"{x['graph_tbs']:.3f} TB/s ({x['graph_tbs'] / 4.8:.3f})", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
