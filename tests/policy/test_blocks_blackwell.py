"""The KV block-size contract for Blackwell layers (issue 15 item 7), from stub-built stores.

FA4's sm100 forward tiles 128 keys at every head dim, so the TMA page is 128 where sm90's
depends on the head dim (80 at hd256, 64 at hd256 with a window); any other page size takes the
cp.async kernel. An MLA call's kernel (and its TMA pages) is chosen per call: the store-based
block-size answer is empty for MLA layers and FA4's rule (kernel_page_sizes) gives 128.
"""

from __future__ import annotations

import pytest

import fa4aot.build.builder as B
from fa4aot.policy import blocks
from fa4aot.errors import NumSmsRequired, UnsupportedVariant
from fa4aot.model.specs import parse_spec

SPEC = """
name = "bw-paged"
[[attention]]
name = "sliding"
num_q_heads = 8
num_kv_heads = 4
head_dim = 256
causal = true
window = 1024
[[attention]]
name = "fp8"
num_q_heads = 32
num_kv_heads = 8
head_dim = 128
dtype = "float8_e4m3fn"
[serving]
layouts = ["paged"]
phases = ["decode"]
page_sizes = [16, "tile"]
max_context = 65536
"""


@pytest.fixture
def stub(knobs):
    knobs(stub_compiler="1", stub_delay="0")


def _build(root, arch="sm100", **kw):
    spec = parse_spec(SPEC, "bw.toml")
    _, _, results = B.build([spec], arch=arch, root=root, jobs=1, **kw)
    assert results and {r.status for r in results} == {"built"}, results


def test_sm100_tile_n_is_128_at_every_head_dim(tmp_path, stub):
    _build(tmp_path)
    bs = blocks.supported_block_sizes(
        "sm100", "bfloat16", 256, qhead_per_kvhead=2, window=1024, cache=tmp_path
    )
    assert bs.tma == (128,) and bs.any_size and bs.serves(16) and bs.serves(80)
    assert "decode/split/tma" in bs.regimes and "decode/tma" in bs.regimes
    # the same layer on sm90 would take page 64 (hd256 with a window): not so on Blackwell
    assert blocks.kernel_page_sizes("sm90", 256, causal=True, window=1024).tma == (64,)
    assert blocks.kernel_page_sizes("sm100", 256, causal=True, window=1024).tma == (128,)
    assert blocks.preferred_block_size(
        "sm100", "bfloat16", 256, qhead_per_kvhead=2, window=1024, cache=tmp_path
    ) == 128
    fp8 = blocks.supported_block_sizes(
        "sm100", "float8_e4m3fn", 128, qhead_per_kvhead=4, cache=tmp_path
    )
    assert fp8.tma == (128,) and fp8.any_size
    # nothing for sm90 in this store, nor for a bf16 version of the FP8 layer
    assert blocks.supported_block_sizes("sm90", "bfloat16", 256, qhead_per_kvhead=2,
                                        window=1024, cache=tmp_path).tma == ()
    assert blocks.supported_block_sizes("sm100", "bfloat16", 128, qhead_per_kvhead=4,
                                        cache=tmp_path).tma == ()


def test_sm103_needs_its_sm_count(tmp_path, stub):
    _build(tmp_path, arch="sm103", num_sms=160)
    with pytest.raises(NumSmsRequired, match="--num-sms"):
        blocks.supported_block_sizes("sm103", "bfloat16", 256, qhead_per_kvhead=2,
                                     window=1024, cache=tmp_path)
    bs = blocks.supported_block_sizes("sm103", "bfloat16", 256, qhead_per_kvhead=2,
                                      window=1024, cache=tmp_path, num_sms=160)
    assert bs.tma == (128,) and bs.any_size


MLA_SPEC = """
name = "mla-paged"
[[attention]]
name = "mla"
num_q_heads = 20
num_kv_heads = 1
head_dim = 64
qv = 512
[serving]
layouts = ["paged"]
phases = ["decode"]
page_sizes = [64, 128]
max_batch = 512
max_context = 8192
"""


def test_mla_block_sizes(tmp_path, stub):
    bs = blocks.supported_block_sizes("sm100", "bfloat16", 64, 512, qv=512, cache=tmp_path,
                                      qhead_per_kvhead=20)
    assert bs.tma == () and not bs.any_size and "page 128 is TMA on every route" in bs.note
    spec = parse_spec(MLA_SPEC, "mla.toml")
    _, _, results = B.build([spec], arch="sm100", root=tmp_path, jobs=1)
    assert results and {r.status for r in results} == {"built"}, results
    # GLM's ratio 20: the 2CTA kernels padded to 32 and FA4's own 1CTA ones at 20 (large batch)
    bs = blocks.supported_block_sizes("sm100", "bfloat16", 64, 512, qv=512, cache=tmp_path,
                                      qhead_per_kvhead=20)
    assert 128 in bs.tma and bs.serves(128) and bs.any_size and bs.serves(64)
    assert any(r.startswith("2cta/decode/ratio32") for r in bs.regimes), bs.regimes
    assert all(r.split("/")[2] in ("ratio20", "ratio32") for r in bs.regimes)
    none = blocks.supported_block_sizes("sm100", "bfloat16", 64, 512, qv=512, cache=tmp_path,
                                        qhead_per_kvhead=2)  # nothing built at ratio 2
    assert none.tma == () and not none.any_size
    assert blocks.preferred_block_size("sm100", "bfloat16", 64, 512, qv=512) == 128
    rule = blocks.kernel_page_sizes("sm103", 64, 512, qv=512)
    assert rule.tma == (128,) and rule.any_size and "kb64" in rule.note
    for f in (blocks.supported_block_sizes, blocks.preferred_block_size):
        with pytest.raises(UnsupportedVariant, match="sm100-only"):
            f("sm90", "bfloat16", 64, 512, qv=512, cache=tmp_path)
    with pytest.raises(UnsupportedVariant, match="tensor memory"):
        blocks.kernel_page_sizes("sm100", 512)
