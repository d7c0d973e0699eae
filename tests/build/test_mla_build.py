"""Absorbed-MLA (qv) kernels as store entries on Blackwell (issue 15 item 1): enumeration from
the default MLA specs, compile-key parity with FA4 on the CPU, and install() serving FA4's own
`flash_attn_varlen_func(q, k, v, qv=...)` from a store.

The enumerator models FA4's route between its three MLA kernels (variants.mla_features); here
FA4 itself is traced under FakeTensorMode in a subprocess configured for sm100 (compile
stubbed) and every probe call's key is compared with the model: same refusals (FA4's assertion
named), same Variant, and each variant's representative call traces to the same key. One
kernel is cross-compiled for real (its cubin read: sm_100a) into a store, and install() then
serves an MLA call of that variant from it, and refuses (and logs) one it lacks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fa4aot.model import constraints as C
from fa4aot.build.builder import plan_for
from fa4aot.model.specs import load_default, resolve_specs
from fa4aot.model.variants import Variant
from fa4aot.build.enumerate import enumerate_variants
from fa4aot.model.compile_keys import MLA_1CTA_BATCH, representative_call

MLA_SPECS = ("glm-4.7-flash", "deepseek-v3")


def _run(script: str, *args: str, timeout: int = 300) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    env = {k: v for k, v in env.items() if not k.startswith("FA4AOT_")}
    r = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_sm90_plan_is_unchanged():
    plan = plan_for(resolve_specs(None), "sm90")
    assert len(plan.variants()) == 154
    assert not any(n.variant.mla for n in plan.needs)
    mla = [u for u in plan.unsupported if u.spec in MLA_SPECS]
    assert len(mla) == 2 and all("sm100-only" in u.reason for u in mla)


@pytest.mark.parametrize("arch", ["sm100", "sm103"])
def test_default_mla_specs_enumerate_on_blackwell(arch):
    ds = enumerate_variants(load_default("deepseek-v3"), arch)
    assert ds.unsupported == []  # ratio 16 divides 128: FA4 takes every call
    dsv = [n.variant for n in ds.variants().values()]
    assert {v.mla for v in dsv} == set(C.MLA_ROUTES) and {v.qhead_per_kvhead for v in dsv} == {16}
    # decode and prefill, varlen and paged (TMA page 128 and cp.async page 64), LSE both
    assert {v.phase for v in dsv} == {"decode", "prefill"}
    assert {(v.layout, v.paged_tma, v.return_lse) for v in dsv} == {
        (lay, tma, lse) for lay, tma in [("varlen", None), ("paged", True), ("paged", False)]
        for lse in (False, True)
    }
    assert {(v.mla_q_stage, v.static_persistent) for v in dsv if v.mla == "2cta"} == {
        (1, True), (2, True), (2, False)
    }
    glm = enumerate_variants(load_default("glm-4.7-flash"), arch)
    ratios = {n.variant.qhead_per_kvhead for n in glm.needs}
    assert ratios == {5, 10, 20, 8, 16, 32}  # FA4's 1CTA kernels at 5/10/20, padded 8/16/32
    by_ratio = {}
    for n in glm.needs:
        by_ratio.setdefault(n.variant.qhead_per_kvhead, set()).add(n.variant.mla)
    assert all(by_ratio[r] == {"1cta", "1cta-kb64"} for r in (5, 10, 20))
    assert all(by_ratio[r] == set(C.MLA_ROUTES) for r in (8, 16, 32))
    rows = sorted(glm.unsupported, key=lambda u: u.reason)
    assert [u.reason.split()[0] for u in rows] == ["10", "20", "5"]
    for u, r2 in zip(rows, (16, 32, 8)):
        assert "flash_fwd_mla_sm100.py:214" in u.reason and "cluster_tile_m" in u.reason
        assert u.served_by.startswith(f"padding {u.reason.split()[0]} -> {r2} ")
    # the padded ratio 16 is DeepSeek-V3's own: one set of kernels serves both specs
    assert {n.variant.id for n in ds.needs} <= {n.variant.id for n in glm.needs}


def test_mla_variant_ids_and_representative_calls():
    plan = plan_for([load_default(n) for n in MLA_SPECS], "sm100")
    vs = [n.variant for n in plan.variants().values()]
    assert all(v.mla for v in vs) and len(vs) == 114
    for n in plan.variants().values():
        v = n.variant
        assert Variant.from_dict(json.loads(json.dumps(v.to_dict()))) == v
        call = representative_call(v)
        assert call == n.call and call.qv == 512
        # the batches (1: 2CTA; MLA_1CTA_BATCH: 1CTA) route alike on any real SM count
        for sms in (8, 132, 148, 160, 2 * MLA_1CTA_BATCH - 1):
            assert call.variant("sm100", sms) == v, (v.describe(), sms)
    # an MLA variant's id differs from the same features without qv
    d = vs[0].to_dict()
    d.update(mla=None, mla_q_stage=None)
    assert Variant.from_dict(d).id != vs[0].id


def test_mla_features_refuse_what_is_not_modelled():
    base = load_default("deepseek-v3")
    call = next(iter(enumerate_variants(base, "sm100").variants().values())).call
    from dataclasses import replace

    with pytest.raises(ValueError, match="sm100-only"):
        call.variant("sm90")
    with pytest.raises(ValueError, match="dtype"):
        replace(call, dtype="float8_e4m3fn").variant("sm100")
    with pytest.raises(ValueError, match="latent KV heads"):
        replace(call, num_heads_kv=2, num_heads=32).variant("sm100")
    with pytest.raises(ValueError, match="packs q"):
        replace(call, batch_q=True)
    with pytest.raises(ValueError, match="cluster_tile_m"):
        replace(call, num_heads=20, batch=1).variant("sm100")


def test_mla_store_entries_from_a_stub_build(tmp_path, knobs):
    """`fa4aot build --arch sm100` stores the MLA variants (stub compiler: the store, records and
    spec index are the real code; coverage counts no stub as a hit)."""
    from click.testing import CliRunner

    from fa4aot.cli import main

    knobs(stub_compiler="1", stub_delay="0")
    r = CliRunner().invoke(main, ["build", "--spec", "deepseek-v3", "--arch", "sm100",
                                  "--cache", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    from fa4aot.store.layers import stores_at

    (store,) = stores_at(tmp_path)
    recs = [a.record for _, a in store.iter_artifacts()]
    assert len(recs) == 28 and all(rec["variant"]["mla"] for rec in recs)
    assert all(rec["representative_call"]["qv"] == 512 for rec in recs)
    index = json.loads(store.spec_index("deepseek-v3").read_text())
    assert index["variants"] == sorted(rec["id"] for rec in recs) and index["unsupported"] == []
    glm = [u for u in plan_for([load_default("glm-4.7-flash")], "sm100").unsupported]
    assert len(glm) == 3  # its index would list the refused ratios with FA4's reason


_PARITY = r"""
import json, sys, dataclasses
from fa4aot.fa4 import driver, keys
from fa4aot.build import mla
from fa4aot.build.builder import plan_for
from fa4aot.model.specs import load_default
arch = sys.argv[1]
driver.configure(arch, 148)
specs = [load_default(n) for n in ("glm-4.7-flash", "deepseek-v3")]
probes = [c for s in specs for c in mla.probe_calls(s, arch)]
# the padded ratios and a few more (one latent head: 1..128), at FA4's probe shapes
probes += [dataclasses.replace(c, num_heads=r) for c in probes if c.num_heads == 20
           for r in (1, 2, 8, 32, 64, 128)]
plan = plan_for(specs, arch)
reps = {vid: n.call for vid, n in plan.variants().items()}
import cutlass.cute as cute
real = cute.compile
cute.compile = lambda *a, **k: (lambda *x, **y: None)
def trace(call):
    caches = driver._caches()
    for c in caches.values():
        c.clear()
    driver.fake_call(call)
    return {n: list(c.cache) for n, c in caches.items()}
rep_keys, bad = {}, []
for vid, call in reps.items():
    got = trace(call)
    if len(got["fwd"]) != 1 or any(got[n] for n in got if n != "fwd"):
        bad.append(f"rep {vid}: {[(n, len(k)) for n, k in got.items()]}")
        continue
    rep_keys[vid] = keys.key_repr(got["fwd"][0])
    if keys.variant_from_fa4_key(got["fwd"][0], arch) != plan.variants()[vid].variant:
        bad.append(f"rep key -> variant differs: {plan.variants()[vid].variant.describe()}")
taken = refused = 0
covered = set()
for p in probes:
    try:
        want = p.to_call().variant(arch, 148)
        model_error = None
    except ValueError as e:
        want, model_error = None, str(e)
    try:
        got = trace(p.to_call())
        fa4_error = None
    except (AssertionError, ValueError, NotImplementedError) as e:
        import traceback, pathlib
        fr = traceback.extract_tb(e.__traceback__)[-1]
        fa4_error = f"{pathlib.Path(fr.filename).name}:{fr.lineno}"
    if (model_error is None) != (fa4_error is None):
        bad.append(f"{p}: model {model_error}, FA4 {fa4_error}")
        continue
    if fa4_error is not None:
        refused += 1
        if fa4_error not in model_error:
            bad.append(f"reason: FA4 {fa4_error}, model {model_error}")
        continue
    taken += 1
    key = got["fwd"][0]
    if keys.variant_from_fa4_key(key, arch) != want:
        bad.append(f"{p}: key -> {keys.variant_from_fa4_key(key, arch)}, model {want}")
    if want.id in rep_keys:
        covered.add(want.id)
        if rep_keys[want.id] != keys.key_repr(key):
            bad.append(f"{p}: FA4 key differs from its variant's representative call's")
    elif p.num_heads in (5, 8, 10, 16, 20, 32):  # the default specs' ratios and padded ones
        bad.append(f"{p}: variant {want.describe()} not in the plan")
cute.compile = real
print(json.dumps({"probes": len(probes), "taken": taken, "refused": refused,
                  "variants": len(reps), "covered": len(covered), "bad": bad[:10]}))
"""


@pytest.mark.parametrize("arch", ["sm100", "sm103"])
def test_fa4_mla_keys_map_to_the_enumerated_variants(arch):
    got = _run(_PARITY, arch)
    assert got["bad"] == [], got["bad"]
    # 384 probe calls of the two specs (138 taken), 576 more at other ratios
    assert got["probes"] == 960 and got["refused"] >= 246 and got["taken"] >= 138 + 500, got
    assert got["variants"] == 114 and got["covered"] >= 90


_NO_HINT = r"""
import json, sys
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from fa4aot.fa4 import driver, keys
from fa4aot.model.compile_keys import features
driver.configure("sm100", 148)
_, I = driver._fa4()
import cutlass.cute as cute
cute.compile = lambda *a, **k: (lambda *x, **y: None)
out = []
# (batch, total_q, max_seqlen_q): no host hint with most sequences empty, with a hint, small
for b, tq, msq in ((100, 2, None), (100, 2, 1), (100, 3, None), (1, 1, None), (200, 200, None)):
    I._flash_attn_fwd.compile_cache.clear()
    with FakeTensorMode():
        def t(*shape, dt=torch.bfloat16):
            return torch.empty(*shape, dtype=dt, device="cuda")
        I._flash_attn_fwd(
            t(tq, 16, 64), t(b * 50, 1, 64), t(b * 50, 1, 512), qv=t(tq, 16, 512),
            cu_seqlens_q=t(b + 1, dt=torch.int32), cu_seqlens_k=t(b + 1, dt=torch.int32),
            max_seqlen_q=msq, max_seqlen_k=50, causal=True, _arch=100,
        )
    (key,) = I._flash_attn_fwd.compile_cache.cache
    fa4 = keys.variant_from_fa4_key(key, "sm100")
    mine = features(arch="sm100", dtype="bfloat16", head_dim=64, head_dim_v=512, qv=512,
                    num_heads=16, num_heads_kv=1, causal=True, window_left=None,
                    window_right=None, return_lse=False, sink_dtype=None, batch=b,
                    seqlen_q=None, total_q=tq, max_seqlen_q=msq, cu_seqlens_q=True,
                    cu_seqlens_k=True, num_sms=148)
    out.append([b, tq, msq, fa4.mla, mine.mla, fa4 == mine])
print(json.dumps(out))
"""


def test_mla_route_without_a_max_seqlen_q_hint_follows_fa4():
    """Without a host max_seqlen_q FA4 routes by total_q (its default for the hint), not as
    prefill: 100 sequences holding 2 query rows in all take its 1CTA kernel. The runtime keys
    and plans such calls from the same model (variants.mla_features)."""
    rows = _run(_NO_HINT)
    assert all(same for *_, same in rows), rows
    routes = {(b, tq, msq): fa4 for b, tq, msq, fa4, _, _ in rows}
    assert routes[(100, 2, None)] == "1cta" and routes[(100, 2, 1)] == "1cta-kb64"
    assert routes[(1, 1, None)] == routes[(200, 200, None)] == "2cta"


_INSTALL = r"""
import json, sys
from pathlib import Path
from fa4aot import settings
from fa4aot.fa4 import driver, keys
from fa4aot.fa4 import cubin
from fa4aot.build.builder import build, plan_for
from fa4aot.model.specs import load_default
from fa4aot.model.needs import Plan
root, log = Path(sys.argv[1]), sys.argv[2]
spec = load_default("deepseek-v3")
full = plan_for([spec], "sm100")
(need,) = [n for n in full.needs if n.variant.mla == "2cta" and n.variant.paged
           and n.variant.paged_tma and n.variant.return_lse and n.variant.mla_q_stage == 1]
store, _, results = build([spec], arch="sm100", root=root, jobs=1, num_sms=148,
                          plan=Plan(needs=[need]))
assert [r.status for r in results] == ["built"], [r.error for r in results]
(art,) = [a for _, a in store.iter_artifacts()]
targets = [c.target for c in cubin.cubin_targets(art.part_path("fwd"))]

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
import flash_attn.cute as fa
import fa4aot

def mla_call(b, sq, sk, page=128):
    with FakeTensorMode():
        e = lambda *s, dt=torch.bfloat16: torch.empty(*s, dtype=dt, device="cuda")
        n = -(-sk // page)
        fa.flash_attn_varlen_func(
            e(b * sq, 16, 64), e(b * n, page, 1, 64), e(b * n, page, 1, 512),
            qv=e(b * sq, 16, 512), cu_seqlens_q=e(b + 1, dt=torch.int32), max_seqlen_q=sq,
            page_table=e(b, n, dt=torch.int32), seqused_k=e(b, dt=torch.int32),
            max_seqlen_k=sk, causal=True, return_lse=True)

with settings.scope(miss_log=log):
    counters = fa4aot.install(cache=root, on_miss="error", arch="sm100", num_sms=148)
    try:
        mla_call(3, 1, 777)       # a decode step: the stored 2CTA kernel
        mla_call(5, 2, 4000)      # speculative decode, 2 tokens: the same kernel
        hits, compiles, misses = counters.hits, counters.compiles, list(counters.misses)
        try:
            mla_call(2, 4096, 4096)  # prefill: not stored
            refused = None
        except fa4aot.ArtifactMissing as e:
            refused = str(e)
    finally:
        fa4aot.uninstall()
from fa4aot.store.misses import read_misses
(missed,) = read_misses(log)
print(json.dumps({"id": need.variant.id, "record_id": art.id, "targets": targets,
                  "hits": hits, "compiles": compiles, "misses": misses, "refused": refused,
                  "missed": missed.describe(), "missed_mla": missed.mla}))
"""


@pytest.mark.slow
def test_one_mla_kernel_cross_compiled_and_served_by_install(tmp_path):
    got = _run(_INSTALL, str(tmp_path / "store"), str(tmp_path / "misses.jsonl"))
    assert got["record_id"] == got["id"]
    assert got["targets"] == ["sm_100a"]
    # both calls ran FA4's lookup of the stored kernel: loaded once (a hit), then held
    assert got["hits"] == 1 and got["compiles"] == 0 and got["misses"] == []
    assert got["refused"] and "nothing was compiled" in got["refused"]
    # the miss names the MLA variant FA4 wanted: --from-misses can build it
    assert got["missed_mla"] == "2cta" and "prefill" in got["missed"]


def test_the_1cta_routes_follow_the_sm_count():
    """FA4 routes decode shapes to its 1CTA kernels past one wave of 2CTA clusters (2 x batch >
    SMs): with max_batch 70, a 148-SM B200 never gets there, a 132-SM part does."""
    spec = load_default("deepseek-v3")
    from dataclasses import replace

    spec = replace(spec, serving=replace(spec.serving, max_batch=70))
    routes = {sms: {n.variant.mla for n in enumerate_variants(spec, "sm100", sms).needs}
              for sms in (None, 148, 132)}
    assert routes[None] == routes[148] == {"2cta"}
    assert routes[132] == set(C.MLA_ROUTES)
    # sm103 has no default SM count: the 1CTA routes are assumed reachable (built, not missed)
    assert {n.variant.mla for n in enumerate_variants(spec, "sm103").needs} == set(C.MLA_ROUTES)
