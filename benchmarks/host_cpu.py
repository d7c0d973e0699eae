r"""The runtime's per-call Python overhead on a CPU, per path, optionally against an older fa4aot.

    python benchmarks/host_cpu.py [--baseline DIR] [--n 2000] [--repeats 15] [--json FILE]

No GPU and no store: the runtime's seams are replaced by stand-ins (the device is "sm90, 132
SMs"; `Runtime.find` / `_load` serve every variant of a small in-memory "store" with no-op
kernels; CPU tensors report device 0, so the split path, which needs a CUDA device index, is
reachable). Each path's plan is resolved on its first call (not timed); then N back-to-back
calls are timed, median of R repeats, all cases round-robin. This is Python overhead plus
CPU-side torch dispatch (views, allocations, the split's metadata ops running on the CPU); the
H200 figure (benchmarks/host_overhead.py) adds CUDA launch costs. Also counts the torch ops
(aten calls) of one call per path: what a CUDA call would dispatch, views included.

--baseline DIR: DIR holds `fa4aot_base`, an earlier fa4aot package whose own imports name it
(else they load this checkout's modules), e.g.
    mkdir -p /tmp/base && git archive cec8fa9 fa4aot | tar -x -C /tmp/base \
        && mv /tmp/base/fa4aot /tmp/base/fa4aot_base && find /tmp/base -name '*.py' -exec \
        sed -i -E 's/^(\s*)(from|import) fa4aot(\b|\.)/\1\2 fa4aot_base\3/' {} +
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

BF16 = torch.bfloat16


def _noop(*a):
    return None


class _Art:
    """A stand-in store artifact: every part present, a combine for bf16 partials."""

    def __init__(self, vid):
        self.id = vid
        self.record = {
            "parts": {  # as `fa4aot build` writes a split chunk kernel's (stores before it:
                # FA4's combine, no metadata kernel, no chunk modes)
                "fwd": {"q_broadcast": True, "chunk_lengths": True},
                "merge": {"partial_dtype": "bfloat16", "max_splits": 128, "threads": 256},
                "combine": {"partial_dtype": "bfloat16", "tile_m": 16, "max_splits": 128},
                "chunk_meta": {},
            }
        }
        self.dir = Path("/nonexistent") / vid


def _calls(pkg):
    """(name, function, args, kwargs) per path, and the variants the stand-in store holds."""
    keys = getattr(pkg, "variants", None) or pkg.model.compile_keys  # flat layout or stages
    feats = keys.features
    split_v = keys.split_kernel_variant
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g).to(BF16)

    def i32(x):
        return torch.tensor(x, dtype=torch.int32)

    base = dict(arch="sm90", dtype="bfloat16", head_dim=128, head_dim_v=128, window_left=None,
                window_right=None, sink_dtype=None)
    have = []
    cases = []
    # dense decode, b8 sk512 32:8 (short: not split)
    cases.append(("dense decode b8 sk512", "flash_attn_func",
                  (r(8, 1, 32, 128), r(8, 512, 8, 128), r(8, 512, 8, 128)), dict(causal=True)))
    have.append(feats(**base, num_heads=32, num_heads_kv=8, causal=True, return_lse=False,
                      batch=8, seqlen_q=1, total_q=8, max_seqlen_q=None))
    # dense prefill, b1 s128 32:8
    cases.append(("dense prefill b1 s128", "flash_attn_func",
                  (r(1, 128, 32, 128), r(1, 128, 8, 128), r(1, 128, 8, 128)),
                  dict(causal=True)))
    have.append(feats(**base, num_heads=32, num_heads_kv=8, causal=True, return_lse=False,
                      batch=1, seqlen_q=128, total_q=128, max_seqlen_q=None))
    # varlen prefill, 4 x 128 tokens
    cu = i32([0, 128, 256, 384, 512])
    cases.append(("varlen prefill b4 s128", "flash_attn_varlen_func",
                  (r(512, 32, 128), r(512, 8, 128), r(512, 8, 128)),
                  dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=128, max_seqlen_k=128,
                       causal=True)))
    have.append(feats(**base, num_heads=32, num_heads_kv=8, causal=True, return_lse=False,
                      batch=4, seqlen_q=None, total_q=512, max_seqlen_q=128, cu_seqlens_q=True,
                      cu_seqlens_k=True))
    # paged decode, b8, 4 pages of 128 (512 keys: not split)
    b = 8
    cases.append(("paged decode b8 sk512", "flash_attn_varlen_func",
                  (r(b, 32, 128), r(b * 4, 128, 8, 128), r(b * 4, 128, 8, 128)),
                  dict(cu_seqlens_q=i32(list(range(b + 1))), max_seqlen_q=1,
                       page_table=i32(list(range(b * 4))).view(b, 4),
                       seqused_k=i32([512] * b), causal=True)))
    have.append(feats(**base, num_heads=32, num_heads_kv=8, causal=True, return_lse=False,
                      batch=b, seqlen_q=None, total_q=b, max_seqlen_q=1, cu_seqlens_q=True,
                      seqused_k=True, page_size=128))
    # head-ratio padding: 20:1 prefill served by the 32:1 kernel (q padded, O cropped)
    cases.append(("padded 20:1->32:1 b1 s128", "flash_attn_func",
                  (r(1, 128, 20, 128), r(1, 128, 1, 128), r(1, 128, 1, 128)),
                  dict(causal=True)))
    have.append(feats(**base, num_heads=32, num_heads_kv=1, causal=True, return_lse=False,
                      batch=1, seqlen_q=128, total_q=128, max_seqlen_q=None))
    # an unsplit one-row decode over more than 1023 keys: the fold on the chunk kernel
    cases.append(("fold dense b8 sk2048", "flash_attn_func",
                  (r(8, 1, 32, 128), r(8, 2048, 8, 128), r(8, 2048, 8, 128)),
                  dict(causal=True)))
    # split decode: dense K, b1 sk8192 32:8; paged, b2 sk8192 page 128 with LSE; varlen b1
    cases.append(("split dense b1 sk8192", "flash_attn_func",
                  (r(1, 1, 32, 128), r(1, 8192, 8, 128), r(1, 8192, 8, 128)),
                  dict(causal=True)))
    cases.append(("split paged b2 sk8192 +lse", "flash_attn_varlen_func",
                  (r(2, 32, 128), r(2 * 64, 128, 8, 128), r(2 * 64, 128, 8, 128)),
                  dict(cu_seqlens_q=i32([0, 1, 2]), max_seqlen_q=1,
                       page_table=i32(list(range(128))).view(2, 64),
                       seqused_k=i32([8000, 8192]), causal=True, return_lse=True)))
    cases.append(("split varlen b1 sk8192", "flash_attn_varlen_func",
                  (r(1, 32, 128), r(8192, 8, 128), r(8192, 8, 128)),
                  dict(cu_seqlens_q=i32([0, 1]), cu_seqlens_k=i32([0, 8192]), max_seqlen_q=1,
                       max_seqlen_k=8192, causal=True)))
    # a KV cache in batch form with seqused_k (the padded layout), b1 8192 keys: its own pages
    cases.append(("split padded b1 sk8192", "flash_attn_varlen_func",
                  (r(1, 32, 128), r(1, 8192, 8, 128), r(1, 8192, 8, 128)),
                  dict(cu_seqlens_q=i32([0, 1]), max_seqlen_q=1, max_seqlen_k=8192,
                       seqused_k=i32([8000]), causal=True)))
    have.append(feats(**base, num_heads=32, num_heads_kv=8, causal=True, return_lse=False,
                      batch=1, seqlen_q=None, total_q=1, max_seqlen_q=1, cu_seqlens_q=True,
                      seqused_k=True))  # (a baseline without the padded split runs it unsplit)
    # speculative decoding over a dense K (4 query rows): split with the K as its own pages
    cases.append(("split dense b1 sk8192 sq4", "flash_attn_func",
                  (r(1, 4, 32, 128), r(1, 8192, 8, 128), r(1, 8192, 8, 128)),
                  dict(causal=True)))
    have += [split_v("sm90", "bfloat16", 128, 128, p) for p in (None, 128)]
    return cases, have


def setup(pkg_name: str):
    """Import `pkg_name` (fa4aot or fa4aot_base), point its runtime at the stand-in store."""
    pkg = importlib.import_module(pkg_name)
    for m in ("model.compile_keys", "runtime", "policy.split", "variants", "split"):
        try:  # the modules of either layout (flat, or one folder per stage)
            importlib.import_module(f"{pkg_name}.{m}")
        except ModuleNotFoundError:
            pass
    R = pkg.runtime
    cases, have = _calls(pkg)
    ids = {v.id for v in have}
    Runtime = R.Runtime

    def find(self, variant, num_sms):
        return _Art(variant.id) if variant.id in ids else None

    def load(self, art, *names):
        return [None if n == "tile_cumsum" else _noop for n in names]  # batch <= 256: none

    Runtime.find = find
    Runtime._load = load
    Runtime.available = lambda self, arch, num_sms: list(have)
    sm = lambda device: ("sm90", 132)  # noqa: E731
    for mod in [R, *(sys.modules[n] for n in list(sys.modules) if n.startswith(R.__name__ + "."))]:
        if hasattr(mod, "_arch_of"):
            mod._arch_of = sm
    rt = R.reset(roots=["/nonexistent"], on_miss="error")
    rt._devices[0] = ("sm90", 132)
    fns = {}
    for name, entry, args, kw in cases:
        f = getattr(R, entry)
        fns[name] = (lambda f=f, args=args, kw=kw: f(*args, **kw))
    return fns, rt


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def count_ops(fn) -> list[str]:
    with _Count() as c:
        fn()
    return c.ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", help="directory holding fa4aot_base (an older fa4aot)")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fa4aot
    # CPU tensors stand in for device 0 (the split path needs a CUDA device index)
    torch.Tensor.get_device = lambda self: 0
    sides = {"new": setup("fa4aot")}
    print(f"new: {sys.modules['fa4aot'].__file__}")
    if a.baseline:
        sys.path.insert(0, a.baseline)
        sides["old"] = setup("fa4aot_base")
        print(f"old: {sys.modules['fa4aot_base'].__file__}")
    names = list(sides["new"][0])
    for side, (fns, rt) in sides.items():
        for name, fn in fns.items():
            for _ in range(50):
                fn()
    split_taken = {side: bool(rt._split_runs) for side, (_, rt) in sides.items()}
    per = {(s, n): [] for s in sides for n in names}
    order = list(sides.items())
    for i in range(a.repeats):
        for name in names:
            for side, (fns, _) in order if i % 2 else order[::-1]:  # neither side always first
                fn = fns[name]
                t = time.perf_counter()
                for _ in range(a.n):
                    fn()
                per[(side, name)].append((time.perf_counter() - t) / a.n * 1e6)
    rows = []
    for name in names:
        row = {"case": name}
        for side, (fns, _) in sides.items():
            ops = count_ops(fns[name])
            row[side] = {"us": round(statistics.median(per[(side, name)]), 2),
                         "min_us": round(min(per[(side, name)]), 2),
                         "aten_ops": len(ops), "ops": ops}
        rows.append(row)
    hdr = f"{'case':30s}" + "".join(
        f" {s + ' us':>8s} {s + ' ops':>8s}" for s in sides
    ) + ("   new/old" if "old" in sides else "")
    print(hdr)
    for row in rows:
        line = f"{row['case']:30s}" + "".join(
            f" {row[s]['us']:8.2f} {row[s]['aten_ops']:8d}" for s in sides
        )
        if "old" in sides:
            line += f"   {row['new']['us'] / row['old']['us']:7.2f}"
        print(line)
    print(f"split path taken: {split_taken}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
