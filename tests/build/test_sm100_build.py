"""Blackwell build-side variants (issue 15 items 3-4): FP8 with descales, FA4's native split-KV.

Nothing here runs a kernel. FA4's real entry is traced under FakeTensorMode in a subprocess
configured for sm100 (this process may already target sm90), with cute.compile stubbed (about
10 ms a call): for every FP8 and split probe call the enumerator makes, FA4's compile key maps
back to the call's Variant (`keys.variant_from_fa4_key` == `features()`), and the variant's
representative call (what the builder compiles) traces to the same forward key, with FA4's
combine kernel beside exactly the split ones. Then one FP8 split artifact and its non-split twin
are cross-compiled for real into a store and each part's cubin target is read (sm_100a).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fa4aot.build.builder as B
from fa4aot.model import constraints as C
from fa4aot import settings
from fa4aot.fa4 import cubin
from fa4aot.model.specs import SpecError, load_default, parse_spec
from fa4aot.model.variants import Variant
from fa4aot.build.enumerate import enumerate_variants
from fa4aot.model.needs import Plan
from fa4aot.model.compile_keys import Call, representative_call

FP8_SPEC = """
name = "fp8-grid"
[[attention]]
name = "full"
num_q_heads = 32
num_kv_heads = 8
head_dim = 128
dtype = "float8_e4m3fn"
[[attention]]
name = "sliding"
num_q_heads = 16
num_kv_heads = 16
head_dim = 64
dtype = "float8_e4m3fn"
window = 512
sinks = true
[serving]
tp = [1, 8]
max_batch = 512
page_sizes = [16, "tile"]
speculative = 4
return_lse = "both"
"""


def _fp8_spec():
    return parse_spec(FP8_SPEC, "fp8-grid.toml")


def test_fp8_spec_builds_descaled_variants_on_blackwell_only():
    spec = _fp8_spec()
    for arch in ("sm100", "sm103"):
        plan = enumerate_variants(spec, arch)
        vs = [n.variant for n in plan.variants().values()]
        assert not plan.unsupported and vs
        assert {v.dtype for v in vs} == {"float8_e4m3fn"} and {v.descales for v in vs} == {"qkv"}
        assert any(v.split_kv for v in vs) and any(v.paged_tma is False for v in vs)
    plan = enumerate_variants(spec, "sm90")
    assert not plan.needs and len(plan.unsupported) == 2
    assert all("sm100-only" in u.reason and "FP8" in u.reason for u in plan.unsupported)


def test_new_fields_leave_old_ids_alone():
    """Stores are keyed by variant id: the new fields at their defaults are not in it."""
    v = Call(
        layout="dense", batch=1, seqlen_q=1, seqlen_k=256, num_heads=4, num_heads_kv=1,
        head_dim=128, head_dim_v=128, dtype="bfloat16", causal=True, window_left=None,
        window_right=None, return_lse=False, sink_dtype=None,
    ).variant("sm90")
    assert v.descales is None and not v.split_kv and v.s_ping_pong is None
    d = v.to_dict()
    for k in ("descales", "split_kv", "s_ping_pong", "mla", "mla_q_stage", "tile_m", "two_cta",
              "kv_dtype"):
        del d[k]
    assert Variant.from_dict(d) == v  # records written before the fields still load
    import hashlib

    for k in ("softcap", "pack_gqa"):
        del d[k]
    blob = json.dumps({"schema": 1, **d}, sort_keys=True, separators=(",", ":"))
    assert v.id == hashlib.sha256(blob.encode()).hexdigest()[:16]  # the schema-1 formula


def test_features_refuse_what_fa4aot_does_not_model():
    base = dict(
        arch="sm100", dtype="bfloat16", head_dim=128, head_dim_v=128, num_heads=4,
        num_heads_kv=1, causal=True, window_left=None, window_right=None, return_lse=False,
        sink_dtype=None, batch=1, seqlen_q=1, total_q=1, max_seqlen_q=None,
    )
    from fa4aot.model.compile_keys import features

    with pytest.raises(ValueError, match="FP8"):
        features(**base, descales="qkv")  # descales with bf16: FA4 asserts the same
    with pytest.raises(ValueError, match="sm100-only"):
        features(**{**base, "arch": "sm90"}, num_splits=4, max_seqlen_k=4096)
    with pytest.raises(ValueError, match="equal head dims"):
        features(**{**base, "head_dim": 192}, num_splits=4, max_seqlen_k=4096)
    with pytest.raises(ValueError, match="batch form"):
        features(**{**base, "cu_seqlens_q": True}, num_splits=4, max_seqlen_k=4096)
    v = features(**base, num_splits=4, max_seqlen_k=4 * 64 * 128)
    assert v.split_kv and v.s_ping_pong and v.phase == "decode"
    assert not features(**base, num_splits=5, max_seqlen_k=4 * 64 * 128).s_ping_pong


def test_every_new_variant_has_a_representative_call():
    for arch in ("sm100", "sm103"):
        for spec in (_fp8_spec(), *map(load_default, ("llama-3.1-8b", "gpt-oss-20b", "gemma-4"))):
            for n in enumerate_variants(spec, arch).needs:
                v = n.variant
                if v.split_kv or v.descales:
                    assert representative_call(v).variant(arch) == v, v.describe()
                    assert n.call.variant(arch) == v


_PARITY = r"""
import json, sys
from fa4aot.fa4 import driver, dropin, keys
from fa4aot.model.specs import load_default, parse_spec
from fa4aot.build.enumerate import _probe_calls
from fa4aot.model.compile_keys import representative_call
driver.configure("sm100", 148)
specs = [parse_spec(sys.argv[1], "fp8-grid.toml")]
specs += [load_default(n) for n in ("llama-3.1-8b", "gpt-oss-20b", "gemma-4", "mistral-7b")]
calls = []
for s in specs:
    for a in s.attention:
        if a.qv is None and a.head_dim <= 256 and a.head_dim_v <= 256:
            calls += [c for c in _probe_calls(s, a, "sm100") if c.descales or c.num_splits > 1]
reps = {}
for c in calls:
    v = c.variant("sm100")
    reps.setdefault(v.id, representative_call(v))
got = driver.trace_raw_keys(calls + list(reps.values()))
bad, kinds = [], set()
for c, k in zip(calls, got):
    want = c.variant("sm100")
    kinds.add((want.dtype, want.split_kv, bool(want.s_ping_pong), want.layout))
    if len(k["fwd"]) != 1:
        bad.append(f"{want.describe()}: {len(k['fwd'])} forward keys")
        continue
    if keys.variant_from_fa4_key(k["fwd"][0], "sm100") != want:
        bad.append(f"key->variant differs: {want.describe()} vs "
                   f"{keys.variant_from_fa4_key(k['fwd'][0], 'sm100')}")
    if bool(k["combine"]) != want.split_kv:
        bad.append(f"combine presence: {want.describe()}")
    r = got[len(calls) + list(reps).index(want.id)]
    if [keys.key_repr(x) for x in r["fwd"]] != [keys.key_repr(k["fwd"][0])]:
        bad.append(f"representative call traces elsewhere: {want.describe()}")
    if want.split_kv and [x[7] for x in r["combine"]] != [7]:
        bad.append(f"combine not built for 128 splits: {want.describe()}")
# FA4's split heuristic (num_splits=0) against constraints.native_num_splits
from types import SimpleNamespace
from flash_attn.cute import interface as I
from fa4aot.model import constraints as C
for b_, hk, r, sq, sk, d in [(1, 8, 4, 1, 131072, 128), (1, 1, 16, 1, 4096, 64),
                             (4, 8, 1, 4, 65536, 128), (64, 8, 4, 1, 8192, 128),
                             (1, 2, 2, 1, 512, 256), (2, 4, 8, 40, 30000, 64)]:
    cfg = I._get_fwd_config(
        arch=100, head_dim=d, head_dim_v=d, max_seqlen_q=sq, max_seqlen_k=sk, num_head_kv=hk,
        qhead_per_kvhead=r, pack_gqa=r > 1, batch_size=b_, causal=True, local=False,
        window_size_left=None, window_size_right=None, num_splits=0,
        device=SimpleNamespace(index=0), seqlen_q=sq)
    mine = C.native_num_splits("sm100", batch=b_, num_heads_kv=hk, qhead_per_kvhead=r,
                               seqlen_q=sq, max_seqlen_k=sk, head_dim=d, num_sms=148)
    if cfg.num_splits != mine:
        bad.append(f"num_splits for {(b_, hk, r, sq, sk, d)}: FA4 {cfg.num_splits}, ours {mine}")
print(json.dumps({"calls": len(calls), "variants": len(reps), "bad": bad[:20],
                  "kinds": sorted(map(list, kinds))}))
"""


def _run(script: str, *args: str, timeout: int = 600) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    r = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_fa4_keys_of_fp8_and_split_calls_map_to_their_variants():
    got = _run(_PARITY, FP8_SPEC)
    assert got["bad"] == [], got["bad"]
    assert got["calls"] > 100 and got["variants"] > 40
    kinds = {tuple(k) for k in got["kinds"]}
    # FP8 non-split and split, bf16 split, ping-pong or not, dense / varlen / paged K
    assert ("float8_e4m3fn", False, False, "paged") in kinds
    assert ("float8_e4m3fn", True, True, "dense") in kinds
    assert ("bfloat16", True, False, "paged") in kinds
    assert ("bfloat16", True, True, "varlen") in kinds


# one FP8 layer, dense decode: its decode kernel and its native split kernel (no ping-pong:
# max_context is below 2 splits of 16 blocks), with FA4's combine; only the split one is
# compiled (its forward is an FP8 descaled kernel too: both new kinds in one artifact)
TINY_FP8_SPLIT = """
name = "tiny-fp8-split"
[[attention]]
name = "full"
num_q_heads = 2
num_kv_heads = 1
head_dim = 64
dtype = "float8_e4m3fn"
[serving]
layouts = ["dense"]
phases = ["decode"]
max_context = 2048
decode_fold = false
"""


@pytest.mark.slow
def test_fp8_and_split_artifacts_carry_sm100_cubins(tmp_path):
    spec = parse_spec(TINY_FP8_SPLIT, "tiny-fp8-split.toml")
    plan = enumerate_variants(spec, "sm100")
    assert sorted(n.variant.split_kv for n in plan.needs) == [False, True]
    plan = Plan(needs=[n for n in plan.needs if n.variant.split_kv])
    # jobs=2: a spawned worker configured for sm100 (this process may target sm90 already)
    with settings.scope(stub_compiler=None):
        store, _, results = B.build(
            [spec], arch="sm100", root=tmp_path, jobs=2, num_sms=148, plan=plan
        )
    assert [r.status for r in results] == ["built"], [r.error for r in results]
    (art,) = [a for _, a in store.iter_artifacts()]
    assert not isinstance(art, Exception), art
    v = Variant.from_dict(art.record["variant"])
    assert v.descales == "qkv" and v.split_kv and v.dtype == "float8_e4m3fn"
    parts = art.record["parts"]
    assert sorted(parts) == ["combine", "fwd"]
    for name in parts:
        assert cubin.target_problem(art.part_path(name), C.cubin_target("sm100")) is None
        (c,) = cubin.cubin_targets(art.part_path(name))
        assert c.sm == 100 and c.arch_specific
    comb = parts["combine"]
    assert comb["max_splits"] == C.MAX_NATIVE_SPLITS and comb["partial_dtype"] == "float32"
    # the builder records the forward's Blackwell key facts, and they are the runtime's model
    from fa4aot.runtime import plan as P

    rec = parts["fwd"]["abi"]
    assert rec["split_kv"] and rec["tile_m"] == 128 and rec["pack_gqa"]
    assert not rec["num_splits_dynamic"] and not rec["cu_total_m_blocks"]
    assert P.fwd_facts(v, art)["split_kv"]
    _runtime_and_install_serve_the_sm100_store(tmp_path, v)


def _runtime_and_install_serve_the_sm100_store(root, v):
    """In a fresh process (FA4 fixes its arch at import): the runtime loads the real sm100
    artifact as a Blackwell plan (forward and combine, with tvm-ffi; nothing runs), and
    fa4aot.install(arch="sm100") serves FA4's own entry point from the same store: the
    variant's representative call hits the forward and the combine, and compiles nothing."""
    import json
    import subprocess
    import sys

    code = f"""
import json
from pathlib import Path
from fa4aot.fa4 import driver, dropin, keys
from fa4aot.runtime import plan as P
from fa4aot.model.variants import Variant
from fa4aot.model.compile_keys import representative_call
import fa4aot
v = Variant.from_dict(json.loads({json.dumps(json.dumps(v.to_dict()))}))
rt = P.Runtime([Path({str(root)!r})], "error")
plan = rt.plan(v, 148)
assert plan is not None and plan.abi.blackwell and plan.special and plan.combine is not None
assert plan.facts["split_kv"] and plan.tile is None and plan.b2b is None
driver.configure("sm100", 148)
counters = fa4aot.install(cache=Path({str(root)!r}), on_miss="error", arch="sm100", num_sms=148)
from dataclasses import replace
call = representative_call(v)
try:
    driver.fake_call(call)
    first = [counters.hits, counters.compiles, list(counters.misses)]
    # FA4's combine key holds the call's head count and log_max_splits: other counts and
    # head counts are served by the stored 128-split combine (dropin._Installed.combine_for);
    # at the spec's max_context the forward stays the stored one (no ping-pong: few key blocks)
    for n, heads in ((3, 1), (16, 1), (40, 1), (16, 2)):
        driver.fake_call(replace(call, num_splits=n, seqlen_k=2048,
                                   num_heads=call.num_heads * heads,
                                   num_heads_kv=call.num_heads_kv * heads))
finally:
    fa4aot.uninstall()
print(json.dumps([first, counters.hits, counters.compiles, list(counters.misses), call.num_splits]))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    first, hits, compiles, misses, n = json.loads(r.stdout.strip().splitlines()[-1])
    assert first == [2, 0, []] and n == C.MAX_NATIVE_SPLITS, first
    # three new combine keys (log_max_splits 4 and 6 at its heads, 4 at twice them; hd64: 16-row
    # tiles, so at least 4), each served by the stored one; the forward's key is unchanged
    assert (hits, compiles, misses) == (5, 0, []), (hits, compiles, misses)


def test_spec_fp8_dtype_parsing():
    a = _fp8_spec().attention[0]
    assert a.dtype == "float8_e4m3fn"
    with pytest.raises(SpecError, match="dtype"):
        parse_spec(FP8_SPEC.replace('"float8_e4m3fn"', '"float8"', 1), "x.toml")
    # FP8 rows are 1 byte a element: FA4 needs head dims in multiples of 16
    odd = parse_spec(FP8_SPEC.replace("head_dim = 64", "head_dim = 72"), "x.toml")
    (u,) = enumerate_variants(odd, "sm100").unsupported
    assert "multiples of 16" in u.reason and u.layer == "sliding"


_HD256 = r"""
import json, sys
from dataclasses import replace
from fa4aot.fa4 import driver, dropin, keys
from fa4aot.model.compile_keys import Call, representative_call
sms = int(sys.argv[1])
driver.configure("sm100", sms)
calls = []
base = dict(seqlen_k=512, head_dim=256, head_dim_v=256, dtype="bfloat16", return_lse=False,
            sink_dtype=None)
for r in (2, 3, 6, 8):
    for hk in (1, 2, 8, 16):
        for b in (1, 2, 4, 5, 9, 10, 37, 38, 75, 76, 200):
            for sq in (1, 2, 200):
                for form in (dict(layout="dense"), dict(layout="varlen"),
                             dict(layout="paged", page_size=128, batch_q=True),
                             dict(layout="paged", page_size=64)):
                    for mask in (dict(causal=True, window_left=None, window_right=None),
                                 dict(causal=False, window_left=1024, window_right=0)):
                        calls.append(Call(batch=b, seqlen_q=sq, num_heads=r * hk,
                                          num_heads_kv=hk, **base, **form, **mask))
want = [c.variant("sm100", sms) for c in calls]
reps = {}
for v in want:
    reps.setdefault(v.id, representative_call(v, sms))
got = driver.trace_raw_keys(calls + list(reps.values()))
bad, kinds = [], set()
for c, v, k in zip(calls, want, got):
    mapped = keys.variant_from_fa4_key(k["fwd"][0], "sm100")
    kinds.add((v.two_cta, v.pack_gqa, v.static_persistent))
    if mapped != v:
        bad.append(f"{c}: ours {v.describe()}, FA4's {mapped and mapped.describe()}")
fwd_keys = {v.id: keys.key_repr(k["fwd"][0]) for v, k in zip(want, got)}
for (vid, rc), k in zip(reps.items(), got[len(calls):]):
    if keys.key_repr(k["fwd"][0]) != fwd_keys[vid]:
        bad.append(f"representative call of {vid} traces to another key: {rc}")
print(json.dumps({"calls": len(calls), "variants": len(reps), "bad": bad[:10],
                  "kinds": sorted(map(str, kinds))}))
"""


@pytest.mark.parametrize("sms", [148, 152])
def test_hd256_kernel_follows_the_batch_as_fa4_picks_it(sms):
    """On Blackwell FA4 picks an hd256 call's pack_gqa (ratios not dividing 128) and its 2CTA
    kernel (one M block) by 2 x batch x heads against the SM count; `features` models both
    (Variant.two_cta) and the runtime keys its plans by them (plan.hd256_class). FA4 traced
    under FakeTensorMode for 4224 calls around the turning batches (B200's and GB200's counts),
    each key mapped back to the call's variant; every variant's representative call traces to
    the same key."""
    got = _run(_HD256, str(sms), timeout=900)
    assert got["bad"] == [], got["bad"]
    assert got["calls"] == 4224 and got["variants"] > 20
    kinds = set(got["kinds"])
    # 2CTA and not, packed and not (FA4's own default turned off), persistent and not
    assert any("(True, False" in k for k in kinds) and any("(False, None" in k for k in kinds)
    assert any(k.startswith("(True, None, False") for k in kinds), kinds


def test_gemma4_hd256_layers_build_both_kernels_of_their_batch_range():
    """Gemma-4's hd256 sliding layers (16 KV heads at TP1) on sm100: decode at batch 1 runs the
    2CTA kernel, at 512 the 1CTA persistent one; the enumerator builds both per layout, as
    FA4 picks them (B200: 148 SMs; the turn is at 2 x batch x 16 > 148)."""
    spec = load_default("gemma-4")
    vs = [n.variant for n in enumerate_variants(spec, "sm100").needs
          if n.variant.head_dim == 256 and not n.variant.split_kv]
    for layout in ("dense", "varlen", "paged"):
        got = {v.two_cta for v in vs if v.layout == layout}
        assert got == {True, False}, (layout, got)
    # the dense 2CTA kernel is FA4's at any query length (the same key: LPT, not persistent)
    assert {v.phase for v in vs if v.layout == "dense" and v.two_cta} == {"any"}
    one = Call(layout="dense", batch=4, seqlen_q=1, seqlen_k=4096, num_heads=32,
               num_heads_kv=16, head_dim=256, head_dim_v=256, dtype="bfloat16", causal=True,
               window_left=1024, window_right=None, return_lse=False, sink_dtype=None)
    from dataclasses import replace

    assert one.variant("sm100", 148).two_cta  # 128 <= 148
    assert not replace(one, batch=5).variant("sm100", 148).two_cta  # 160 > 148
    assert replace(one, batch=5).variant("sm100", 160).two_cta
    ids = {v.id for v in vs}
    assert one.variant("sm100", 148).id in ids and replace(one, batch=5).variant("sm100", 148).id in ids
