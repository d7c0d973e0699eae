"""forwards.trace_chunk_modes, on the CPU: FA4's sm90 chunk kernel compiled behind the chunk
modes, and its guards against an FA4 whose internals it no longer matches.

In a fresh interpreter (it imports flash_attn and configures the cross-compile target). The
GPU tests (tests/test_gpu_split.py) check the kernels' numbers on the H200."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

# (not imported here: flash_attn fixes its target arch on import, and the in-process build
# tests configure theirs first)
if importlib.util.find_spec("flash_attn") is None:
    pytest.skip("flash-attn-4 is not installed", allow_module_level=True)

_DRIVER = r"""
import json
from fa4aot.fa4 import driver, export, forwards, kernels
driver.configure("sm90", 132)
from fa4aot.model import compile_keys as V
from flash_attn.cute.seqlen_info import SeqlenInfoQK

out = {}
v = V.split_kernel_variant("sm90", "bfloat16", 64, 64, 128)
compiles = []
driver.trace(V.representative_call(v), compiles)
out["compiled"] = forwards.trace_chunk_modes(compiles) is not None

# an FA4 whose SeqlenInfoQK.create no longer takes seqused_k by that name
real = SeqlenInfoQK.create
SeqlenInfoQK.create = staticmethod(lambda batch_idx, seqlen_q_static, seqlen_k_static, **kw: None)
try:
    forwards.trace_chunk_modes(compiles)
    out["renamed"] = "compiled"
except RuntimeError as e:
    out["renamed"] = str(e)
SeqlenInfoQK.create = real

# an FA4 that stopped reading seqused_k through create (here: create ignores the call's
# mSeqUsedK): the paged kernel would read a length per virtual sequence, past the caller's
def create(*a, mSeqUsedK=None, **kw):
    return real(*a, mSeqUsedK=None, **kw)
import flash_attn.cute.flash_fwd_sm90 as F90
class Proxy:
    create = staticmethod(create)
F90.SeqlenInfoQK = Proxy
try:
    forwards.trace_chunk_modes(compiles)
    out["bypassed"] = "compiled"
except RuntimeError as e:
    out["bypassed"] = str(e)
print(json.dumps(out))
"""


def test_chunk_modes_compile_and_refuse_an_fa4_they_do_not_match():
    r = subprocess.run([sys.executable, "-c", _DRIVER], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["compiled"] is True
    assert "has no ['mCuSeqlensK', 'mCuSeqlensQ', 'mSeqUsedK', 'mSeqUsedQ']" in doc["renamed"]
    assert "did not read seqused_k" in doc["bypassed"]


_WIDE = r"""
import json, sys, tempfile
from pathlib import Path
from fa4aot.fa4 import cubin, driver, export, forwards, kernels
driver.configure("sm90", 132)
from fa4aot.model import compile_keys as V
from fa4aot.model import constraints as C

out = {}
v = V.split_kernel_variant("sm90", "bfloat16", 64, 64, None)
rec = export.compile_variant(V.representative_call(v), v, Path(tempfile.mkdtemp()))
parts = rec["parts"]
out["wide"] = {n: {k: x for k, x in parts[n].items() if k not in ("object", "key")}
               for n in ("fwd_wide", "fwd_wide1")}
out["regs"] = {n: cubin.register_counts(parts[n]["object"])
               for n in ("fwd", "fwd_wide", "fwd_wide1")}
out["hd64_parts"] = sorted(parts)
out["pdl"] = sorted(n for n, p in parts.items() if p.get("pdl"))
# the wide split part (constraints.wide_split: head dim 128 only) through the chunk modes
v128 = V.split_kernel_variant("sm90", "bfloat16", 128, 128, None)
p128 = export.compile_variant(V.representative_call(v128), v128, Path(tempfile.mkdtemp()))["parts"]
out["wide_split"] = {k: x for k, x in p128["fwd_wide_split"].items() if k not in ("object", "key")}
out["wide_split_regs"] = cubin.register_counts(p128["fwd_wide_split"]["object"])
vp = V.split_kernel_variant("sm90", "bfloat16", 64, 64, 64)
pp = export.compile_variant(V.representative_call(vp), vp, Path(tempfile.mkdtemp()))["parts"]
out["paged_parts"] = sorted(pp)
out["tma"] = {k: x for k, x in pp["fwd_tma"].items() if k not in ("object", "key")}
out["tma_regs"] = cubin.register_counts(pp["fwd_tma"]["object"])
v128 = V.split_kernel_variant("sm90", "bfloat16", 64, 64, 128)  # FA4's TMA path already
out["page128_parts"] = sorted(
    export.compile_variant(V.representative_call(v128), v128, Path(tempfile.mkdtemp()))["parts"])
compiles = []
driver.trace(V.representative_call(v128), compiles)
try:
    forwards.trace_tma_page(compiles, 64)
    out["tma_on_tma"] = "compiled"
except RuntimeError as e:
    out["tma_on_tma"] = str(e)
# the wide fold builds only on the 64-row chunk kernel: FA4's own decode kernel (128 rows)
call = V.representative_call(V.split_kernel_variant("sm90", "bfloat16", 64, 64, None))
import dataclasses
compiles = []
driver.trace(dataclasses.replace(call, tile_m=None), compiles)
try:
    forwards.trace_wide_fold(compiles, C.WIDE_FOLD, False)
    out["tile128"] = "compiled"
except RuntimeError as e:
    out["tile128"] = str(e)
# _pdl_secondary refuses a kernel it cannot make wait first (no make_warp_uniform)
# (the DSL compiles from source: the kernel lives in a file)
d = tempfile.mkdtemp()
Path(d, "pdl_guard_kernel.py").write_text(
    "import cutlass.cute as cute\n"
    "@cute.kernel\ndef k():\n    pass\n"
    "@cute.jit\ndef h(stream):\n    k().launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)\n")
sys.path.insert(0, d)
import cutlass.cute as cute
import pdl_guard_kernel

try:
    with forwards._pdl_secondary(True):
        cute.compile(pdl_guard_kernel.h, cute.runtime.make_fake_stream())
    out["pdl_guard"] = "compiled"
except RuntimeError as e:
    out["pdl_guard"] = str(e)
print(json.dumps(out))
"""


def test_wide_fold_compiles_two_ctas_per_sm_and_refuses_other_tiles():
    """The packed split kernel's part fwd_wide: 64-key tiles, and ptxas held its threads to
    128 registers (two 256-thread CTAs per SM), where FA4's launch lets them take 255; its part
    fwd_wide1: the same tiles at 240 (one CTA per SM); at head dim 128 its part fwd_wide_split:
    fwd_wide through the chunk modes (q read per chunk, constraints.wide_split). A paged one has
    fwd_wide (and at hd128 fwd_wide_split), and on FA4's cp.async paged path fwd_tma (64-key
    tiles on the TMA path, for pages of 64). Each is a programmatic dependent launch
    (forwards._pdl_secondary), which refuses a kernel it cannot make wait before its first
    statement."""
    r = subprocess.run([sys.executable, "-c", _WIDE], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["wide"] == {
        "fwd_wide": {"tile_n": 64, "ctas_per_sm": 2, "registers": 128, "pdl": True},
        "fwd_wide1": {"tile_n": 64, "ctas_per_sm": 1, "registers": 240, "pdl": True}}
    # every forward of the split kernel a programmatic dependent launch (forwards._pdl_secondary)
    assert doc["pdl"] == ["fwd", "fwd_bounds", "fwd_used", "fwd_wide", "fwd_wide1"]
    assert "no PDL launch" in doc["pdl_guard"]
    assert doc["regs"] == {"fwd": [255], "fwd_wide": [128], "fwd_wide1": [240]}
    assert doc["wide_split"] == {"tile_n": 64, "ctas_per_sm": 2, "registers": 128,
                                 "q_broadcast": True, "pdl": True}
    assert doc["wide_split_regs"] == [128]
    assert "fwd_wide_split" not in doc["hd64_parts"]  # hd128 only
    assert "fwd_wide" in doc["paged_parts"] and "fwd_wide1" not in doc["paged_parts"]
    assert "fwd_wide_split" not in doc["paged_parts"]  # (hd128 only: test_default_build)
    # its packed-rows metadata kernel (kernels.trace_packed_meta): paged K only
    assert "packed_meta" in doc["paged_parts"] and "packed_meta" not in doc["hd64_parts"]
    # the paged cp.async kernel's TMA part for pages of 64 (constraints.tma_page); none beside
    # FA4's TMA paged kernel (pages of 128), and none built on it
    assert "fwd_tma" in doc["paged_parts"] and doc["tma"] == {"page_size": 64, "pdl": True}
    assert len(doc["tma_regs"]) == 1
    assert "fwd_tma" not in doc["page128_parts"]
    assert "cp.async paged path" in doc["tma_on_tma"]
    assert "builds on the 64-row chunk kernel" in doc["tile128"]
