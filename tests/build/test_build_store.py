"""Builder and store: a real cross-compile of two kernels (no GPU), the store layout and records
it leaves, idempotent rebuilds, lookup by the runtime, and per-variant failure reporting."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fa4aot import settings
import fa4aot.build.builder as B
from fa4aot.model import constraints as C
from fa4aot.errors import CorruptArtifact, FingerprintMismatch
from fa4aot.runtime import Runtime
from fa4aot.model.specs import parse_spec
from fa4aot.store.layers import Store
from fa4aot.store.records import CACHEDIR_TAG
from fa4aot.store.toolchain import build_toolchain, fingerprint_dir
from fa4aot.model.variants import Variant
from fa4aot.build.enumerate import enumerate_variants
from fa4aot.model.compile_keys import Call

ARCH, SMS = "sm90", 132
TINY = (Path(__file__).parents[1] / "specs" / "tiny.toml").read_text()
# four variants, for the stub-compiled tests: decode and prefill, with and without LSE
TINY4 = TINY.replace('phases = ["decode"]', 'phases = ["decode", "prefill"]')


def _files(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every file under root -> (inode, mtime_ns, size)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """Two real sm90 kernels cross-compiled once for this module (~15 s: compiler import + 2).

    jobs=2: each kernel compiles in a fresh worker process, which sets the target before its
    first FA4 import. In this process FA4 may already be imported (another test module's
    collection), and FA4 reads its target arch once, at import.
    """
    root = tmp_path_factory.mktemp("store")
    spec = parse_spec(TINY, "tiny.toml")
    with settings.scope(stub_compiler=None):  # held in the spawned workers too
        store, plan, results = B.build([spec], arch=ARCH, root=root, jobs=2)
    return root, spec, store, plan, results


@pytest.fixture
def stub(knobs):
    knobs(stub_compiler="1", stub_delay="0")


def test_real_build_lands_every_variant(real):
    _, _, _, plan, results = real
    assert len(plan.variants()) == 2
    assert sorted(r.status for r in results) == ["built", "built"], [r.error for r in results]
    assert {r.id for r in results} == set(plan.variants())
    assert all(r.size > 10_000 and r.error is None for r in results)


def test_store_layout(real):
    root, spec, store, plan, _ = real
    tc = build_toolchain(ARCH, SMS)
    assert (root / "CACHEDIR.TAG").read_text() == CACHEDIR_TAG
    assert CACHEDIR_TAG.startswith("Signature: 8a477f597d28d172789f06886806bc55")
    assert [d.name for d in (root / "v1").iterdir()] == [fingerprint_dir(tc)]
    assert store.dir == root / "v1" / fingerprint_dir(tc)
    assert store.dir.name.startswith(f"sm90-132sm-py{tc['python'].replace('.', '')}-")
    assert json.loads((store.dir / "toolchain.json").read_text()) == tc
    arts = sorted(d.name for d in (store.dir / "artifacts").iterdir())
    assert arts == sorted(plan.variants())
    for vid in arts:
        assert sorted(p.name for p in (store.dir / "artifacts" / vid).iterdir()) == [
            "fwd.so",
            "record.json",
        ]
    index = json.loads((store.dir / "specs" / "tiny.json").read_text())
    assert index["variants"] == arts
    assert index["unsupported"] == []
    assert index["spec"] == json.loads(spec.identity())
    # build scratch is gone
    assert list((store.dir / "tmp").iterdir()) == []


def test_records(real):
    _, _, store, plan, _ = real
    tc = build_toolchain(ARCH, SMS)
    keys = set()
    for vid, need in plan.variants().items():
        d = store.dir / "artifacts" / vid
        rec = json.loads((d / "record.json").read_text())
        assert rec["id"] == vid and rec["variant"] == need.variant.to_dict()
        assert Variant.from_dict(rec["variant"]).id == vid
        assert rec["description"] == need.variant.describe()
        so = d / "fwd.so"
        part = rec["parts"]["fwd"]
        assert part["file"] == "fwd.so"
        assert part["sha256"] == hashlib.sha256(so.read_bytes()).hexdigest()
        assert part["size"] == so.stat().st_size
        data = so.read_bytes()
        assert data[:4] == b"\x7fELF" and data[16] == 3  # a shared object (ET_DYN)
        assert b"fa4aot_fwd" in data  # the exported entry point the runtime looks up
        # FA4's own compile key, as FA4 computed it for the representative call
        assert rec["fa4_key"] == part["key"] and "BFloat16" in rec["fa4_key"]
        keys.add(rec["fa4_key"])
        c = rec["contract"]
        assert (c["tile_m"], c["tile_n"], c["pack_gqa"], c["page_size"], c["num_sms"]) == (
            192,
            128,
            True,
            None,
            SMS,
        )
        assert rec["compile_seconds"] > 0
        assert rec["requested_by"] == {"spec": "tiny", "layer": "full"}
        assert rec["toolchain"] == tc
        assert rec["stub"] is False
        assert Call(**rec["representative_call"]).variant(ARCH) == need.variant
        # the store's reader accepts it and checks every part
        art = store.get(vid)
        assert art is not None and art.id == vid and art.size == part["size"]
    assert len(keys) == 2  # LSE on / off: two kernels, two FA4 keys


def test_second_build_is_a_noop(real):
    root, spec, store, _, _ = real
    before = _files(store.dir / "artifacts") | {
        "toolchain.json": _files(store.dir)["toolchain.json"]
    }
    tag = (root / "CACHEDIR.TAG").stat().st_mtime_ns
    spec_index = (store.dir / "specs" / "tiny.json").read_text()
    _, _, results = B.build([spec], arch=ARCH, root=root, jobs=1)
    assert [r.status for r in results] == ["cached", "cached"]
    assert all(r.seconds == 0.0 for r in results)  # found before any lock or compiler
    after = _files(store.dir / "artifacts") | {
        "toolchain.json": _files(store.dir)["toolchain.json"]
    }
    assert after == before
    assert (root / "CACHEDIR.TAG").stat().st_mtime_ns == tag
    assert (store.dir / "specs" / "tiny.json").read_text() == spec_index


def test_runtime_finds_the_built_artifacts(real):
    root, _, store, plan, _ = real
    rt = Runtime(roots=[root])
    for vid, need in plan.variants().items():
        art = rt.find(need.variant, SMS)
        assert art is not None and art.id == vid and art.dir == store.dir / "artifacts" / vid
    assert sorted(v.id for v in rt.available(ARCH, SMS)) == sorted(plan.variants())
    # a variant nobody built is a miss, not an error
    other = next(iter(plan.variants().values())).variant
    from dataclasses import replace

    assert rt.find(replace(other, head_dim=128, head_dim_v=128), SMS) is None


def test_runtime_refuses_another_sm_count(real):
    root, _, _, plan, _ = real
    need = next(iter(plan.variants().values()))
    with pytest.raises(FingerprintMismatch, match="num_sms"):
        Runtime(roots=[root]).find(need.variant, 114)


# -- stub-compiled stores (the compiler is not the point) ---------------------------------------


def test_store_for_another_python_is_not_served_here(tmp_path, stub):
    spec = parse_spec(TINY, "tiny.toml")
    other = "3.12" if sys.version_info[:2] != (3, 12) else "3.11"
    store, _, results = B.build([spec], arch=ARCH, root=tmp_path, python=other)
    assert {r.status for r in results} == {"built"}
    assert store.dir.name.startswith(f"sm90-132sm-py{other.replace('.', '')}-")
    with pytest.raises(FingerprintMismatch, match=rf"python: store has '{re.escape(other)}'"):
        Runtime(roots=[tmp_path]).find(
            Variant.from_dict(store.get(results[0].id).record["variant"]), SMS
        )


def test_failing_variant_is_reported_and_the_others_land(tmp_path, monkeypatch, knobs):
    knobs(stub_compiler=None, stub_delay="0")
    spec = parse_spec(TINY4, "tiny.toml")
    ids = sorted(enumerate_variants(spec, ARCH).variants())
    assert len(ids) == 4
    bad = ids[1]

    def compile_or_fail(call, variant, workdir):
        if variant.id == bad:
            raise RuntimeError("ptxas died")
        return B._compile_stub(call, variant, workdir)

    monkeypatch.setattr(B, "_compile_real", compile_or_fail)
    store, _, results = B.build([spec], arch=ARCH, root=tmp_path, jobs=1)
    by = {r.id: r for r in results}
    assert by[bad].status == "failed" and by[bad].error == "RuntimeError: ptxas died"
    assert all(by[i].status == "built" and by[i].error is None for i in ids if i != bad)
    assert store.get(bad) is None and not store.artifact_dir(bad).exists()
    assert all(store.get(i) is not None for i in ids if i != bad)
    assert list((store.dir / "tmp").iterdir()) == []
    # the spec index still names every variant the spec needs (coverage shows the hole)
    assert json.loads(store.spec_index("tiny").read_text())["variants"] == ids
    # next build: only the failed one is compiled
    monkeypatch.setattr(B, "_compile_real", B._compile_stub)
    _, _, again = B.build([spec], arch=ARCH, root=tmp_path, jobs=1)
    assert {r.id: r.status for r in again} == {i: ("built" if i == bad else "cached") for i in ids}


def test_corrupt_artifact_is_quarantined_and_rebuilt(tmp_path, stub):
    spec = parse_spec(TINY, "tiny.toml")
    store, _, results = B.build([spec], arch=ARCH, root=tmp_path)
    vid = results[0].id
    so = store.artifact_dir(vid) / "fwd.so"
    data = bytearray(so.read_bytes())
    data[100] ^= 0xFF
    so.write_bytes(bytes(data))
    with pytest.raises(CorruptArtifact, match="sha256"):
        store.get(vid)
    _, _, again = B.build([spec], arch=ARCH, root=tmp_path)
    assert {r.id: r.status for r in again}[vid] == "rebuilt"
    assert store.get(vid) is not None
    assert [p.name.split(".")[0] for p in (store.dir / "quarantine").iterdir()] == [vid]


def test_store_reader_treats_a_record_less_directory_as_absent(tmp_path, stub):
    spec = parse_spec(TINY, "tiny.toml")
    store, _, results = B.build([spec], arch=ARCH, root=tmp_path)
    vid = results[0].id
    (store.artifact_dir(vid) / "record.json").unlink()
    assert store.get(vid) is None
    assert vid not in [i for i, _ in store.iter_artifacts()]
    _, _, again = B.build([spec], arch=ARCH, root=tmp_path)
    assert {r.id: r.status for r in again}[vid] == "built"
    assert store.get(vid) is not None


def test_build_writes_nothing_outside_its_root(tmp_path, stub):
    spec = parse_spec(TINY, "tiny.toml")
    store, _, _ = B.build([spec], arch=ARCH, root=tmp_path / "a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    assert isinstance(store, Store) and store.root == tmp_path / "a"


def test_superseded_is_a_split_kernel_merging_with_fa4s_combine_or_copying_q():
    """`fa4aot build` replaces a split chunk kernel's artifact built before fa4aot's merge and
    chunk metadata kernels (its chunks merged by FA4's combine) or its current merge, or, on
    sm90, before its forward read q through a chunk mode; nothing else."""
    from types import SimpleNamespace

    from fa4aot.model.compile_keys import split_kernel_variant

    def art(variant, *parts, q_broadcast=True, chunk_lengths=True, bounds=True, wide=True,
            wide1=True, tma=True, wide_split=True, merge_version=C.MERGE_VERSION, pdl=True,
            packed_meta=True, ragged=C.RAGGED_VERSION):
        rec = {"variant": variant.to_dict(), "parts": {p: {} for p in ("fwd", *parts)}}
        if ragged and "merge" in parts:
            rec["parts"].update(ragged_meta={"version": ragged}, ragged_merge={})
        if "merge" in parts and merge_version is not None:
            rec["parts"]["merge"]["version"] = merge_version
        if q_broadcast:
            rec["parts"]["fwd"]["q_broadcast"] = True
        if pdl:
            rec["parts"]["fwd"]["pdl"] = True
        if chunk_lengths and variant.paged:
            rec["parts"]["fwd"]["chunk_lengths"] = True
        if bounds and variant.split_kernel and not variant.paged:
            rec["parts"]["fwd_bounds"] = ({} if bounds == "one-row" else
                                          {"rows": 1 if bounds == "no-anchor" else 2})
        if wide and variant.split_kernel and variant.tile_m == 64:
            rec["parts"]["fwd_wide"] = {}
        if wide1 and variant.split_kernel and variant.tile_m == 64 and not variant.paged:
            rec["parts"]["fwd_wide1"] = {}
        if (wide_split and variant.split_kernel and variant.tile_m == 64
                and variant.head_dim == 128):
            rec["parts"]["fwd_wide_split"] = {}
        if tma and variant.split_kernel and variant.tile_m == 64 and variant.paged:
            rec["parts"]["fwd_tma"] = {"page_size": 64}
        if packed_meta and variant.split_kernel and variant.paged and parts:
            rec["parts"]["packed_meta"] = {"version": 1}
        return SimpleNamespace(record=rec)

    split = split_kernel_variant("sm90", "bfloat16", 128, 128, None)
    other = enumerate_variants(parse_spec(TINY, "tiny.toml"), ARCH).variants()
    assert B.superseded(art(split, "combine"))
    assert B.superseded(art(split, "merge"))
    assert not B.superseded(art(split, "merge", "chunk_meta"))
    # the ragged step's kernels (kernels.trace_ragged), at their current version
    assert B.superseded(art(split, "merge", "chunk_meta", ragged=None))
    assert B.superseded(art(split, "merge", "chunk_meta", ragged=C.RAGGED_VERSION - 1))
    assert B.superseded(art(split, "merge", "chunk_meta", q_broadcast=False))
    assert B.superseded(art(split, "merge", "chunk_meta", bounds=False))
    # the bounds mode as built before it took several rows a sequence ((b + 1, c) bounds)
    assert B.superseded(art(split, "merge", "chunk_meta", bounds="one-row"))
    assert B.superseded(art(split, "merge", "chunk_meta", bounds="no-anchor"))
    # a merge an earlier fa4aot compiled (before C.MERGE_VERSION 2, the PDL launch)
    assert B.superseded(art(split, "merge", "chunk_meta", merge_version=1))
    assert B.superseded(art(split, "merge", "chunk_meta", merge_version=None))
    # an sm90 chunk kernel launched plainly (before forwards._pdl_secondary)
    assert B.superseded(art(split, "merge", "chunk_meta", pdl=False))
    assert B.superseded(art(paged := split_kernel_variant("sm90", "bfloat16", 128, 128, 128),
                            "merge", "chunk_meta", pdl=False))
    # the packed 64-row chunk kernel carries the wide fold (forwards.trace_wide_fold); the
    # decode fold's 1:1 kernel (FA4's M tile) and head dims over 128 (FA4's tile) do not
    assert B.superseded(art(split, "merge", "chunk_meta", wide=False))
    assert B.superseded(art(split, "merge", "chunk_meta", wide1=False))  # before fwd_wide1
    # and the wide split kernel (constraints.wide_split): the 64-row kernel at hd128
    assert B.superseded(art(split, "merge", "chunk_meta", wide_split=False))
    hd64 = split_kernel_variant("sm90", "bfloat16", 64, 64, None)  # head dim 128 only
    assert not B.superseded(art(hd64, "merge", "chunk_meta", wide_split=False))
    fa4_tile = replace(split, tile_m=None)
    assert not B.superseded(art(fa4_tile, "merge", "chunk_meta", wide=False))
    big = split_kernel_variant("sm90", "bfloat16", 192, 128, None)
    assert big.tile_m is None and not B.superseded(art(big, "merge", "chunk_meta", wide=False))
    paged = split_kernel_variant("sm90", "bfloat16", 128, 128, 128)
    assert not B.superseded(art(paged, "merge", "chunk_meta"))
    assert B.superseded(art(paged, "merge", "chunk_meta", wide=False))
    assert not B.superseded(art(paged, "merge", "chunk_meta", wide1=False))  # packed K only
    assert B.superseded(art(paged, "merge", "chunk_meta", wide_split=False))  # paged too
    assert B.superseded(art(paged, "merge", "chunk_meta", chunk_lengths=False))
    # a paged one carries the packed-rows metadata kernel (kernels.trace_packed_meta)
    assert B.superseded(art(paged, "merge", "chunk_meta", packed_meta=False))
    assert not B.superseded(art(split, "merge", "chunk_meta", packed_meta=False))
    # FA4's TMA paged kernel (pages of 128) has no fwd_tma; its cp.async one (every other page
    # size) carries one for pages of 64 (constraints.tma_page)
    assert not B.superseded(art(paged, "merge", "chunk_meta", tma=False))
    cpasync = split_kernel_variant("sm90", "bfloat16", 128, 128, 16)
    assert cpasync == split_kernel_variant("sm90", "bfloat16", 128, 128, 64)
    assert not B.superseded(art(cpasync, "merge", "chunk_meta"))
    assert B.superseded(art(cpasync, "merge", "chunk_meta", tma=False))
    assert not any(B.superseded(art(n.variant, "combine", q_broadcast=False))
                   for n in other.values())
    stub = art(split, q_broadcast=False)
    stub.record["stub"] = True
    assert not B.superseded(stub)  # a placeholder: never loaded, not rebuilt each build


def test_a_superseded_artifact_is_replaced(tmp_path, stub, monkeypatch):
    """The replacement takes the old copy out in one rename and publishes the new one;
    nothing is left behind, and the next build finds it current."""
    spec = parse_spec(TINY, "tiny.toml")
    store, _, results = B.build([spec], arch=ARCH, root=tmp_path)
    vid = results[0].id
    # held open, the old record's inode cannot be reused by the new copy's (it was, once)
    old = open(store.artifact_dir(vid) / "record.json", "rb")  # noqa: SIM115
    inode = os.fstat(old.fileno()).st_ino
    monkeypatch.setattr(B, "superseded", lambda art: (art.dir / "record.json").stat().st_ino == inode)
    _, _, again = B.build([spec], arch=ARCH, root=tmp_path)
    assert {r.id: r.status for r in again} == {r.id: ("rebuilt" if r.id == vid else "cached")
                                               for r in results}
    assert (store.artifact_dir(vid) / "record.json").stat().st_ino != inode  # a new copy
    old.close()
    assert store.get(vid) is not None and not list((store.dir / "tmp").iterdir())
    _, _, third = B.build([spec], arch=ARCH, root=tmp_path)
    assert all(r.status == "cached" for r in third)
