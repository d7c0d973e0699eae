"""Blackwell (sm100 B200/GB200, sm103 B300/GB300) checks that need the GPU (marker `gpu`).
Skipped unless device 0 has compute capability 10.0 or 10.3. Run on such a machine:

    python -m pytest -q -m gpu tests/test_gpu_blackwell.py

1. Which cubins load: the tiny spec cross-compiled for sm100 (sm_100a) and sm103 (sm_103a),
   each cubin handed to the driver (cuModuleLoadData). Expected, from the CUDA Programming
   Guide's arch-specific ("a") target rule: only the device's own target loads; the other one
   fails with CUDA_ERROR_NO_BINARY_FOR_GPU (209).
2. Ratio padding for absorbed MLA: FA4's own MLA kernel (JIT) at ratio 32 on a 20-head call
   padded with zero heads, O and LSE cropped, against the fp32 reference of the unpadded call.
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
