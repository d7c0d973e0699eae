"""The engines' FA4 copies for tests, unpacked once from their released wheels: only the copy's
`cute/` directory and the package's `_version.py` are extracted, nothing is installed. Wheels
are found as tests/engines/wheels.py finds them (FA4AOT_ENGINE_WHEELS, else
~/.cache/fa4aot-test-wheels, else `pip download --no-deps` there); skipped with the reason
when none of these works."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "fa4aot_test_engine_wheels", Path(__file__).parent / "engines" / "wheels.py")
wheels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wheels)

COPIES = {  # package: the copy's directory inside the wheel
    "vllm": "vllm/vllm_flash_attn/cute/",
    "sglang": "sglang/kernels/ops/attention/flash_attn/cute/",
}


def engine_root(pkg: str) -> Path:
    """The top-level package directory (e.g. .../vllm) holding only `pkg`'s FA4 copy and its
    `_version.py`, extracted from the wheel; pytest.skip when no wheel can be had."""
    out = wheels.CACHE / "extracted" / f"{pkg}-{wheels.PINS[pkg]}"
    done = out / ".complete"
    if not done.exists():
        whl = wheels.wheel(pkg)
        if whl is None:
            pytest.skip(wheels.skip_reason(pkg))
        with zipfile.ZipFile(whl) as z:
            for n in z.namelist():
                if n.startswith(COPIES[pkg]) or n == f"{pkg}/_version.py":
                    z.extract(n, out)
        done.touch()
    return out / pkg
