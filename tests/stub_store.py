"""Helpers for the store reliability tests: stub-compiled stores, CLI subprocesses, drivers;
and the in-memory stand-in store the runtime's CPU plan tests serve from (`serve_variants`).

The stub compiler (FA4AOT_STUB_COMPILER=1) writes fake shared objects with the real builder's
file traffic; everything around it (locks, publish, records, checksums) is the real code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

# 8 variants on sm90: dense + varlen, decode + prefill, with and without LSE (no fold or
# split-KV kernels)
TINY_SPEC = """
name = "tiny"
model = "test/tiny"

[[attention]]
name = "full"
num_q_heads = 8
num_kv_heads = 8
head_dim = 128
dtype = "bfloat16"
causal = true

[serving]
layouts = ["dense", "varlen"]
phases = ["decode", "prefill"]
max_batch = 16
return_lse = "both"
decode_fold = false
split_kv = false
"""


def write_spec(d: Path, text: str = TINY_SPEC, name: str = "tiny.toml") -> Path:
    p = Path(d) / name
    p.write_text(text)
    return p


def stub_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FA4AOT_")}
    env.update(
        FA4AOT_STUB_COMPILER="1",
        FA4AOT_STUB_DELAY="0.02",
        FA4AOT_PROGRESS="0",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.update(extra)
    return env


def cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "fa4aot.cli", *args],
        env=env or stub_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def popen_cli(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [PY, "-m", "fa4aot.cli", *args],
        env=env or stub_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def popen_py(code: str, *args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [PY, "-c", code, *args],
        env=env or stub_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def build_stub(root: Path, spec: Path, monkeypatch, **kw):
    """Build `spec` into `root` in this process with the stub compiler."""
    from fa4aot.build.builder import build
    from fa4aot.model.specs import load_spec

    from fa4aot import settings

    # for the rest of the test (later builds in it stay stub builds), undone at teardown: a
    # settings override, not an os.environ edit
    for attr, value in (("stub_compiler", "1"), ("stub_delay", "0")):
        monkeypatch.setitem(settings.settings._overrides, attr, value)
    store, plan, results = build(
        [load_spec(spec)], arch=kw.pop("arch", "sm90"), root=root, jobs=1, **kw
    )
    assert all(r.status in ("built", "cached") for r in results), results
    return store, results


def reseal(art_dir: Path, **changes) -> dict:
    """Rewrite an artifact's record with `changes`, sealed again (a valid, edited record)."""
    from fa4aot.store.records import RECORD, seal_record

    rec = json.loads((art_dir / RECORD).read_text())
    rec.pop("record_sha256")
    rec.update(changes)
    rec = seal_record(rec)
    (art_dir / RECORD).write_text(json.dumps(rec, indent=2, sort_keys=True) + "\n")
    return rec


def artifact_dirs(store) -> list[Path]:
    base = store.dir / "artifacts"
    return sorted(base.iterdir()) if base.is_dir() else []


_RO_PROBE: bool | None = None


def _can_mount_readonly(scratch: Path) -> bool:
    global _RO_PROBE
    if _RO_PROBE is None:
        import shutil

        d = Path(scratch) / "ro-probe"
        d.mkdir(exist_ok=True)
        script = (
            f'mount --bind "{d}" "{d}" && mount -o remount,ro,bind "{d}" "{d}" && ! touch "{d}/x"'
        )
        _RO_PROBE = (
            bool(shutil.which("unshare"))
            and subprocess.run(
                ["unshare", "-m", "sh", "-c", script], capture_output=True
            ).returncode
            == 0
        )
    return _RO_PROBE


def run_readonly(
    argv: list[str], ro_paths: list[Path], env: dict, scratch: Path, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run `argv` with `ro_paths` read-only, for real: file modes for a normal user, a read-only
    bind mount in a private mount namespace for root (whom modes do not stop). Skips the test
    where neither is possible."""
    import pytest

    if os.geteuid() != 0:
        for p in ro_paths:
            subprocess.run(["chmod", "-R", "a-w", str(p)], check=True)
        try:
            return subprocess.run(
                argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
            )
        finally:
            for p in ro_paths:
                subprocess.run(["chmod", "-R", "u+w", str(p)], check=True)
    if not _can_mount_readonly(scratch):
        pytest.skip(
            "running as root without a private mount namespace: cannot make a "
            "directory read-only for this process"
        )
    mounts = "".join(
        f'mount --bind "{p}" "{p}" && mount -o remount,ro,bind "{p}" "{p}" && ' for p in ro_paths
    )
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", mounts + 'exec "$@"', "sh", *argv],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class StandInArtifact:
    """A store artifact of the runtime's CPU plan tests: a record with these parts, no files."""

    def __init__(self, variant, parts: dict):
        self.id, self.variant = variant.id, variant
        self.record = {"parts": parts}
        self.dir = Path("/nonexistent") / variant.id


def serve_variants(monkeypatch, root, variants, load, arch: str, num_sms: int, parts):
    """The default runtime (reset over `root`, on_miss="error") on a device 0 of `arch` with
    `num_sms` SMs, its stores holding exactly `variants`: stand-in artifacts whose record parts
    are `parts(variant)`, bound by `load(runtime, artifact, *part_names)` (Runtime._load)."""
    import fa4aot.runtime as R
    from fa4aot.runtime import plan as P

    have = {v.id: v for v in variants}

    def find(self, variant, sms):
        return StandInArtifact(variant, parts(variant)) if variant.id in have else None

    monkeypatch.setattr(P.Runtime, "find", find)
    monkeypatch.setattr(P.Runtime, "_load", load)
    monkeypatch.setattr(P.Runtime, "available", lambda self, a, sms: list(have.values()))
    rt = R.reset(roots=[root], on_miss="error")
    rt._devices[0] = (arch, num_sms)
    return rt
