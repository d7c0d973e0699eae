"""`doctor` and `coverage` say plainly that Blackwell artifacts are built and checked, not run
(issue 15): stub-built sm100 store, CLI through CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fa4aot.model import constraints as C

TINY = (Path(__file__).parents[1] / "specs" / "tiny.toml").read_text()
NOT_RUN = "built and checked but not run"


@pytest.fixture
def stores(run, tmp_path):
    spec = tmp_path / "tiny.toml"
    spec.write_text(TINY)
    root = tmp_path / "c"
    for arch in ("sm90", "sm100"):
        r = run("build", "--arch", arch, "--spec", str(spec), "--cache", str(root), "--json")
        assert r.exit_code == 0, r.output
    return root, spec


def test_doctor_marks_blackwell_stores_not_run(run, stores):
    root, _ = stores
    r = run("doctor", "--cache", str(root), "--json")
    doc = json.loads(r.stdout)
    by_arch = {s["arch"]: s for lay in doc["layers"] for s in lay["stores"]}
    assert by_arch["sm90"]["not_run"] is None
    assert NOT_RUN in by_arch["sm100"]["not_run"]
    assert not any(NOT_RUN in p for p in doc["problems"])  # a note, not a problem on a build host
    text = run("doctor", "--cache", str(root)).stdout
    assert f"note: sm100 artifacts are {NOT_RUN}" in text


def test_coverage_says_a_blackwell_hit_was_never_run(run, stores):
    root, spec = stores
    args = ["coverage", "--spec", str(spec), "--cache", str(root), "--no-trace"]
    # (stub records are never served, so the tiny spec's two variants count as missing here:
    # the note is given whatever the counts)
    r = run(*args, "--arch", "sm100", "--json")
    doc = json.loads(r.stdout)
    assert len(doc["rows"]) == 2 and NOT_RUN in doc["not_run"]
    assert any(NOT_RUN in w for w in doc["warnings"])
    r = run(*args, "--arch", "sm100")
    assert f"warning: sm100 artifacts are {NOT_RUN}" in r.output
    doc = json.loads(run(*args, "--arch", "sm90", "--json").stdout)
    assert doc["not_run"] is None and NOT_RUN not in json.dumps(doc)


def test_note_names_every_unserved_arch():
    assert C.not_run_note("sm90") is None
    for arch in ("sm100", "sm103"):
        assert C.not_run_note(arch).startswith(f"{arch} artifacts are {NOT_RUN}")
