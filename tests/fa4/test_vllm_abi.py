"""vLLM 0.33.0's FA4 copy, modelled: its compile-key fields by name (model/abis.py) and its sm90
launch ABI (runtime/vllm_abi.py: 21 forward slots, 10 combine slots), checked against the copy
itself, as tests/test_abi.py checks upstream's.

The copy comes from the released wheel (tests/fa4_copies.py: only its cute/ directory is
unpacked). Its `_flash_attn_fwd` runs on the CPU under FakeTensorMode in a subprocess
(_record_vllm.py: the copy fixes its arch at import), with a recording stand-in for every
compiled function; each of vLLM's Gemma-4 calls (hd512 32:4 paged at pages 64 and 16, FP8-KV
dequant, varlen, dense, split + combine, TP8's ratio 4) and an hd128 control is laid out again
with vllm_abi, and the two call sequences are compared slot by slot: None vs tensor, a tensor by
the input it aliases (or the order FA4-allocated buffers first appear), shape, strides, offset
and dtype, scalars by type and value, tuples member by member.
"""

from __future__ import annotations

import _record_copy
import pytest
import torch
from _record_copy import S, slot_names

from fa4aot.model import abis
from fa4aot.runtime import vllm_abi as VA
from fa4_copies import engine_root


_FIXED = {"block_sparse": None, "aux": VA.AUX_NONE}


def test_builders_fill_the_tables_in_order():
    pos = ("q", "k", "v", "out", "lse", "softmax_scale", "cu_seqlens_q", "cu_seqlens_k",
           "seqused_q", "seqused_k", "page_table", "window_left", "window_right",
           "learnable_sink")  # fmt: skip
    kw = {n: S(n) for n in ("dynamic_causal", "descales", "output_scale", "cu_total_m_blocks",
                            "cu_total_splits_m_blocks")}
    args = VA.fwd_args(*[S(n) for n in pos], **kw)
    assert len(args) == 21 == len(abis.VLLM_SM90_FWD)
    assert slot_names(args) == tuple(_FIXED.get(n, n) for n in abis.VLLM_SM90_FWD)
    comb = VA.combine_args(*[S(n) for n in abis.VLLM_COMBINE])
    assert slot_names(comb) == abis.VLLM_COMBINE and len(comb) == 10
    # the launcher: the runtime's 16 leading parameters, then descales; passes fwd_args' list
    p = [S(n) for n in pos]
    cu, desc = S("cu_total_m_blocks"), S("descales")
    got = VA.launch_sm90(lambda *a: a, *p, cu, desc)
    assert got == VA.fwd_args(*p, descales=desc, cu_total_m_blocks=cu)


def test_upstream_and_vllm_tables_differ_where_the_copy_does():
    up, vl = abis.UPSTREAM_SM90_FWD, abis.VLLM_SM90_FWD
    assert vl[:10] == up[:10] and vl[10] == "dynamic_causal" and vl[11] == up[10]
    assert vl[12:17] == up[11:16] and vl[17:19] == ("descales", "output_scale")
    assert vl[19:] == up[16:]
    assert abis.VLLM_COMBINE == abis.UPSTREAM_COMBINE + ("output_scale",)


def test_fp8_kv_prepare_views_and_descales():
    q = torch.empty(3, 8, 64, dtype=torch.bfloat16)
    kv = torch.empty(2, 64, 2, 64, dtype=torch.float8_e4m3fn)
    kd, vd = torch.rand(3, 2), torch.rand(3, 2)
    k, v, (qd, kd2, vd2) = VA.fp8_kv_prepare(q, kv, kv, kd, vd)
    assert k.dtype == v.dtype == torch.uint8 and k.data_ptr() == kv.data_ptr()
    assert torch.equal(qd, torch.ones(3, 2)) and kd2 is kd and vd2 is vd
    with pytest.raises(ValueError, match="bf16/fp16 q"):
        VA.fp8_kv_prepare(q.float(), kv, kv, kd, vd)
    with pytest.raises(ValueError, match="e4m3 k and v"):
        VA.fp8_kv_prepare(q, kv.to(torch.bfloat16), kv, kd, vd)
    with pytest.raises(ValueError, match="v_descale"):
        VA.fp8_kv_prepare(q, kv, kv, kd, vd.t().contiguous().t())  # head stride 3, not 1
    with pytest.raises(ValueError, match="k_descale"):
        VA.fp8_kv_prepare(q, kv, kv, None, vd)


def test_key_fields_by_name():
    key = tuple(range(len(abis.VLLM_FWD_KEY))) + ("hd256",)
    f = abis.KeyFields(key, abis.VLLM_FWD_KEY)
    assert f["dtype"] == 0 and f["fp8_kv_dequant"] == abis.VLLM_FWD_KEY.index("fp8_kv_dequant")
    assert f.extra == ("hd256",) and "paged_kv_tma" not in f
    with pytest.raises(KeyError, match="paged_kv_tma"):
        f["paged_kv_tma"]
    with pytest.raises(ValueError, match="62 fields"):
        abis.KeyFields(key[:62], abis.VLLM_FWD_KEY)


def test_the_wheels_key_fields_are_the_models():
    """The field lists read from the 0.33.0 wheel's interface.py are VLLM_FWD_KEY and
    VLLM_COMBINE_KEY, and the copy is detected as the vllm ABI (upstream's as upstream)."""
    iface = engine_root("vllm") / "vllm_flash_attn" / "cute" / "interface.py"
    assert abis.key_field_names(iface, "_flash_attn_fwd") == abis.VLLM_FWD_KEY
    assert abis.key_field_names(iface, "_flash_attn_fwd_combine") == abis.VLLM_COMBINE_KEY
    assert abis.detect_abi(iface) == "vllm"


@pytest.fixture(scope="module")
def recorded():
    return _record_copy.run("_record_vllm.py", engine_root("vllm"))


CASES = ("bf16_p64_decode", "bf16_p64_prefill", "bf16_p64_decode_tp8", "bf16_p16_decode",
         "fp8_p64_decode", "fp8_p64_prefill", "bf16_varlen_prefill", "bf16_varlen_lse_split",
         "bf16_dense_prefill", "bf16_p64_split32", "fp8_p64_split32", "bf16_p64_split48",
         "fp8_p64_split100_tp8", "hd128_p128_decode", "bf16_varlen_b300")


@pytest.mark.parametrize("case", CASES)
def test_launches_equal_the_copys_slot_by_slot(recorded, case):
    # (the batch > 256 helpers take upstream's slots: compared by position)
    _record_copy.assert_same_calls(recorded[case]["copy"], recorded[case]["fa4aot"],
                                   {"fwd": abis.VLLM_SM90_FWD, "combine": abis.VLLM_COMBINE})


def test_gemma4_keys_read_by_name(recorded):
    """What a build reads from the copy's keys, by field name, for Gemma-4's hd512 calls."""
    fwd = {c: recorded[c]["keys"]["fwd"] for c in CASES}
    assert all(len(k) == 1 and k[0]["_len"] == 63 for k in fwd.values())
    k = {c: v[0] for c, v in fwd.items()}
    for c in CASES:  # hd512 on sm90: the 64 x 64 tile
        if c.startswith("hd128"):
            continue
        assert (k[c]["head_dim"], k[c]["tile_m"], k[c]["tile_n"]) == ("512", "64", "64"), c
    tma = "page_size not in [None, tile_n]"
    assert k["bf16_p64_decode"][tma] == "False" and k["bf16_p16_decode"][tma] == "True"
    assert k["bf16_p64_decode"]["qhead_per_kvhead"] == "8"
    assert k["bf16_p64_decode_tp8"]["qhead_per_kvhead"] == "4"
    f8 = k["fp8_p64_decode"]
    assert (f8["fp8_kv_dequant"], f8["dtype"], f8["q.dtype"], f8["mma_pv_is_rs"]) == (
        "True", "Float16", "torch.bfloat16", "True")
    assert [f8[f"{t}_descale is not None"] for t in "qkv"] == ["True"] * 3
    assert k["bf16_p64_decode"]["is_static_persistent"] == "True"
    assert k["bf16_p64_prefill"]["is_static_persistent"] == "False"
    split = k["bf16_p64_split32"]
    assert split["is_split_kv"] == "True" and split["is_static_persistent"] == "False"
    comb = recorded["bf16_p64_split32"]["keys"]["combine"]
    assert len(comb) == 1 and comb[0]["log_max_splits"] == "5" and comb[0]["_len"] == 15
    assert comb[0]["num_head"] == "32" and comb[0]["dtype_partial"] == "Float32"
    assert k["bf16_varlen_b300"]["cu_total_m_blocks is not None"] == "True"
    # the combine the runtime picks for a count (vllm_abi.combine_bucket) is the copy's: its
    # log_max_splits and num_head, one combine per (query heads, bucket)
    for case, heads, n in (("bf16_p64_split48", 32, 48), ("fp8_p64_split100_tp8", 4, 100)):
        (comb,) = recorded[case]["keys"]["combine"]
        assert 1 << int(comb["log_max_splits"]) == VA.combine_bucket(n), case
        assert comb["num_head"] == str(heads), case
