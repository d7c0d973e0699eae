"""Sharded builds and `fa4aot merge`: build a large cache in parallel on many machines, then
join the pieces into one store.

`shard(ids, index, count)` is the partition `fa4aot build --shard I/N` uses: the variant ids in
sorted order, every N-th from position I. It depends only on the set of ids (the specs and the
arch), so it is the same on every machine and every run, the N shards are disjoint and together
complete, and their sizes differ by at most one.

`merge(sources, dest)` plans the whole merge before writing anything: every source artifact's
record and parts are checked, and a conflict refuses the merge with nothing written. Conflicts:
one variant id in one fingerprint directory whose records disagree on what the kernel is
(variant, FA4 compile key, parts), or one spec name indexed with different content (shards built
from different versions of a spec). Two builds of the same kernel whose bytes differ are not a
conflict: the copy already in `dest` (else the first source's) is kept. Each artifact is then
staged in the destination's tmp/ and published with one rename under its lock, as a build does.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fa4aot.errors import BuildError, CorruptArtifact, MergeConflict
from fa4aot.store.archive import import_artifact
from fa4aot.store.files import atomic_write, open_quietly, owner_tag
from fa4aot.store.layers import Store, scan_root, sweep_temp
from fa4aot.store.records import Artifact


def shard(ids: list[str], index: int, count: int) -> list[str]:
    """Shard `index` (0-based) of `count`: sorted ids at positions index, index+count, ..."""
    if not (isinstance(count, int) and count >= 1 and 0 <= index < count):
        raise ValueError(f"shard must be I/N with 0 <= I < N, got {index}/{count}")
    return sorted(ids)[index::count]


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N), 0-based; ValueError with the rule otherwise."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"expected I/N such as 0/4 (0-based), got {text!r}") from None
    shard([], i, n)  # validates
    return i, n


def identity(record: dict[str, Any]) -> dict[str, Any]:
    """What a record says the kernel is (two records of one id must agree on it)."""
    return {
        "variant": record.get("variant"),
        "fa4_key": record.get("fa4_key"),
        "parts": sorted(record.get("parts", {})),
        "stub": record.get("stub"),
    }


@dataclass
class MergeResult:
    dest: Path
    rows: list[dict[str, Any]] = field(default_factory=list)  # store, id, status, source
    specs: list[dict[str, Any]] = field(default_factory=list)  # store, spec, status


def _spec_doc(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None


def _plan(sources: list[Path], dest: Path):
    chosen: dict[tuple[str, str], tuple[Store, Artifact]] = {}
    specs: dict[tuple[str, str], tuple[Path, Any]] = {}
    toolchains: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for src in sources:
        if not src.is_dir():
            problems.append(f"{src}: not a directory")
            continue
        stores, broken = scan_root(src)
        problems += [f"{d}: {e}" for d, e in broken]
        if not stores and not broken:
            problems.append(f"{src}: holds no store")
        for s in stores:
            toolchains.setdefault(s.dir.name, s.toolchain)
            for vid, art in s.iter_artifacts():
                try:
                    if isinstance(art, Exception):
                        raise art
                    art.verify()
                except CorruptArtifact as e:
                    problems.append(f"{s.dir}/artifacts/{vid}: {e}")
                    continue
                prev = chosen.setdefault((s.dir.name, vid), (s, art))[1]
                if identity(prev.record) != identity(art.record):
                    problems.append(
                        f"conflict: {s.dir.name}/{vid} differs between {prev.dir} and {art.dir}"
                    )
            for f in sorted((s.dir / "specs").glob("*.json")):
                doc = _spec_doc(f)
                if not isinstance(doc, dict):
                    problems.append(f"{f}: not a JSON object")
                    continue
                prev_path, prev_doc = specs.setdefault((s.dir.name, f.stem), (f, doc))
                if prev_doc != doc:
                    problems.append(
                        f"conflict: spec {f.stem!r} of {s.dir.name} differs between "
                        f"{prev_path} and {f}"
                    )
    # and against what the destination already holds
    for (fp, vid), (s, art) in chosen.items():
        target = Store(dest, s.toolchain)
        try:
            have = target.get(vid, verify=False)
        except CorruptArtifact:
            continue  # replaced by the merge, as unpack does
        if have is not None and identity(have.record) != identity(art.record):
            problems.append(f"conflict: {fp}/{vid} in {dest} differs from {art.dir}")
    for (fp, name), (path, doc) in specs.items():
        have_path = dest / "v1" / fp / "specs" / f"{name}.json"
        if have_path.exists() and _spec_doc(have_path) != doc:
            problems.append(f"conflict: spec {name!r} in {have_path} differs from {path}")
    return chosen, specs, toolchains, problems


def _stage_copy(art: Artifact, target: Store) -> Path:
    """Copy an artifact's record and parts into target's tmp/, fsync'ed, and check the copy."""
    stage = Path(
        tempfile.mkdtemp(prefix=f".merge.{owner_tag()}", suffix=".tmp", dir=target.dir / "tmp")
    )
    names = ["record.json", *(p["file"] for p in art.record["parts"].values())]
    for name in names:
        with open_quietly(art.dir / name) as src, open(stage / name, "xb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
            dst.flush()
            os.fsync(dst.fileno())
        os.chmod(stage / name, 0o644)
    Artifact(stage, art.record).verify()  # the copy, not only the source
    return stage


def merge(sources: list[Path], dest: Path) -> MergeResult:
    """Merge the stores under each of `sources` (store roots) into root `dest`."""
    sources = [Path(s) for s in sources]
    dest = Path(dest)
    if not sources:
        raise MergeConflict("nothing to merge: name at least one source store root")
    for s in sources:
        if s.exists() and dest.exists() and s.resolve() == dest.resolve():
            raise MergeConflict(f"{s} is both a source and the destination")
    chosen, specs, toolchains, problems = _plan(sources, dest)
    if problems:
        shown = problems[:20] + (
            [f"... and {len(problems) - 20} more"] if len(problems) > 20 else []
        )
        raise MergeConflict("merge refused, nothing written:\n  " + "\n  ".join(shown))
    res = MergeResult(dest)
    targets: dict[str, Store] = {}
    for fp, tc in sorted(toolchains.items()):
        target = targets[fp] = Store(dest, tc)
        try:
            target.ensure()
        except OSError as e:
            raise BuildError(f"cannot write the store at {dest}: {e.strerror or e}") from None
        sweep_temp(target)
    for (fp, vid), (s, art) in sorted(chosen.items()):
        stage = _stage_copy(art, targets[fp])
        try:
            status = import_artifact(targets[fp], vid, stage)
        finally:
            shutil.rmtree(stage, ignore_errors=True)  # gone already when published
        res.rows.append({"store": fp, "id": vid, "status": status, "source": str(s.root)})
    for (fp, name), (path, _) in sorted(specs.items()):
        out = targets[fp].spec_index(name)
        status = "present" if out.exists() else "added"
        if status == "added":
            atomic_write(out, path.read_bytes())
        res.specs.append({"store": fp, "spec": name, "status": status})
    return res
