"""The CLI through click's CliRunner: rows out (--json or a table), one-line errors, exit codes
0 ok / 1 failure / 2 usage. Builds use the stub compiler: the CLI is the point here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import fa4aot.build.builder as B
from fa4aot import settings
from fa4aot.cli import main

TINY = (Path(__file__).parents[1] / "specs" / "tiny.toml").read_text()


@pytest.fixture
def env(tmp_path):
    # cache_dir too: a command that forgot --cache must not touch the user's cache
    return {
        "stub_compiler": "1",
        "stub_delay": "0",
        "progress": "0",
        "cache_dir": str(tmp_path / "default-cache"),
        "debug": None,
    }


@pytest.fixture
def run(env):
    runner = CliRunner()

    def invoke(*args):
        with settings.scope(**env):
            return runner.invoke(main, list(args), catch_exceptions=False)

    return invoke


@pytest.fixture
def spec_file(tmp_path) -> Path:
    p = tmp_path / "tiny.toml"
    p.write_text(TINY)
    return p


@pytest.fixture
def built(run, tmp_path, spec_file):
    cache = tmp_path / "store"
    r = run("build", "--cache", str(cache), "--spec", str(spec_file), "-j", "1", "--json")
    assert r.exit_code == 0, r.output
    return cache, json.loads(r.stdout)


def test_build_dry_run_json_lists_the_default_plan(run, tmp_path):
    r = run("build", "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert len(doc["rows"]) == 154
    assert len({row["id"] for row in doc["rows"]}) == 154
    assert all(set(row) == {"arch", "num_sms", "id", "variant", "spec"} for row in doc["rows"])
    assert {row["num_sms"] for row in doc["rows"]} == {132}
    assert any(
        row["spec"] == "llama-3.1-8b/full" and row["variant"].startswith("sm90 bfloat16 hd128")
        for row in doc["rows"]
    )
    (u,) = [u for u in doc["unsupported"] if u["spec"] == "gemma-4"]
    assert (u["spec"], u["layer"]) == ("gemma-4", "full") and "512" in u["reason"]
    mla = [u for u in doc["unsupported"] if u["spec"] != "gemma-4"]
    assert sorted(u["spec"] for u in mla) == ["deepseek-v3", "glm-4.7-flash"]
    assert all("sm100-only" in u["reason"] for u in mla)
    # a dry run compiles and writes nothing
    assert not (tmp_path / "default-cache").exists()


def test_build_dry_run_table(run, spec_file):
    r = run("build", "--dry-run", "--spec", str(spec_file))
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["ID", "VARIANT", "SPEC"]
    assert len(lines) == 3 and all("tiny/full" in line for line in lines[1:])


def test_specs_json_reports_unsupported_layers(run):
    r = run("specs", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["rows"]
    gemma_full = [row for row in rows if (row["spec"], row["layer"]) == ("gemma-4", "full")]
    assert len(gemma_full) == 1
    assert (
        gemma_full[0]["status"].startswith("unsupported: head_dim 512/512")
        and gemma_full[0]["id"] == ""
    )
    needed = [row for row in rows if row["status"] in ("built", "missing")]
    assert {row["status"] for row in needed} == {"missing"}  # nothing built in this store
    assert {row["spec"] for row in needed} == {
        "gemma-4",
        "gpt-oss-20b",
        "llama-3.1-70b",
        "llama-3.1-8b",
        "mistral-7b",
        "qwen3-32b",
    }
    # per spec, so shared kernels are listed under each spec that needs them
    assert len({row["id"] for row in needed}) == 154


def test_specs_one_spec(run):
    r = run("specs", "--spec", "llama-3.1-8b", "--json")
    rows = json.loads(r.stdout)["rows"]
    assert (
        r.exit_code == 0 and len(rows) == 53 and {row["spec"] for row in rows} == {"llama-3.1-8b"}
    )


def test_build_json(built):
    cache, doc = built
    assert doc["counts"] == {"built": 2, "rebuilt": 0, "cached": 0, "failed": 0}
    assert doc["unsupported"] == []
    assert Path(doc["store"]).parent == cache / "v1"
    assert {row["status"] for row in doc["rows"]} == {"built"}
    for row in doc["rows"]:
        assert (Path(doc["store"]) / "artifacts" / row["id"] / "record.json").is_file()
        assert row["size"] > 0 and "error" not in row


def test_second_build_reports_cached(run, built, spec_file):
    cache, first = built
    r = run("build", "--cache", str(cache), "--spec", str(spec_file), "-j", "1")
    assert r.exit_code == 0, r.output
    first_line, last = r.stdout.splitlines()
    assert first_line == f"nothing to build: all 2 variants are in {first['store']}"
    # the last line says how to point the runtime at it (--cache is not a runtime layer)
    assert last.startswith(f"serve it with: export FA4AOT_CACHE_DIR={cache}:")


def test_build_human_summary(run, tmp_path, spec_file):
    r = run("build", "--cache", str(tmp_path / "s"), "--spec", str(spec_file), "-j", "1")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("built 2, cached 0, failed 0 in ")


def test_build_in_worker_processes(run, tmp_path, spec_file):
    r = run("build", "--cache", str(tmp_path / "s"), "--spec", str(spec_file), "-j", "2", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["counts"]["built"] == 2


def test_build_defaults_to_the_cache_dir_env(run, env, spec_file):
    r = run("build", "--spec", str(spec_file), "-j", "1", "--json")
    assert r.exit_code == 0, r.output
    assert Path(json.loads(r.stdout)["store"]).is_relative_to(Path(env["cache_dir"]))


def test_ls_json(run, built):
    cache, doc = built
    r = run("ls", "--cache", str(cache), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert sorted(row["id"] for row in out["rows"]) == sorted(row["id"] for row in doc["rows"])
    for row in out["rows"]:
        assert (
            row["arch"],
            row["spec"],
            row["dtype"],
            row["head_dims"],
            row["ratio"],
            row["mask"],
            row["regime"],
        ) == ("sm90", "tiny", "bfloat16", "64/64", 2, "causal", "dense/decode")
    assert sorted(row["lse"] for row in out["rows"]) == ["", "yes"]
    assert out["block_sizes"] == []  # no paged layout in this spec


def test_ls_empty_store(run, tmp_path):
    (tmp_path / "empty").mkdir()
    r = run("ls", "--cache", str(tmp_path / "empty"))
    assert r.exit_code == 0 and r.stdout.strip() == "(nothing)"
    assert r.stderr == f"read: {tmp_path / 'empty'} (--cache)\n"  # the layers it read, named
    # a --cache that names no directory is a typo, not an empty store
    r = run("ls", "--cache", str(tmp_path / "nothing"))
    assert r.exit_code == 1 and "no such directory (--cache)" in r.stderr


def test_inspect_by_id_prefix(run, built):
    cache, doc = built
    vid = doc["rows"][0]["id"]
    r = run("inspect", vid[:6], "--cache", str(cache))
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)
    assert rec["id"] == vid and rec["dir"].endswith(f"/artifacts/{vid}")
    assert rec["requested_by"] == {"spec": "tiny", "layer": "full"}


def test_inspect_unknown_and_ambiguous(run, built):
    cache, _ = built
    r = run("inspect", "zzzz", "--cache", str(cache))
    assert r.exit_code == 1 and "no artifact 'zzzz'" in r.stderr
    r = run("inspect", "", "--cache", str(cache))  # every id starts with ""
    assert r.exit_code == 2 and "ambiguous (2 artifacts)" in r.stderr


def test_verify_then_flip_a_byte(run, built):
    cache, doc = built
    r = run("verify", "--cache", str(cache), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["ok"], out["corrupt"]) == (2, 0) and {row["status"] for row in out["rows"]} == {
        "ok"
    }
    bad = doc["rows"][1]["id"]
    so = Path(doc["store"]) / "artifacts" / bad / "fwd.so"
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 0x01
    so.write_bytes(bytes(data))
    r = run("verify", "--cache", str(cache), "--json")
    assert r.exit_code == 1
    out = json.loads(r.stdout)
    assert (out["ok"], out["corrupt"]) == (1, 1)
    (row,) = [row for row in out["rows"] if row["status"] != "ok"]
    assert row["id"] == bad and row["status"] == "corrupt" and "sha256" in row["error"]
    # human output, same verdict
    r = run("verify", "--cache", str(cache))
    assert r.exit_code == 1 and r.stdout.splitlines()[-1].startswith("1 ok, 1 ")


def test_failed_variant_exits_1(run, tmp_path, spec_file, monkeypatch):
    real_stub = B._compile_stub
    failing = []

    def stub_failing_once(call, variant, workdir):
        if not failing:
            failing.append(variant.id)
            raise RuntimeError("no kernel for you")
        return real_stub(call, variant, workdir)

    monkeypatch.setattr(B, "_compile_stub", stub_failing_once)
    r = run("build", "--cache", str(tmp_path / "s"), "--spec", str(spec_file), "-j", "1", "--json")
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert doc["counts"] == {"built": 1, "rebuilt": 0, "cached": 0, "failed": 1}
    (row,) = [row for row in doc["rows"] if row["status"] == "failed"]
    assert row["id"] == failing[0] and row["error"] == "RuntimeError: no kernel for you"
    failing.clear()
    r = run("build", "--cache", str(tmp_path / "s2"), "--spec", str(spec_file), "-j", "1")
    assert r.exit_code == 1
    assert f"FAILED {failing[0]} " in r.stdout and "no kernel for you" in r.stdout


def test_a_build_whose_every_variant_failed_gives_no_serve_hint(run, tmp_path, spec_file,
                                                               monkeypatch):
    def stub_failing(call, variant, workdir):
        raise RuntimeError("No CTK flavor installed")

    monkeypatch.setattr(B, "_compile_stub", stub_failing)
    r = run("build", "--cache", str(tmp_path / "s"), "--spec", str(spec_file), "-j", "1")
    assert r.exit_code == 1
    assert "built 0, cached 0, failed 2 in " in r.stdout and "serve it with" not in r.stdout
    r = run("build", "--cache", str(tmp_path / "s"), "--spec", str(spec_file), "-j", "1", "--json")
    assert r.exit_code == 1 and json.loads(r.stdout)["serve"] is None


def test_bad_spec_is_one_line_exit_1(run, tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text(TINY.replace("head_dim = 64", "head_dim = 64\ncausal = 1"))
    for cmd in (
        ["build", "--cache", str(tmp_path / "s"), "--spec", str(p)],
        ["specs", "--spec", str(p)],
        ["build", "--dry-run", "--spec", str(p)],
    ):
        r = run(*cmd)
        assert r.exit_code == 1, cmd
        assert r.stderr == f"error: {p}: attention[0].causal: must be true or false, got 1\n"
        assert r.stdout == ""
    r = run("build", "--dry-run", "--spec", "no-such-spec")
    assert (
        r.exit_code == 1
        and r.stderr.startswith("error: no-such-spec: no such spec")
        and r.stderr.count("\n") == 1
    )
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("python", ["3", "three", "3.x", "3.12.1", "", "2.7", "3.99", "3.10"])
def test_bad_python_is_a_usage_error(run, tmp_path, spec_file, python):
    r = run("build", "--cache", str(tmp_path / "s"), "--spec", str(spec_file), "--python", python)
    assert r.exit_code == 2
    assert "--python" in r.stderr and "MAJOR.MINOR" in r.stderr
    assert not (tmp_path / "s").exists()


def test_spec_with_nothing_buildable_fails_and_writes_no_store(run, tmp_path):
    # one hd512 layer: upstream FA4 runs no head_dim above 256 on sm90
    spec = tmp_path / "big.toml"
    spec.write_text(TINY.replace("head_dim = 64", "head_dim = 512"))
    r = run("build", "--cache", str(tmp_path / "s"), "--spec", str(spec), "-j", "1")
    assert r.exit_code == 1, r.output
    assert r.stderr.startswith("error: nothing to build for sm90") and "head_dim 512" in r.stderr
    assert "FA4AOT_CACHE_DIR" not in r.output  # no invitation to serve an empty store
    assert not (tmp_path / "s").exists()


def test_other_usage_errors_exit_2(run):
    assert run("build", "--arch", "sm75", "--dry-run").exit_code == 2
    assert run("build", "-j", "0", "--dry-run").exit_code == 2
    assert run("no-such-command").exit_code == 2


def test_python_target_names_the_store(run, tmp_path, spec_file):
    r = run(
        "build",
        "--cache",
        str(tmp_path / "s"),
        "--spec",
        str(spec_file),
        "--python",
        "3.12",
        "--json",
    )
    assert r.exit_code == 0, r.output
    assert Path(json.loads(r.stdout)["store"]).name.startswith("sm90-132sm-py312-")


def test_version(run):
    r = run("--version")
    assert r.exit_code == 0 and "0.1.0" in r.stdout


# -- explain -----------------------------------------------------------------------------------


@pytest.fixture
def explain_store(monkeypatch):
    """explain over a store holding 32:1 causal decode and the decode-fold kernel (hd128, dense
    and paged page 128): records only, explain never loads code."""
    from fakes import call, fold_kernel

    held = [call(hq=32).variant("sm90"), fold_kernel("dense"), fold_kernel("paged", page=128)]
    held += [call(hq=32, layout="paged", page=128).variant("sm90")]
    _explain_holds(monkeypatch, held)


def _explain_holds(monkeypatch, held, **record):
    """explain's store: the records of the variants `held` (explain never loads code), each
    with the fields `record` adds."""
    from types import SimpleNamespace

    import fa4aot.cli as cli
    from fa4aot.cli.common import Match

    monkeypatch.setattr(
        cli.explain,
        "_cached_artifacts",
        lambda *a: (
            [SimpleNamespace(id=x.id, record={"variant": x.to_dict(), **record}) for x in held],
            {},
            Match(stores=[SimpleNamespace(dir="(test)", toolchain={}, fa4_abi="upstream")]),
        ),
    )


@pytest.mark.parametrize("held", ["both", "twin"])
def test_explain_names_the_twin_the_runtime_serves(run, monkeypatch, held):
    """A 4-row step at 32:8 (32 packed rows) is served by its cached twin on a 64-row M tile,
    as plan.resolve serves it: beside FA4's tile, or alone in the store."""
    from fakes import call

    feat = call(hq=32, hk=8, sq=4).features()
    twin = feat.small_tile_variant("sm90")
    assert twin is not None and twin.tile.m == 64
    _explain_holds(monkeypatch, [twin] + ([feat.variant("sm90")] if held == "both" else []))
    args = ["explain", "--heads", "32:8", "--head-dim", "128", "--seqlen-q", "4", "--batch", "4"]
    r = run(*args, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["small_tile"]["id"] == twin.id
    r = run(*args)
    assert r.exit_code == 0 and f"(id {twin.id}): the rows fit a 64-row M tile" in r.stdout
    assert ("alternative : " in r.stdout) == (held == "both"), r.stdout


@pytest.mark.parametrize(
    "layout", [["--layout", "dense"], ["--layout", "paged", "--page-size", "128"]]
)
def test_explain_decode_fold_then_padding(run, explain_store, monkeypatch, layout):
    r = run("explain", "--heads", "20:1", "--head-dim", "128", "--batch", "4", *layout, "--json")
    assert r.exit_code == 0, r.output
    got = [(c["ratio"], c["fold"], c["cost"]) for c in json.loads(r.stdout)["choices"]]
    assert got[0] == (1, 20, 1.0) and got[1] == (32, 1, 1.6)
    text = run("explain", "--heads", "20:1", "--head-dim", "128", *layout).stdout
    assert (
        "served by   : decode fold (20 query heads per KV head -> 1 heads x 20 query rows" in text
    )
    # a speculative step (4 rows) cannot fold: padded
    r = run("explain", "--heads", "20:1", "--head-dim", "128", "--seqlen-q", "4", *layout, "--json")
    assert [c["fold"] for c in json.loads(r.stdout)["choices"]] == [1]
    with settings.scope(decode_fold="0"):
        r = run("explain", "--heads", "20:1", "--head-dim", "128", *layout, "--json")
    assert [(c["ratio"], c["fold"]) for c in json.loads(r.stdout)["choices"]] == [(32, 1)]
    with settings.scope(decode_fold="yes"):  # the runtime refuses it; so does explain
        r = run("explain", "--heads", "20:1", "--head-dim", "128", *layout)
    assert r.exit_code == 1
    assert r.stderr == "error: FA4AOT_DECODE_FOLD='yes' is invalid: expected 0 or 1\n"


@pytest.fixture
def split_store(monkeypatch):
    """explain over a store holding only the split-KV kernels (packed K and page 128), each
    with its merge and metadata parts as `fa4aot build` writes them: records only."""
    _hold_split_kernels(monkeypatch, {
        "fwd": {"q_broadcast": True},
        "merge": {"partial_dtype": "bfloat16", "max_splits": 128, "threads": 256},
        "chunk_meta": {"form": "lengths"},
    })


def test_explain_splits_speculative_rows_over_a_packed_k_on_the_bounds_mode(run, monkeypatch):
    """A packed-K split kernel whose bounds mode takes several rows (record fwd_bounds.rows)
    splits a speculative step over a packed K, or a dense one no cached page size divides:
    packed as rows of one chunk with its causal tail, or (20 query heads x 4 rows exceed the
    64-row tile) unrolled."""
    _hold_split_kernels(monkeypatch, {
        "fwd": {"q_broadcast": True},
        "fwd_bounds": {"rows": 2},
        "merge": {"partial_dtype": "bfloat16", "max_splits": 128, "threads": 256},
        "chunk_meta": {"form": "bounds"},
    })
    base = ["explain", "--head-dim", "128", "--json", "--seqlen-q", "4"]
    for extra in (["--seqlen-k", "65520"], ["--seqlen-k", "65536", "--layout", "varlen"]):
        r = run(*base, "--heads", "32:8", *extra)
        doc = json.loads(r.stdout)["split"]
        assert r.exit_code == 0 and doc["splits"] > 1, (extra, r.stdout)
        assert ("4 query rows packed as rows of each chunk, the causal tail unrolled over each "
                "sequence's last 3 keys (the bounds mode)") in doc["plan"], doc["plan"]
        r = run(*base, "--heads", "20:1", *extra)
        doc = json.loads(r.stdout)["split"]
        assert r.exit_code == 0 and doc["splits"] > 1, (extra, r.stdout)
        assert "4 query rows unrolled (each row's chunk bounds read from cu_seqlens_k" in (
            doc["plan"])


def _hold_split_kernels(monkeypatch, parts, pages=(None, 128)):
    from fa4aot.model.compile_keys import split_kernel_variant

    held = [split_kernel_variant("sm90", "bfloat16", 128, 128, p) for p in pages]
    _explain_holds(monkeypatch, held, parts=parts)


def test_explain_names_the_merge_kernel(run, monkeypatch):
    """The split plan says which kernel merges its chunks: fa4aot's, or FA4's combine in a
    store built before it (and that a build replaces it)."""
    args = ["explain", "--head-dim", "128", "--heads", "32:8", "--seqlen-k", "65536", "--json"]
    _hold_split_kernels(monkeypatch, {
        "fwd": {}, "merge": {"partial_dtype": "bfloat16", "max_splits": 128, "threads": 256}})
    doc = json.loads(run(*args).stdout)["split"]
    assert doc["merge"] == "merge" and doc["plan"].endswith("merged by fa4aot's merge kernel")
    _hold_split_kernels(monkeypatch, {
        "fwd": {}, "combine": {"partial_dtype": "bfloat16", "tile_m": 16, "max_splits": 128}})
    doc = json.loads(run(*args).stdout)["split"]
    assert doc["merge"] == "combine" and "`fa4aot build` replaces it" in doc["plan"]
    assert doc["splits"] == 16


def test_explain_says_how_the_split_reads_q(run, monkeypatch):
    """Several decode rows: q read in place through the chunk mode, or (a store built before
    it) copied over the chunks; one row reads it in place either way."""
    args = ["explain", "--head-dim", "128", "--heads", "32:8", "--seqlen-k", "65536", "--json"]
    merge = {"partial_dtype": "bfloat16", "max_splits": 128, "threads": 256}
    for q_broadcast in (True, False):
        _hold_split_kernels(monkeypatch, {"fwd": {"q_broadcast": q_broadcast}, "merge": merge})
        for batch in ("1", "4"):
            doc = json.loads(run(*args, "--batch", batch).stdout)["split"]
            assert doc["q_broadcast"] is q_broadcast and doc["splits"] > 1
            copied = "q copied over the chunks" in doc["plan"]
            assert copied == (not q_broadcast and batch == "4"), (q_broadcast, batch)
            assert copied != ("q read in place" in doc["plan"])


def test_explain_says_a_split_over_pages_of_64_runs_on_the_tma_page_part(run, monkeypatch):
    """The cp.async paged split kernel serves every page size; its part fwd_tma runs the chunks
    of a split over pages of its size (64) only (constraints.tma_page)."""
    merge = {"partial_dtype": "bfloat16", "max_splits": 128, "threads": 256}
    _hold_split_kernels(monkeypatch, {"fwd": {"q_broadcast": True, "chunk_lengths": True},
                                      "merge": merge, "fwd_tma": {"page_size": 64}}, pages=(16,))
    args = ["explain", "--head-dim", "128", "--heads", "32:8", "--seqlen-k", "8192",
            "--layout", "paged", "--json", "--page-size"]
    doc = json.loads(run(*args, "64").stdout)["split"]
    assert doc["splits"] > 1 and doc["chunk_kernel"] == "fwd_tma"
    assert "chunks on fwd_tma (64-key tiles on FA4's TMA paged path) of" in doc["plan"]
    doc = json.loads(run(*args, "16").stdout)["split"]
    assert doc["splits"] > 1 and doc["chunk_kernel"] == "fwd" and "fwd_tma" not in doc["plan"]


def test_explain_says_a_long_packed_step_runs_on_the_wide_split_part(run, monkeypatch):
    """split.wide_split: a dense or varlen K's unsplit one-wave fold over 64K+ keys (b16/64K
    at 32:8) runs 8 chunks on fwd_wide_split where the store holds it, a fold of two waves 16;
    a split plan (b8/64K: 2 chunks of 32K keys) keeps the chunk kernel, as do a paged K over
    pages of 128 and a store without the part."""
    merge = {"partial_dtype": "bfloat16", "max_splits": 128, "threads": 256}
    args = ["explain", "--head-dim", "128", "--heads", "32:8", "--seqlen-k", "65536", "--batch",
            "16", "--json"]
    parts = {"fwd": {"q_broadcast": True}, "merge": merge}
    _hold_split_kernels(monkeypatch, {**parts, "fwd_wide_split": {"tile_n": 64,
                                                                   "ctas_per_sm": 2}})
    doc = json.loads(run(*args).stdout)["split"]
    assert doc["splits"] == 8 and doc["chunk_kernel"] == "fwd_wide_split"
    assert ("chunks on fwd_wide_split (fwd_wide through the chunk modes: 64-key tiles, 2 CTAs "
            "per SM) of") in doc["plan"]
    assert "1024 CTAs" in doc["plan"]
    doc = json.loads(run(*args[:-2], "8", "--json").stdout)["split"]
    assert doc["splits"] == 2 and doc["chunk_kernel"] == "fwd"
    # a fold of two waves (b32/128K: 256 CTAs on 132 SMs) runs 16 chunks there too
    doc = json.loads(run(*args[:-4], "131072", "--batch", "32", "--json").stdout)["split"]
    assert doc["splits"] == 16 and doc["chunk_kernel"] == "fwd_wide_split"
    assert "4096 CTAs" in doc["plan"]
    doc = json.loads(run(*args, "--layout", "varlen").stdout)["split"]
    assert doc["splits"] == 8 and doc["chunk_kernel"] == "fwd_wide_split"
    doc = json.loads(run(*args, "--layout", "paged", "--page-size", "128").stdout)["split"]
    assert doc["splits"] == 0
    _hold_split_kernels(monkeypatch, parts)
    doc = json.loads(run(*args).stdout)["split"]
    assert doc["splits"] == 0


def test_explain_says_which_kernel_the_fold_runs_on(run, monkeypatch):
    """A one-row step left unsplit: on a wide fold kernel (parts fwd_wide, fwd_wide1:
    constraints.fold_kernel) where its CTAs fill that kernel's waves on the SMs and the store
    holds it; else on the chunk kernel."""
    merge = {"partial_dtype": "bfloat16", "max_splits": 128, "threads": 256}
    wide = {"tile_n": 64, "ctas_per_sm": 2}
    wide1 = {"tile_n": 64, "ctas_per_sm": 1}
    args = ["explain", "--head-dim", "128", "--heads", "32:8", "--json"]
    cases = (("16", "2048", None), ("25", "2048", "fwd_wide"), ("64", "2048", "fwd_wide"),
             ("40", "2048", None), ("64", "16384", "fwd_wide1"))
    for held in ((), ("fwd_wide",), ("fwd_wide", "fwd_wide1")):
        parts = {"fwd": {"q_broadcast": True}, "merge": merge}
        parts.update({n: {"fwd_wide": wide, "fwd_wide1": wide1}[n] for n in held})
        _hold_split_kernels(monkeypatch, parts)
        for batch, keys, want in cases:
            if want is not None and want not in held:
                want = "fwd_wide" if held else None
            doc = json.loads(run(*args, "--batch", batch, "--seqlen-k", keys).stdout)["split"]
            assert doc["splits"] == 0 and doc["wide"] is (want is not None), (held, batch, doc)
            assert doc["fold_kernel"] == (want or "fwd"), (held, batch, doc)
            ctas = {"fwd_wide": 2, "fwd_wide1": 1}.get(want)
            assert (f"the wide fold kernel {want} (64-key tiles, {ctas} CTA(s) per SM"
                    in doc["fold"]) is (want is not None)
            why = {"16": "fit one wave at one CTA per SM", "40": "thin last wave"}.get(batch)
            assert (why is not None and bool(held) and want is None) == (
                "(the chunk kernel: " in doc["fold"]), (held, batch, doc["fold"])
            if why and held:
                assert why in doc["fold"], doc["fold"]


def test_explain_says_speculative_rows_run_packed(run, monkeypatch):
    """split.plan_packed: 4 causal query rows over a paged K (or a dense one viewed as pages),
    where the chunk kernel reads q and cuts a paged K's lengths through its chunk modes, run
    packed as rows of each chunk, their causal tail in one more slot; a head ratio whose rows
    overflow the chunk kernel's tile (20:1 x 4 > 64), or a store without the chunk-length
    mode, unrolls them."""
    merge = {"partial_dtype": "bfloat16", "max_splits": 128, "threads": 256}
    parts = {"fwd": {"q_broadcast": True, "chunk_lengths": True}, "merge": merge,
             "chunk_meta": {"form": "lengths"}}
    _hold_split_kernels(monkeypatch, parts)
    base = ["explain", "--head-dim", "128", "--seqlen-k", "65536", "--seqlen-q", "4", "--json"]
    paged = ["--layout", "paged", "--page-size", "128"]
    doc = json.loads(run(*base, "--heads", "32:8", *paged).stdout)["split"]
    assert doc["packed"] and doc["slots"] == doc["splits"] + 1, doc
    assert ("4 query rows packed as rows of each chunk, the causal tail unrolled over two "
            "pages") in doc["plan"] and "(+1 causal tail slot)" in doc["plan"]
    doc = json.loads(run(*base, "--heads", "32:8").stdout)["split"]
    assert doc["packed"] and "the dense K viewed as pages of 128" in doc["plan"], doc
    doc = json.loads(run(*base, "--heads", "32:8", "--no-causal", *paged).stdout)["split"]
    assert doc["packed"] and doc["slots"] == doc["splits"] and "tail" not in doc["plan"]
    doc = json.loads(run(*base, "--heads", "20:1", *paged).stdout)["split"]
    assert not doc["packed"] and "4 query rows unrolled" in doc["plan"], doc
    _hold_split_kernels(monkeypatch, {**parts, "fwd": {"q_broadcast": True}})
    doc = json.loads(run(*base, "--heads", "32:8", *paged).stdout)["split"]
    assert not doc["packed"] and "4 query rows unrolled" in doc["plan"], doc


def test_explain_plans_with_the_named_cards_hbm(run, monkeypatch):
    """split.model_for in explain: --gpu h100 (3.35 TB/s) or --hbm-tbps plans as the runtime
    does on that card (b8/16K s_q 4 over pages of 128: FA4's unsplit kernel, where the H200's
    figures pack 2 chunks); the default and --gpu h200 plan with the H200's."""
    merge = {"partial_dtype": "bfloat16", "max_splits": 128, "threads": 256}
    _hold_split_kernels(monkeypatch, {
        "fwd": {"q_broadcast": True, "chunk_lengths": True}, "merge": merge,
        "chunk_meta": {"form": "lengths"}})
    base = ["explain", "--head-dim", "128", "--heads", "32:8", "--seqlen-k", "16384",
            "--seqlen-q", "4", "--batch", "8", "--layout", "paged", "--page-size", "128"]
    for extra, splits, tbps in (([], 2, 4.8), (["--gpu", "h200"], 2, 4.8),
                                (["--gpu", "h100"], 0, 3.35), (["--hbm-tbps", "3.35"], 0, 3.35)):
        doc = json.loads(run(*base, *extra, "--json").stdout)["split"]
        assert doc["splits"] == splits and doc["hbm_tbps"] == tbps, (extra, doc)
    text = run(*base, "--gpu", "h100").stdout
    assert "cost model  : the split plans' for HBM at 3.35 TB/s" in text
    assert "cost model" not in run(*base).stdout
    r = run(*base, "--hbm-tbps", "0")
    assert r.exit_code == 2 and "--hbm-tbps" in r.output


def test_explain_split_kv(run, split_store):
    base = ["explain", "--head-dim", "128", "--json"]
    r = run(*base, "--heads", "32:8", "--seqlen-k", "65536")
    assert r.exit_code == 0, r.output  # no 4:1 kernel: the split serves it alone
    assert json.loads(r.stdout)["split"]["splits"] == 16
    # GLM's 20:1 over one KV head, paged: 128 chunks
    r = run(*base, "--heads", "20:1", "--seqlen-k", "131072", "--layout", "paged",
            "--page-size", "128")
    doc = json.loads(r.stdout)["split"]
    assert r.exit_code == 0 and doc["splits"] > 64 and doc["chunk"] % 128 == 0
    text = run("explain", "--heads", "20:1", "--head-dim", "128", "--seqlen-k", "131072",
               "--layout", "paged", "--page-size", "128").stdout
    assert "served by   : split-KV:" in text
    # each refusal names its reason, and nothing else serves these calls
    for extra, why in (
        (["--window", "128"], "windowed"),
        # 128 does not divide 65520, and this store's packed-K kernel predates the bounds
        # mode's several rows
        (["--seqlen-q", "4", "--seqlen-k", "65520"], "`fa4aot build` rebuilds it"),
        (["--seqlen-k", "600"], "never split"),
    ):
        args = ["--heads", "32:8", "--seqlen-k", "65536", *extra]
        r = run(*base, *args)
        assert r.exit_code == 1 and why in json.loads(r.stdout)["split"]["why"], (extra, r.stdout)
    # several query rows over a dense K whose length a cached page size divides: its own pages
    r = run(*base, "--heads", "32:8", "--seqlen-k", "65536", "--seqlen-q", "4")
    doc = json.loads(r.stdout)["split"]
    assert r.exit_code == 0 and doc["splits"] > 1, r.stdout
    assert "4 query rows unrolled, the dense K viewed as pages of 128" in doc["plan"]
    # a KV cache in batch form with seqused_k: its own page pool at any number of rows, where
    # a cached page size divides its capacity
    for rows in ("1", "4"):
        r = run(*base, "--heads", "32:8", "--seqlen-k", "65536", "--layout", "padded",
                "--seqlen-q", rows)
        doc = json.loads(r.stdout)["split"]
        assert r.exit_code == 0 and doc["splits"] > 1, r.stdout
        assert "the KV cache viewed as pages of 128" in doc["plan"], doc["plan"]
    r = run(*base, "--heads", "32:8", "--seqlen-k", "65000", "--layout", "padded")
    assert r.exit_code == 1
    assert "divides the KV cache's 65000 keys" in json.loads(r.stdout)["split"]["why"]
    with settings.scope(split_kv="0"):
        r = run(*base, "--heads", "32:8", "--seqlen-k", "65536")
    assert r.exit_code == 1 and json.loads(r.stdout)["split"]["why"] == "FA4AOT_SPLIT_KV=0"
    # a one-row step the cost model leaves unsplit runs as the fold (one chunk per sequence on
    # the chunk kernel), which serves it with no 4:1 kernel cached, at any batch
    for batch in ("8", "64"):
        r = run(*base, "--heads", "32:8", "--seqlen-k", "2048", "--batch", batch)
        doc = json.loads(r.stdout)["split"]
        assert r.exit_code == 0 and doc["splits"] == 0 and "cost model" in doc["why"]
        assert doc["fold"].startswith("the fold: one chunk per sequence")
    text = run("explain", "--heads", "32:8", "--head-dim", "128", "--seqlen-k", "2048",
               "--batch", "8").stdout
    assert "served by   : the fold:" in text and "split-KV    : no (the cost model" in text
    with settings.scope(split_kv="0"):
        r = run(*base, "--heads", "32:8", "--seqlen-k", "2048", "--batch", "8")
    assert r.exit_code == 1 and "fold" not in json.loads(r.stdout)["split"]


def test_explain_says_a_ragged_batch_splits_by_its_real_lengths(run, monkeypatch):
    """A one-row step over a paged or packed K of at least RAGGED_MIN_BYTES at the bound runs
    the ragged plan where the split kernel holds its parts (policy/ragged.plan_ragged, as
    runtime/splitkv.split_step: the same function), its entries on the chunk kernel (fwd_tma
    for pages of its size); a smaller batch, a dense K or a store without the parts keep the
    uniform plan."""
    from fa4aot.model import constraints as C

    merge = {"partial_dtype": "bfloat16", "max_splits": 128, "threads": 256}
    ragged = {"ragged_meta": {"version": C.RAGGED_VERSION}, "ragged_merge": {}}
    parts = {"fwd": {"q_broadcast": True, "chunk_lengths": True}, "merge": merge}
    _hold_split_kernels(monkeypatch, {**parts, **ragged, "fwd_tma": {"page_size": 64}},
                        pages=(None, 64))
    base = ["explain", "--head-dim", "128", "--heads", "32:8", "--seqlen-k", "131072", "--json"]
    for layout in (["--layout", "varlen"], ["--layout", "paged", "--page-size", "64"]):
        doc = json.loads(run(*base, *layout, "--batch", "8").stdout)["split"]
        assert doc.get("ragged") and doc["splits"] == 66 and doc["entries"] == 74, doc
        assert doc["chunk_kernel"] == ("fwd_tma" if "paged" in layout else "fwd")
        assert "ragged split-KV" in doc["plan"]
        doc = json.loads(run(*base, *layout, "--batch", "1").stdout)["split"]
        assert not doc.get("ragged")
    doc = json.loads(run(*base, "--batch", "8").stdout)["split"]  # (a dense K: uniform)
    assert not doc.get("ragged")
    # one row in uniform chunks of at most 2 MiB, at most 2 CTAs an SM: 32 x 4096 keys
    # unsplit, 4 x 32768 in 8 chunks of 4096 (the cost model's 4 cut; policy/ragged.py
    # uniform_splits); several rows keep the ragged plan
    paged = ["--layout", "paged", "--page-size", "64", "--heads", "64:8"]
    for batch, keys, splits in (("32", "4096", 0), ("4", "32768", 8)):
        doc = json.loads(run(*base, *paged, "--batch", batch, "--seqlen-k", keys).stdout)
        doc = doc["split"]
        assert not doc.get("ragged") and doc["splits"] == splits, doc
        assert doc["ragged_why"].startswith("one row a sequence in chunks of at most 2 MiB")
    doc = json.loads(run(*base, *paged, "--batch", "4", "--seqlen-k", "32768",
                         "--seqlen-q", "4").stdout)["split"]
    assert doc.get("ragged"), doc
    text = run(*base[:-1], *paged, "--batch", "32", "--seqlen-k", "4096").stdout
    assert "ragged plan : no (one row a sequence in chunks" in text
    _hold_split_kernels(monkeypatch, parts, pages=(None, 64))
    doc = json.loads(run(*base, "--layout", "varlen", "--batch", "8").stdout)["split"]
    assert not doc.get("ragged") and doc["splits"] >= 0
