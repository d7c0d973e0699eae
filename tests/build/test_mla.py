"""Absorbed MLA (qv) layers: spec validation, sm90 refusal, and on sm100 the kernels FA4's own
MLA entry compiles for the GLM-4.7-Flash and DeepSeek-V3 specs (traced under FakeTensorMode in
a subprocess configured for sm100; one kernel cross-compiled for real)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fa4aot.errors import SpecError
from fa4aot.model.specs import default_spec_names, load_default, parse_spec
from fa4aot.build.enumerate import enumerate_variants

MLA = """
name = "m"
[[attention]]
num_q_heads = 16
num_kv_heads = 1
head_dim = 64
qv = 512
{extra}
"""


def test_default_mla_specs_match_the_model_configs():
    glm, ds = load_default("glm-4.7-flash"), load_default("deepseek-v3")
    (g,), (d,) = glm.attention, ds.attention
    assert (g.num_q_heads, g.num_kv_heads, g.head_dim, g.head_dim_v, g.qv) == (20, 1, 64, 512, 512)
    assert glm.serving.tp == (1, 2, 4)
    assert (d.num_q_heads, d.head_dim, d.qv) == (128, 64, 512) and ds.serving.tp == (8,)
    assert {"glm-4.7-flash", "deepseek-v3"} <= set(default_spec_names())


@pytest.mark.parametrize(
    "extra, field, words",
    [
        ("", None, None),
        ("head_dim_v = 512", None, None),
        ("qv = 256", "qv", "512"),
        ("head_dim_v = 128", "head_dim_v", "latent"),
        ("window = 128", "window", "local window"),
        ("softcap = 30.0", "softcap", "softcap"),
    ],
)
def test_mla_spec_validation(extra, field, words):
    text = MLA.format(extra=extra)
    if extra.startswith("qv"):
        text = text.replace("qv = 512\n", "")
    if field is None:
        (a,) = parse_spec(text, "m.toml").attention
        assert (a.head_dim, a.head_dim_v, a.qv) == (64, 512, 512)
        return
    with pytest.raises(SpecError, match=f"m.toml: attention\\[0\\]\\.{field}: .*{words}"):
        parse_spec(text, "m.toml")


def test_mla_needs_rope_64_and_one_latent_kv_head():
    with pytest.raises(SpecError, match="head_dim: .*rope.*64"):
        parse_spec(MLA.format(extra="").replace("head_dim = 64", "head_dim = 128"), "m.toml")
    with pytest.raises(SpecError, match="num_kv_heads: .*one latent"):
        parse_spec(MLA.format(extra="").replace("num_kv_heads = 1", "num_kv_heads = 2"), "m.toml")


def test_spec_identity_unchanged_without_qv():
    s = load_default("llama-3.1-8b")
    assert '"qv"' not in s.identity()


@pytest.mark.parametrize("name", ["glm-4.7-flash", "deepseek-v3"])
def test_mla_is_unsupported_on_sm90_with_the_reason(name):
    p = enumerate_variants(load_default(name), "sm90")
    assert p.needs == []
    (u,) = p.unsupported
    assert "sm100-only" in u.reason and "MLA" in u.reason and u.served_by is None


@pytest.mark.parametrize("arch", ["sm100", "sm103"])
def test_build_stores_mla_on_blackwell(arch):
    """(tests/build/test_mla_build.py checks what; here: that it does)"""
    plan = enumerate_variants(load_default("deepseek-v3"), arch)
    assert plan.unsupported == [] and plan.needs and all(n.variant.mla for n in plan.needs)


_TRACE = r"""
import json, sys
from fa4aot.fa4 import driver
from fa4aot.build import mla
from fa4aot.fa4.cubin import cubin_targets
from fa4aot.model.specs import load_default
driver.configure("sm100", 148)
out = {}
for name in ("glm-4.7-flash", "deepseek-v3"):
    calls = mla.probe_calls(load_default(name), "sm100")
    needs, refused = mla.mla_plan(driver.trace_mla(calls))
    out[name] = {
        "calls": len(calls), "kernels": len(needs),
        "refused_ratios": sorted({r.call.num_heads for r in refused}),
        "refused_reasons": sorted({r.reason.split(" at ")[-1] for r in refused}),
        "kernel_ratios": sorted({n.call.num_heads for n in needs}),
        "layouts": sorted({(n.call.layout, n.call.return_lse) for n in needs}),
        "phases": sorted({n.call.seqlen_q > 4 for n in needs}),
    }
    if name == "deepseek-v3":  # one decode kernel for real
        c = next(n.call for n in needs if n.call.batch == 1 and n.call.seqlen_q == 1)
        driver.trace_mla([c], compile=True, outdir=sys.argv[1])
        out["cubin"] = [x.target for x in cubin_targets(sys.argv[1] + "/0/fwd.o")]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_sm100_mla_kernels_traced_and_one_cross_compiled(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    r = subprocess.run(
        [sys.executable, "-c", _TRACE, str(tmp_path)], capture_output=True, text=True, env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    ds, glm = got["deepseek-v3"], got["glm-4.7-flash"]
    # DeepSeek-V3 at TP 8: 16 heads per latent head, every probe compiles (2CTA and 1CTA routes)
    assert ds["refused_ratios"] == [] and ds["kernel_ratios"] == [16] and ds["kernels"] >= 8
    assert ds["layouts"] == [["paged", False], ["paged", True], ["varlen", False],
                             ["varlen", True]]
    assert ds["phases"] == [False, True]  # decode and prefill kernels
    # GLM-4.7-Flash's 20/10/5 heads: FA4's 2CTA MLA kernel needs a ratio dividing 128, so most
    # of its calls are refused; padding them to 32/16/8 (select.mla_padded_ratio) is the way
    assert glm["refused_ratios"] == [5, 10, 20]
    assert any("cluster_tile_m" in s for s in glm["refused_reasons"])
    assert got["cubin"] == ["sm_100a"]
