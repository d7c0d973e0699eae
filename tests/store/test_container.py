"""docs/container/Dockerfile, replayed without Docker (no engine here): each stage's file tree is
built in a temp directory from the Dockerfile's own instructions (COPY, COPY --from, ENV, and
the RUN lines that are fa4aot commands or plain file operations), then the runtime stage's
checks run with the compiler made uninstallable (an import of `cutlass`, `flash_attn`, `quack`
or `triton` is recorded and fails, as in the real image). `pip`/`apt-get` lines are checked for
what they install, not run. The build uses the stub compiler and a tiny spec to stay fast: what
is tested is the image layout, not the kernels (those are tested elsewhere)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stub_store import ROOT, stub_env, write_spec

DOCKERFILE = ROOT / "docs" / "container" / "Dockerfile"
COMPILER = ("cutlass", "flash_attn", "quack", "triton")
PY_MINOR = f"{sys.version_info.major}.{sys.version_info.minor}"

# Imports of the compiler fail and are logged to $FA4AOT_TEST_IMPORT_LOG, whoever catches them.
BLOCKER = """
import importlib.abc, os, sys
class _NoCompiler(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            with open(os.environ['FA4AOT_TEST_IMPORT_LOG'], 'a') as f:
                f.write(name + '\\n')
            raise ModuleNotFoundError(f'No module named {{name!r}} (runtime image)', name=name)
sys.meta_path.insert(0, _NoCompiler())
""".format(blocked=COMPILER)


def stages(text: str) -> dict[str, list[tuple[str, str]]]:
    """Dockerfile -> {stage name: [(INSTRUCTION, args)]}, continuation lines joined."""
    out: dict[str, list[tuple[str, str]]] = {}
    args: dict[str, str] = {}
    cur = None
    for line in re.sub(r"\\\n", " ", text).splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        ins, _, rest = line.partition(" ")
        ins = ins.upper()
        if ins == "ARG" and cur is None:
            k, _, v = rest.partition("=")
            args[k] = v
            continue
        if ins == "FROM":
            cur = rest.split(" AS ")[-1].strip()
            out[cur] = []
            continue
        out[cur].append((ins, rest))
    return out


@pytest.fixture(scope="module")
def dockerfile():
    return stages(DOCKERFILE.read_text())


def _pip_line(stage) -> str:
    (line,) = [a for i, a in stage if i == "RUN" and "pip install" in a and "/src" in a]
    return line


def test_dockerfile_stages(dockerfile):
    assert list(dockerfile) == ["build", "runtime"]
    build, runtime = dockerfile["build"], dockerfile["runtime"]
    assert "[build]" in _pip_line(build)
    # the runtime stage installs fa4aot without the compiler extra, and nothing of the compiler
    line = _pip_line(runtime)
    assert "[build]" not in line
    for pkg in ("flash-attn", "cutlass", "quack", "triton"):
        assert pkg not in line
    builds = [a for i, a in build if i == "RUN" and a.startswith("fa4aot build")]
    assert len(builds) == 1 and "--arch sm90 --arch sm100" in builds[0]
    assert not any(i == "RUN" and a.startswith("fa4aot build") for i, a in runtime)
    env = dict(a.split("=", 1) for i, a in runtime if i == "ENV")
    assert env["FA4AOT_ON_MISS"] == "error"  # an image never compiles while serving


class Stage:
    """One stage's file tree under `tree`; container paths map to tree paths."""

    def __init__(self, tree: Path, env: dict[str, str]):
        self.tree, self.env, self.workdir = tree, env, "/"
        (tree / "opt").mkdir(parents=True)  # the base image's directories

    def path(self, p: str) -> Path:
        p = p if p.startswith("/") else f"{self.workdir.rstrip('/')}/{p}"
        return self.tree / p.lstrip("/")

    def rewrite(self, cmd: str) -> str:
        # container paths -> tree paths (every absolute path in the Dockerfile is /opt or /src)
        return re.sub(r"(?<![\w.])/(opt|src)\b", lambda m: f"{self.tree}/{m.group(1)}", cmd)

    def copy(self, srcs: list[Path], dest: str) -> None:
        d = self.path(dest)
        for src in srcs:
            target = d / src.name if dest.endswith("/") or len(srcs) > 1 else d
            target.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, target, dirs_exist_ok=True)
            else:
                shutil.copy2(src, target)


def _run(stage: Stage, cmd: str, extra_env: dict[str, str]) -> None:
    cmd = stage.rewrite(cmd.replace("${PYTHON}", PY_MINOR))
    bindir = stage.tree / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bindir / "fa4aot").write_text('#!/bin/sh\nexec python -m fa4aot.cli "$@"\n')
    for f in bindir.iterdir():
        f.chmod(0o755)
    env = {**stub_env(), **{k: stage.rewrite(v) for k, v in stage.env.items()}, **extra_env}
    env["PATH"] = f"{bindir}{os.pathsep}{os.environ['PATH']}"
    r = subprocess.run(
        ["sh", "-c", cmd],
        env=env,
        cwd=stage.path(stage.workdir),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr}"


def _replay(stage: Stage, instructions, ctx: Path, other: Stage | None, extra_env, on_run):
    for ins, a in instructions:
        if ins == "WORKDIR":
            stage.workdir = a
            stage.path(a).mkdir(parents=True, exist_ok=True)
        elif ins == "ENV":
            k, v = a.split("=", 1)
            stage.env[k] = v
        elif ins == "COPY":
            parts = a.split()
            src_root = ctx
            if parts[0].startswith("--from="):
                src_root = other.tree
                parts = parts[1:]
            *srcs, dest = parts
            stage.copy([src_root / s.lstrip("/") for s in srcs], dest)
        elif ins == "RUN":
            on_run(a)
        elif ins != "ARG":
            raise AssertionError(f"unhandled instruction {ins} {a}")


def test_stages_replayed_runtime_never_imports_the_compiler(dockerfile, tmp_path):
    spec = write_spec(tmp_path)
    build = Stage(tmp_path / "build", {})
    ran = []

    def build_run(cmd: str):
        if cmd.startswith(("apt-get", "pip install")):
            return  # checked in test_dockerfile_stages; this machine has the packages
        if cmd.startswith("fa4aot build"):
            cmd = cmd.replace("fa4aot build", f"fa4aot build --spec {spec} -j 1", 1)
        ran.append(cmd)
        _run(build, cmd, {"FA4AOT_STUB_COMPILER": "1", "PYTHONPATH": str(build.path("/src"))})

    _replay(build, dockerfile["build"], ROOT, None, {}, build_run)
    assert any(c.startswith("fa4aot build") for c in ran) and any("cp " in c for c in ran)
    report = json.loads(build.path("/opt/fa4aot-build.json").read_text())
    assert report["counts"]["failed"] == 0 and report["counts"]["built"] == 16  # 8 per arch
    assert {Path(s).name.split("-")[0] for s in report["stores"]} == {"sm90", "sm100"}

    runtime = Stage(tmp_path / "runtime", {})
    log = tmp_path / "imports.log"
    log.touch()
    prelude = tmp_path / "prelude"
    prelude.mkdir()
    (prelude / "sitecustomize.py").write_text(BLOCKER)
    rt_env = {
        "FA4AOT_TEST_IMPORT_LOG": str(log),
        # "installed": fa4aot from the stage's copy of the source, no compiler importable
        "PYTHONPATH": f"{prelude}{os.pathsep}{runtime.path('/opt/fa4aot/src')}",
        "FA4AOT_STUB_COMPILER": "",
    }

    def runtime_run(cmd: str):
        if cmd.startswith("pip install"):
            return
        _run(runtime, cmd, rt_env)

    _replay(runtime, dockerfile["runtime"], ROOT, build, rt_env, runtime_run)
    tree = {str(p.relative_to(runtime.tree)) for p in runtime.tree.rglob("*") if p.is_file()}
    assert "opt/fa4aot/lib/libcute_dsl_runtime.so" in tree
    assert "opt/fa4aot/src/fa4aot/runtime/__init__.py" in tree
    assert "opt/fa4aot/src/fa4aot/runtime/launch.py" in tree
    assert not any(p.startswith("src/") for p in tree), "the build context leaked in"
    # serve-side checks in the runtime image: the store is found, a call reaches the contract
    # checks (no GPU here) and the packaged store answers block-size queries
    check = """
import os, sys, torch, fa4aot
from fa4aot.runtime import Runtime
# fa4aot as the image installed it, not this checkout
assert fa4aot.__file__.startswith(os.environ['FA4AOT_CACHE_DIR'].removesuffix('/cache')), fa4aot.__file__
from fa4aot.store.layers import find_serving_store
from fa4aot.store.toolchain import runtime_expectation
stores = find_serving_store(Runtime().roots, runtime_expectation('sm90', 132))
assert len(stores) == 1 and len(list(stores[0].iter_artifacts())) == 8, stores
q = torch.zeros(1, 1, 8, 128, dtype=torch.bfloat16)
try:
    fa4aot.flash_attn_func(q, q, q, causal=True)
except fa4aot.ContractViolation as e:
    assert 'CUDA' in str(e), e
else:
    raise AssertionError('a CPU call was not refused')
print(fa4aot.supported_block_sizes('sm90', 'bfloat16', 128))
"""
    _run(runtime, f"python -c {shlex.quote(check)}", rt_env)
    _run(runtime, "fa4aot doctor --json > /dev/null || test $? -eq 1", rt_env)
    assert log.read_text() == "", f"the runtime stage imported the compiler:\n{log.read_text()}"


def test_vllm_dockerfile_builds_in_the_engine_image_from_its_fa4_copy():
    """docs/container/Dockerfile.vllm: the engine's image is both stages (its pins build the
    store that it serves), the build compiles from vLLM's FA4 copy, and the serving stage never
    compiles. The `--fa4 vllm` build itself is tested in tests/fa4/test_fa4_source_build.py."""
    text = (ROOT / "docs" / "container" / "Dockerfile.vllm").read_text()
    froms = re.findall(r"^FROM (\S+) AS (\w+)$", text, re.MULTILINE)
    assert froms == [("${VLLM_IMAGE}", "build"), ("${VLLM_IMAGE}", "runtime")]
    assert re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v0\.33\.0$", text, re.MULTILINE)
    st = stages(text)
    (build_cmd,) = [a for i, a in st["build"] if i == "RUN" and a.startswith("fa4aot build")]
    assert "--fa4 vllm" in build_cmd and "--arch sm90" in build_cmd
    pips = [a for s in st.values() for i, a in s if i == "RUN" and "pip install" in a]
    # fa4aot alone: the image's torch, tvm-ffi and CuTe DSL stay (pyproject's ranges admit them)
    assert pips and all("[build]" not in a and "torch" not in a for a in pips)
    env = dict(a.split("=", 1) for i, a in st["runtime"] if i == "ENV")
    assert env["FA4AOT_ON_MISS"] == "error"
    assert not any(i == "RUN" and a.startswith("fa4aot build") for i, a in st["runtime"])
