"""The engines' released sources for tests: files read out of the vLLM 0.33.0 / SGLang 0.5.23
wheels with zipfile (nothing is installed). Wheels come from FA4AOT_ENGINE_WHEELS (a directory)
or `pip download --no-deps` into ~/.cache/fa4aot-test-wheels; None when neither works."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

PINS = {"vllm": "0.33.0", "sglang": "0.5.23"}
CACHE = Path.home() / ".cache" / "fa4aot-test-wheels"


def _find(engine: str, d: Path) -> Path | None:
    hits = sorted(d.glob(f"{engine}-{PINS[engine]}-*.whl"))
    return hits[0] if hits else None


@functools.cache
def wheel(engine: str) -> Path | None:
    env = os.environ.get("FA4AOT_ENGINE_WHEELS")
    if env:
        return _find(engine, Path(env))
    got = _find(engine, CACHE)
    if got is not None:
        return got
    CACHE.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q",
             f"{engine}=={PINS[engine]}", "-d", str(CACHE)],
            check=True, capture_output=True, timeout=900,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return _find(engine, CACHE)


def source(engine: str, path: str) -> str | None:
    """The text of `path` (e.g. "vllm/vllm_flash_attn/cute/interface.py") in the engine's wheel."""
    w = wheel(engine)
    if w is None:
        return None
    with zipfile.ZipFile(w) as z:
        return z.read(path).decode()


def skip_reason(engine: str) -> str:
    return (
        f"{engine}=={PINS[engine]} wheel not found: set FA4AOT_ENGINE_WHEELS to a directory "
        f"holding it, or allow `pip download --no-deps {engine}=={PINS[engine]}` "
        f"(cache: {CACHE})"
    )


def load_module(name: str, text: str, filename: str) -> types.ModuleType:
    """Execute a wheel's module text as `name` (its package stand-ins must be in sys.modules)."""
    mod = types.ModuleType(name)
    mod.__file__ = filename
    mod.__package__ = name.rpartition(".")[0]
    sys.modules[name] = mod
    exec(compile(text, filename, "exec"), mod.__dict__)
    return mod
