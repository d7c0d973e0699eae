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
   same path runs with stand-in kernels (tests/test_mla_runtime.py) and its kernel calls equal
   FA4's (tests/test_runtime_sm100.py); this is the check that the kernels compute it.
4. FP8 through the runtime with descales, from a store built here: exact, ratio padding (3 ->
   4) and the decode fold (6 query heads as rows of the 1:1 kernel), against the fp32
   reference of the dequantized inputs (on the CPU: tests/test_plan_sm100.py's FP8 tests).
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
    import fa4aot.build as B
    from fa4aot import cubin, settings
    from fa4aot.specs import parse_spec

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

    from fa4aot.select import crop_heads, mla_padded_ratio, pad_heads

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
    import fa4aot.build as B
    from fa4aot import settings
    from fa4aot.specs import parse_spec

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    root = tmp_path_factory.mktemp(name)
    with settings.scope(stub_compiler=None):
        _, plan, results = B.build(
            [parse_spec(spec, f"{name}.toml")], arch=ARCH, root=root, jobs=4, num_sms=sms
        )
    assert results and all(r.status == "built" for r in results), [r.error for r in results]
    return root, plan


@pytest.fixture(scope="module")
def mla_runtime(tmp_path_factory):
    import fa4aot.runtime as R

    root, plan = _built_on_this_gpu(tmp_path_factory, "mla", MLA_SPEC)
    assert {n.variant.qhead_per_kvhead for n in plan.needs} == {16, 32}  # 20 is padded to 32
    yield R.reset(roots=[root], on_miss="error")
    R.reset()


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
    import fa4aot.runtime as R

    root, _ = _built_on_this_gpu(tmp_path_factory, "fp8", FP8_SPEC)
    yield R.reset(roots=[root], on_miss="error")
    R.reset()


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
