"""`fa4aot build --fa4`: what each source builds, where it lands, how the runtime picks and
calls it (CPU; FA4AOT_STUB_COMPILER builds, no compiler).

- vLLM's copy builds Gemma-4's hd512 full layers and their FP8-KV dequant kernels on sm90, its
  plain forwards only (no fold or split kernels); upstream refuses both naming `--fa4 vllm`;
  SGLang's copy is refused before anything is planned.
- The store records the source (toolchain fa4_source, fa4_abi) in its own fingerprint
  directory, so two sources' artifacts never mix; FA4AOT_KERNEL_SOURCE picks the one the runtime serves.
- Block sizes answer by KV dtype (FP8-KV: the 64-token TMA page only, as vLLM's
  `_get_sm90_fa4_fp8_kv_block_size`), and the runtime binds such a store's kernels to the
  copy's 21-slot launcher.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fa4_copies import engine_root
from fa4aot import settings
from fa4aot.build.builder import build, plan_for
from fa4aot.errors import ArtifactMissing, ContractViolation, Fa4SourceError
from fa4aot.fa4 import sources
from fa4aot.model import constraints as C
from fa4aot.model.specs import parse_spec
from fa4aot.runtime import fp8kv
from fa4aot.runtime import launch as L
from fa4aot.runtime import vllm_abi as VA
from fa4aot.store.layers import find_serving_store
from fa4aot.store.toolchain import fingerprint_dir, read_toolchain, runtime_expectation

ROOT = Path(__file__).resolve().parents[2]

GEMMA = """
name = "gemma-4-kv"
model = "google/gemma-4"
[[attention]]
name = "sliding"
num_q_heads = 32
num_kv_heads = 16
head_dim = 256
window = 1024
[[attention]]
name = "full"
num_q_heads = 32
num_kv_heads = 4
head_dim = 512
[serving]
tp = [1, 8]
layouts = ["varlen", "paged"]
page_sizes = [16, 64]
max_batch = 8
kv_cache_dtypes = ["auto", "float8_e4m3fn"]
"""


@pytest.fixture(scope="module")
def vllm_dir() -> str:
    return str(engine_root("vllm") / "vllm_flash_attn" / "cute")


def test_upstream_refuses_hd512_and_fp8_kv_naming_the_vllm_source():
    plan = plan_for([parse_spec(GEMMA)], "sm90")
    why = {u.layer: u.reason for u in plan.unsupported}
    assert list(why) == ["full"] and "fa4aot build --fa4 vllm" in why["full"]
    assert all(n.variant.head_dim == 256 for n in plan.needs)
    # FP8-KV dequant: vLLM's copy, sm90, where vLLM runs FA4 (head dims over 256)
    fp8 = C.FP8_KV
    assert "fa4aot build --fa4 vllm" in C.kv_dtype_reason("sm90", "upstream", "bfloat16", fp8,
                                                          512, 512)
    assert C.kv_dtype_reason("sm90", "vllm", "bfloat16", fp8, 512, 512) is None
    assert "FA3" in C.kv_dtype_reason("sm90", "vllm", "bfloat16", fp8, 256, 256)
    assert "sm90-only" in C.kv_dtype_reason("sm100", "vllm", "bfloat16", fp8, 512, 512)
    assert "head_dim == head_dim_v" in C.kv_dtype_reason("sm90", "vllm", "bfloat16", fp8,
                                                         512, 256)


def test_vllm_source_plans_hd512_and_fp8_kv_plain_forwards_only(vllm_dir):
    plan = plan_for([parse_spec(GEMMA)], "sm90", fa4="vllm")
    vs = [n.variant for n in plan.needs]
    full = [v for v in vs if v.head_dim == 512]
    fp8 = [v for v in full if v.kv_dtype]
    assert {v.qhead_per_kvhead for v in full} == {8, 4}  # TP1's ratio and TP8's
    assert fp8 and all(v.paged and v.paged_tma and v.kv_dtype == "float8_e4m3fn" for v in fp8)
    assert {v.paged_tma for v in full if v.paged and not v.kv_dtype} == {True, False}
    # no fold or split chunk kernels (they patch upstream's internals): causal/window forwards,
    # and the copy's own split forward beside each paged decode kernel without LSE (its twin)
    assert all(v.causal or v.local for v in vs) and not any(v.tile_m for v in vs)
    twins = [v for v in vs if v.split_kv]
    assert twins and all(v.paged and v.phase == "decode" and not v.return_lse
                         and v.head_dim == 512 for v in twins)
    assert plan.unsupported == []  # (the hd256 layer's FP8 cache is FA3's in vLLM)


def test_an_unmodelled_source_is_refused_before_anything_is_planned(tmp_path):
    cute = tmp_path / "tree" / "cute"
    shutil.copytree(engine_root("sglang") / "kernels" / "ops" / "attention" / "flash_attn"
                    / "cute", cute)
    iface = cute / "interface.py"  # a compile key of a shape no modelled ABI has
    iface.write_text(iface.read_text().replace("        batch_invariant,\n", "", 1))
    with settings.scope(stub_compiler="1"), pytest.raises(Fa4SourceError, match="matches no"):
        build([parse_spec(GEMMA)], arch="sm90", root=tmp_path / "s", fa4=str(cute))
    assert not (tmp_path / "s").exists()


def _stub_build(root: Path, fa4: str | None):
    with settings.scope(stub_compiler="1", stub_delay="0"):
        return build([parse_spec(GEMMA)], arch="sm90", root=root, fa4=fa4)


def test_two_sources_two_fingerprint_dirs(tmp_path, vllm_dir):
    up, _, r1 = _stub_build(tmp_path, None)
    vl, _, r2 = _stub_build(tmp_path, vllm_dir)
    assert up.dir != vl.dir and all(r.status == "built" for r in r1 + r2)
    tc = json.loads((vl.dir / "toolchain.json").read_text())
    src = sources.resolve("vllm", root=engine_root("vllm"))
    assert tc["fa4_source"] == src.record() and tc["fa4_abi"] == "vllm"
    assert tc["fa4"] == "vllm 0.33.0" and fingerprint_dir(tc) == vl.dir.name
    utc = json.loads((up.dir / "toolchain.json").read_text())
    # an upstream store is written as before sources were recorded (its `fa4` names it)
    assert "fa4_source" not in utc and "fa4_abi" not in utc and fingerprint_dir(utc) == up.dir.name
    assert read_toolchain(up.dir)["fa4_abi"] == "upstream"
    ids_up = {p.name for p in (up.dir / "artifacts").iterdir()}
    ids_vl = {p.name for p in (vl.dir / "artifacts").iterdir()}
    assert len(ids_vl) > len(ids_up)  # hd512 and FP8-KV from the copy only
    # FA4AOT_KERNEL_SOURCE picks the store the runtime serves
    with settings.scope(kernel_source="vllm"):
        got = find_serving_store([tmp_path], runtime_expectation("sm90", 132))
        assert [s.dir for s in got] == [vl.dir]
    with settings.scope(kernel_source="upstream"):
        got = find_serving_store([tmp_path], runtime_expectation("sm90", 132))
        assert [s.dir for s in got] == [up.dir]


def test_block_sizes_by_kv_dtype(tmp_path, vllm_dir):
    from fa4aot.policy.blocks import preferred_block_size, supported_block_sizes

    _stub_build(tmp_path, vllm_dir)
    kw = dict(qhead_per_kvhead=8, cache=tmp_path)
    with settings.scope(kernel_source="vllm", stub_compiler="1"):
        fp8 = supported_block_sizes("sm90", "bfloat16", 512, kv_dtype="float8_e4m3fn", **kw)
        bf = supported_block_sizes("sm90", "bfloat16", 512, **kw)
        assert (fp8.tma, fp8.any_size) == ((64,), False) and fp8.serves(64)
        assert not fp8.serves(16) and bf.serves(16) and bf.tma == (64,)
        assert preferred_block_size("sm90", "bfloat16", 512, kv_dtype="float8_e4m3fn", **kw) == 64
        assert supported_block_sizes("sm90", "bfloat16", 512, kv_dtype="auto", **kw) == bf


def test_a_vllm_store_is_called_with_the_copys_slots():
    """launch.abi_for binds a vLLM-built kernel to the copy's 21 slots, as vllm_abi lists them
    (descales at 17), and an upstream one to upstream's 18."""
    class S:
        def data_ptr(self):  # off a mapping boundary: the page table passes unguarded
            return 16

    got = []
    kernel = lambda *a: got.append(a)  # noqa: E731
    args = [S() for _ in range(15)]
    desc = (S(), S(), S())
    L.abi_for("sm90", "vllm").fwd(kernel)(*args, descales=desc)
    assert got[-1] == VA.fwd_args(*args[:14], cu_total_m_blocks=args[14], descales=desc)
    L.abi_for("sm90").fwd(kernel)(*args)
    assert len(got[-1]) == 18
    with pytest.raises(Exception, match="no vllm FA4 kernel ABI for sm100"):
        L.abi_for("sm100", "vllm")


def test_fp8_kv_contract_refused_before_any_launch():
    q = torch.empty(4, 32, 512, dtype=torch.bfloat16)
    k = torch.empty(10, 64, 4, 512, dtype=torch.float8_e4m3fn)
    cu = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32)
    used = torch.full((4,), 100, dtype=torch.int32)
    pt = torch.zeros(4, 2, dtype=torch.int32)
    d = torch.ones(4, 4)
    assert fp8kv.is_fp8_kv(q, k, k, None) and not fp8kv.is_fp8_kv(q, q, q, None)
    with pytest.raises(ContractViolation, match="bf16/fp16 q and e4m3"):
        fp8kv.is_fp8_kv(q, q, q, True)

    class NoRuntime:  # a refusal must come before the runtime is asked anything
        _plans: dict = {}

    def call(**over):
        a = dict(cu_seqlens_q=cu, max_seqlen_q=1, seqused_k=used, page_table=pt,
                 softmax_scale=None, causal=True, window_size=(None, None), learnable_sink=None,
                 return_lse=False, out=None, lse=None, k_descale=d, v_descale=d)
        a.update(over)
        return fp8kv.varlen(NoRuntime(), q, k, k, **a)

    with pytest.raises(ContractViolation, match="page_table and seqused_k"):
        call(page_table=None)
    with pytest.raises(ContractViolation, match="k_descale: float32 \\(4, 4\\)"):
        call(k_descale=torch.ones(4, 2))
    with pytest.raises(ContractViolation, match="v_descale"):
        call(v_descale=None)
    with pytest.raises(ContractViolation, match="CUDA device"):
        call()


def test_cli_build_names_the_source_and_ls_lists_it(tmp_path, vllm_dir):
    spec = tmp_path / "g.toml"
    spec.write_text(GEMMA)
    env = {"FA4AOT_STUB_COMPILER": "1", "PATH": "/usr/bin:/bin"}
    run = [sys.executable, "-m", "fa4aot"]
    r = subprocess.run(run + ["build", "--arch", "sm90", "--spec", str(spec), "--fa4", vllm_dir,
                              "--cache", str(tmp_path / "s"), "-j", "1"],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run(run + ["ls", "--cache", str(tmp_path / "s"), "--json"],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    rows = json.loads(r.stdout)["rows"]
    assert {row["fa4"] for row in rows} == {"vllm 0.33.0 (f3bcc631ba55)"}
    assert {row["kv"] for row in rows} == {"", "float8_e4m3fn"}
    sg = engine_root("sglang") / "kernels" / "ops" / "attention" / "flash_attn" / "cute"
    r = subprocess.run(run + ["build", "--arch", "sm90", "--spec", str(spec), "--fa4", str(sg),
                              "--cache", str(tmp_path / "s2"), "--dry-run"],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-2000:]  # (SGLang's copy: tests/fa4/test_sglang_*)


def test_missing_fp8_artifact_names_the_build(tmp_path, monkeypatch):
    """A runtime with no FP8-KV kernel for the call raises ArtifactMissing (not a launch)."""

    class Rt:
        _plans: dict = {}

        def device(self, dev):
            return "sm90", 132

        def fa4_abi(self, arch, sms):
            return "vllm"

        def plan(self, variant, sms):
            return None

        def miss(self, variant, sms, pad):
            raise ArtifactMissing(f"no artifact for {variant.describe()}")

    q = torch.empty(4, 32, 512, dtype=torch.bfloat16)
    k = torch.empty(10, 64, 4, 512, dtype=torch.float8_e4m3fn)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(ArtifactMissing, match="kv:float8_e4m3fn"):
        fp8kv.varlen(Rt(), q, k, k, torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32), 1,
                     torch.full((4,), 100, dtype=torch.int32), torch.zeros(4, 2, dtype=torch.int32),
                     None, True, (None, None), None, False, None, None, torch.ones(4, 4),
                     torch.ones(4, 4))
