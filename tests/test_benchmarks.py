"""CPU checks of the benchmarks (no GPU): helpers that read recorded results, and probe
kernels compiled for sm_90."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_decode_tally_counts_each_cell_over_runs(tmp_path):
    """decode_split.py --tally: per grid cell, the runs at or below cuDNN (a tie counts), eager
    and in a graph, and the eager ratios' median and range; per run, the summary's counts and
    cuDNN's read rate at b16/64K."""
    ds = _module("decode_split")

    def cell(b, sk, ours, cudnn, ours_g, cudnn_g):
        return {"b": b, "sk": sk, "fa4aot": ours, "cudnn": cudnn, "fa4aot_graph": ours_g,
                "cudnn_graph": cudnn_g}

    runs = [
        [dict(cell(16, 65536, 101.0, 100.0, 99.0, 100.0), kv_mb=460.0),
         cell(1, 1024, 9.0, 10.0, 5.0, 5.0)],
        [cell(16, 65536, 99.0, 100.0, 101.0, 100.0), cell(1, 1024, 12.0, 10.0, 6.0, 5.0),
         {"b": 128, "sk": 131072, "skipped": "memory"}],
        [cell(16, 65536, 102.0, 100.0, 102.0, 100.0), cell(1, 1024, 10.0, 10.0, 4.0, 5.0)],
    ]
    paths = []
    for i, grid in enumerate(runs):
        p = tmp_path / f"run{i}.json"
        p.write_text(json.dumps({"grid": grid}))
        paths.append(str(p))
    t = ds.tally(paths)
    assert [(e, g) for _, e, g, _ in t["runs"]] == [(1, 2), (1, 0), (1, 1)]
    # the machine: cuDNN's read rate at b16/64K (MB per us = TB/s), where the run recorded it
    assert [tbs for *_, tbs in t["runs"]] == [4.6, None, None]
    big = t["cells"]["b16/64K"]
    assert (big["runs"], big["eager_at_or_below"], big["graph_at_or_below"]) == (3, 1, 1)
    assert (big["eager_median"], big["eager_min"], big["eager_max"]) == (1.01, 0.99, 1.02)
    small = t["cells"]["b1/1K"]
    assert (small["eager_at_or_below"], small["graph_at_or_below"]) == (2, 2)
    assert "b128/128K" not in t["cells"]  # a skipped cell is not a run of it


def test_hbm_ceiling_stream_kernels_compile_for_sm90_as_described():
    """hbm_ceiling.py --streams: its persistent reads compile for sm_90 (Triton, no GPU) into
    what its docstring says they are: the stream/kv loops software-pipelined through cp.async
    into shared memory (a stream's 16 KB a step, 3 buffers; kv twice that), the tma loop
    through TMA tensor loads, so a GPU run spends no device time on a kernel that fails."""
    import pytest

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    _, stream_kernel, tma_kernel = _module("hbm_ceiling").kernels()
    target = GPUTarget("cuda", 90, 32)
    sig = {"x_ptr": "*i64", "y_ptr": "*i64", "out_ptr": "*fp32", "n": "i64", "per": "i64",
           "BLOCK": "constexpr", "KV": "constexpr"}
    for kv in (False, True):
        k = triton.compile(ASTSource(stream_kernel, sig, {"BLOCK": 2048, "KV": kv}), target=target)
        assert "cp.async" in k.asm["ptx"]
        assert k.metadata.shared >= (2 if kv else 1) * 3 * 2048 * 8
    desc = "tensordesc<bf16[64,128]>"
    sig = {"kd": desc, "vd": desc, "out_ptr": "*fp32", "rows": "i32", "per": "i32",
           "R": "constexpr", "C": "constexpr"}
    k = triton.compile(ASTSource(tma_kernel, sig, {"R": 64, "C": 128}), target=target)
    assert "cp.async.bulk.tensor" in k.asm["ptx"]


def test_triton_decode_probe_step_matches_a_reference_in_the_interpreter():
    """triton_decode_probe.py: its split step (chunks + merge) run by Triton's interpreter on
    the CPU (which needs numpy, a test dependency) equals an fp32 reference, as launched,
    chunks first, through TMA descriptors, and all KV heads in one program (fp16: the
    interpreter's bf16 dot is wrong; the kernels are generic in the dtype), with ragged chunks
    (200 keys in 64-key blocks, 3 chunks asked, 2 made) and a NaN-poisoned output."""
    import subprocess
    import sys

    import pytest

    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    code = (
        "import sys, torch; sys.path.insert(0, 'benchmarks'); import triton_decode_probe as P\n"
        "torch.manual_seed(0)\n"
        "q = torch.randn(2, 1, 32, 128, dtype=torch.float16)\n"
        "k = torch.randn(2, 200, 8, 128, dtype=torch.float16); v = torch.randn_like(k)\n"
        "ref = P.reference(q, k, v)\n"
        "for kw in ({}, {'hfirst': False}, {'tma': True}, {'all_heads': True}):\n"
        "    o = torch.full_like(q, float('nan'))\n"
        "    P.make_step(q, k, v, o, 32 if kw.get('all_heads') else 64, 2, 3, **kw)()\n"
        "    print(((o.float() - ref).norm() / ref.norm()).item())\n"
    )
    env = dict(__import__("os").environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    errs = [float(x) for x in r.stdout.split()]
    assert len(errs) == 4 and max(errs) < 2e-3  # fp16 inputs, fp32 accumulation


def test_triton_decode_probe_kernels_compile_for_sm90():
    """triton_decode_probe.py's chunk kernels compile for sm_90 in bf16 with the K/V loads
    pipelined through cp.async (or TMA) and the dots on mma.sync."""
    import pytest

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    chunk_kernel, _, all_heads_kernel = _module("triton_decode_probe").kernels()
    sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Op": "*fp32", "Lp": "*fp32", "sk": "i32",
           "chunk": "i32", "scale_log2": "fp32"}
    const = {"HQ": 32, "HK": 8, "G": 4, "GP": 16, "D": 128, "BLOCK_N": 64, "STAGES": 3,
             "TMA": False, "HFIRST": True}
    sig.update({c: "constexpr" for c in const})
    # the pointers 16-byte aligned and the lengths multiples of 16, as Triton's JIT specializes
    # them on the GPU (without that it loads 2 bytes at a time and does not pipeline)
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(7)}
    k = triton.compile(ASTSource(chunk_kernel, sig, const, attrs),
                       target=GPUTarget("cuda", 90, 32))
    assert "cp.async.cg.shared.global" in k.asm["ptx"] and "mma.sync" in k.asm["ptx"]
    # :tma, K and V through TMA descriptors of [64, 1, 128] boxes
    sig.update(K="tensordesc<bf16[64,1,128]>", V="tensordesc<bf16[64,1,128]>")
    const["TMA"] = True
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 3, 4, 5, 6)}
    k = triton.compile(ASTSource(chunk_kernel, sig, const, attrs),
                       target=GPUTarget("cuda", 90, 32))
    assert "cp.async.bulk.tensor.3d" in k.asm["ptx"] and "mma.sync" in k.asm["ptx"]
    # :all, every KV head in one program (8 warps), the heads a batch of the dots
    sig.update(K="*bf16", V="*bf16")
    del sig["TMA"], sig["HFIRST"], const["TMA"], const["HFIRST"]
    const["BLOCK_N"] = 16
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(7)}
    k = triton.compile(ASTSource(all_heads_kernel, sig, const, attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    assert "cp.async.cg.shared.global" in k.asm["ptx"] and "mma.sync" in k.asm["ptx"]
