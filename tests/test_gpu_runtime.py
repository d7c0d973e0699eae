"""GPU correctness of every artifact of the default sm90 build (marker `gpu`).

Run on an H200 with a store built by `fa4aot build` in FA4AOT_CACHE_DIR. Every case draws fresh
random inputs, hands the runtime output (and LSE) buffers filled with NaN (`out=`, `lse=`) and
checks that none survives, and compares output and LSE with an fp32 reference per sequence. The last test
checks that every artifact in the store was loaded and exercised by the cases before it.
"""

from __future__ import annotations

import os
import random

import pytest

torch = pytest.importorskip("torch")

from reference import attention_ref, pad_ragged, paged_kv, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu
TOL = 1e-2  # bf16 attention vs fp32: ~2e-3 seen
LSE_TOL = 1e-3

# (spec, layer, hq, hk, hd, window, sinks, lse options) of the default specs (TP1 heads)
LAYERS = [
    ("llama-3.1-8b", "full", 32, 8, 128, None, False, (False, True)),
    ("llama-3.1-70b", "full", 64, 8, 128, None, False, (False,)),
    ("mistral-7b", "sliding", 32, 8, 128, 4096, False, (False,)),
    ("gpt-oss-20b", "full", 64, 8, 64, None, True, (False,)),
    ("gpt-oss-20b", "sliding", 64, 8, 64, 128, True, (False,)),
    ("gemma-4", "sliding", 32, 16, 256, 1024, False, (False,)),
]
TILE_M = {64: 192, 128: 128, 256: 128}
TILE_N = {
    (64, False): 128,
    (64, True): 128,
    (128, False): 128,
    (128, True): 128,
    (256, False): 80,
    (256, True): 64,
}

USED: set[str] = set()


def _fa4aot():
    import fa4aot

    return fa4aot


@pytest.fixture(autouse=True)
def _track():
    yield
    import fa4aot.runtime

    rt = fa4aot.runtime.default_runtime()
    USED.update(rt._modules)


def _check(out, lse, ref_out, ref_lse, lq, want_lse, tag):
    assert not torch.isnan(out).any(), f"{tag}: NaN in output (unwritten rows?)"
    err = rel_err(out, ref_out)
    assert err < TOL, f"{tag}: rel err {err:.3e}"
    if want_lse:
        assert lse is not None
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), fin), f"{tag}: LSE -inf pattern differs"
        if fin.any():
            lerr = (
                (lse[fin] - ref_lse[fin]).abs().max() / ref_lse[fin].abs().max().clamp_min(1)
            ).item()
            assert lerr < LSE_TOL, f"{tag}: LSE err {lerr:.3e}"
    else:
        assert lse is None
    return err


def _poisoned(out_shape, lse_shape, lse):
    """Output (and LSE) buffers filled with NaN, passed to the runtime: any element the kernel
    does not write stays NaN and fails `_check`."""
    bufs = {"out": torch.full(out_shape, float("nan"), device="cuda", dtype=torch.bfloat16)}
    if lse:
        bufs["lse"] = torch.full(lse_shape, float("nan"), device="cuda", dtype=torch.float32)
    return bufs


def _assert_written_in_place(out, olse, kw):
    assert out.data_ptr() == kw["out"].data_ptr()
    if "lse" in kw:
        assert olse.data_ptr() == kw["lse"].data_ptr()


def _heads(hq, hk, tp):
    return hq // tp, max(1, hk // tp)


def run_dense(hq, hk, d, b, sq, sk, window, sinks, lse, keep=None):
    """keep: a list the output is appended to."""
    fa4aot = _fa4aot()
    dt = torch.bfloat16
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dt)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dt)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dt)
    sink = torch.randn(hq, device="cuda") if sinks else None
    kw = dict(causal=True, return_lse=lse, learnable_sink=sink)
    if window is not None:
        kw["window_size"] = (window, 0)
    kw.update(_poisoned((b, sq, hq, d), (b, hq, sq), lse))
    out, olse = fa4aot.flash_attn_func(q, k, v, **kw)
    _assert_written_in_place(out, olse, kw)
    lq = torch.full((b,), sq, device="cuda")
    lk = torch.full((b,), sk, device="cuda")
    ro, rl = attention_ref(q, k, v, lq, lk, causal=True, window_left=window, sink=sink)
    if keep is not None:
        keep.append(out)
    return _check(out, olse, ro.to(dt).float(), rl, lq, lse, f"dense b{b} sq{sq} sk{sk}")


def run_varlen(hq, hk, d, lq, lk, window, sinks, lse, page=None, max_q_hint=True, keep=None):
    """lq, lk: per-sequence lengths (lq[i] <= lk[i]). page: paged KV with that page size.
    keep: a list the output is appended to."""
    fa4aot = _fa4aot()
    dt = torch.bfloat16
    b = len(lq)
    cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), device="cuda", dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d, device="cuda", dtype=dt)
    sink = torch.randn(hq, device="cuda") if sinks else None
    kw = dict(
        cu_seqlens_q=cu_q,
        max_seqlen_q=max(lq) if max_q_hint else None,
        causal=True,
        return_lse=lse,
        learnable_sink=sink,
    )
    if window is not None:
        kw["window_size"] = (window, 0)
    maxk = max(max(lk), 1)
    kp = torch.zeros(b, maxk, hk, d, device="cuda", dtype=dt)
    vp = torch.zeros(b, maxk, hk, d, device="cuda", dtype=dt)
    if page is None:
        cu_k = torch.tensor(
            [0] + list(torch.tensor(lk).cumsum(0)), device="cuda", dtype=torch.int32
        )
        k = torch.randn(int(cu_k[-1]), hk, d, device="cuda", dtype=dt)
        v = torch.randn_like(k)
        for i, n in enumerate(lk):
            kp[i, :n], vp[i, :n] = k[cu_k[i] : cu_k[i] + n], v[cu_k[i] : cu_k[i] + n]
        kw.update(cu_seqlens_k=cu_k, max_seqlen_k=maxk)
    else:
        for i, n in enumerate(lk):
            kp[i, :n], vp[i, :n] = torch.randn_like(kp[i, :n]), torch.randn_like(vp[i, :n])
        k, v, table = paged_kv(kp, vp, lk, page, shuffle=True, spare=3)
        kw.update(
            page_table=table,
            seqused_k=torch.tensor(lk, device="cuda", dtype=torch.int32),
            max_seqlen_k=maxk,
        )
    kw.update(_poisoned((q.shape[0], hq, d), (hq, q.shape[0]), lse))
    out, olse = fa4aot.flash_attn_varlen_func(q, k, v, **kw)
    _assert_written_in_place(out, olse, kw)
    lqt = torch.tensor(lq, device="cuda")
    lkt = torch.tensor(lk, device="cuda")
    qp = pad_ragged(q, cu_q.tolist(), lq, max(lq))
    ro, rl = attention_ref(qp, kp, vp, lqt, lkt, causal=True, window_left=window, sink=sink)
    # back to packed layout
    ref_out = torch.cat([ro[i, :n] for i, n in enumerate(lq)], 0)
    ref_lse = torch.cat([rl[i, :, :n] for i, n in enumerate(lq)], 1) if lse else None
    tag = f"{'paged p' + str(page) if page else 'varlen'} b{b} maxq{max(lq)} maxk{max(lk)}"
    if keep is not None:
        keep.append(out)
    return _check(out, olse, ref_out.to(dt).float(), ref_lse, lq, lse, tag)


def _ragged(b, qmax, kextra, rng, zero=True, ones=True):
    lq = [rng.randint(0 if zero else 1, qmax) for _ in range(b)]
    if ones and b > 1:
        lq[0] = 1
    if zero and b > 2:
        lq[1] = 0
    lk = [n + rng.randint(0 if n else 1, kextra) for n in lq]
    return lq, lk


def _cases(layer):
    spec, name, hq, hk, d, window, sinks, lses = layer
    rng = random.Random(os.getpid())  # a different ragged batch each run
    r = hq // hk
    tm = TILE_M[d] // r
    out = []
    long_k = 6000 if window == 4096 else 2048
    for lse in lses:
        for b, sq, sk in [
            (1, 1, 1),
            (2, 1, 777),
            (2, 2, 300),
            (2, 4, 300),
            (2, tm, tm),
            (2, tm + 1, tm + 1),
            (1, 2048, 2048),
            (3, 16, 1000),
            (1, 1, long_k),
            (1, 256, long_k),
        ]:
            out.append(("dense", (b, sq, sk), lse, None))
        for b in (1, 256, 257, 512):
            # (tm rows a sequence: past the 64-row twin, on FA4's tile: constraints.small_m_tile)
            for sq in (1, 2, 4) if b in (256, 512) else (1, 2, 4, tm):
                lq = [sq] * b
                lk = [rng.randint(sq, 300) for _ in range(b)]
                lk[0] = sq
                out.append(("varlen", (lq, lk), lse, None))
        # decode at batch > 256 with empty sequences (max_seqlen_q 1: the runtime passes
        # cu_seqlens_q as the block cumsum instead of running FA4's helper kernel)
        lq = [rng.randint(0, 1) for _ in range(300)]
        lq[0] = 1
        out.append(("varlen", (lq, [rng.randint(1, 300) for _ in lq]), lse, None))
        for b in (1, 3, 257):
            lq, lk = _ragged(b, 300 if b < 10 else 40, 200, rng)
            lq[-1], lk[-1] = tm + 9, tm + 50  # one sequence past the decode boundary: prefill
            out.append(("varlen", (lq, lk), lse, None))
        out.append(("varlen", ([700, 0, 1, 300], [long_k, 5, 1, 900]), lse, None))
        out.append(("varlen-nohint", ([5, 1, 3], [7, 9, 3]), lse, None))
        for page in sorted({16, 64, 128, TILE_N[(d, window is not None)]}):
            for b in (1, 256, 257, 512):
                for sq in (1, 2, 4) if b in (256, 512) else (1, 2, 4, tm):
                    lk = [rng.randint(sq, 400) for _ in range(b)]
                    out.append(("paged", ([sq] * b, lk), lse, page))
            lq = [rng.randint(0, 1) for _ in range(300)]
            lq[0] = 1
            out.append(("paged", (lq, [rng.randint(1, 400) for _ in lq]), lse, page))
            for b in (3, 257):
                lq, lk = _ragged(b, 200 if b < 10 else 30, 300, rng)
                lq[-1], lk[-1] = tm + 9, tm + 70  # prefill regime
                out.append(("paged", (lq, lk), lse, page))
            out.append(("paged", ([300, 1], [long_k, 77]), lse, page))
    return out


PARAMS = []
for layer in LAYERS:
    for i, case in enumerate(_cases(layer)):
        PARAMS.append(pytest.param(layer, case, id=f"{layer[0]}-{layer[1]}-{case[0]}-{i}"))


@pytest.mark.parametrize("layer,case", PARAMS)
def test_gpu_case(layer, case):
    spec, name, hq, hk, d, window, sinks, _ = layer
    kind, shape, lse, page = case
    torch.manual_seed(random.randrange(1 << 30))
    if kind == "dense":
        run_dense(hq, hk, d, *shape, window, sinks, lse)
    else:
        run_varlen(
            hq, hk, d, *shape, window, sinks, lse, page=page, max_q_hint=kind != "varlen-nohint"
        )


@pytest.mark.parametrize("layer", [x for x in LAYERS if x[4] <= 128],
                         ids=lambda x: f"{x[0]}-{x[1]}")
def test_gpu_small_tile_twin(layer):
    """Calls whose query rows fit a 64-row M tile (constraints.small_m_tile) run unsplit on its
    twin: on fresh inputs, within TOL of the fp32 reference and bit for bit FA4's tile's
    (Runtime.set_small_tile(False)), dense, varlen and paged, 1 row a sequence to the tile's."""
    import fa4aot.runtime as R

    _, _, hq, hk, d, window, sinks, lses = layer
    rows = 64 // (hq // hk)
    runs = [
        lambda keep: run_dense(hq, hk, d, 3, rows, 700, window, sinks, lses[-1], keep),
        lambda keep: run_varlen(hq, hk, d, [1, rows, 0, 2], [300, 900, 5, 2], window, sinks,
                                lses[-1], keep=keep),
        *(lambda keep, p=p: run_varlen(hq, hk, d, [rows, 1, 3], [1000, 1, 77], window, sinks,
                                       lses[-1], page=p, keep=keep) for p in (16, 64, 128)),
    ]
    rt = R.default_runtime()
    seed, tiles, outs = random.randrange(1 << 30), {}, {}
    saved, rt.split = rt.split, 0
    try:
        for on in (True, False):
            rt.set_small_tile(on)
            rt._plans.clear()
            torch.manual_seed(seed)
            outs[on] = []
            for run in runs:
                run(outs[on])
            tiles[on] = {p.variant.tile.m for p in rt._plans.values()}
    finally:
        rt.split = saved
        rt.set_small_tile(True)
    assert tiles[True] == {64} and 64 not in tiles[False], tiles
    for a, b in zip(outs[True], outs[False], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("tp", [2, 8])
def test_gpu_tensor_parallel_heads(tp):
    """Head counts are dynamic: TP-sharded heads use the same artifacts."""
    for spec, name, hq, hk, d, window, sinks, lses in LAYERS:
        hq_, hk_ = _heads(hq, hk, tp)
        if hq_ % hk_:
            continue
        run_dense(hq_, hk_, d, 2, 3, 500, window, sinks, False)
        run_varlen(hq_, hk_, d, [1, 7, 0], [50, 90, 3], window, sinks, False, page=16)


@pytest.mark.parametrize("ratio", [20, 5, 3])
def test_gpu_decode_fold_any_ratio(ratio):
    """Decode steps at head ratios no default spec builds (20:1, 5:1, 3:1 over 8 KV heads) are
    served by the decode-fold kernels of the hd128 layers (llama, qwen), every K layout, with
    and without LSE; one sequence has no keys."""
    import fa4aot.runtime as R

    hk, d = 8, 128
    for lse in (False, True):
        R.default_runtime()._plans.clear()
        run_dense(ratio * hk, hk, d, 3, 1, 700, None, False, lse)
        lk = [1, 300, 0, 129, 1000]
        run_varlen(ratio * hk, hk, d, [1] * len(lk), lk, None, False, lse)
        for page in (16, 64, 128):
            run_varlen(ratio * hk, hk, d, [1] * len(lk), lk, None, False, lse, page=page)
        outer = [p for k, p in R.default_runtime()._plans.items() if k[4] == ratio]
        assert len(outer) == 5 and all(p.pad is not None and p.pad.fold == ratio for p in outer)


@pytest.mark.parametrize("layer", [x for x in LAYERS if x[5] is None], ids=lambda x: f"{x[0]}-{x[1]}")
@pytest.mark.parametrize("page", [None, "varlen", 16, 64, 128])
def test_gpu_split_decode(layer, page):
    """Long-context decode steps with a forced split (FA4AOT_SPLIT_KV=8): the split-KV chunk
    kernels and their combine, for every layer (test_gpu_split.py checks the plan in depth)."""
    import fa4aot.runtime as R

    _, _, hq, hk, d, _, sinks, lses = layer
    rt = R.default_runtime()
    rt.split = 8
    try:
        for lse in lses:
            if page is None:
                run_dense(hq, hk, d, 2, 1, 3000, None, sinks, lse)
            else:
                run_varlen(hq, hk, d, [1, 1, 1], [3000, 1, 1777], None, sinks, lse,
                           page=None if page == "varlen" else page)
    finally:
        rt.split = -1


def test_gpu_every_artifact_exercised():
    """Runs last in this module: every artifact of the default specs was loaded by the cases
    above (the store's per-spec index lists them)."""
    import json

    from fa4aot.model.specs import default_spec_names
    from fa4aot.store.layers import default_roots, stores_at

    ids = set()
    for root in default_roots():
        for s in stores_at(root):
            for name in default_spec_names():
                f = s.spec_index(name)
                if f.exists():
                    ids.update(json.loads(f.read_text())["variants"])
    missing = ids - USED
    assert ids, "the store is empty"
    assert not missing, f"{len(missing)} artifacts never exercised: {sorted(missing)[:5]}"
