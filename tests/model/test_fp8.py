"""The FP8 call contract (fa4aot/model/fp8.py) on CPU tensors: dtype pairs per arch, descales."""

from __future__ import annotations

import pytest
import torch

from fa4aot.model import fp8
from fa4aot.errors import ContractViolation, UnsupportedVariant

E4 = torch.float8_e4m3fn


def _t(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype)


def test_fp8_kv_with_bf16_q_on_sm100_says_what_fa4_needs():
    why = fp8.fp8_mismatch_reason("sm100", torch.bfloat16, E4)
    assert "same dtype" in why and "q_descale" in why and "float8_e4m3fn" in why
    assert "bfloat16" in why and "(batch, num_kv_heads)" in why
    with pytest.raises(UnsupportedVariant, match="Quantize q"):
        fp8.check_fp8_dtypes("sm103", _t(1, 1, 8, 64), _t(1, 9, 2, 64, dtype=E4),
                             _t(1, 9, 2, 64, dtype=E4))
    assert "quantize K/V" in fp8.fp8_mismatch_reason("sm100", E4, torch.bfloat16)
    assert fp8.fp8_mismatch_reason("sm100", E4, "float8_e4m3fn") is None
    assert "one FP8 dtype" in fp8.fp8_mismatch_reason("sm100", E4, torch.float8_e5m2)
    assert fp8.fp8_mismatch_reason("sm100", torch.bfloat16, torch.bfloat16) is None
    fp8.check_fp8_dtypes("sm100", *(_t(1, 1, 2, 64, dtype=E4) for _ in range(3)))


def test_fp8_on_sm90_reuses_the_sm90_reason():
    why = fp8.fp8_mismatch_reason("sm90", torch.bfloat16, E4)
    assert why.startswith("k/v dtype float8_e4m3fn on sm90") and "sm100-only" in why
    assert "vllm_flash_attn" in why  # the alternatives constraints.fp8_reason names
    assert fp8.fp8_mismatch_reason("sm90", E4, E4).startswith("q/k/v dtype")
    with pytest.raises(UnsupportedVariant, match="sm100-only"):
        fp8.check_fp8_dtypes("sm90", *(_t(1, 1, 2, 64, dtype=E4) for _ in range(3)))


def test_output_dtype():
    assert fp8.fp8_out_dtype(E4) == "bfloat16" == fp8.fp8_out_dtype("float8_e5m2")
    assert fp8.fp8_out_dtype(torch.float16) == "float16"


def _ok(**kw):
    d = torch.ones(3, 2)
    args = dict(dtype=E4, batch=3, num_heads_kv=2, device="cpu", q_descale=d, k_descale=d,
                v_descale=d)
    args.update(kw)
    fp8.check_descales("qkv", **args)


def test_descales_contract():
    _ok()
    fp8.check_descales(None, dtype=torch.bfloat16, batch=3, num_heads_kv=2, device="cpu")
    cases = [
        (dict(q_descale=None), "takes descales 'qkv', the call passes 'kv'"),
        (dict(k_descale=torch.ones(3, 4)), r"shape \(3, 4\), expected .* = \(3, 2\)"),
        (dict(v_descale=torch.ones(3, 2, dtype=torch.float64)), "dtype float64, expected float32"),
        (dict(v_descale=torch.ones(1, 1).expand(3, 2)), "stride-0"),
        (dict(q_descale=torch.ones(2, 3).t()), "contiguous in its last dim"),
        (dict(q_descale=[[1.0, 1.0]] * 3), "must be a torch.Tensor"),
        (dict(device="meta"), "on cpu, the inputs on meta"),
        (dict(dtype=torch.bfloat16), "scale FP8 q/k/v only"),
    ]
    for kw, msg in cases:
        with pytest.raises(ContractViolation, match=msg):
            _ok(**kw)
    with pytest.raises(ContractViolation, match="takes descales 'none'"):
        fp8.check_descales(None, dtype=E4, batch=3, num_heads_kv=2, device="cpu",
                           k_descale=torch.ones(3, 2))
