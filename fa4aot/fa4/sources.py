"""Where the FA4 kernels come from: upstream `flash-attn-4` (`flash_attn.cute`), the copy an
installed vLLM ships (`vllm.vllm_flash_attn.cute`), the one SGLang ships
(`sglang.kernels.ops.attention.flash_attn.cute`), or a source tree.

`resolve(spec)` names a source without importing any of it: its module prefix, package and
version, a content hash of its cute directory and the ABI fa4aot models for it (read from its
interface.py's compile-key tuple, `abis.detect_abi`). `load(source)` imports the source's
interface module; for the engines' copies it first registers their parent packages as bare
modules, so the engine's package `__init__`s (vLLM's env overrides and CUDA extensions,
SGLang's runtime) never run. Only the `fa4aot.fa4` package calls `load`.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.machinery
import importlib.util
import re
import sys
import types
from collections import Counter
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from fa4aot.errors import Fa4SourceError
from fa4aot.model.abis import ABIS, detect_abi

# the named sources: (module prefix of the cute package, distribution, top-level package)
NAMED = {
    "upstream": ("flash_attn.cute", "flash-attn-4", "flash_attn"),
    "vllm": ("vllm.vllm_flash_attn.cute", "vllm", "vllm"),
    "sglang": ("sglang.kernels.ops.attention.flash_attn.cute", "sglang", "sglang"),
}
DEFAULT = "upstream"


@dataclass(frozen=True)
class Fa4Source:
    """One FA4 source. name: "upstream", "vllm", "sglang" or "path"; prefix: the module the cute
    package imports itself as; cute_dir: that package's directory; package/version: the
    distribution it ships in (None for a bare tree); sha256: `content_hash(cute_dir)`; abi: the
    ABI fa4aot models for it (`abis.ABIS`), or None when its compile key matches none."""

    name: str
    prefix: str
    cute_dir: Path
    package: str | None
    version: str | None
    sha256: str
    abi: str | None

    def record(self) -> dict[str, Any]:
        """The store's `toolchain["fa4_source"]`: what the artifacts were compiled from."""
        return {"name": self.name, "package": self.package, "version": self.version,
                "sha256": self.sha256, "abi": self.abi, "prefix": self.prefix}

    def describe(self) -> str:
        pkg = f"{self.package} {self.version}" if self.package else str(self.cute_dir)
        return f"{self.name} ({pkg}, {self.prefix}, sha256 {self.sha256[:12]}, abi {self.abi})"

    def require_modelled(self) -> None:
        """Fa4SourceError unless fa4aot models this source's kernel ABI (no silent fallback to
        another source's argument lists)."""
        if self.abi is None or not ABIS[self.abi].buildable:
            why = ABIS[self.abi].note if self.abi else (
                "its _flash_attn_fwd compile key matches no ABI fa4aot models")
            raise Fa4SourceError(
                f"fa4aot cannot build from FA4 source {self.describe()}: {why}. "
                f"Buildable sources: {', '.join(n for n, a in ABIS.items() if a.buildable)}"
            )


def content_hash(cute_dir: Path) -> str:
    """sha256 over the cute directory's *.py files (recursively, sorted by relative path; each
    file as its path, a NUL, its bytes, a NUL): two sources hash alike only if their Python
    sources are byte-identical. __pycache__ is skipped."""
    h = hashlib.sha256()
    files = sorted(p for p in cute_dir.rglob("*.py") if "__pycache__" not in p.parts)
    for p in files:
        h.update(p.relative_to(cute_dir).as_posix().encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()


def self_prefix(interface: Path) -> str:
    """The module prefix a cute package's interface.py imports its siblings by: the most common
    `X` of `from X.<mod> import ...` / `from X import <mod>` whose <mod> is a file beside it."""
    mods = {p.stem for p in interface.parent.glob("*.py")}
    votes: Counter[str] = Counter()
    for node in ast.walk(ast.parse(interface.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            head, _, last = node.module.rpartition(".")
            if head and last in mods:
                votes[head] += 1
            elif any(a.name in mods for a in node.names):
                votes[node.module] += 1
    if not votes:
        raise Fa4SourceError(f"{interface}: imports none of its sibling modules by absolute "
                             "name, so its import prefix is unknown")
    return votes.most_common(1)[0][0]


def _top_dir(top: str) -> Path | None:
    """An importable top-level package's directory, found without executing it."""
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _version(dist: str, pkg_dir: Path | None) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        pass
    # an unpacked wheel on a path: setuptools-scm's _version.py holds it
    if pkg_dir is not None and (pkg_dir / "_version.py").is_file():
        m = re.search(r"^__version__\s*=\s*version\s*=\s*['\"]([^'\"]+)",
                      (pkg_dir / "_version.py").read_text(), re.M)
        if m:
            return m.group(1)
    return None


def resolve(spec: str | None = None, *, root: str | Path | None = None) -> Fa4Source:
    """`spec` (None: upstream) -> its Fa4Source. A named source is found where Python would
    import it from; root: the engine's top-level package directory instead (e.g. an unpacked
    wheel's `vllm/`). Anything else is a path: a cute directory, or a tree holding one
    (`<path>/cute`, `<path>/flash_attn/cute`). Fa4SourceError when it is not there."""
    spec = spec or DEFAULT
    if spec in NAMED:
        prefix, dist, top = NAMED[spec]
        top_dir = Path(root) if root else _top_dir(top)
        if top_dir is None:
            raise Fa4SourceError(f"FA4 source {spec!r}: package {top!r} is not installed "
                                 f"(pip install {dist}), or give its path")
        cute = top_dir.joinpath(*prefix.split(".")[1:])
        if not (cute / "interface.py").is_file():
            raise Fa4SourceError(f"FA4 source {spec!r}: no {cute}/interface.py "
                                 f"({dist} {_version(dist, top_dir)} ships no FA4 copy there)")
        found = self_prefix(cute / "interface.py")
        if found != prefix:
            raise Fa4SourceError(f"FA4 source {spec!r}: {cute}/interface.py imports itself as "
                                 f"{found}, not {prefix}")
        return Fa4Source(spec, prefix, cute, dist, _version(dist, top_dir),
                         content_hash(cute), detect_abi(cute / "interface.py"))
    path = Path(spec).expanduser()
    for cand in (path, path / "cute", path / "flash_attn" / "cute"):
        if (cand / "interface.py").is_file():
            cute = cand.resolve()
            break
    else:
        raise Fa4SourceError(
            f"FA4 source {spec!r}: not one of {', '.join(NAMED)} and no cute/interface.py "
            "under that path")
    prefix = self_prefix(cute / "interface.py")
    name, dist, top_dir = "path", None, None
    for n, (p, d, top) in NAMED.items():
        # an engine's copy in place (an installed or unpacked package): named as that engine
        depth = len(p.split(".")) - 1
        if prefix == p and len(cute.parents) > depth - 1 and cute.parents[depth - 1].name == top:
            name, dist, top_dir = n, d, cute.parents[depth - 1]
    return Fa4Source(name, prefix, cute, dist, _version(dist, top_dir) if dist else None,
                     content_hash(cute), detect_abi(cute / "interface.py"))


def resolve_for_build(spec: str | None) -> Fa4Source | None:
    """`resolve(spec)` for a build, checked buildable (Fa4SourceError otherwise); None for
    upstream where flash-attn-4 is not installed (a stub build, or the builder's own "needs FA4"
    refusal, decides then)."""
    if spec in (None, DEFAULT) and _top_dir(NAMED[DEFAULT][2]) is None:
        return None
    src = resolve(spec)
    src.require_modelled()
    return src


# -- importing a source ----------------------------------------------------------------------------

_LOADED: Fa4Source | None = None


def loaded() -> Fa4Source | None:
    """The source this process imported FA4 from (load), or None."""
    return _LOADED


def _bare_package(name: str, path: Path) -> None:
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)]
    mod.__package__ = name
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__spec__.submodule_search_locations = mod.__path__
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent:  # as the import system does for a submodule it loads
        setattr(sys.modules[parent], child, mod)


def stub_parents(prefix: str, cute_dir: Path) -> None:
    """Register the parents of `prefix` (all but its last name) as bare packages whose
    __path__ leads to `cute_dir`, so `prefix.*` imports the source's own files, unmodified,
    and no parent `__init__` runs. A parent already imported must lead there too (one source
    per process: FA4 keeps module-level compile caches and reads its arch at import)."""
    parts = prefix.split(".")
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        where = cute_dir.parents[len(parts) - 1 - i]
        have = sys.modules.get(name)
        if have is None:
            _bare_package(name, where)
        elif str(where) not in [str(Path(p)) for p in getattr(have, "__path__", [])]:
            raise Fa4SourceError(
                f"module {name} is already imported from {list(getattr(have, '__path__', []))}, "
                f"not {where}: build from one FA4 source per process")


def load(source: Fa4Source):
    """Import `source`'s interface module (the build side only: it imports cutlass).
    Upstream imports as installed; an engine's copy or a tree through `stub_parents`."""
    global _LOADED
    if _LOADED is not None and _LOADED.cute_dir != source.cute_dir:
        raise Fa4SourceError(f"this process already imported FA4 from {_LOADED.describe()}; "
                             f"{source.describe()} needs another process")
    if source.name != "upstream":
        stub_parents(source.prefix, source.cute_dir)
    if source.abi == "sglang":  # (the SGLang modules it imports from outside its package)
        from fa4aot.fa4 import sglang_copy

        sglang_copy.stand_ins()
    mod = importlib.import_module(source.prefix + ".interface")
    got = Path(mod.__file__).resolve().parent
    if got != source.cute_dir.resolve():
        raise Fa4SourceError(f"{source.prefix}.interface imported from {got}, not "
                             f"{source.cute_dir}: another copy is first on sys.path")
    _LOADED = source
    return mod


def module(source: Fa4Source, name: str):
    """The source's module `name` (e.g. "flash_fwd_sm90", "utils"), after `load`."""
    return importlib.import_module(f"{source.prefix}.{name}")
