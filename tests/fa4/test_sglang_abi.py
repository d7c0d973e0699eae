"""SGLang 0.5.23's FA4 copy, modelled: its compile-key fields by name (model/abis.py), its sm90
launch ABI (runtime/sglang_abi.py and the runtime's launcher launch.SM90_SGLANG: 17 forward
slots, 9 combine slots) and the canonical variant its keys read back as
(fa4/sglang_copy.py), checked against the copy itself, as test_vllm_abi.py does for vLLM's.

The copy comes from the released wheel (tests/fa4_copies.py: only its cute/ directory is
unpacked; fa4aot stands in for the three SGLang modules it imports). Its `_flash_attn_fwd` runs
on the CPU under FakeTensorMode in a subprocess (_record_sglang.py) with a recording stand-in
for every compiled function; each case (hd128 GQA paged at a TMA page and two cp.async pages,
varlen with LSE, varlen batch 300, dense causal and MHA non-causal, hd64 with a bf16 sink and
a window, hd256 windowed paged decode, a 4-way split with its combine) is laid out again by
fa4aot's launcher, and the two call sequences are compared slot by slot.
"""

from __future__ import annotations

import _record_copy
import pytest
from _record_copy import S, slot_names

from fa4_copies import engine_root
from fa4aot.fa4 import sglang_copy as SG
from fa4aot.model import abis
from fa4aot.model.compile_keys import Call
from fa4aot.runtime import launch as L
from fa4aot.runtime import sglang_abi as SA

CUTE = ("kernels", "ops", "attention", "flash_attn", "cute")


POS = ("q", "k", "v", "out", "lse", "softmax_scale", "cu_seqlens_q", "cu_seqlens_k",
       "seqused_q", "seqused_k", "page_table", "window_left", "window_right",
       "learnable_sink")  # fmt: skip


def test_builders_fill_the_tables_in_order():
    fixed = {"block_sparse": None, "aux": SA.AUX_NONE}
    args = SA.fwd_args(*[S(n) for n in POS], bias=S("bias"))
    assert len(args) == 17 == len(abis.SGLANG_SM90_FWD)
    assert slot_names(args) == tuple(fixed.get(n, n) for n in abis.SGLANG_SM90_FWD)
    comb = SA.combine_args(*[S(n) for n in abis.SGLANG_COMBINE])
    assert slot_names(comb) == abis.SGLANG_COMBINE and len(comb) == 9
    # the runtime's launcher: its 15 arch-neutral parameters in, fwd_args' list out (the
    # cu_total it may be handed has no slot); no bias
    got = []
    launch = L.abi_for("sm90", "sglang").fwd(lambda *a: got.append(a), guard=False)
    p = [S(n) for n in POS]
    launch(*p, S("cu_total_m_blocks"))
    assert got == [SA.fwd_args(*p)]


def test_upstream_and_sglang_tables_differ_where_the_copy_does():
    up, sg = abis.UPSTREAM_SM90_FWD, abis.SGLANG_SM90_FWD
    assert sg[:16] == up[:16] and sg[16:] == ("bias",)
    assert "cu_total_m_blocks" not in sg and abis.SGLANG_COMBINE == abis.UPSTREAM_COMBINE
    assert L.abi_for("sm90", "sglang") is L.SM90_SGLANG
    assert L.SM90_SGLANG.combine is L.SM90.combine  # (upstream's nine combine slots)


def test_the_wheels_key_fields_are_the_models():
    """The field lists read from the 0.5.23 wheel's interface.py are SGLANG_FWD_KEY and
    SGLANG_COMBINE_KEY (the tuple `_fwd_combine_compile_key` returns), and the copy is detected
    as the sglang ABI, buildable."""
    iface = engine_root("sglang").joinpath(*CUTE, "interface.py")
    assert abis.key_field_names(iface, "_flash_attn_fwd") == abis.SGLANG_FWD_KEY
    assert abis.key_field_names(iface, "_fwd_combine_compile_key") == abis.SGLANG_COMBINE_KEY
    assert abis.key_field_names(iface, "_flash_attn_fwd_combine") == ()  # (a helper builds it)
    assert abis.detect_abi(iface) == "sglang" and abis.ABIS["sglang"].buildable
    assert len(abis.SGLANG_FWD_KEY) == 62 and "is_static_persistent" not in abis.SGLANG_FWD_KEY


def test_the_copy_imports_only_the_stood_in_sglang_modules():
    """Every absolute `sglang.` import of the copy is its own package or one of the three
    modules sglang_copy.stand_ins provides, with the names the copy takes from them."""
    import ast

    cute = engine_root("sglang").joinpath(*CUTE)
    own = "sglang.kernels.ops.attention.flash_attn.cute"
    outside: dict[str, set] = {}
    for f in cute.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                    node.module.startswith("sglang")) and not node.module.startswith(own):
                outside.setdefault(node.module, set()).update(a.name for a in node.names)
    assert outside == {
        "sglang.kernels.jit.cute_aot_cache": {"get_jit_cache"},
        "sglang.kernels.jit.utils": {"is_arch_support_pdl"},
        "sglang.kernels.ops.attention.fa4_sm120.dispatch": {
            "get_forward_host", "try_cached_paged_decode", "try_cached_varlen"},
    }
    mods = {f"{SG.JIT}.cute_aot_cache": SG, f"{SG.JIT}.utils": SG, f"{SG.SM120}.dispatch": SG}
    for mod, names in outside.items():
        assert all(callable(getattr(mods[mod], n)) for n in names), mod


def test_stand_ins_answer_as_sglang_does_on_sm90(monkeypatch):
    cache = SG.get_jit_cache("fwd", source_paths=("x",), enable_tvm_ffi=True)
    cache[(1, 2)] = "fn"
    assert (1, 2) in cache and cache[(1, 2)] == "fn" and cache.cache == {(1, 2): "fn"}
    cache.clear()
    assert cache.cache == {}
    assert SG.get_forward_host(90) is None and SG.try_cached_varlen(arch=90) is None
    with pytest.raises(NotImplementedError, match="sm120"):
        SG.get_forward_host(120)
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_90")
    assert SG.is_arch_support_pdl()
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_80")
    assert not SG.is_arch_support_pdl()


def _call(layout, b, sq, page=None, **kw):
    return Call(layout=layout, batch=b, seqlen_q=sq, seqlen_k=1024, num_heads=32,
                num_heads_kv=8, head_dim=128, head_dim_v=128, dtype="bfloat16", causal=True,
                window_left=None, window_right=None, return_lse=False, sink_dtype=None,
                page_size=page, **kw)


def test_canonical_drops_only_what_the_copys_kernel_lacks():
    dec = _call("varlen", 300, 1).variant("sm90", 132)
    pre = _call("varlen", 2, 512).variant("sm90", 132)
    assert dec.cu_hint and dec != pre
    assert SG.canonical(dec) == SG.canonical(pre)  # one kernel of the copy serves both
    tma = SG.canonical(_call("paged", 4, 1, 128).variant("sm90", 132))
    assert tma != SG.canonical(_call("paged", 4, 1, 16).variant("sm90", 132))
    assert not tma.static_persistent and not tma.cu_hint and tma.paged_tma


@pytest.fixture(scope="module")
def recorded():
    return _record_copy.run("_record_sglang.py", engine_root("sglang"))


CASES = ("hd128_p128_decode", "hd128_p16_decode", "hd128_p64_prefill", "hd128_varlen_lse",
         "hd128_varlen_b300", "hd128_dense_prefill", "hd128_dense_mha_noncausal",
         "hd64_varlen_sink_window", "hd256_p64_window_decode", "hd128_p128_split4")


@pytest.mark.parametrize("case", CASES)
def test_launches_equal_the_copys_slot_by_slot(recorded, case):
    _record_copy.assert_same_calls(recorded[case]["copy"], recorded[case]["fa4aot"],
                                   {"fwd": abis.SGLANG_SM90_FWD, "combine": abis.SGLANG_COMBINE})


def test_keys_read_by_name(recorded):
    """What a build reads from the copy's keys, by field name; the batch-300 varlen call
    compiles no helper kernel (the copy has no cu_total slot); only the split is unmodelled."""
    k = {c: recorded[c]["keys"]["fwd"] for c in CASES}
    assert all(len(v) == 1 and v[0]["_len"] == 62 for v in k.values())
    k = {c: v[0] for c, v in k.items()}
    tma = "page_size not in [None, tile_n]"
    assert k["hd128_p128_decode"][tma] == "False" and k["hd128_p16_decode"][tma] == "True"
    assert k["hd128_p64_prefill"][tma] == "True"
    assert (k["hd256_p64_window_decode"]["tile_n"], k["hd256_p64_window_decode"][tma]) == (
        "64", "False")
    assert k["hd64_varlen_sink_window"]["learnable_sink is not None"] == "True"
    assert (k["hd128_dense_prefill"]["tile_m"], k["hd128_dense_prefill"]["q_stage"]) == ("128", "1")
    assert [x for x, _ in recorded["hd128_varlen_b300"]["copy"]] == ["fwd"]
    assert k["hd128_varlen_b300"] == {**k["hd128_varlen_lse"], "lse is None": "True"}
    assert k["hd128_p128_split4"]["is_split_kv"] == "True"
    comb = recorded["hd128_p128_split4"]["keys"]["combine"]
    assert len(comb) == 1 and comb[0]["_len"] == 10 and comb[0]["head_dim"] == "128"
    variants = {c: recorded[c]["variants"] for c in CASES}
    assert variants.pop("hd128_p128_split4") == [None]
    assert all(len(v) == 1 and v[0] for v in variants.values())
    assert "sink:bfloat16" in variants["hd64_varlen_sink_window"][0]
    assert "page!=tile_n" in variants["hd128_p16_decode"][0]
