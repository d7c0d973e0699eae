"""Can any decode kernel beat cuDNN where fa4aot trails it? A Triton split-KV decode (H200)

    FA4AOT_CACHE_DIR=<store> python benchmarks/triton_decode_probe.py [--cells 16:65536,...]
                                                                      [--out f.json]

At b16 over 16K-128K keys (32:8 hd128) fa4aot trails torch SDPA's cuDNN backend by 0.4-1.8% in
every recorded run (`decode_split.py --tally`), where cuDNN reads K and V at 99.1-99.85% of
what a plain read reaches (`hbm_ceiling.py`, s15-b). FA4's sm90 kernel has a 64-row MMA tile
(4 rows real at 32:8); FA4's 16-row Ampere kernel streamed no faster (s15-a). This probe is a
third, independent kernel: a flash-decoding split step written in Triton (a benchmark only;
fa4aot serves none of it), with the keys of a chunk streamed in BLOCK_N-key blocks through a
software pipeline of STAGES buffers (cp.async), the 4 query heads of a KV head padded to 16
rows of mma.sync, one program per (KV head, chunk, sequence) with the KV heads adjacent in the
launch order (so the 8 programs of a (sequence, chunk) read each key's 2 KB together), then a
merge kernel over the chunks' partial O and LSE. Columns (same inputs, one process, 3
interleaved rounds, eager and CUDA-graph medians, `_timing.interleaved_medians`): fa4aot's plan,
cuDNN, and the Triton step at each --configs entry BLOCK_N x STAGES x programs-per-SM (the
chunk count per (sequence, KV head) is the one that gives about that many programs per SM),
optionally `:tma` (K and V through TMA descriptors, as FA4's sm90 kernel loads them) and
`:cfirst` (the chunks first in the launch order, so the programs in flight read the same KV
head's keys far apart: does the heads-adjacent order matter?) or `:all` (one program per
(chunk, sequence) over all 8 KV heads, 8 warps: each block of keys is one contiguous run of K
and of V, where a per-head program reads 256 bytes every 2 KB).
Each Triton column's output is compared with cuDNN's (max abs difference) and with an fp32
reference on the first 2 sequences (relative error); one off by more than 1e-2 is reported and
not timed. `TRITON_INTERPRET=1` runs the kernels on the CPU (tests/test_benchmarks.py).
bf16, hd128, 32:8, one query row, causal (one row: no mask), dense K/V.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

CELLS = "16:65536,16:131072,16:16384,4:65536,32:131072,2:131072"
CONFIGS = ("64x3x2,64x4x1,128x2x1,128x3x1,64x2x3,32x4x3,64x3x2:cfirst,64x3x2:tma,128x2x1:tma,"
           "16x2x1:all,16x3x1:all")
ROUNDS = 3


def kernels():
    """(chunk kernel, merge kernel): Triton functions, built on first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def chunk_kernel(Q, K, V, Op, Lp, sk, chunk, scale_log2, HQ: tl.constexpr, HK: tl.constexpr,
                     G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                     STAGES: tl.constexpr, TMA: tl.constexpr = False,
                     HFIRST: tl.constexpr = True):
        # K, V: pointers to (b, sk, hk, d), or with TMA descriptors of its (b * sk, hk, d) view
        # with [BLOCK_N, 1, D] boxes; HFIRST: the KV heads first in the launch order
        if HFIRST:
            h = tl.program_id(0)
            c = tl.program_id(1)
            nc = tl.num_programs(1)
        else:
            c = tl.program_id(0)
            h = tl.program_id(1)
            nc = tl.num_programs(0)
        bi = tl.program_id(2)
        rows = tl.arange(0, GP)
        cols = tl.arange(0, D)
        keys = tl.arange(0, BLOCK_N)
        q = tl.load(Q + (bi * HQ + h * G + rows[:, None]) * D + cols[None, :],
                    mask=rows[:, None] < G, other=0.0)
        kv0 = (bi.to(tl.int64) * sk * HK + h) * D
        m = tl.full([GP], float("-inf"), tl.float32)
        den = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        start = c * chunk
        end = tl.minimum(start + chunk, sk)
        for n0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
            n = n0 + keys
            if TMA:  # keys past the chunk's end are masked below (zero-filled past the tensor)
                k = K.load([bi * sk + n0, h, 0]).reshape(BLOCK_N, D)
            else:
                at = kv0 + n.to(tl.int64)[:, None] * (HK * D) + cols[None, :]
                k = tl.load(K + at, mask=n[:, None] < end, other=0.0,
                            eviction_policy="evict_first")
            s = tl.dot(q, tl.trans(k)) * scale_log2
            s = tl.where(n[None, :] < end, s, float("-inf"))
            m2 = tl.maximum(m, tl.max(s, 1))
            p = tl.exp2(s - m2[:, None])
            alpha = tl.exp2(m - m2)
            den = den * alpha + tl.sum(p, 1)
            if TMA:
                v = V.load([bi * sk + n0, h, 0]).reshape(BLOCK_N, D)
            else:
                v = tl.load(V + at, mask=n[:, None] < end, other=0.0,
                            eviction_policy="evict_first")
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m = m2
        part = (bi * HK + h) * nc + c  # partials (b, hk, chunks, GP rows, D)
        tl.store(Op + (part * GP + rows[:, None]) * D + cols[None, :], acc / den[:, None])
        tl.store(Lp + part * GP + rows, m + tl.log2(den))

    @triton.jit
    def merge_kernel(Op, Lp, O, nc, HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr,
                     GP: tl.constexpr, D: tl.constexpr):
        h = tl.program_id(0)
        bi = tl.program_id(1)
        rows = tl.arange(0, GP)
        cols = tl.arange(0, D)
        base = (bi * HK + h) * nc
        mx = tl.full([GP], float("-inf"), tl.float32)
        for c in range(nc):
            mx = tl.maximum(mx, tl.load(Lp + (base + c) * GP + rows))
        den = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for c in range(nc):
            w = tl.exp2(tl.load(Lp + (base + c) * GP + rows) - mx)
            den += w
            acc += w[:, None] * tl.load(Op + ((base + c) * GP + rows[:, None]) * D + cols[None, :])
        tl.store(O + (bi * HQ + h * G + rows[:, None]) * D + cols[None, :],
                 (acc / den[:, None]).to(O.dtype.element_ty), mask=rows[:, None] < G)

    @triton.jit
    def chunk_all_heads_kernel(Q, K, V, Op, Lp, sk, chunk, scale_log2, HQ: tl.constexpr,
                               HK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                               D: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
        # one program per (chunk, sequence) over every KV head: each block of BLOCK_N keys is
        # one contiguous BLOCK_N * HK * D run of K (and of V), the heads a batch of the dots
        c = tl.program_id(0)
        bi = tl.program_id(1)
        nc = tl.num_programs(0)
        hh = tl.arange(0, HK)
        rows = tl.arange(0, GP)
        cols = tl.arange(0, D)
        keys = tl.arange(0, BLOCK_N)
        q = tl.load(Q + (bi * HQ + hh[:, None, None] * G + rows[None, :, None]) * D
                    + cols[None, None, :], mask=rows[None, :, None] < G, other=0.0)
        kv0 = bi.to(tl.int64) * sk * HK * D
        m = tl.full([HK, GP], float("-inf"), tl.float32)
        den = tl.zeros([HK, GP], tl.float32)
        acc = tl.zeros([HK, GP, D], tl.float32)
        start = c * chunk
        end = tl.minimum(start + chunk, sk)
        for n0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
            n = n0 + keys
            at = (kv0 + n.to(tl.int64)[None, :, None] * (HK * D) + hh[:, None, None] * D
                  + cols[None, None, :])  # (HK, BLOCK_N, D)
            live = n[None, :, None] < end
            k = tl.load(K + at, mask=live, other=0.0, eviction_policy="evict_first")
            s = tl.dot(q, tl.permute(k, (0, 2, 1))) * scale_log2  # (HK, GP, BLOCK_N)
            s = tl.where(n[None, None, :] < end, s, float("-inf"))
            m2 = tl.maximum(m, tl.max(s, 2))
            p = tl.exp2(s - m2[:, :, None])
            alpha = tl.exp2(m - m2)
            den = den * alpha + tl.sum(p, 2)
            v = tl.load(V + at, mask=live, other=0.0, eviction_policy="evict_first")
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, :, None])
            m = m2
        part = (bi * HK + hh) * nc + c  # (HK,): the chunk kernel's partial layout
        tl.store(Op + (part[:, None, None] * GP + rows[None, :, None]) * D + cols[None, None, :],
                 acc / den[:, :, None])
        tl.store(Lp + part[:, None] * GP + rows[None, :], m + tl.log2(den))

    return chunk_kernel, merge_kernel, chunk_all_heads_kernel


def make_step(q, k, v, out, block_n: int, stages: int, chunks: int, num_warps: int = 4,
              tma: bool = False, hfirst: bool = True, all_heads: bool = False):
    """The Triton split step over `chunks` chunks per (sequence, KV head) into `out`
    (q, out: (b, 1, hq, d); k, v: (b, sk, hk, d), contiguous) -> a no-argument call. tma: K
    and V loaded through TMA descriptors; hfirst: the KV heads first in the launch order (else
    the chunks); all_heads: one program per (chunk, sequence) over every KV head (8 warps)."""
    import torch

    chunk_kernel, merge_kernel, all_heads_kernel = kernels()
    b, sk, hk, d = k.shape
    hq = q.shape[2]
    g = hq // hk
    gp = max(16, 1 << (g - 1).bit_length())
    chunk = -(-sk // chunks)
    chunk = -(-chunk // block_n) * block_n
    nc = -(-sk // chunk)
    op = torch.empty(b, hk, nc, gp, d, device=q.device, dtype=torch.float32)
    lp = torch.empty(b, hk, nc, gp, device=q.device, dtype=torch.float32)
    scale_log2 = 1.0 / math.sqrt(d) * math.log2(math.e)

    kk, vv = k, v
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        kk, vv = (TensorDescriptor.from_tensor(t.view(b * sk, hk, d), [block_n, 1, d])
                  for t in (k, v))
    grid = (hk, nc, b) if hfirst else (nc, hk, b)

    def step():
        if all_heads:
            all_heads_kernel[(nc, b)](q, k, v, op, lp, sk, chunk, scale_log2, HQ=hq, HK=hk, G=g,
                                      GP=gp, D=d, BLOCK_N=block_n, STAGES=stages, num_warps=8)
        else:
            chunk_kernel[grid](q, kk, vv, op, lp, sk, chunk, scale_log2, HQ=hq, HK=hk, G=g,
                               GP=gp, D=d, BLOCK_N=block_n, STAGES=stages, TMA=tma,
                               HFIRST=hfirst, num_warps=num_warps)
        merge_kernel[(hk, b)](op, lp, out, nc, HQ=hq, HK=hk, G=g, GP=gp, D=d, num_warps=4)

    return step


def reference(q, k, v):
    """fp32 attention of one query row per sequence (GQA) -> (b, 1, hq, d) float32."""
    import torch

    hq, hk = q.shape[2], k.shape[2]
    qf = q.float()[:, 0]  # (b, hq, d)
    kf = k.float().repeat_interleave(hq // hk, dim=2)  # (b, sk, hq, d)
    vf = v.float().repeat_interleave(hq // hk, dim=2)
    s = torch.einsum("bhd,bshd->bhs", qf, kf) / math.sqrt(q.shape[-1])
    return torch.einsum("bhs,bshd->bhd", s.softmax(-1), vf)[:, None]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default=CELLS)
    ap.add_argument("--configs", default=CONFIGS,
                    help="BLOCK_N x STAGES x programs per SM[:tma][:cfirst][:all], comma-separated"
                    " (tma: K/V through TMA descriptors; cfirst: chunks first in the launch order;"
                    " all: one program over every KV head)")
    ap.add_argument("--no-fa4aot", action="store_true", help="without the fa4aot column")
    ap.add_argument("--out")
    a = ap.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import (decode_columns, decode_inputs, interleaved_medians, parse_cells,
                         print_columns)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = [(tuple(int(x) for x in c.split(":")[0].split("x")), c.split(":")[1:])
               for c in a.configs.split(",")]
    rows = []
    for b, sk in parse_cells(a.cells):
        torch.cuda.empty_cache()
        q, k, v, out = decode_inputs(b, sk)
        base = decode_columns(q, k, v, out)
        cols = {"cudnn": base["cudnn"]}
        if not a.no_fa4aot:
            cols["fa4aot"] = base["fa4aot"]
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            want = base["cudnn"]()
        ref = reference(q[:2], k[:2], v[:2])
        row = {"b": b, "sk": sk, "diff": {}, "rel_err": {}, "chunks": {}, "refused": {}}
        for (bn, st, per_sm), opts in configs:
            name = f"triton {bn}x{st}x{per_sm}" + "".join(f":{x}" for x in opts)
            all_heads = "all" in opts  # programs: chunks * b, else chunks * b * KV heads
            chunks = max(1, round(per_sm * sms / (b * (1 if all_heads else k.shape[2]))))
            o = torch.full_like(out, float("nan"))
            try:
                step = make_step(q, k, v, o, bn, st, chunks, tma="tma" in opts,
                                 hfirst="cfirst" not in opts, all_heads=all_heads)
                step()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 (a config this Triton or the SMEM refuses)
                row["refused"][name] = f"{type(exc).__name__}: {str(exc)[:200]}"
                print(f"   {name}: refused ({row['refused'][name]})", flush=True)
                continue
            diff = (o.float() - want.transpose(1, 2).float()).abs().max().item()
            err = ((o[:2].float() - ref).norm() / ref.norm()).item()
            row["diff"][name], row["rel_err"][name], row["chunks"][name] = diff, err, chunks
            if not diff <= 1e-2:
                print(f"   {name}: output off by {diff:.2e} (not timed)", flush=True)
                continue
            cols[name] = step
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            row["eager"], row["graph"] = interleaved_medians(cols, ROUNDS)
        rows.append(row)
        ce, cg = row["eager"]["cudnn"], row["graph"]["cudnn"]
        gb = 2 * k.numel() * k.element_size() / 1e9
        print(f"b{b} sk{sk} K+V {gb:.2f} GB  cudnn {ce:.1f}/{cg:.1f} us "
              f"({gb * 1e3 / ce:.3f} TB/s eager)", flush=True)
        print_columns(row, cols, 20, {c: f"rel err {row['rel_err'][c]:.1e}  chunks "
                                         f"{row['chunks'][c]}" for c in row["chunks"]})
        del q, k, v, out, want
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
