"""FA4 sources (fa4aot/fa4/sources.py): resolved without importing them, hashed, their ABI
recognised from their interface.py, an unmodelled one refused by name."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fa4aot.fa4 import sources as S
from fa4aot.model.abis import ABIS
from fa4_copies import engine_root

ROOT = Path(__file__).resolve().parents[2]


def test_upstream_resolves_to_the_installed_flash_attn_4():
    src = S.resolve(None)
    assert (src.name, src.prefix, src.package, src.abi) == (
        "upstream", "flash_attn.cute", "flash-attn-4", "upstream")
    assert src.version and (src.cute_dir / "interface.py").is_file()
    assert src.sha256 == S.content_hash(src.cute_dir) and len(src.sha256) == 64
    assert src.record() == {"name": "upstream", "package": "flash-attn-4",
                            "version": src.version, "sha256": src.sha256, "abi": "upstream",
                            "prefix": "flash_attn.cute"}
    src.require_modelled()


def test_vllm_copy_from_the_wheel():
    root = engine_root("vllm")
    src = S.resolve("vllm", root=root)
    assert (src.prefix, src.package, src.version, src.abi) == (
        "vllm.vllm_flash_attn.cute", "vllm", "0.33.0", "vllm")
    src.require_modelled()
    # the same copy given as a path: named, versioned and hashed alike, its prefix read from
    # its imports
    p = S.resolve(str(root / "vllm_flash_attn"))
    assert p.record() == src.record() and p.cute_dir == src.cute_dir


def test_sglang_copy_is_recognised_and_buildable():
    src = S.resolve("sglang", root=engine_root("sglang"))
    assert (src.abi, src.version) == ("sglang", "0.5.23") and ABIS["sglang"].buildable
    src.require_modelled()


def test_content_hash_follows_every_python_file(tmp_path):
    cute = tmp_path / "pkg" / "cute"
    shutil.copytree(engine_root("vllm") / "vllm_flash_attn" / "cute", cute)
    h0 = S.content_hash(cute)
    (cute / "__pycache__").mkdir(exist_ok=True)
    (cute / "__pycache__" / "x.py").write_text("ignored")
    (cute / "README.txt").write_text("not python")
    assert S.content_hash(cute) == h0
    f = cute / "flash_fwd_sm90.py"
    f.write_text(f.read_text() + "\n# patched\n")
    assert S.content_hash(cute) != h0


def test_unmodelled_tree_is_refused(tmp_path):
    cute = tmp_path / "mine" / "cute"
    shutil.copytree(engine_root("vllm") / "vllm_flash_attn" / "cute", cute)
    iface = cute / "interface.py"
    iface.write_text(iface.read_text().replace("        decode_splits,\n    )", "    )", 1))
    src = S.resolve(str(tmp_path / "mine"))
    assert src.abi is None and src.prefix == "vllm.vllm_flash_attn.cute"
    with pytest.raises(S.Fa4SourceError, match="matches no ABI"):
        src.require_modelled()


def test_missing_sources_say_what_to_do(tmp_path):
    with pytest.raises(S.Fa4SourceError, match="no cute/interface.py"):
        S.resolve(str(tmp_path))
    with pytest.raises(S.Fa4SourceError, match="ships no FA4 copy"):
        S.resolve("vllm", root=tmp_path)


_LOAD = """
import sys
from fa4aot.fa4 import sources as S
src = S.resolve("vllm", root=sys.argv[1])
stubbed = S.stub_parents(src.prefix, src.cute_dir)
import vllm, vllm.vllm_flash_attn
# the parents are bare: neither vllm/__init__.py nor vllm_flash_attn/__init__.py ran
assert vllm.__spec__.origin is None and vllm.vllm_flash_attn.__spec__.origin is None
import importlib
m = importlib.import_module(src.prefix + ".cache_utils")
assert m.__file__.startswith(str(src.cute_dir)), m.__file__
try:
    S.stub_parents("vllm.vllm_flash_attn.cute", src.cute_dir.parent / "elsewhere" / "cute")
except S.Fa4SourceError as e:
    print("refused", e)
print("ok")
"""


def test_stub_parents_import_the_copy_in_place_and_only_it():
    """A copy's modules import from its own directory with its parents' __init__s skipped
    (cache_utils: no cutlass import needed), and a second tree for the same parents is refused."""
    root = engine_root("vllm")
    r = subprocess.run([sys.executable, "-c", _LOAD, str(root)], capture_output=True,
                       text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "refused module vllm is already imported" in r.stdout
    assert r.stdout.strip().endswith("ok")
