"""The fa4aot runtime calls sm100/sm103 kernels exactly as FA4's interface does.

For every default sm100 variant, the absorbed-MLA (qv) kernels included (`build.plan_for(default
specs, "sm100")`, each variant's `representative_call`: for MLA the packed q with qv over packed or
paged K/V, on each of FA4's three MLA kernels), and again as sm103: FA4's real `_flash_attn_fwd`
runs on the CPU under
FakeTensorMode with `cute.compile` replaced by a recorder (tests/runtime/test_abi.py's machinery: FA4 then
calls every forward, combine, tile-cumsum and blocks-to-batch kernel it "compiled", and each call
is recorded with its positional arguments). Then fa4aot's runtime serves the same call through its
public entry point (flash_attn_func for dense, flash_attn_varlen_func otherwise) from a stand-in
store: its artifacts' records are what the builder records from FA4's compile keys
(`export.part_record`: tile_m, pack_gqa, split, scheduler slots; the helpers' flags; the
combine), and their parts are recording callables. The two call sequences are compared slot by
slot (test_abi's normalisation: None vs tensor; a tensor by the input it aliases or, for buffers
allocated on the way, by first appearance, plus shape, strides, offset, dtype; scalars by type and
value; tuples member by member), including the returned (out, lse).

The runtime resolves the variant itself (from the call's features, the plan step's
`variants.features`), and the store serves only the variant FA4's key maps to
(`keys.variant_from_fa4_key`): a runtime choosing another kernel misses and fails the case.
Split-KV variants are called with FA4's own heuristic (num_splits=0) against the runtime's
(`constraints.native_num_splits`): the store holds the call's unsplit kernel too, recorded under
its own label, so calling it instead of the split kernel is a mismatch. A few extra calls cover
what the representative calls do not: FP8 descale sets, a max_seqlen_q hint, batch > 256 with
seqused_q, a sliding window at batch > 256, absorbed-MLA q and qv as strided views of one tensor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHS = ("sm100", "sm103")
NUM_SMS = 148


def _extra_cases() -> list[dict]:
    base = dict(batch=2, seqlen_q=1, seqlen_k=4096, num_heads=8, num_heads_kv=2, head_dim=128,
                head_dim_v=128, dtype="bfloat16", causal=False, window_left=None,
                window_right=None, return_lse=True, sink_dtype=None)  # fmt: skip
    mla = dict(base, layout="varlen", num_heads=16, num_heads_kv=1, head_dim=64,
               head_dim_v=512, qv=True, causal=True)  # fmt: skip
    return [
        dict(base, layout="dense", dtype="float8_e4m3fn", descales="q,k,v", seqlen_q=256),
        dict(base, layout="paged", page_size=128, batch_q=True, dtype="float8_e4m3fn",
             descales="k,v"),  # fmt: skip
        dict(base, layout="varlen", dtype="float8_e4m3fn", seqlen_q=64, causal=True),
        dict(base, layout="varlen", seqlen_q=3, max_seqlen_q_hint=7, causal=True),
        dict(base, layout="padded", batch=300, seqlen_q=5, batch_q=True, seqused_q=True),
        dict(base, layout="varlen", batch=300, seqlen_q=1, window_left=64, window_right=0),
        dict(base, layout="dense", seqlen_q=2, seqlen_k=20000, sink_dtype="float32"),  # splits
        dict(base, layout="padded", seqlen_q=3, causal=True),  # packed q over a batch-form KV
        # absorbed MLA with q and qv strided views of one tensor (passed as they are), varlen
        # and paged (page 64: the cp.async kernel)
        dict(mla, qv_views=True),
        dict(mla, qv_views=True, layout="paged", page_size=64, seqlen_q=3, return_lse=False),
    ]


def _runtime_call(R, c: dict, inp: dict, kw: dict):
    """The same call through fa4aot's public entry point (padding off: served exactly)."""
    common = dict(
        causal=kw["causal"], window_size=(kw["window_size_left"], kw["window_size_right"]),
        learnable_sink=inp.get("learnable_sink"), return_lse=kw["return_lse"], padding=False,
        softcap=kw.get("softcap") or 0.0, pack_gqa=kw.get("pack_gqa"),
        q_descale=inp.get("q_descale"), k_descale=inp.get("k_descale"),
        v_descale=inp.get("v_descale"),
    )  # fmt: skip
    if c["layout"] == "dense":
        return R.flash_attn_func(inp["q"], inp["k"], inp["v"], **common)
    return R.flash_attn_varlen_func(
        inp["q"], inp["k"], inp["v"], cu_seqlens_q=inp.get("cu_seqlens_q"),
        cu_seqlens_k=inp.get("cu_seqlens_k"), max_seqlen_q=kw.get("max_seqlen_q"),
        max_seqlen_k=kw.get("max_seqlen_k"), seqused_q=inp.get("seqused_q"),
        seqused_k=inp.get("seqused_k"), page_table=inp.get("page_table"), qv=inp.get("qv"),
        **common,
    )  # fmt: skip


def _worker(arch: str) -> dict:
    warnings.simplefilter("ignore")
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_abi beside this file
    import test_abi as TA
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fa4aot.fa4 import driver, export, keys
    from fa4aot.model import compile_keys as VS
    from fa4aot.build.builder import plan_for
    from fa4aot.runtime import blackwell as B
    from fa4aot.runtime import plan as P
    from fa4aot.runtime import splitkv as SK
    from fa4aot.runtime import splitruns as SR
    from fa4aot.model.specs import default_spec_names, load_default

    t0 = time.perf_counter()
    driver.configure("sm100", NUM_SMS)
    _, I = driver._fa4()
    import cutlass.cute as cute

    import fa4aot.runtime as R

    cute.compile = lambda kernel, *a, **k: TA._Rec(kernel)
    I.is_fake_mode = lambda: False  # FA4 calls what it "compiled": the recorder
    caches = [I._flash_attn_fwd, I._flash_attn_fwd_combine, I._compute_tile_cumsum,
              I._compute_blocks_to_batch, I._get_scheduler_metadata]  # fmt: skip
    # fake CUDA tensors on a CPU-only torch: no stream to ask about capture
    SK._is_capturing = SR._is_capturing = B._is_capturing = lambda: False
    SK._raw_stream = SR._raw_stream = B._raw_stream = lambda dev: 0

    served: dict = {}  # variant id -> (label, record parts)

    class _Art:
        def __init__(self, vid):
            self.id = vid
            self.label, parts = served[vid]
            self.record = {"parts": parts}
            self.dir = Path("/nonexistent") / vid

    def load(self, art, *names):
        def rec(name):
            kind = f"fwd:{art.label}" if name == "fwd" else name

            def k(*args, **kwargs):
                assert not kwargs, kwargs
                TA._Rec.log.append((kind, args))

            return k

        return [rec(n) if n in art.record["parts"] else None for n in names]

    P.Runtime.find = lambda self, v, sms: _Art(v.id) if v.id in served else None
    P.Runtime._load = load
    P.Runtime.available = lambda self, a, sms: []

    specs = [load_default(n) for n in default_spec_names()]
    cases = [("default", n.call, n.variant) for n in plan_for(specs, "sm100").variants().values()]
    cases += [("extra", c, None) for c in _extra_cases()]
    report = {"arch": arch, "compared": {}, "mismatches": [], "kinds": {}, "slots": 0,
              "features": {}, "splits": {}, "model": 0, "label_gap": []}  # fmt: skip
    num = int(arch[2:])
    for origin, call, built in cases:
        c = TA._call_dict(call) if origin == "default" else dict(call)
        split = bool(c.get("num_splits", 1) > 1)
        forced = split and built is not None and built.local
        if split and not forced:
            c["num_splits"] = 0  # FA4's heuristic, against the runtime's native_num_splits
        for f in caches:
            f.compile_cache.clear()
        TA._Rec.log = []
        with FakeTensorMode():
            inp, kw = TA._case_inputs(c)
            if c.get("qv_views"):
                # q and qv as views of one (total_q, h, 512 + 64) tensor, as engines hold the
                # absorbed query: strided, 16-byte aligned, so FA4 passes them as they are
                tq, h = inp["q"].shape[:2]
                both = torch.empty(tq, h, 576, dtype=inp["q"].dtype, device="cuda")
                inp["qv"], inp["q"] = both.narrow(-1, 0, 512), both.narrow(-1, 512, 64)
            if origin == "extra" and c["layout"] == "dense" and c["seqlen_k"] > 4096:
                kw["num_splits"] = 0  # FA4's heuristic (its public default is 1: no split)
            args = {n: inp[n] for n in TA._FWD_TENSORS if n in inp}
            ret = I._flash_attn_fwd(inp["q"], inp["k"], inp["v"], **args, **kw, _arch=num)
            (key,) = I._flash_attn_fwd.compile_cache.cache
            v = keys.variant_from_fa4_key(key, arch)
            assert v is not None, c
            if built is not None:
                # the store holds the enumerated variant (the builder stores under its id);
                # a key that maps to another label is a gap in the model (none, asserted below)
                built = replace(built, arch=arch)
                if built != v:
                    report["label_gap"].append([built.describe(), v.describe()])
                v = built
            parts = {"fwd": export.part_record("fwd", key, arch)}
            for name, cache in (("tile_cumsum", I._compute_tile_cumsum),
                                ("blocks_to_batch", I._compute_blocks_to_batch),
                                ("combine", I._flash_attn_fwd_combine)):  # fmt: skip
                for hk in cache.compile_cache.cache:
                    parts[name] = export.part_record(name, hk, arch)
            # FA4's key, as the builder records it, agrees with the runtime's model of the
            # variant (plan.fwd_facts raises on any difference)
            try:
                P.fwd_facts(v, _ArtRec(parts))
                report["model"] += 1
            except Exception as e:
                report["mismatches"].append({"case": c, "variant": v.describe(), "model": str(e)})
                continue
            fa4 = [(f"fwd:{v.id}" if k == "fwd" else k, a) for k, a in TA._Rec.log]
            fa4.append(("return", ret[:2]))
            served.clear()
            served[v.id] = (v.id, parts)
            if v.split_kv:
                # the call's unsplit kernel too (the plan step resolves it first)
                uv = _unsplit(VS, call if origin == "default" else c).variant(arch)
                served[uv.id] = (uv.id, {"fwd": {"key": "unsplit"}})
                n_fa4 = str(next(a for k, a in fa4 if k.startswith("fwd"))[3].shape[0])
                report["splits"][n_fa4] = report["splits"].get(n_fa4, 0) + 1
            TA._Rec.log = []
            rt = R.reset(roots=[Path("/nonexistent")], on_miss="error")
            rt._devices[0] = (arch, NUM_SMS)
            if forced:
                # a windowed split kernel: FA4's heuristic splits no window of the
                # representative call (its keys fit 4 blocks), so both are forced to 128
                # splits (FA4AOT_SPLIT_KV=128 for the runtime)
                rt.split = 128
                report["forced"] = report.get("forced", 0) + 1
            try:
                out = _runtime_call(R, c, inp, kw)
                mine = list(TA._Rec.log) + [("return", tuple(out))]
            except Exception as e:  # a refusal or a miss: reported as a mismatch
                mine = [("error", f"{type(e).__name__}: {e}")]
        a = TA._norm_seq(fa4, inp)
        b = TA._norm_seq(mine, inp) if mine[0][0] != "error" else mine
        report["compared"][origin] = report["compared"].get(origin, 0) + 1
        report["slots"] += sum(len(x[1]) for x in a)
        for kind, _ in fa4:
            k0 = kind.split(":")[0]
            report["kinds"][k0] = report["kinds"].get(k0, 0) + 1
        for feat in TA._features(arch, c, inp, key):
            report["features"][feat] = report["features"].get(feat, 0) + 1
        if a != b:
            report["mismatches"].append({"case": c, "variant": v.describe(), "fa4": a, "rt": b})
    report["seconds"] = time.perf_counter() - t0
    return report


def _unsplit(VS, call):
    """The call's variants.Call with num_splits 1 (a representative call, or an extra case)."""
    if isinstance(call, VS.Call):
        return replace(call, num_splits=1)
    names = {f.name for f in VS.Call.__dataclass_fields__.values()}
    return VS.Call(**{k: x for k, x in call.items() if k in names and k != "num_splits"})


class _ArtRec:
    """The record part of an artifact, for plan.fwd_facts."""

    def __init__(self, parts):
        self.id = "parity"
        self.record = {"parts": parts}


@pytest.fixture(scope="module")
def parity():
    """Both archs' workers, concurrently (FA4 fixes its arch at import: one process each)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = {
        a: subprocess.Popen([sys.executable, __file__, a], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        for a in ARCHS
    }  # fmt: skip
    out = {}
    for a, p in procs.items():
        so, se = p.communicate(timeout=300)
        assert p.returncode == 0, se[-4000:]
        out[a] = json.loads(so.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_runtime_calls_every_default_blackwell_variant_as_fa4_does(parity, arch):
    from fa4aot.build.builder import plan_for
    from fa4aot.model.specs import default_spec_names, load_default

    rep = parity[arch]
    assert rep["mismatches"] == [], json.dumps(rep["mismatches"][:2])[:6000]
    specs = [load_default(n) for n in default_spec_names()]
    planned = plan_for(specs, "sm100").variants().values()
    n = len(planned)
    n_mla = sum(1 for v in planned if v.variant.mla)
    # every default variant: 193, and the 114 absorbed-MLA kernels (those FA4 takes at their
    # own head ratio: the padded ratios 32/16/8, 16, and the 1CTA ones at 20/10/5)
    assert rep["compared"]["default"] == n == 309 and n_mla == 114
    assert rep["compared"]["extra"] == len(_extra_cases())
    assert rep["model"] == n + len(_extra_cases())  # every FA4 key agrees with fwd_facts
    for kind in ("fwd", "combine", "tile_cumsum", "blocks_to_batch"):
        assert rep["kinds"].get(kind, 0) > 0, rep["kinds"]
    feats = rep["features"]
    for f in ("dense", "varlen", "paged", "padded", "paged+batch_q", "padded+batch_q",
              "varlen+batch_q",
              "seqused_q", "seqused_k", "learnable_sink", "lse", "window", "split",
              "cu_total_m_blocks", "fp8", "q_descale", "k_descale"):
        assert feats.get(f, 0) > 0, (f, feats)  # fmt: skip
    # each MLA kernel through flash_attn_varlen_func(..., qv=), and the two extra MLA calls
    # whose q and qv are strided views of one tensor (passed on as FA4 passes them, no copy)
    assert feats["qv"] == n_mla + 2
    # every split case split (FA4's heuristic, or both forced for windowed split kernels), and
    # the runtime matched its count and kernel: 128 for the representative calls, 37 for the
    # extra dense one
    assert sum(rep["splits"].values()) == feats["split"] > 0 and rep["splits"]["37"] == 1
    assert rep["forced"] > 0
    # FA4's key labels every kernel as the enumerated variant the store holds (hd256's 2CTA
    # decode kernel included: Variant.two_cta, chosen by the batch, variants.features)
    assert not rep["label_gap"], rep["label_gap"]


if __name__ == "__main__":
    print(json.dumps(_worker(sys.argv[1])))
