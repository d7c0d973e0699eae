"""fa4aot.install() on the GPU (marker `gpu`; needs flash_attn.cute, i.e. the compiler bundle).

With install(on_miss="error"), FA4's own public functions over the default specs' serving shapes
give outputs bit-identical to FA4's JIT kernels, with zero compiles; a call outside the cache
raises before any compile starts.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    # before importing FA4: an import here would fix FA4's target for the whole pytest process
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("flash_attn.cute")

pytestmark = pytest.mark.gpu


def _calls():
    """(name, fn, args, kwargs) over the default specs: dense/varlen/paged, decode/prefill, b>256."""
    dt = torch.bfloat16
    out = []
    for name, hq, hk, d, window, sinks in [
        ("llama8b", 32, 8, 128, None, False),
        ("mistral", 32, 8, 128, 4096, False),
        ("gpt-oss", 64, 8, 64, 128, True),
        ("gemma4", 32, 16, 256, 1024, False),
    ]:
        kw = dict(causal=True)
        if window:
            kw["window_size"] = (window, 0)
        if sinks:
            kw["learnable_sink"] = torch.randn(hq, device="cuda")
        for b, sq, sk in [(2, 1, 300), (1, 300, 300)]:
            q = torch.randn(b, sq, hq, d, device="cuda", dtype=dt)
            k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dt) for _ in range(2))
            out.append((f"{name} dense b{b} sq{sq}", "flash_attn_func", (q, k, v), dict(kw)))
        for b, sq in [(4, 1), (300, 1), (3, 100)]:
            cu_q = torch.arange(b + 1, device="cuda", dtype=torch.int32) * sq
            q = torch.randn(b * sq, hq, d, device="cuda", dtype=dt)
            sk = 200
            cu_k = torch.arange(b + 1, device="cuda", dtype=torch.int32) * sk
            k, v = (torch.randn(b * sk, hk, d, device="cuda", dtype=dt) for _ in range(2))
            out.append(
                (
                    f"{name} varlen b{b} sq{sq}",
                    "flash_attn_varlen_func",
                    (q, k, v),
                    dict(
                        kw, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=sq, max_seqlen_k=sk
                    ),
                )
            )
            for page in (16, 128):
                npg = -(-sk // page)
                kp, vp = (
                    torch.randn(b * npg, page, hk, d, device="cuda", dtype=dt) for _ in range(2)
                )
                table = torch.randperm(b * npg, device="cuda", dtype=torch.int32).reshape(b, npg)
                used = torch.full((b,), sk, device="cuda", dtype=torch.int32)
                out.append(
                    (
                        f"{name} paged p{page} b{b} sq{sq}",
                        "flash_attn_varlen_func",
                        (q, kp, vp),
                        dict(
                            kw, cu_seqlens_q=cu_q, max_seqlen_q=sq, page_table=table, seqused_k=used
                        ),
                    )
                )
    return out


def test_install_bitwise_equal_to_fa4_jit_zero_compiles():
    import flash_attn.cute as fa

    import fa4aot

    calls = _calls()
    counters = fa4aot.install(on_miss="error")
    try:
        ours = [getattr(fa, fn)(*a, **kw) for _, fn, a, kw in calls]
        torch.cuda.synchronize()
        assert counters.compiles == 0, f"{counters.compiles} compiles after install"
        assert counters.hits > 0 and not counters.misses
    finally:
        assert fa4aot.uninstall()
    theirs = [getattr(fa, fn)(*a, **kw) for _, fn, a, kw in calls]  # FA4 JIT-compiles each
    torch.cuda.synchronize()
    for (name, *_), (o1, l1), (o2, l2) in zip(calls, ours, theirs):
        assert not torch.isnan(o1).any(), name
        assert torch.equal(o1, o2), f"{name}: differs from FA4's JIT kernel"
    print(
        f"{len(calls)} calls bit-identical, {counters.hits} kernels served from the store, 0 compiles"
    )


def test_install_miss_raises_before_compiling():
    import flash_attn.cute as fa

    import fa4aot

    counters = fa4aot.install(on_miss="error")
    try:
        q = torch.randn(
            1, 8, 24, 96, device="cuda", dtype=torch.bfloat16
        )  # hd96, ratio 3: not built
        k = torch.randn(1, 8, 8, 96, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(fa4aot.ArtifactMissing):
            fa.flash_attn_func(q, k, k, causal=True)
        assert counters.compiles == 0
    finally:
        fa4aot.uninstall()
