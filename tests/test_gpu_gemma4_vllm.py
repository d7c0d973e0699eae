"""Gemma-4's full-attention layers on sm90 (hd512, 32:4 and TP8's 4:1; bf16 KV at pages 64 (TMA)
and 16 (the copy's cp.async path), FP8-KV dequant at page 64; paged decode and prefill, varlen
and dense prefill) through fa4aot's compiler-free runtime, from a store built from vLLM's FA4
copy (marker `gpu`):

    fa4aot build --fa4 vllm --arch sm90 --spec gemma-4        (CPU: the engine's image)
    FA4AOT_CACHE_DIR=<store> pytest -m gpu tests/test_gpu_gemma4_vllm.py

Each case draws fresh random inputs (vLLM's cache views, a shuffled page table), hands the
runtime an output buffer full of NaN, and checks that none survives and that the output is
within TOL of an fp32 reference (FP8: against the dequantized K/V). Where vLLM's copy imports
(an installed vllm, or FA4AOT_ENGINE_SRC=<dir holding vllm/>, with cutlass), the same call
through the copy's JIT must give a bit-identical output, at the split count the runtime chose
(`gemma4_cases.runtime_splits`: 1 where it ran the step unsplit).

Long-context decode (`gemma4_cases.LONG_CASES`: b1 at 64K keys, b4 at 32K, bf16 pages 64 and 16,
FP8-KV page 64, TP8's 4:1) must take the split path (the copy's split forward and combine,
built beside the decode kernels: runtime/vllm_abi.SplitKv): against fp32 as above, bit-identical
to the copy's JIT at the same num_splits, chosen by the cost model or pinned
(FA4AOT_SPLIT_KV=N: a count in each combine bucket, 32/64/128), and replayed from a CUDA graph
at new lengths (no host sync: the count depends on max_seqlen_k only).
"""

from __future__ import annotations

import zlib

import pytest

torch = pytest.importorskip("torch")

from reference import attention_ref, rel_err  # noqa: E402
import gemma4_cases as G  # noqa: E402

pytestmark = pytest.mark.gpu
TOL = 1e-2  # bf16 vs fp32: ~3e-3 expected at hd512; FP8 vs its dequantized K/V the same order
SEEDS = (0, 1)


@pytest.fixture(scope="module", autouse=True)
def _vllm_store():
    """Serve from the stores built from vLLM's copy (FA4AOT_KERNEL_SOURCE=vllm: an image with
    flash-attn-4 installed would pick upstream's otherwise); skip without one."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    from fa4aot import settings
    from fa4aot.errors import FingerprintMismatch
    from fa4aot.runtime import reset

    with settings.scope(kernel_source="vllm"):
        rt = reset()
        arch, sms = rt.device(torch.cuda.current_device())
        try:
            stores = rt.stores_for(arch, sms)
        except FingerprintMismatch as e:
            pytest.skip(f"no store built from vLLM's copy for this GPU: {e}")
        if not stores:
            pytest.skip("no store built from vLLM's copy: build with "
                        "`fa4aot build --fa4 vllm --arch sm90 --spec gemma-4`")
        yield
    reset()


ALL = G.CASES + G.LONG_CASES
LONG = {c.name for c in G.LONG_CASES}


def _fresh(**values):
    """A fresh default runtime (its split counts empty) under `values` (fa4aot settings)."""
    from fa4aot import settings
    from fa4aot.runtime import reset

    with settings.scope(**values):
        reset()


def _check(case, inp, got, out):
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(got).any(), f"{case.name}: NaN survives in the output"
    err = rel_err(got, G.reference(inp, attention_ref))
    assert err < TOL, f"{case.name}: rel err {err:.2e}"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", ALL, ids=lambda c: c.name)
def test_against_fp32(case, seed):
    _fresh()
    gen = torch.Generator().manual_seed(1000 * seed + zlib.crc32(case.name.encode()) % 997)
    inp = G.make(case, gen)
    out = torch.full_like(inp["q"], float("nan"))
    _check(case, inp, G.fa4aot_call(inp, out=out), out)
    if case.name in LONG:
        assert G.runtime_splits() > 1, f"{case.name} ran unsplit: the split twin not served?"


@pytest.mark.parametrize("case", ALL, ids=lambda c: c.name)
def test_bit_identical_to_vllms_copy(case):
    if G.vllm_copy() is None:
        pytest.skip(G.copy_skip_reason())
    _fresh()
    inp = G.make(case, torch.Generator().manual_seed(7))
    ours = G.fa4aot_call(inp, out=torch.full_like(inp["q"], float("nan")))
    n = G.runtime_splits()
    theirs = G.copy_call(inp, out=torch.full_like(inp["q"], float("nan")), num_splits=n)
    torch.cuda.synchronize()
    assert torch.equal(ours, theirs), (
        f"{case.name} at num_splits={n}: max |diff| "
        f"{(ours.float() - theirs.float()).abs().max().item():.3e}")


@pytest.mark.parametrize("splits", (24, 64, 128))
@pytest.mark.parametrize("case", G.LONG_CASES, ids=lambda c: c.name)
def test_pinned_split_count_bit_identical_and_exact(case, splits):
    """FA4AOT_SPLIT_KV=N: N splits, one count per combine bucket (32, 64, 128)."""
    _fresh(split_kv=str(splits))
    try:
        inp = G.make(case, torch.Generator().manual_seed(11))
        out = torch.full_like(inp["q"], float("nan"))
        got = G.fa4aot_call(inp, out=out)
        assert G.runtime_splits() == splits
        _check(case, inp, got, out)
        if G.vllm_copy() is not None:
            theirs = G.copy_call(inp, out=torch.full_like(inp["q"], float("nan")),
                                 num_splits=splits)
            torch.cuda.synchronize()
            assert torch.equal(got, theirs), f"{case.name} at num_splits={splits}"
    finally:
        _fresh()


@pytest.mark.parametrize("case", [c for c in G.LONG_CASES if c.batch > 1],
                         ids=lambda c: c.name)
def test_split_step_replays_from_a_cuda_graph_at_new_lengths(case):
    """Captured once with max_seqlen_k fixed (vLLM's full-graph decode), replayed after the
    lengths, the page table and the query change in place: each replay matches fp32."""
    _fresh()
    inp = G.make(case, torch.Generator().manual_seed(3))
    out = torch.full_like(inp["q"], float("nan"))
    inp["lk"] = [case.max_k] * case.batch  # (max_seqlen_k: the bound every replay keeps to)
    G.fa4aot_call(inp, out=out)  # (the plan and its kernels loaded outside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        G.fa4aot_call(inp, out=out)
    assert G.runtime_splits() > 1
    for seed in (4, 5):
        new = G.make(case, torch.Generator().manual_seed(seed))
        for name in ("q", "k", "v", "seqused_k", "page_table", "k_descale", "v_descale"):
            if name in inp:
                inp[name].copy_(new[name])
        inp["lk"] = new["lk"]
        out.fill_(float("nan"))
        graph.replay()
        _check(case, inp, out, out)
