"""Blackwell (sm100 B200/GB200, sm103 B300/GB300) checks that need the GPU (marker `gpu`).
Skipped unless device 0 has compute capability 10.0 or 10.3. Run on such a machine:

    python -m pytest -q -m gpu tests/test_gpu_blackwell.py

1. Which cubins load: the tiny spec cross-compiled for sm100 (sm_100a) and sm103 (sm_103a),
   each cubin handed to the driver (cuModuleLoadData). Expected, from the CUDA Programming
   Guide's arch-specific ("a") target rule: only the device's own target loads; the other one
   fails with CUDA_ERROR_NO_BINARY_FOR_GPU (209).
2. Ratio padding for absorbed MLA: FA4's own MLA kernel (JIT) at ratio 32 on a 20-head call
   padded with zero heads, O and LSE cropped, against the fp32 reference of the unpadded call.
3. The fa4aot runtime serving absorbed MLA (`fa4aot.flash_attn_varlen_func(..., qv=)`) from a
   store built here for this GPU (a two-layer MLA spec: 20 query heads, padded to 32 as FA4's
   2CTA kernel needs, and 16, exact): varlen and paged, decode and prefill, LSE or not, into
   NaN-poisoned buffers, against the fp32 reference (tests/reference.mla_ref). On the CPU the
   same path runs with stand-in kernels (tests/runtime/test_mla_runtime.py) and its kernel calls equal
   FA4's (tests/runtime/test_runtime_sm100.py); this is the check that the kernels compute it.
4. FP8 through the runtime with descales, from a store built here: exact, ratio padding (3 ->
   4) and the decode fold (6 query heads as rows of the 1:1 kernel), against the fp32
   reference of the dequantized inputs (on the CPU: tests/runtime/test_plan_sm100.py's FP8 tests).
5. bf16 through the runtime from a store built here (8:2 hd128, causal, dense / varlen /
   paged, decode and prefill, LSE, batches up to 300): the exact kernels (ragged lengths with
   0- and 1-key sequences; batch 300 through FA4's tile-cumsum and blocks-to-batch helpers),
   ratio padding (3 -> 4) and the decode fold (ratio 6), FA4's native split-KV with its
   combine (the heuristic's count, forced counts, a CUDA-graph replay bit-identical to eager),
   into NaN-poisoned buffers, against the fp32 reference and the unsplit kernel (on the CPU:
   tests/runtime/test_plan_sm100.py); and FA4's own entry through fa4aot.install() with explicit
   num_splits 3, 16 and 40, served by the stored 128-split combine.
6. hd256 (16:8, windowed) decode at batch 1 and past 2 x batch x 8 > SMs: the 2CTA and the 1CTA
   persistent kernels FA4 picks, each built here for this SM count, against the fp32 reference.
Written without a Blackwell GPU: nothing here has run yet.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

TINY = (Path(__file__).parent / "specs" / "tiny.toml").read_text().replace(
    'return_lse = "both"', "return_lse = false"
)


def _device_arch() -> str | None:
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return {(10, 0): "sm100", (10, 3): "sm103"}.get((major, minor))


ARCH = _device_arch()
if ARCH is None:
    pytest.skip("needs a B200/GB200 (sm100) or B300/GB300 (sm103) GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    import fa4aot.build.builder as B
    from fa4aot import settings
    from fa4aot.fa4 import cubin
    from fa4aot.model.specs import parse_spec

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = {}
    for arch in ("sm100", "sm103"):
        root = tmp_path_factory.mktemp(arch)
        with settings.scope(stub_compiler=None):
            store, _, results = B.build(
                [parse_spec(TINY, "tiny.toml")], arch=arch, root=root, jobs=2, num_sms=sms
            )
        assert [r.status for r in results] == ["built"], [r.error for r in results]
        (_, art), = list(store.iter_artifacts())
        data = art.part_path("fwd").read_bytes()
        (c,) = cubin.embedded_cubins(data)
        out[arch] = data[c.offset : c.offset + c.size]
    return out


def test_only_the_devices_own_arch_specific_cubin_loads(cubins):
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # a current context for the driver API
    cuda = ctypes.CDLL("libcuda.so.1")
    results = {}
    for arch, image in cubins.items():
        mod = ctypes.c_void_p()
        buf = ctypes.create_string_buffer(image, len(image))
        results[arch] = cuda.cuModuleLoadData(ctypes.byref(mod), buf)
        if results[arch] == 0:
            cuda.cuModuleUnload(mod)
    other = "sm103" if ARCH == "sm100" else "sm100"
    assert results[ARCH] == 0, results
    assert results[other] == 209, results  # CUDA_ERROR_NO_BINARY_FOR_GPU


def test_mla_ratio_padding_against_fa4():
    from flash_attn.cute import flash_attn_varlen_func

    from fa4aot.policy.select import crop_heads, mla_padded_ratio, pad_heads

    torch.manual_seed(0)
    b, sk, ratio = 3, 1000, 20
    r2, _ = mla_padded_ratio(ratio)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(b, ratio, 64, device=dev, dtype=dt)
    qv = torch.randn(b, ratio, 512, device=dev, dtype=dt)
    k = torch.randn(b * sk, 1, 64, device=dev, dtype=dt)
    v = torch.randn(b * sk, 1, 512, device=dev, dtype=dt)
    cu_q = torch.arange(b + 1, device=dev, dtype=torch.int32)
    cu_k = torch.arange(b + 1, device=dev, dtype=torch.int32) * sk
    o, lse = flash_attn_varlen_func(
        pad_heads(q, ratio, r2), k, v, qv=pad_heads(qv, ratio, r2), cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k, max_seqlen_q=1, max_seqlen_k=sk, causal=True, return_lse=True,
    )
    o, lse = crop_heads(o, ratio, r2), crop_heads(lse, ratio, r2, head_dim=-1)
    scale = 1.0 / math.sqrt(64 + 512)
    kk, vv = k.float().view(b, sk, 64), v.float().view(b, sk, 512)
    s = (torch.einsum("bhd,bkd->bhk", q.float(), kk) + torch.einsum("bhd,bkd->bhk", qv.float(), vv))
    s = s * scale
    o_ref = torch.einsum("bhk,bkd->bhd", torch.softmax(s, -1), vv)
    rel = ((o.float() - o_ref).norm() / o_ref.norm()).item()
    assert rel < 1e-2, rel
    torch.testing.assert_close(lse.float(), torch.logsumexp(s, -1), atol=2e-2, rtol=0)


MLA_SPEC = """
name = "mla-gpu"
model = "test/mla"

[[attention]]
name = "mla20"
num_q_heads = 20
num_kv_heads = 1
head_dim = 64
qv = 512
dtype = "bfloat16"
causal = true

[[attention]]
name = "mla16"
num_q_heads = 16
num_kv_heads = 1
head_dim = 64
qv = 512
dtype = "bfloat16"
causal = true

[serving]
layouts = ["varlen", "paged"]
phases = ["decode", "prefill"]
max_batch = 4
max_context = 4096
page_sizes = [128]
return_lse = "both"
"""


def _built_on_this_gpu(tmp_path_factory, name: str, spec: str):
    """Build `spec` for this GPU (real compiles, its SM count) into a fresh root: -> (root,
    the build plan); every variant must build."""
    import fa4aot.build.builder as B
    from fa4aot import settings
    from fa4aot.model.specs import parse_spec

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    root = tmp_path_factory.mktemp(name)
    with settings.scope(stub_compiler=None):
        _, plan, results = B.build(
            [parse_spec(spec, f"{name}.toml")], arch=ARCH, root=root, jobs=4, num_sms=sms
        )
    assert results and all(r.status == "built" for r in results), [r.error for r in results]
    return root, plan


def _serving(root):
    """A module fixture's body: the default runtime serving `root` only (misses raise), reset
    to the default stores after the module."""
    import fa4aot.runtime as R

    yield R.reset(roots=[root], on_miss="error")
    R.reset()


@pytest.fixture(scope="module")
def mla_runtime(tmp_path_factory):
    root, plan = _built_on_this_gpu(tmp_path_factory, "mla", MLA_SPEC)
    assert {n.variant.qhead_per_kvhead for n in plan.needs} == {16, 32}  # 20 is padded to 32
    yield from _serving(root)


def _mla_inputs(heads, lens_q, lens_k, page, seed):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    ks, vs = [rnd(n, 64) for n in lens_k], [rnd(n, 512) for n in lens_k]
    q, qv = rnd(sum(lens_q), heads, 64), rnd(sum(lens_q), heads, 512)
    kw = dict(cu_seqlens_q=cu(lens_q), max_seqlen_q=max(lens_q))
    if page is None:
        k, v = torch.cat(ks)[:, None], torch.cat(vs)[:, None]
        kw.update(cu_seqlens_k=cu(lens_k), max_seqlen_k=max(lens_k))
    else:
        per = [-(-n // page) for n in lens_k]
        k = torch.zeros(sum(per), page, 1, 64, dtype=torch.bfloat16)
        v = torch.zeros(sum(per), page, 1, 512, dtype=torch.bfloat16)
        table = torch.zeros(len(lens_k), max(per), dtype=torch.int32)
        order = torch.randperm(sum(per), generator=g).tolist()
        for i, n in enumerate(lens_k):
            for j in range(per[i]):
                pg = order.pop()
                table[i, j] = pg
                rows = slice(j * page, min(n, (j + 1) * page))
                k[pg, : rows.stop - rows.start, 0] = ks[i][rows]
                v[pg, : rows.stop - rows.start, 0] = vs[i][rows]
        kw.update(page_table=table, seqused_k=torch.tensor(lens_k, dtype=torch.int32))
    return q, qv, k, v, kw, ks, vs


@pytest.mark.parametrize("heads", [20, 16])
@pytest.mark.parametrize("layout", ["varlen", "paged"])
@pytest.mark.parametrize("lens_q", [[1, 1, 1], [3, 130, 17]])  # decode; prefill, ragged
@pytest.mark.parametrize("lse_wanted", [True, False])
def test_runtime_serves_mla_from_the_store(mla_runtime, heads, layout, lens_q, lse_wanted):
    import fa4aot
    from reference import mla_ref

    lens_k = [n + 300 * (i + 1) for i, n in enumerate(lens_q)]
    q, qv, k, v, kw, ks, vs = _mla_inputs(
        heads, lens_q, lens_k, None if layout == "varlen" else 128, seed=heads + len(lens_q)
    )
    dev = "cuda"
    kw = {n: t.to(dev) if torch.is_tensor(t) else t for n, t in kw.items()}
    out = torch.full((q.shape[0], heads, 512), float("nan"), dtype=torch.bfloat16, device=dev)
    lse = torch.full((q.shape[0], heads), float("nan"), device=dev) if lse_wanted else None
    o, l_ = fa4aot.flash_attn_varlen_func(
        q.to(dev), k.to(dev), v.to(dev), qv=qv.to(dev), causal=True, out=out, lse=lse, **kw
    )
    torch.cuda.synchronize()
    ro, rl = mla_ref(q, qv, ks, vs, kw["cu_seqlens_q"].tolist(), causal=True)
    assert o is out and not o.isnan().any()
    rel = ((o.float().cpu() - ro).norm() / ro.norm()).item()
    assert rel < 1e-2, rel
    if lse_wanted:
        assert l_ is lse
        torch.testing.assert_close(l_.cpu(), rl, atol=2e-2, rtol=0)
    plans = [p for p in mla_runtime._plans.values() if p.variant.mla]
    assert any((p.pad is not None) == (heads == 20) for p in plans)


FP8_SPEC = """
name = "fp8-gpu"
model = "test/fp8"

[[attention]]
name = "full"
num_q_heads = 8
num_kv_heads = 2
head_dim = 128
dtype = "float8_e4m3fn"
causal = true

[serving]
layouts = ["dense"]
phases = ["decode", "prefill"]
max_batch = 4
max_context = 4096
return_lse = true
decode_fold = true
split_kv = false
"""


@pytest.fixture(scope="module")
def fp8_runtime(tmp_path_factory):
    root, _ = _built_on_this_gpu(tmp_path_factory, "fp8", FP8_SPEC)
    yield from _serving(root)


@pytest.mark.parametrize(
    "hq, sq, plan",
    [(8, 300, "exact"), (6, 300, "pad"), (8, 1, "exact"), (12, 1, "fold")],
)
def test_fp8_exact_padded_and_folded_against_the_dequantized_reference(fp8_runtime, hq, sq, plan):
    """FP8 with (q, k, v) descales per (batch, KV head): the ratio-4 kernels exact, ratio 3
    padded to 4, ratio 6 decode folded onto the 1:1 kernel; O bfloat16 into a NaN-poisoned
    buffer, LSE, against the fp32 reference of the dequantized inputs."""
    import fa4aot
    from reference import attention_ref

    torch.manual_seed(hq * 1000 + sq)
    b, sk, hk, d, dev = 2, 700, 2, 128, "cuda"
    q = torch.randn(b, sq, hq, d, device=dev).to(torch.float8_e4m3fn)
    k = torch.randn(b, sk, hk, d, device=dev).to(torch.float8_e4m3fn)
    v = torch.randn(b, sk, hk, d, device=dev).to(torch.float8_e4m3fn)
    ds = {n: torch.rand(b, hk, device=dev) + 0.5 for n in ("q_descale", "k_descale", "v_descale")}
    out = torch.full((b, sq, hq, d), float("nan"), dtype=torch.bfloat16, device=dev)
    o, lse = fa4aot.flash_attn_func(q, k, v, causal=True, return_lse=True, out=out, **ds)
    torch.cuda.synchronize()

    def deq(x, s, rep):
        return x.float() * s.repeat_interleave(rep, 1)[:, None, :, None]

    r = hq // hk
    ro, rl = attention_ref(
        deq(q, ds["q_descale"], r), deq(k, ds["k_descale"], 1), deq(v, ds["v_descale"], 1),
        torch.full((b,), sq, device=dev), torch.full((b,), sk, device=dev), causal=True,
    )  # fmt: skip
    assert o is out and not o.isnan().any()
    rel = ((o.float() - ro).norm() / ro.norm()).item()
    assert rel < 3e-2, rel  # FP8 P@V
    torch.testing.assert_close(lse, rl, atol=5e-2, rtol=0)
    pads = {p.pad.fold > 1 if p.pad else None for p in fp8_runtime._plans.values()}
    assert {"exact": None, "pad": False, "fold": True}[plan] in pads


BF16_SPEC = """
name = "bf16-gpu"
model = "test/bf16"

[[attention]]
name = "full"
num_q_heads = 8
num_kv_heads = 2
head_dim = 128
dtype = "bfloat16"
causal = true

[serving]
layouts = ["dense", "varlen", "paged"]
phases = ["decode", "prefill"]
max_batch = 300
max_context = 8192
page_sizes = [128]
return_lse = true
decode_fold = true
split_kv = true
"""


@pytest.fixture(scope="module")
def bf16_runtime(tmp_path_factory):
    root, _ = _built_on_this_gpu(tmp_path_factory, "bf16", BF16_SPEC)
    yield from _serving(root)


def _kv_layout(lk, hk, d, layout, page=128):
    """K/V for per-sequence lengths `lk`: (k, v, kwargs for the varlen entry, zero-padded
    (b, max, hk, d) copies for the reference). varlen: packed with cu_seqlens_k; paged: pages
    of `page` keys in a shuffled pool, with seqused_k."""
    dev, dt = "cuda", torch.bfloat16
    b, top = len(lk), max(max(lk), 1)
    kp = torch.zeros(b, top, hk, d, device=dev, dtype=dt)
    vp = torch.zeros_like(kp)
    for i, n in enumerate(lk):
        kp[i, :n] = torch.randn(n, hk, d, device=dev, dtype=dt)
        vp[i, :n] = torch.randn(n, hk, d, device=dev, dtype=dt)
    if layout == "varlen":
        cu = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], device=dev,
                          dtype=torch.int32)
        k = torch.cat([kp[i, :n] for i, n in enumerate(lk)])
        v = torch.cat([vp[i, :n] for i, n in enumerate(lk)])
        return k, v, dict(cu_seqlens_k=cu, max_seqlen_k=top), kp, vp
    per = [max(1, -(-n // page)) for n in lk]
    pool = sum(per) + 1
    k = torch.zeros(pool, page, hk, d, device=dev, dtype=dt)
    v = torch.zeros_like(k)
    order = torch.randperm(pool).tolist()
    table = torch.zeros(b, max(per), device=dev, dtype=torch.int32)
    for i, n in enumerate(lk):
        for j in range(per[i]):
            pg = order.pop()
            table[i, j] = pg
            lo, hi = j * page, min(n, (j + 1) * page)
            if hi > lo:
                k[pg, : hi - lo], v[pg, : hi - lo] = kp[i, lo:hi], vp[i, lo:hi]
    used = torch.tensor(lk, device=dev, dtype=torch.int32)
    return k, v, dict(page_table=table, seqused_k=used, max_seqlen_k=top), kp, vp


def _check(o, lse, ro, rl):
    from reference import rel_err

    assert not o.isnan().any()
    assert rel_err(o, ro) < 1e-2, rel_err(o, ro)
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), fin)
    torch.testing.assert_close(lse[fin], rl[fin], atol=1e-3, rtol=0)


@pytest.mark.parametrize("layout", ["dense", "varlen", "paged"])
@pytest.mark.parametrize("sq", [1, 200])
@pytest.mark.parametrize("b", [3, 300])
def test_bf16_exact_from_the_store(bf16_runtime, layout, sq, b):
    """The exact kernels (the plan neither pads nor folds), split off: dense at equal lengths,
    varlen and paged with ragged ones (0 and 1 keys among them); batch 300 with a packed q
    runs FA4's batch > 256 helpers first."""
    import fa4aot
    from reference import attention_ref

    if b == 300 and (sq > 1 or layout == "dense"):
        pytest.skip("batch 300: the packed-q decode step (the helpers' case) only")
    bf16_runtime.split = 0
    bf16_runtime._plans.clear()
    hq, hk, d, dev = 8, 2, 128, "cuda"
    if layout == "dense":
        lk = [700] * b
        q = torch.randn(b, sq, hq, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, 700, hk, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kp, vp = k, v
        out = torch.full((b, sq, hq, d), float("nan"), device=dev, dtype=torch.bfloat16)
        lse = torch.full((b, hq, sq), float("nan"), device=dev)
        o, lse = fa4aot.flash_attn_func(q, k, v, causal=True, out=out, lse=lse)
    else:
        lk = [0, 1, *torch.randint(sq, 1500, (b - 2,)).tolist()]
        k, v, kw, kp, vp = _kv_layout(lk, hk, d, layout)
        q = torch.randn(b, sq, hq, d, device=dev, dtype=torch.bfloat16)
        cu_q = torch.arange(0, (b + 1) * sq, sq, device=dev, dtype=torch.int32)
        out = torch.full((b * sq, hq, d), float("nan"), device=dev, dtype=torch.bfloat16)
        lse = torch.full((hq, b * sq), float("nan"), device=dev)
        o, lse = fa4aot.flash_attn_varlen_func(
            q.view(b * sq, hq, d), k, v, cu_seqlens_q=cu_q, max_seqlen_q=sq, causal=True,
            out=out, lse=lse, **kw,
        )
        o = o.view(b, sq, hq, d)
        lse = lse.view(hq, b, sq).transpose(0, 1)
    torch.cuda.synchronize()
    ro, rl = attention_ref(q, kp, vp, torch.full((b,), sq, device=dev),
                           torch.tensor(lk, device=dev), causal=True)
    _check(o, lse, ro, rl)
    assert all(p.pad is None for p in bf16_runtime._plans.values() if p)
    bf16_runtime.split = -1


@pytest.mark.parametrize("hq, sq, want", [(6, 200, "pad"), (12, 1, "fold")])
def test_bf16_padded_and_folded(bf16_runtime, hq, sq, want):
    """Ratio 3 padded to the cached ratio-4 kernel; a ratio-6 decode step folded onto the 1:1
    kernel (6 query rows per KV head); O and LSE against the fp32 reference."""
    import fa4aot
    from reference import attention_ref

    bf16_runtime.split = 0
    b, hk, d, sk, dev = 2, 2, 128, 900, "cuda"
    q = torch.randn(b, sq, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(b, sk, hk, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = torch.full((b, sq, hq, d), float("nan"), device=dev, dtype=torch.bfloat16)
    lse = torch.full((b, hq, sq), float("nan"), device=dev)
    bf16_runtime._plans.clear()
    o, lse = fa4aot.flash_attn_func(q, k, v, causal=True, out=out, lse=lse)
    torch.cuda.synchronize()
    ro, rl = attention_ref(q, k, v, torch.full((b,), sq, device=dev),
                           torch.full((b,), sk, device=dev), causal=True)
    _check(o, lse, ro, rl)
    pads = {p.pad.fold > 1 if p.pad else None for p in bf16_runtime._plans.values() if p}
    assert {"pad": False, "fold": True}[want] in pads
    bf16_runtime.split = -1


def _splits(rt) -> set[int]:
    """The native split counts the runtime's plans decided so far."""
    return {got[0] for p in rt._plans.values() if p for got in getattr(p, "native", {}).values()}


@pytest.mark.parametrize("layout", ["dense", "paged"])
@pytest.mark.parametrize("setting", [-1, 3, 16])
def test_bf16_native_split_with_its_combine(bf16_runtime, layout, setting):
    """A long decode step over FA4's native split kernels and the stored combine: the
    heuristic's count (-1) must split; forced counts split where the store holds their kernel
    (the envelope's), and any count gives the fp32 reference's values and the unsplit kernel's
    to split precision; a CUDA-graph replay equals the eager call bit for bit."""
    import fa4aot
    from reference import attention_ref, rel_err

    hq, hk, d, b, dev = 8, 2, 128, 1, "cuda"
    lk = [8000]
    q = torch.randn(b, 1, hq, d, device=dev, dtype=torch.bfloat16)
    if layout == "dense":
        k = torch.randn(b, 8000, hk, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kp, vp = k, v

        def call(out, lse):
            return fa4aot.flash_attn_func(q, k, v, causal=True, out=out, lse=lse)
    else:
        k, v, kw, kp, vp = _kv_layout(lk, hk, d, "paged")
        cu_q = torch.arange(b + 1, device=dev, dtype=torch.int32)

        def call(out, lse):  # (the packed q's LSE is (hq, b); returned as (b, hq, 1))
            o, l_ = fa4aot.flash_attn_varlen_func(
                q.view(b, hq, d), k, v, cu_seqlens_q=cu_q, max_seqlen_q=1, causal=True,
                out=out.view(b, hq, d), lse=lse, **kw)
            return o.view(b, 1, hq, d), l_.t().reshape(b, hq, 1)

    def fresh():
        lse_shape = (b, hq, 1) if layout == "dense" else (hq, b)
        return (torch.full((b, 1, hq, d), float("nan"), device=dev, dtype=torch.bfloat16),
                torch.full(lse_shape, float("nan"), device=dev))

    rt = bf16_runtime
    rt._plans.clear()
    rt.split = setting
    o1, l1 = call(*fresh())
    torch.cuda.synchronize()
    split = max(_splits(rt), default=1)
    if setting == -1:
        assert split > 1, "the heuristic's count did not split (no split kernel cached?)"
    rt.split = 0
    o0, l0 = call(*fresh())
    rt.split = setting
    ro, rl = attention_ref(q, kp, vp, torch.ones(b, device=dev, dtype=torch.long),
                           torch.tensor(lk, device=dev), causal=True)
    _check(o1, l1, ro, rl)
    assert rel_err(o1, ro) <= 1.5 * rel_err(o0, ro) + 2e-4
    if split > 1:  # a captured graph replays the split (fresh scratch from its pool)
        bufs = fresh()
        call(*bufs)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            call(*bufs)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        gb = fresh()
        with torch.cuda.graph(g):
            call(*gb)
        g.replay()
        torch.cuda.synchronize()
        go, gl = gb if layout == "dense" else (gb[0], gb[1].t().reshape(b, hq, 1))
        assert torch.equal(go, o1) and torch.equal(gl, l1)
    rt.split = -1


def test_install_serves_fa4s_num_splits_from_the_stored_combine(bf16_runtime):
    """FA4's own entry point through fa4aot.install() with explicit num_splits (3, 16, 40):
    FA4 keys its combine by the split count and head count, and the store holds the 128-split
    combine, which serves every count (dropin._Installed.combine_for; checked on the CPU in
    tests/build/test_sm100_build.py): nothing compiles, nothing misses, and each output is the fp32
    reference's and FA4's unsplit output's to split precision. Needs flash_attn.cute."""
    import fa4aot
    from flash_attn.cute import flash_attn_func
    from reference import attention_ref, rel_err

    root = bf16_runtime.roots[0]  # the store the module built on this GPU
    hq, hk, d, b, sk, dev = 8, 2, 128, 1, 8000, "cuda"
    q = torch.randn(b, 1, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(b, sk, hk, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ro, _ = attention_ref(q, k, v, torch.ones(b, device=dev, dtype=torch.long),
                          torch.full((b,), sk, device=dev), causal=True)
    counters = fa4aot.install(cache=root, on_miss="error")
    try:
        # (the module's store holds LSE kernels only: BF16_SPEC's return_lse = true)
        o1 = flash_attn_func(q, k, v, causal=True, num_splits=1, return_lse=True)[0]
        for n in (3, 16, 40):
            o = flash_attn_func(q, k, v, causal=True, num_splits=n, return_lse=True)[0]
            torch.cuda.synchronize()
            assert not o.isnan().any()
            assert rel_err(o, ro) <= 1.5 * rel_err(o1, ro) + 2e-4, n
    finally:
        fa4aot.uninstall()
    assert counters.compiles == 0 and not counters.misses, counters.misses


HD256_SPEC = """
name = "hd256-gpu"
model = "test/hd256"

[[attention]]
name = "sliding"
num_q_heads = 16
num_kv_heads = 8
head_dim = 256
dtype = "bfloat16"
causal = true
window = 512

[serving]
layouts = ["dense", "paged"]
phases = ["decode"]
max_batch = 64
max_context = 4096
page_sizes = [128]
"""


@pytest.fixture(scope="module")
def hd256_runtime(tmp_path_factory):
    root, plan = _built_on_this_gpu(tmp_path_factory, "hd256", HD256_SPEC)
    assert {n.variant.two_cta for n in plan.needs if not n.variant.split_kv} == {True, False}
    yield from _serving(root)


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_hd256_decode_runs_the_kernel_fa4_picks_for_its_batch(hd256_runtime, layout):
    """hd256 on Blackwell: a decode step whose 2 x batch x 8 KV heads fit the SMs runs FA4's
    2CTA kernel, a larger batch the 1CTA persistent one (Variant.two_cta, variants.features:
    FA4's own choice); each built here for this GPU's SM count, each against the fp32
    reference into NaN-poisoned buffers (windowed, 600 keys)."""
    import fa4aot
    from reference import attention_ref

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    hq, hk, d, sk, dev = 16, 8, 256, 600, "cuda"
    rt = hd256_runtime
    rt.split = 0
    kinds = set()
    for b in (1, min(64, sms // (2 * hk) + 1)):
        q = torch.randn(b, 1, hq, d, device=dev, dtype=torch.bfloat16)
        lk = [sk] * b
        rt._plans.clear()
        if layout == "dense":
            k = torch.randn(b, sk, hk, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            kp, vp = k, v
            out = torch.full((b, 1, hq, d), float("nan"), device=dev, dtype=torch.bfloat16)
            o = fa4aot.flash_attn_func(q, k, v, causal=True, window_size=(512, 0), out=out)[0]
        else:
            k, v, kw, kp, vp = _kv_layout(lk, hk, d, "paged")
            cu_q = torch.arange(b + 1, device=dev, dtype=torch.int32)
            out = torch.full((b, hq, d), float("nan"), device=dev, dtype=torch.bfloat16)
            o = fa4aot.flash_attn_varlen_func(
                q.view(b, hq, d), k, v, cu_seqlens_q=cu_q, max_seqlen_q=1, causal=True,
                window_size=(512, 0), out=out, **kw)[0].view(b, 1, hq, d)
        torch.cuda.synchronize()
        ro, _ = attention_ref(q, kp, vp, torch.ones(b, device=dev, dtype=torch.long),
                              torch.tensor(lk, device=dev), causal=True, window_left=512)
        from reference import rel_err

        assert not o.isnan().any() and rel_err(o, ro) < 1e-2, (b, rel_err(o, ro))
        kinds |= {p.variant.two_cta for p in rt._plans.values() if p}
    assert kinds == {True, False}, kinds
    rt.split = -1
