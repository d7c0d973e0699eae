"""Layered store roots (FA4AOT_CACHE_DIR=/node:/image): a corrupt copy in the build target is
rebuilt even when a lower layer holds a good one; the KV block-size answer comes only from stores
this process serves from; `fa4aot ls` lists a record it cannot read instead of crashing."""

from __future__ import annotations

import json
import os
import sys

import pytest
from stub_store import artifact_dirs, build_stub, cli, reseal, stub_env, write_spec

import fa4aot
from fa4aot.build import builder as B
from fa4aot.errors import CorruptArtifact
from fa4aot.model.specs import load_spec, parse_spec
from fa4aot.model.variants import Variant
from fa4aot.policy import blocks
from fa4aot.runtime import Runtime
from fa4aot.store.layers import Store
from fa4aot.store.records import RECORD, seal_record
from fa4aot.store.toolchain import runtime_expectation

N_TINY = 8


def _layers(tmp_path):
    return tmp_path / "node", tmp_path / "img"


def _flip_part(art_dir):
    so = art_dir / "fwd.so"
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 1
    so.write_bytes(bytes(data))


def _edit_record(art_dir):
    rec = art_dir / RECORD
    rec.write_text(rec.read_text().replace('"tile_m": 128', '"tile_m": 64'))


# -- build: a corrupt copy in the target is replaced, whatever lower layers hold ---------------


@pytest.mark.parametrize("corrupt", [_flip_part, _edit_record])
def test_corrupt_target_copy_is_rebuilt_though_a_lower_layer_has_a_good_one(
    tmp_path, monkeypatch, corrupt
):
    node, img = _layers(tmp_path)
    spec = write_spec(tmp_path)
    build_stub(img, spec, monkeypatch)
    node_store, _ = build_stub(node, spec, monkeypatch)
    victim = artifact_dirs(node_store)[0]
    vid = victim.name
    corrupt(victim)
    img_before = {p: p.read_bytes() for p in img.rglob("*") if p.is_file()}
    with pytest.raises(CorruptArtifact):
        node_store.get(vid)

    _, _, results = B.build([load_spec(spec)], arch="sm90", layers=[node, img], jobs=1)
    status = {r.id: r.status for r in results}
    assert status.pop(vid) == "rebuilt"
    assert set(status.values()) == {"cached"}
    node_store.get(vid).verify()  # a good copy in the first layer again
    assert [q.name.split(".")[0] for q in (node_store.dir / "quarantine").iterdir()] == [vid]
    assert {p: p.read_bytes() for p in img.rglob("*") if p.is_file()} == img_before
    # the runtime searches node first and now finds a valid copy there
    art = Runtime(roots=[node, img]).find(
        Variant.from_dict(node_store.get(vid).record["variant"]), 132
    )
    assert art.dir == node_store.artifact_dir(vid)
    art.verify()


def test_a_miss_in_the_target_is_served_by_a_lower_layer(tmp_path, monkeypatch):
    node, img = _layers(tmp_path)
    spec = write_spec(tmp_path)
    img_store, _ = build_stub(img, spec, monkeypatch)
    vid = artifact_dirs(img_store)[0].name
    target = Store(node, img_store.toolchain)
    target.artifact_dir(vid).mkdir(parents=True)  # record-less: a reader's miss, not corrupt
    _, _, results = B.build([load_spec(spec)], arch="sm90", layers=[node, img], jobs=1)
    assert {r.status for r in results} == {"cached"}
    assert {r.found_in for r in results} == {str(img_store.dir)}
    assert [d.name for d in artifact_dirs(target)] == [vid]  # nothing copied or built into node


def test_nothing_to_build_names_the_layers_that_hold_the_variants(tmp_path, monkeypatch):
    node, img = _layers(tmp_path)
    spec = write_spec(tmp_path)
    env = stub_env(FA4AOT_CACHE_DIR=f"{node}{os.pathsep}{img}", FA4AOT_CACHE_WHEELS="0")
    img_store, _ = build_stub(img, spec, monkeypatch)
    target = Store(node, img_store.toolchain).dir

    r = cli("build", "--spec", str(spec), "-j", "1", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == (
        f"nothing to build: all {N_TINY} variants are in the store layers: "
        f"{N_TINY} in {img_store.dir}"
    )

    build_stub(node, spec, monkeypatch, shard=(0, 2))  # half of them in node too
    r = cli("build", "--spec", str(spec), "-j", "1", env=env)
    assert r.returncode == 0, r.stderr
    half = N_TINY // 2
    assert r.stdout.splitlines()[0] == (
        f"nothing to build: all {N_TINY} variants are in the store layers: "
        f"{half} in {target}, {half} in {img_store.dir}"
    )

    build_stub(node, spec, monkeypatch)  # all of them in the target: the one-layer wording
    r = cli("build", "--spec", str(spec), "-j", "1", env=env)
    first, last = r.stdout.splitlines()
    assert first == f"nothing to build: all {N_TINY} variants are in {target}"
    # the last line: the runtime reads this layer already (it is FA4AOT_CACHE_DIR's first)
    assert last == f"the runtime reads it already: {node} (FA4AOT_CACHE_DIR)"


def test_corrupt_target_copy_is_rebuilt_through_the_cli(tmp_path, monkeypatch):
    node, img = _layers(tmp_path)
    spec = write_spec(tmp_path)
    build_stub(img, spec, monkeypatch)
    node_store, _ = build_stub(node, spec, monkeypatch)
    _flip_part(artifact_dirs(node_store)[0])
    env = stub_env(FA4AOT_CACHE_DIR=f"{node}{os.pathsep}{img}", FA4AOT_CACHE_WHEELS="0")
    r = cli("build", "--spec", str(spec), "-j", "1", "--json", env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["counts"] == {"built": 0, "rebuilt": 1, "cached": N_TINY - 1, "failed": 0}
    r = cli("verify", "--cache", str(node), env=env)
    assert r.returncode == 0, r.stdout


# -- KV block sizes: only stores this process serves from -------------------------------------


def _paged_spec():
    return parse_spec(
        """
name = "pg"
[[attention]]
name = "attn"
num_q_heads = 32
num_kv_heads = 8
head_dim = 128
[serving]
layouts = ["paged"]
phases = ["decode"]
max_batch = 8
page_sizes = [128]
""",
        "pg.toml",
    )


@pytest.fixture
def stub(knobs):
    knobs(stub_compiler="1", stub_delay="0")


def _build_paged(root, **kw):
    store, _, results = B.build([_paged_spec()], arch="sm90", root=root, jobs=1, **kw)
    assert {r.status for r in results} == {"built"}, results
    return store


def _tma(cache, **kw):
    return blocks.supported_block_sizes(
        "sm90", "bfloat16", 128, qhead_per_kvhead=4, cache=cache, **kw
    ).tma


# a Python minor a store can target (builder.SERVING_PYTHONS) other than this process's
_OTHER_PY = "3.12" if sys.version_info[:2] != (3, 12) else "3.13"


def test_block_sizes_come_from_the_serving_store_only(tmp_path, stub):
    _build_paged(tmp_path / "ok")
    assert _tma(tmp_path / "ok") == (128,)  # the control: this process's toolchain
    _build_paged(tmp_path / "py", python=_OTHER_PY)
    assert _tma(tmp_path / "py") == ()
    assert (
        fa4aot.preferred_block_size(
            "sm90", "bfloat16", 128, qhead_per_kvhead=4, cache=tmp_path / "py"
        )
        is None
    )
    # a layer of another Python first does not hide the serving store behind it
    assert _tma([tmp_path / "py", tmp_path / "ok"]) == (128,)


def test_block_sizes_for_another_sm_count(tmp_path, stub):
    _build_paged(tmp_path, num_sms=114)
    assert _tma(tmp_path) == ()  # default: the arch's 132 SMs; not SM-count independent
    assert _tma(tmp_path, num_sms=114) == (128,)
    assert (
        blocks.preferred_block_size(
            "sm90", "bfloat16", 128, qhead_per_kvhead=4, cache=tmp_path, num_sms=114
        )
        == 128
    )


def test_block_sizes_skip_stores_of_another_tvm_ffi_series(tmp_path, stub, monkeypatch):
    assert runtime_expectation("sm90", 132)["tvm_ffi_abi"] == "0.1"
    real = B.build_toolchain
    monkeypatch.setattr(
        B, "build_toolchain", lambda *a, **k: {**real(*a, **k), "tvm_ffi": "0.2.0"}
    )
    _build_paged(tmp_path)
    assert _tma(tmp_path) == ()


def test_block_sizes_skip_stub_records_outside_stub_builds(tmp_path, stub, monkeypatch, knobs):
    store = _build_paged(tmp_path)
    assert _tma(tmp_path) == (128,)  # stub builds count their own stubs (the contract tests)
    knobs(stub_compiler=None)
    assert _tma(tmp_path) == ()  # a serving process: stubs are no kernels
    tma = [  # the layer's own TMA kernels (4:1; the 1:1 split kernels are others)
        d
        for d in artifact_dirs(store)
        if (v := json.loads((d / RECORD).read_text())["variant"])["paged_tma"]
        and v["qhead_per_kvhead"] == 4
    ]
    reseal(tma[0], stub=False)  # a real kernel's record
    assert _tma(tmp_path) == (128,)


def test_block_size_rows_describe_each_store_of_the_root(tmp_path, stub):
    _build_paged(tmp_path, python=_OTHER_PY)
    (row,) = blocks.block_size_rows(tmp_path)
    assert (row["spec"], row["tma_page_size"], row["preferred"]) == ("pg", "128", 128)


# -- ls / inspect: a sealed record with variant fields this fa4aot does not know -----------------


def _drop_requested_by(victim, store):
    """A record with no `requested_by` (sealed again), and no spec index naming it."""
    for f in (store.dir / "specs").glob("*.json"):
        f.unlink()
    rec = json.loads((victim / RECORD).read_text())
    del rec["record_sha256"], rec["requested_by"]
    (victim / RECORD).write_text(json.dumps(seal_record(rec), indent=2, sort_keys=True))


@pytest.mark.parametrize("case", ["variant with wrong keys", "no requested_by"])
def test_ls_lists_an_unreadable_record_instead_of_crashing(tmp_path, monkeypatch, case):
    store, _ = build_stub(tmp_path / "s", write_spec(tmp_path), monkeypatch)
    victim = artifact_dirs(store)[0]
    if case == "no requested_by":
        _drop_requested_by(victim, store)
    else:
        reseal(victim, variant={"bogus": 1})
    store.get(victim.name).verify()  # validly sealed: only ls's reading of it fails
    r = cli("ls", "--cache", str(store.root), "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    rows = {row["id"]: row for row in json.loads(r.stdout)["rows"]}
    bad = rows.pop(victim.name)
    assert bad["status"] == "unreadable" and bad["error"] and bad["store"] == store.dir.name
    assert len(rows) == N_TINY - 1 and all("error" not in row for row in rows.values())
    r = cli("ls", "--cache", str(store.root))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    (line,) = [x for x in r.stdout.splitlines() if x.startswith(victim.name)]
    assert "unreadable" in line
    r = cli("inspect", victim.name[:8], "--cache", str(store.root))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["id"] == victim.name


def test_ls_still_lists_a_corrupt_record_with_its_error(tmp_path, monkeypatch):
    store, _ = build_stub(tmp_path / "s", write_spec(tmp_path), monkeypatch)
    victim = artifact_dirs(store)[0]
    (victim / RECORD).write_text("{")
    r = cli("ls", "--cache", str(store.root), "--json")
    assert r.returncode == 0, r.stderr
    (bad,) = [row for row in json.loads(r.stdout)["rows"] if row["id"] == victim.name]
    assert bad["status"] == "corrupt" and "not valid JSON" in bad["error"]
