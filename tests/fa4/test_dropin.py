"""CPU tests of the drop-in path (fa4aot.install), coverage and the autoinstall hook.

A tiny store is really cross-compiled (2 variants); FA4's entry points are then driven under
FakeTensorMode, so install's store-backed caches are exercised without a GPU (the kernels are
loaded with tvm-ffi, never launched)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

pytestmark = pytest.mark.slow

TINY = (Path(__file__).parents[1] / "specs" / "tiny.toml").read_text()


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    from fa4aot.build.builder import build
    from fa4aot.model.specs import parse_spec

    d = tmp_path_factory.mktemp("dropin")
    spec_file = d / "tiny.toml"
    spec_file.write_text(TINY)
    spec = parse_spec(TINY, str(spec_file))
    store, plan, results = build([spec], arch="sm90", root=d / "store", jobs=1)
    assert [r.status for r in results] == ["built", "built"], results
    return d / "store", spec_file


def _fake_dense(sq, lse=False):
    import flash_attn.cute as fa
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, sq, 4, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 256, 2, 64, dtype=torch.bfloat16, device="cuda")
        fa.flash_attn_func(q, k, k.clone(), causal=True, return_lse=lse)


def test_variant_from_fa4_key_matches_every_default_variant():
    """The FA4-key -> Variant mapping (used to log install() misses) agrees with the enumerator
    for every default sm90 variant, by tracing FA4 itself (compile stubbed)."""
    from fa4aot.fa4 import driver, keys
    from fa4aot.build.builder import plan_for
    from fa4aot.model.specs import resolve_specs

    driver.configure("sm90", 132)
    import cutlass.cute as cute

    real = cute.compile
    cute.compile = lambda *a, **k: lambda *x, **y: None
    try:
        for n in plan_for(resolve_specs(None), "sm90").variants().values():
            got = driver.trace(n.call)
            assert len(got["fwd"]) == 1
            assert keys.variant_from_fa4_key(got["fwd"][0][0], "sm90") == n.variant, (
                n.variant.describe()
            )
    finally:
        cute.compile = real
        for c in driver._caches().values():
            c.clear()


def test_install_serves_from_store_and_refuses_misses(tiny_store, monkeypatch, tmp_path, knobs):
    import fa4aot
    from fa4aot.fa4 import driver

    root, _ = tiny_store
    driver.configure("sm90", 132)
    from flash_attn.cute import interface as I

    original = I._flash_attn_fwd.compile_cache
    knobs(miss_log=str(tmp_path / "misses.jsonl"))
    counters = fa4aot.install(cache=root, on_miss="error", arch="sm90", num_sms=132)
    try:
        _fake_dense(1)
        _fake_dense(1, lse=True)
        assert counters.hits == 2 and counters.compiles == 0 and not counters.misses
        with pytest.raises(fa4aot.ArtifactMissing, match="nothing was compiled"):
            _fake_dense(300)  # prefill: not in the store
        assert counters.compiles == 0
    finally:
        assert fa4aot.uninstall()
    assert I._flash_attn_fwd.compile_cache is original
    import cutlass.cute as cute

    assert type(cute.compile).__name__ != "_CompileMonitor"
    # the miss was logged as a variant the next build can consume
    from fa4aot.store.misses import read_misses

    logged = read_misses(tmp_path / "misses.jsonl")
    assert len(logged) == 1 and logged[0].phase == "prefill" and logged[0].head_dim == 64
    assert not fa4aot.uninstall()


def test_compile_monitor_refuses_fa4_compiles_only(tiny_store):
    import cutlass
    import cutlass.cute as cute

    import fa4aot
    from fa4aot.fa4 import driver, dropin

    from _foreign_kernel import noop  # tests/fa4 is on sys.path (rootdir-relative test dirs)

    driver.configure("sm90", 132)
    # a compile asked for by code of FA4's package (as interface.py's own calls are)
    as_fa4 = {"__name__": "flash_attn.cute.interface", "cute": cute}
    exec("def compile_it(*a):\n    return cute.compile(*a)\n"
         "def compile_opt(*a):\n    return cute.compile[()](*a)\n", as_fa4)
    root, _ = tiny_store
    counters = fa4aot.install(cache=root, on_miss="error", arch="sm90", num_sms=132)
    try:
        with pytest.raises(dropin.CompileAttempt, match="flash_attn.cute tried to compile"):
            as_fa4["compile_it"](object())
        with pytest.raises(dropin.CompileAttempt):
            as_fa4["compile_opt"](object())
        assert counters.compiles == 2
        # an engine's own CuTe kernel compiles as before, and is not counted as FA4's
        fn = cute.compile(noop, cutlass.Int32(1))
        assert callable(fn) and counters.compiles == 2
    finally:
        fa4aot.uninstall()


def test_coverage_hit_then_missing(tiny_store, tmp_path):
    from fa4aot.cli import main

    root, spec_file = tiny_store
    r = CliRunner().invoke(
        main, ["coverage", "--spec", str(spec_file), "--cache", str(root), "--json"]
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["counts"] == {"hit": 2, "padding": 0, "missing": 0, "unsupported": 0, "corrupt": 0}
    bigger = tmp_path / "tiny2.toml"
    bigger.write_text(TINY.replace('phases = ["decode"]', 'phases = ["decode", "prefill"]'))
    r = CliRunner().invoke(
        main, ["coverage", "--spec", str(bigger), "--cache", str(root), "--json"]
    )
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert doc["counts"]["hit"] == 2 and doc["counts"]["missing"] == 2
    assert {row["variant"].split()[6] for row in doc["rows"] if row["status"] == "missing"} == {
        "prefill"
    }


def test_coverage_reports_padding(tiny_store, tmp_path):
    from fa4aot.cli import main

    root, _ = tiny_store
    spec = tmp_path / "pad.toml"
    spec.write_text(
        TINY.replace("head_dim = 64", "head_dim = 56").replace('name = "tiny"', 'name = "pad"')
    )
    r = CliRunner().invoke(
        main, ["coverage", "--spec", str(spec), "--cache", str(root), "--json", "--no-trace"]
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["counts"]["padding"] == 2
    assert all("head_dim 56 -> 64" in row["detail"] for row in doc["rows"])


def test_autoinstall_hook_installs_when_fa4_is_imported(tiny_store):
    """FA4AOT_INSTALL + the .pth line: install() runs right after flash_attn.cute.interface is
    imported (device arch faked: no GPU here)."""
    root, _ = tiny_store
    code = textwrap.dedent("""
        import os, sys
        from fa4aot.fa4 import driver, dropin, keys
        dropin._device_arch = lambda: ("sm90", 132)
        driver.configure("sm90", 132)
        exec(open(sys.argv[1]).read())   # the exact .pth line
        assert "flash_attn.cute.interface" not in sys.modules
        import flash_attn.cute.interface as I
        assert type(I._flash_attn_fwd.compile_cache).__name__ == "_StoreCache", type(I._flash_attn_fwd.compile_cache)
        print("installed")
    """)
    from fa4aot._autoinstall import PTH_LINE

    pth = root.parent / "hook.pth"
    pth.write_text(PTH_LINE)
    env = dict(os.environ, FA4AOT_INSTALL="error", FA4AOT_CACHE_DIR=str(root))
    r = subprocess.run(
        [sys.executable, "-c", code, str(pth)], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0 and "installed" in r.stdout, r.stderr[-2000:]
    env.pop("FA4AOT_INSTALL")
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; exec(open(os.sys.argv[1]).read()); import sys; "
            "assert 'fa4aot' not in sys.modules; print('inert')",
            str(pth),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert "inert" in r.stdout, r.stderr[-2000:]


def _fake_varlen_big_batch():
    """A varlen decode step over 257 sequences: FA4 runs its tile_cumsum and blocks_to_batch
    helpers before it looks up the forward kernel."""
    import flash_attn.cute as fa
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    b = 257
    with FakeTensorMode():
        e = lambda *s, dt=torch.bfloat16: torch.empty(*s, dtype=dt, device="cuda")  # noqa: E731
        fa.flash_attn_varlen_func(
            e(b, 2, 64),
            e(b * 256, 1, 64),
            e(b * 256, 1, 64),
            cu_seqlens_q=e(b + 1, dt=torch.int32),
            cu_seqlens_k=e(b + 1, dt=torch.int32),
            max_seqlen_q=1,
            max_seqlen_k=256,
            causal=True,
        )


def test_install_logs_the_forward_when_a_batch_helper_misses_and_from_misses_builds_it(
    tiny_store, tmp_path, knobs
):
    """Issue 13: under install() a batch > 256 varlen call missed FA4's tile_cumsum helper,
    which FA4 looks up before the forward: the refusal logged no variant, so --from-misses could
    not build it. Now the forward's variant is logged, built in one round, then served."""
    import shutil

    import fa4aot
    from fa4aot.fa4 import driver
    from fa4aot.cli import main
    from fa4aot.store.misses import read_misses

    root, _ = tiny_store
    store = tmp_path / "store"
    shutil.copytree(root, store)
    log = tmp_path / "misses.jsonl"
    driver.configure("sm90", 132)
    knobs(miss_log=str(log))
    counters = fa4aot.install(cache=store, on_miss="error", arch="sm90", num_sms=132)
    try:
        with pytest.raises(fa4aot.ArtifactMissing, match="its helper kernel \\(tile_cumsum"):
            _fake_varlen_big_batch()
        assert counters.compiles == 0
    finally:
        fa4aot.uninstall()
    (v,) = read_misses(log)
    assert v.cu_hint and v.cu_seqlens_q and v.cu_seqlens_k and v.qhead_per_kvhead == 2
    r = CliRunner().invoke(
        main, ["build", "--from-misses", str(log), "--cache", str(store), "--json"]
    )
    assert r.exit_code == 0, r.output
    counters = fa4aot.install(cache=store, on_miss="error", arch="sm90", num_sms=132)
    try:
        _fake_varlen_big_batch()
        assert counters.hits == 3 and counters.compiles == 0 and not counters.misses
    finally:
        fa4aot.uninstall()
