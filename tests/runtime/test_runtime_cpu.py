"""The runtime on a CPU: every input check raises its own ContractViolation before the "must be
CUDA" refusal; importing the runtime pulls no compiler; the KV block-size contract as answered
from a (stub-built) store."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import fa4aot
import fa4aot.runtime as R
from fa4aot.policy import blocks
from fa4aot.runtime import abi as A
from fa4aot.build.builder import build
from fa4aot.errors import ContractViolation
from fa4aot.model.specs import parse_spec

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _isolated_runtime(tmp_path, monkeypatch, knobs):
    knobs(cache_dir=str(tmp_path / "cache"), padding=None)
    R.reset(roots=[tmp_path / "cache"])
    yield
    R.reset(roots=[tmp_path / "cache"])


def t(*shape, dtype=BF16):
    return torch.zeros(*shape, dtype=dtype)


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def dense(b=2, sq=3, sk=5, hq=4, hk=2, d=64, dv=64):
    return t(b, sq, hq, d), t(b, sk, hk, d), t(b, sk, hk, dv)


def paged(batch=2, pages=6, page=16, hq=4, hk=2, d=64):
    """Packed q (3 tokens: lengths 1, 2), a KV pool of `pages` pages, a (batch, 3) page table."""
    q = t(3, hq, d)
    k, v = t(pages, page, hk, d), t(pages, page, hk, d)
    table = torch.arange(batch * 3, dtype=torch.int32).reshape(batch, 3) % pages
    return (
        q,
        k,
        v,
        dict(cu_seqlens_q=i32(0, 1, 3), max_seqlen_q=2, page_table=table, seqused_k=i32(5, 20)),
    )


def varlen(hq=4, hk=2, d=64):
    q, k, v = t(3, hq, d), t(7, hk, d), t(7, hk, d)
    return q, k, v, dict(cu_seqlens_q=i32(0, 1, 3), cu_seqlens_k=i32(0, 4, 7), max_seqlen_q=2)


def refused(fn, *args, match: str, **kw):
    with pytest.raises(ContractViolation) as e:
        fn(*args, **kw)
    msg = str(e.value)
    assert match in msg, msg
    assert "CUDA" not in msg or "CUDA" in match, f"refused for the device, not the input: {msg}"
    return msg


# -- good inputs: only the device is wrong -----------------------------------------------------


def test_good_dense_cpu_call_is_refused_for_the_device():
    refused(
        fa4aot.flash_attn_func,
        *dense(),
        causal=True,
        match="q, k, v must be CUDA tensors, got device cpu",
    )


def test_hd256_cpu_calls_are_refused_for_the_device():
    """Head dim 256 adds a term to the plan key (plan.hd256_class, the device's SM count on
    Blackwell): off CUDA the call is still refused, typed, for its device."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 8, 256, generator=g).to(torch.bfloat16)
    k = torch.randn(1, 4, 2, 256, generator=g).to(torch.bfloat16)
    refused(fa4aot.flash_attn_func, q, k, k, causal=True, match="must be CUDA tensors")
    cu = torch.tensor([0, 4], dtype=torch.int32)
    refused(fa4aot.flash_attn_varlen_func, q[0], k[0], k[0], causal=True,
            match="must be CUDA tensors", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4,
            max_seqlen_k=4)


@pytest.mark.parametrize("make", [paged, varlen])
def test_good_varlen_cpu_call_is_refused_for_the_device(make):
    q, k, v, kw = make()
    refused(fa4aot.flash_attn_varlen_func, q, k, v, causal=True, match="must be CUDA tensors", **kw)


def test_good_call_with_every_option_is_refused_for_the_device():
    q, k, v, kw = paged()
    refused(
        fa4aot.flash_attn_varlen_func,
        q,
        k,
        v,
        causal=True,
        window_size=(128, 0),
        return_lse=True,
        learnable_sink=torch.zeros(4),
        softmax_scale=0.1,
        match="must be CUDA tensors",
        **kw,
    )
    refused(
        fa4aot.flash_attn_func,
        *dense(),
        window_size=(-1, -1),
        learnable_sink=torch.zeros(4, dtype=BF16),
        match="must be CUDA tensors",
    )


# -- each bad input, its own message ----------------------------------------------------------


def test_page_table_int64():
    q, k, v, kw = paged()
    kw["page_table"] = kw["page_table"].long()
    refused(
        fa4aot.flash_attn_varlen_func,
        q,
        k,
        v,
        match="page_table must be an int32 tensor, got torch.int64",
        **kw,
    )


def test_page_table_not_contiguous():
    q, k, v, kw = paged()
    kw["page_table"] = torch.zeros(2, 6, dtype=torch.int32)[:, ::2]
    refused(
        fa4aot.flash_attn_varlen_func,
        q,
        k,
        v,
        match="page_table must be contiguous in its last dimension",
        **kw,
    )


def test_page_table_rows_overlapping():
    q, k, v, kw = paged()
    base = torch.zeros(8, dtype=torch.int32)
    kw["page_table"] = base.as_strided((2, 3), (1, 1))  # row 1 starts inside row 0
    refused(fa4aot.flash_attn_varlen_func, q, k, v, match="page_table rows must not overlap", **kw)
    kw["page_table"] = base[:3].expand(2, 3)  # stride 0: one row seen twice
    refused(fa4aot.flash_attn_varlen_func, q, k, v, match="page_table rows must not overlap", **kw)


def test_page_table_wrong_batch():
    q, k, v, kw = paged()
    kw["page_table"] = torch.zeros(3, 3, dtype=torch.int32)
    refused(
        fa4aot.flash_attn_varlen_func,
        q,
        k,
        v,
        match="page_table must have shape (2, max_pages), got (3, 3)",
        **kw,
    )


def test_cu_seqlens_not_int32():
    q, k, v, kw = varlen()
    kw["cu_seqlens_q"] = kw["cu_seqlens_q"].long()
    refused(
        fa4aot.flash_attn_varlen_func,
        q,
        k,
        v,
        match="cu_seqlens_q must be int32, got torch.int64",
        **kw,
    )
    q, k, v, kw = varlen()
    kw["cu_seqlens_k"] = kw["cu_seqlens_k"].float()
    refused(
        fa4aot.flash_attn_varlen_func,
        q,
        k,
        v,
        match="cu_seqlens_k must be int32, got torch.float32",
        **kw,
    )


def test_cu_seqlens_wrong_length_or_rank():
    q, k, v, kw = varlen()
    kw["cu_seqlens_k"] = i32(0, 7)  # batch is 2 (from cu_seqlens_q): needs 3 entries
    refused(
        fa4aot.flash_attn_varlen_func,
        q,
        k,
        v,
        match="cu_seqlens_k must have shape (3,), got (2,)",
        **kw,
    )
    q, k, v, kw = varlen()
    kw["cu_seqlens_q"] = torch.zeros(1, 3, dtype=torch.int32)
    refused(
        fa4aot.flash_attn_varlen_func,
        q,
        k,
        v,
        match="cu_seqlens_q must have shape (batch+1,), got (1, 3)",
        **kw,
    )
    q, k, v, kw = varlen()
    kw["cu_seqlens_q"] = [0, 1, 3]
    refused(
        fa4aot.flash_attn_varlen_func, q, k, v, match="cu_seqlens_q must be an int32 tensor", **kw
    )


def test_cu_seqlens_not_contiguous():
    q, k, v, kw = varlen()
    kw["cu_seqlens_k"] = i32(0, 9, 4, 9, 7, 9)[::2]
    refused(fa4aot.flash_attn_varlen_func, q, k, v, match="cu_seqlens_k must be contiguous", **kw)


def test_page_table_with_cu_seqlens_k():
    q, k, v, kw = paged()
    kw["cu_seqlens_k"] = i32(0, 5, 25)
    refused(
        fa4aot.flash_attn_varlen_func,
        q,
        k,
        v,
        match="page_table and cu_seqlens_k cannot be combined",
        **kw,
    )


def test_paged_without_seqused_k():
    q, k, v, kw = paged()
    del kw["seqused_k"]
    refused(fa4aot.flash_attn_varlen_func, q, k, v, match="paged KV needs seqused_k", **kw)


def test_seqused_k_wrong_shape_or_dtype():
    q, k, v, kw = paged()
    kw["seqused_k"] = i32(5, 20, 1)
    refused(
        fa4aot.flash_attn_varlen_func,
        q,
        k,
        v,
        match="seqused_k must have shape (2,), got (3,)",
        **kw,
    )
    kw["seqused_k"] = torch.tensor([5, 20])
    refused(
        fa4aot.flash_attn_varlen_func,
        q,
        k,
        v,
        match="seqused_k must be int32, got torch.int64",
        **kw,
    )


def test_paged_k_v_layouts_differ():
    q, k, _, kw = paged()
    refused(fa4aot.flash_attn_varlen_func, q, k, t(6, 32, 2, 64), match="page layouts differ", **kw)
    refused(
        fa4aot.flash_attn_varlen_func,
        q,
        t(96, 2, 64),
        t(96, 2, 64),
        match="paged k/v must be (num_pages, page_size, kv_heads, head_dim)",
        **kw,
    )


def test_head_dim_mismatch():
    q, _, v = dense()
    refused(
        fa4aot.flash_attn_func, q, t(2, 5, 2, 128), v, match="q and k head_dim differ: 64 vs 128"
    )
    q, _, v, kw = varlen()
    refused(
        fa4aot.flash_attn_varlen_func,
        q,
        t(7, 2, 96),
        v,
        match="q and k head_dim differ: 64 vs 96",
        **kw,
    )


def test_dtype_mismatch():
    q, k, v = dense()
    refused(fa4aot.flash_attn_func, q, k.half(), v, match="q, k, v must share one dtype")
    refused(
        fa4aot.flash_attn_func,
        q.float(),
        k.float(),
        v.float(),
        match="q dtype must be bfloat16 or float16, got torch.float32",
    )


def test_heads_not_divisible():
    q, k, v = dense(hq=6, hk=4)
    refused(
        fa4aot.flash_attn_func,
        q,
        k,
        v,
        match="num q heads (6) must be a multiple of num kv heads (4)",
    )
    q, k, v = dense()
    refused(
        fa4aot.flash_attn_func,
        q,
        k,
        t(2, 5, 1, 64),
        match="k and v must have the same number of heads, got 2 and 1",
    )


@pytest.mark.parametrize("window", [(1, 2, 3), 5, ("a", 0), (1.5, 0), (True, 0), None])
def test_bad_window_size(window):
    refused(fa4aot.flash_attn_func, *dense(), window_size=window, match="window_size")


@pytest.mark.parametrize(
    "sink,match",
    [
        (torch.zeros(5), "learnable_sink must have shape (4,)"),
        (torch.zeros(1, 4), "learnable_sink must have shape (4,)"),
        (
            torch.zeros(4, dtype=torch.int32),
            "learnable_sink must be a float32/bfloat16/float16 tensor",
        ),
        ([0.0] * 4, "learnable_sink must be a float32/bfloat16/float16 tensor"),
    ],
)
def test_bad_learnable_sink(sink, match):
    refused(fa4aot.flash_attn_func, *dense(), learnable_sink=sink, match=match)
    q, k, v, kw = paged()
    refused(fa4aot.flash_attn_varlen_func, q, k, v, learnable_sink=sink, match=match, **kw)


def test_three_d_q_to_flash_attn_func():
    q, k, v, _ = varlen()
    refused(fa4aot.flash_attn_func, q, k, v, match="flash_attn_func takes 4-D q/k/v")


def test_dense_k_v_shape_mismatch():
    q, _, _ = dense()
    refused(fa4aot.flash_attn_func, q, t(1, 5, 2, 64), t(1, 5, 2, 64), match="do not match q")


@pytest.mark.parametrize("bad", [2.0, "2", True, -1, torch.tensor(2)])
def test_max_seqlen_q_not_a_host_int(bad):
    q, k, v, kw = varlen()
    kw["max_seqlen_q"] = bad
    refused(
        fa4aot.flash_attn_varlen_func,
        q,
        k,
        v,
        match="max_seqlen_q must be a non-negative host int",
        **kw,
    )


def test_varlen_q_rank():
    q, k, v, kw = varlen()
    refused(
        fa4aot.flash_attn_varlen_func,
        q[None],
        k,
        v,
        match="with cu_seqlens_q, q must be (total_q, heads, head_dim)",
        **kw,
    )


def test_not_tensors():
    q, k, _ = dense()
    refused(fa4aot.flash_attn_func, q, k, [1], match="v must be a torch.Tensor, got list")


def test_strided_input_without_padding_is_refused():
    q, k, v = dense(d=128)
    strided = q[..., ::2]  # head_dim 64 with stride 2: no kernel can read it in place
    refused(
        fa4aot.flash_attn_func,
        strided,
        k[..., :64].contiguous(),
        v,
        padding=False,
        match="q must have a 16-byte aligned base, a contiguous last dim",
    )
    # allowed to copy: only the device is left to refuse
    refused(
        fa4aot.flash_attn_func, strided, k[..., :64].contiguous(), v, match="must be CUDA tensors"
    )


def test_checks_do_not_touch_the_store(tmp_path):
    for _ in range(3):
        refused(fa4aot.flash_attn_func, *dense(), match="must be CUDA tensors")
    assert not (tmp_path / "cache").exists()
    assert R.default_runtime()._plans == {}


# -- the serving import pulls no compiler ------------------------------------------------------

_IMPORTS = r"""
import json, sys
import fa4aot
fa4aot.flash_attn_func
fa4aot.flash_attn_varlen_func
fa4aot.supported_block_sizes
import fa4aot.runtime, fa4aot.store.layers, fa4aot.policy.blocks, fa4aot.store.misses, fa4aot.errors
def heavy(name):
    return any(name == p or name.startswith(p + ".") for p in ("cutlass", "flash_attn"))
print(json.dumps(sorted(m for m in sys.modules if heavy(m))))
"""


def test_runtime_import_pulls_no_compiler():
    r = subprocess.run(
        [sys.executable, "-c", _IMPORTS], capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == []


def test_import_check_catches_a_compiler_import():
    """The check itself works: an import of either package does show up."""
    code = _IMPORTS.replace("import fa4aot\n", "import fa4aot\nimport flash_attn, cutlass\n")
    assert code != _IMPORTS
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout.splitlines()[-1])
    assert "flash_attn" in found and "cutlass" in found


# -- KV block sizes, answered from the store -------------------------------------------------


def _paged_spec(name, page_sizes, head_dim=128, window=None, hq=32, hk=8, causal=True):
    w = f"window = {window}\n" if window is not None else ""
    w += "causal = false\n" if not causal else ""
    return parse_spec(
        f"""
name = "{name}"
[[attention]]
name = "attn"
num_q_heads = {hq}
num_kv_heads = {hk}
head_dim = {head_dim}
{w}
[serving]
layouts = ["paged"]
phases = ["decode"]
max_batch = 8
page_sizes = {json.dumps(page_sizes)}
""",
        f"{name}.toml",
    )


@pytest.fixture
def stub(knobs):
    knobs(stub_compiler="1", stub_delay="0")


def _build(root, spec):
    _, _, results = build([spec], arch="sm90", root=root, jobs=1)
    assert results and {r.status for r in results} == {"built"}, results


def test_block_sizes_tma_and_any_size(tmp_path, stub):
    _build(tmp_path, _paged_spec("a", [16, 128]))
    bs = fa4aot.supported_block_sizes(
        "sm90", "bfloat16", 128, qhead_per_kvhead=4, causal=True, cache=tmp_path
    )
    assert bs.tma == (128,) and bs.any_size is True
    assert bs.regimes == ("decode", "decode/tma")
    assert bs.serves(128) and bs.serves(16) and bs.serves(48) and not bs.serves(0)
    assert (
        fa4aot.preferred_block_size("sm90", "bfloat16", 128, qhead_per_kvhead=4, cache=tmp_path)
        == 128
    )


def test_block_sizes_tma_only(tmp_path, stub):
    _build(tmp_path, _paged_spec("b", [128]))
    bs = blocks.supported_block_sizes("sm90", "bfloat16", 128, qhead_per_kvhead=4, cache=tmp_path)
    assert bs.tma == (128,) and bs.any_size is False
    assert bs.serves(128) and not bs.serves(64)


def test_block_sizes_do_not_leak_across_configs(tmp_path, stub):
    _build(tmp_path, _paged_spec("a", [16, 128]))
    for kw in (
        dict(qhead_per_kvhead=8),
        dict(qhead_per_kvhead=4, window=256),
        dict(qhead_per_kvhead=4, causal=False),
        dict(qhead_per_kvhead=4, sink_dtype="float32"),
    ):
        bs = blocks.supported_block_sizes("sm90", "bfloat16", 128, cache=tmp_path, **kw)
        assert (bs.tma, bs.any_size) == ((), False), kw
    assert (
        blocks.supported_block_sizes("sm90", "float16", 128, qhead_per_kvhead=4, cache=tmp_path).tma
        == ()
    )
    assert (
        blocks.preferred_block_size("sm90", "bfloat16", 64, qhead_per_kvhead=4, cache=tmp_path)
        is None
    )


def test_block_sizes_hd256_window_tile_n_64(tmp_path, stub):
    _build(tmp_path, _paged_spec("g", ["tile"], head_dim=256, window=1024, hq=32, hk=16))
    bs = blocks.supported_block_sizes(
        "sm90", "bfloat16", 256, qhead_per_kvhead=2, window=1024, cache=tmp_path
    )
    assert bs.tma == (64,) and bs.any_size is False
    assert (
        blocks.preferred_block_size(
            "sm90", "bfloat16", 256, qhead_per_kvhead=2, window=1024, cache=tmp_path
        )
        == 64
    )
    # the full-attention hd256 kernel has tile_n 80, and none is cached
    assert (
        blocks.supported_block_sizes(
            "sm90", "bfloat16", 256, qhead_per_kvhead=2, cache=tmp_path
        ).tma
        == ()
    )


def test_block_size_rows(tmp_path, stub):
    _build(tmp_path, _paged_spec("a", [16, 128]))
    _build(tmp_path, _paged_spec("g", ["tile"], head_dim=256, window=1024, hq=32, hk=16))
    rows = {r["spec"]: r for r in blocks.block_size_rows(tmp_path)}
    assert rows["a"] == {
        "spec": "a",
        "layer": "attn",
        "arch": "sm90",
        "head_dim": 128,
        "tile_n": 128,
        "served_page_sizes": "any",
        "tma_page_size": "128",
        "preferred": 128,
    }
    assert (rows["g"]["tile_n"], rows["g"]["served_page_sizes"], rows["g"]["preferred"]) == (
        64,
        "64",
        64,
    )


def test_block_sizes_of_an_empty_store(tmp_path):
    bs = blocks.supported_block_sizes("sm90", "bfloat16", 128, cache=tmp_path / "none")
    assert (bs.tma, bs.any_size, bs.regimes) == ((), False, ())
    assert blocks.block_size_rows(tmp_path / "none") == []


def test_block_size_rows_of_a_non_causal_layer(tmp_path, stub):
    # hd96: the non-causal kernel's tile_n is 144, the causal one's 128
    _build(tmp_path, _paged_spec("enc", ["tile"], head_dim=96, causal=False))
    bs = blocks.supported_block_sizes(
        "sm90", "bfloat16", 96, qhead_per_kvhead=4, causal=False, cache=tmp_path
    )
    assert bs.tma == (144,)
    (row,) = blocks.block_size_rows(tmp_path)
    assert (row["tile_n"], row["tma_page_size"], row["preferred"]) == (144, "144", 144)


# caller-owned output buffers: written in place, so checked fully (and before "must be CUDA")
@pytest.mark.parametrize(
    "make_out,make_lse,match",
    [
        (lambda: t(2, 3, 4, 32), None, "out must be a torch.bfloat16 tensor of shape"),
        (lambda: t(2, 3, 4, 64, dtype=torch.float16), None, "out must be a torch.bfloat16"),
        (lambda: t(2, 3, 4, 128)[..., ::2], None, "out must have a 16-byte aligned base"),
        (
            None,
            lambda: t(2, 4, 3, dtype=torch.float32)[:, :, :2],
            "lse must be a float32 tensor of shape",
        ),
        (None, lambda: t(2, 4, 3), "lse must be a float32"),
        (None, lambda: t(2, 3, 4, dtype=torch.float32).transpose(1, 2), "lse must be contiguous"),
    ],
)
def test_dense_out_and_lse_buffers_checked(make_out, make_lse, match):
    q, k, v = dense()
    kw = {}
    if make_out:
        kw["out"] = make_out()
    if make_lse:
        kw["lse"] = make_lse()
    with pytest.raises(ContractViolation, match=match):
        fa4aot.flash_attn_func(q, k, v, **kw)


def test_good_out_and_lse_buffers_reach_the_cuda_refusal():
    q, k, v = dense()
    out = t(2, 3, 4, 64)
    lse = t(2, 4, 3, dtype=torch.float32)
    with pytest.raises(ContractViolation, match="must be CUDA tensors"):
        fa4aot.flash_attn_func(q, k, v, out=out, lse=lse)
    q, k, v, kw = paged()
    with pytest.raises(ContractViolation, match="must be CUDA tensors"):
        fa4aot.flash_attn_varlen_func(
            q, k, v, out=t(3, 4, 64), lse=t(4, 3, dtype=torch.float32), **kw
        )
    with pytest.raises(ContractViolation, match="lse must be a float32 tensor of shape \\(4, 3\\)"):
        fa4aot.flash_attn_varlen_func(q, k, v, lse=t(3, 4, dtype=torch.float32), **kw)


class _AnyKey(dict):
    def __init__(self, plan):
        super().__init__()
        self.plan = plan

    def get(self, key, default=None):
        return self.plan


def _planted(decode_blocks=True, helper_seqused=False):
    """A runtime whose every call finds one plan with recording fakes for the two kernels."""
    calls = {"helper": [], "fwd": []}
    plan = R.plan.Plan(
        None,  # the variant: read when a plan is resolved, not on the call path
        lambda *a: calls["fwd"].append(a),
        lambda *a: calls["helper"].append(a),
        True,
        helper_seqused,
        None,
        decode_blocks=decode_blocks,
    )
    R.default_runtime()._plans = _AnyKey(plan)
    return calls


@pytest.mark.parametrize("max_q", [1, 2, None])
def test_batch_over_256_decode_passes_cu_seqlens_as_block_cumsum(max_q):
    """With max_seqlen_q == 1 every sequence is 0 or 1 m-block: FA4's tile-cumsum helper would
    write cu_seqlens_q itself, so the runtime skips the launch; otherwise the helper runs."""
    calls = _planted()
    b = 300
    lens = torch.tensor([i % 3 != 0 for i in range(b)], dtype=torch.int32)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
    total = int(cu[-1])
    q = t(total, 4, 64)
    k, v = t(b * 2, 16, 2, 64), t(b * 2, 16, 2, 64)
    table = torch.arange(b * 2, dtype=torch.int32).reshape(b, 2)
    fa4aot.flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=cu,
        max_seqlen_q=max_q,
        page_table=table,
        seqused_k=torch.full((b,), 20, dtype=torch.int32),
        causal=True,
    )
    (fwd,) = calls["fwd"]
    if max_q == 1:
        assert calls["helper"] == [] and fwd[16] is cu
    else:
        (helper,) = calls["helper"]
        assert helper[2] is cu and fwd[16] is helper[0] and fwd[16] is not cu


@pytest.mark.parametrize("kw", [{"decode_blocks": False}, {"helper_seqused": True}])
def test_block_cumsum_shortcut_needs_its_conditions(kw):
    calls = _planted(**kw)
    b = 300
    cu = torch.arange(b + 1, dtype=torch.int32)
    q = t(b, 4, 64)
    k, v = t(b, 16, 2, 64), t(b, 16, 2, 64)
    fa4aot.flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=cu,
        max_seqlen_q=1,
        seqused_q=torch.ones(b, dtype=torch.int32) if kw.get("helper_seqused") else None,
        page_table=torch.arange(b, dtype=torch.int32).reshape(b, 1),
        seqused_k=torch.full((b,), 5, dtype=torch.int32),
        causal=True,
    )
    assert len(calls["helper"]) == 1 and calls["fwd"][0][16] is not cu


def test_decode_fold_plan_passes_views_of_the_callers_tensors():
    """A folded plan (20:1 served as 20 rows of the 1:1 kernel): the one kernel launch gets
    q and O as views of the caller's tensors, no cu_seqlens_q, and the K layout as given."""
    from fa4aot.policy.select import Choice

    calls = _planted()
    plan = R.default_runtime()._plans.plan
    plan.pad = Choice(None, 1, 64, 64, 1.0, False, fold=20)
    plan.special = True  # (Plan.__post_init__ sets it once per plan; pad was set after it)
    b = 3
    q, out = t(b, 40, 64), t(b, 40, 64)
    k, v = t(b * 2, 16, 2, 64), t(b * 2, 16, 2, 64)
    # a table 4 bytes past an allocation's start: never at a multiple of 64 KiB, where the
    # launcher would pass a guarded copy instead (abi.GUARD_ALIGN; a 1-in-1024 chance for a
    # fresh 64-byte-aligned CPU tensor, which failed CI once)
    table = torch.arange(b * 2 + 1, dtype=torch.int32)[1:].sub_(1).reshape(b, 2)
    assert table.data_ptr() % A.GUARD_ALIGN
    used = torch.full((b,), 20, dtype=torch.int32)
    o, _ = fa4aot.flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32),
        max_seqlen_q=1,
        page_table=table,
        seqused_k=used,
        causal=True,
        out=out,
    )
    (fwd,) = calls["fwd"]
    assert o is out and calls["helper"] == []
    fq, fk, fo = fwd[0], fwd[1], fwd[3]
    assert fq.shape == (b, 20, 2, 64) and fq.data_ptr() == q.data_ptr()
    assert fq.stride() == (40 * 64, 64, 20 * 64, 1)
    assert fo.shape == (b, 20, 2, 64) and fo.data_ptr() == out.data_ptr()
    assert fk is k and fwd[6] is None and fwd[9] is used and fwd[10] is table
    assert fwd[11] is None and fwd[12] is None  # no window: the folded kernel is non-causal
