"""The miss log: variants the runtime could not serve, appended as JSON lines, read back by
`fa4aot build --from-misses`."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

import fa4aot.store.misses as M
from fa4aot.build.builder import plan_for
from fa4aot.cli import main
from fa4aot import settings
from fa4aot.model.specs import resolve_specs
from fa4aot.model.variants import Variant


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(M, "_seen", set())  # the per-process dedupe set
    with settings.scope(miss_log=None, miss_log_max=None):
        yield


@pytest.fixture(scope="module")
def variants() -> list[Variant]:
    return [
        n.variant for n in plan_for(resolve_specs(["llama-3.1-8b"]), "sm90").variants().values()
    ]


def test_round_trip(tmp_path, variants):
    log = tmp_path / "misses.jsonl"
    for v in variants[:3]:
        assert M.record_miss(v, str(log)) is True
    assert M.read_misses(log) == variants[:3]
    lines = log.read_text().splitlines()
    assert len(lines) == 3
    assert json.loads(lines[0]) == {"id": variants[0].id, "variant": variants[0].to_dict()}


def test_env_names_the_log(tmp_path, variants, monkeypatch):
    assert M.record_miss(variants[0]) is False  # no log configured: nothing written, no error
    log = tmp_path / "env.jsonl"
    with settings.scope(miss_log=str(log)):
        assert M.record_miss(variants[0]) is True
    assert M.read_misses(log) == [variants[0]]


def test_dedupe_in_process_and_against_the_file(tmp_path, variants, monkeypatch):
    log = tmp_path / "m.jsonl"
    assert M.record_miss(variants[0], str(log)) is True
    assert M.record_miss(variants[0], str(log)) is False
    # another process (fresh dedupe set) finds it in the file
    monkeypatch.setattr(M, "_seen", set())
    assert M.record_miss(variants[0], str(log)) is False
    assert len(log.read_text().splitlines()) == 1


def test_duplicate_lines_read_once(tmp_path, variants):
    log = tmp_path / "m.jsonl"
    line = json.dumps({"id": variants[0].id, "variant": variants[0].to_dict()}) + "\n"
    log.write_text(line * 3)
    assert M.read_misses(log) == [variants[0]]


def test_log_is_bounded(tmp_path, variants, monkeypatch, capsys):
    log = tmp_path / "m.jsonl"
    with settings.scope(miss_log_max="2"):
        got = [M.record_miss(v, str(log)) for v in variants[:5]]
    assert got == [True, True, False, False, False]
    assert M.read_misses(log) == variants[:2]
    # an invalid bound: the log is off (a serving call never fails for it), said once
    monkeypatch.setattr(M, "_seen", set())
    with settings.scope(miss_log_max="not a number"):
        assert M.record_miss(variants[5], str(log)) is False
        assert M.record_miss(variants[6], str(log)) is False
    assert M.read_misses(log) == variants[:2]
    err = capsys.readouterr().err
    assert err.count("FA4AOT_MISS_LOG_MAX='not a number' is invalid") == 1


def test_torn_and_foreign_lines_are_skipped(tmp_path, variants):
    log = tmp_path / "m.jsonl"
    good = [json.dumps({"id": v.id, "variant": v.to_dict()}) for v in variants[:2]]
    junk = [
        good[0][: len(good[0]) // 2],  # a torn write
        "",
        "[]",
        '{"id": "x"}',
        json.dumps({"id": "x", "variant": {**variants[2].to_dict(), "extra": 1}}),
        json.dumps({"id": "x", "variant": {"arch": "sm90"}}),
        "\x00\x00\x00",
    ]
    log.write_text("\n".join([junk[0], good[0], *junk[1:], good[1]]) + "\n")
    assert M.read_misses(log) == variants[:2]


def test_append_after_a_torn_last_line_is_not_lost(tmp_path, variants):
    """A writer killed mid-line leaves no newline; the next record must start a line of its own."""
    log = tmp_path / "m.jsonl"
    torn = json.dumps({"id": variants[0].id, "variant": variants[0].to_dict()})[:40]
    log.write_text(torn)
    assert M.record_miss(variants[1], str(log)) is True
    assert M.read_misses(log) == [variants[1]]


def test_missing_or_unwritable_log_never_raises(tmp_path, variants):
    assert M.read_misses(tmp_path / "absent.jsonl") == []
    assert M.record_miss(variants[0], str(tmp_path / "no-such-dir" / "m.jsonl")) is False
    assert M.record_miss(variants[1], str(tmp_path)) is False  # a directory


def test_build_from_misses_dry_run(tmp_path, variants, monkeypatch):
    log = tmp_path / "misses.jsonl"
    picked = [variants[0], variants[5], variants[-1]]
    for v in picked:
        M.record_miss(v, str(log))
    # a variant of another arch is not this build's business
    M.record_miss(replace(variants[1], arch="sm100"), str(log))
    r = CliRunner(env={"FA4AOT_CACHE_DIR": str(tmp_path / "cache")}).invoke(
        main, ["build", "--from-misses", str(log), "--dry-run", "--json"], catch_exceptions=False
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [row["id"] for row in doc["rows"]] == [v.id for v in picked]
    assert all(row["spec"] == "miss-log/misses.jsonl" for row in doc["rows"])
    assert [row["variant"] for row in doc["rows"]] == [v.describe() for v in picked]
    assert doc["unsupported"] == []


def test_build_from_misses_and_a_spec(tmp_path, variants):
    log = tmp_path / "misses.jsonl"
    mistral = plan_for(resolve_specs(["mistral-7b"]), "sm90").variants()
    M.record_miss(variants[0], str(log))
    M.record_miss(next(iter(mistral.values())).variant, str(log))  # already in the spec's plan
    r = CliRunner().invoke(
        main,
        ["build", "--spec", "mistral-7b", "--from-misses", str(log), "--dry-run", "--json"],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    ids = [row["id"] for row in json.loads(r.stdout)["rows"]]
    assert ids == [*mistral, variants[0].id]


def test_build_from_misses_reports_variants_it_cannot_compile(tmp_path, variants):
    """A logged variant is refused only when FA4 cannot run it (with FA4's reason) or no call
    to FA4 produces it (a hand-edited log): such a miss is reported, not a traceback."""
    log = tmp_path / "misses.jsonl"
    dense = next(v for v in variants if v.layout == "dense")
    impossible = replace(dense, causal=False, local=False, static_persistent=False)
    hd512 = replace(dense, head_dim=512, head_dim_v=512)
    M.record_miss(impossible, str(log))
    M.record_miss(hd512, str(log))
    M.record_miss(variants[0], str(log))
    r = CliRunner().invoke(main, ["build", "--from-misses", str(log), "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [row["id"] for row in doc["rows"]] == [variants[0].id]
    u1, u2 = doc["unsupported"]
    assert u1["spec"] == "miss-log" and impossible.id in u1["reason"]
    assert "FA4 never compiles these features together" in u1["reason"]
    assert hd512.id in u2["reason"] and "512" in u2["reason"] and "sm100" in u2["reason"]


def test_build_from_misses_builds_every_layout_issue_13_could_not(tmp_path, variants):
    """The four kinds of variants `--from-misses` refused in issue 13 (a padded KV cache with
    cu_seqlens_q; cu_seqlens_k with seqused_q; seqused_q with seqused_k; bf16 sinks), plus a
    softcap and an explicit pack_gqa, are planned for building."""
    log = tmp_path / "misses.jsonl"
    varlen = next(v for v in variants if v.layout == "varlen" and v.cu_seqlens_q)
    kinds = [
        replace(varlen, cu_seqlens_k=False, seqused_k=True),
        replace(varlen, cu_seqlens_q=False, seqused_q=True),
        replace(varlen, cu_seqlens_q=False, seqused_q=True, cu_seqlens_k=False, seqused_k=True),
        replace(varlen, sink_dtype="bfloat16"),
        replace(varlen, softcap=30.0),
        replace(varlen, pack_gqa=False),
    ]
    for v in kinds:
        M.record_miss(v, str(log))
    todo, refused = M.plan_misses(M.read_misses(log), "sm90")
    assert not refused
    assert [v for v, _ in todo] == kinds
    assert all(call.variant("sm90") == v for v, call in todo)
