"""Building from SGLang's FA4 copy (`fa4aot build --fa4 sglang`): the modules it imports from
SGLang outside its own package, stood in; its calls; its compile keys read by field name; its
kernels exported.

SGLang 0.5.23's copy (`sglang/kernels/ops/attention/flash_attn/cute/`) imports three SGLang
modules besides its own package (interface.py 14-35): `sglang.kernels.jit.cute_aot_cache`
(`get_jit_cache`, whose default reads `sglang.srt.environ`, i.e. SGLang's whole runtime),
`sglang.kernels.jit.utils` (`is_arch_support_pdl`) and
`sglang.kernels.ops.attention.fa4_sm120.dispatch` (the sm120 forward host). `stand_ins` puts
small equivalents in their place: an in-memory compile cache (SGLang's with
SGLANG_CUTE_AOT_CACHE_DIR="": its persistent one would be purged by a trace's clear), PDL on
for a target arch of 9.x and up, as SGLang's `is_arch_support_pdl`, and no sm120 host (fa4aot
builds sm90).

Its sm90 kernel has fewer static features than upstream's: no persistent scheduler (no
`is_static_persistent` in its key), no varlen batch > 256 helpers or cu_total slots. A
`Variant` (fa4aot's feature model, upstream's) maps onto the copy's kernel by `canonical`,
which drops those two features: every variant of one canonical form is served by the same
kernel (`kernel_id`: the builder compiles it once and stores it under each variant's id), and
`compile_variant` checks that the copy compiled exactly that one.
"""

from __future__ import annotations

import os
import sys
import time
import types
from dataclasses import replace
from pathlib import Path
from typing import Any

from fa4aot.fa4 import cubin
from fa4aot.fa4.keys import (
    _CUTE_DTYPES, copy_key_fields, fake_copy_call, key_repr, trace_caches,
)
from fa4aot.model import constraints as C
from fa4aot.model.abis import ABIS, KeyFields
from fa4aot.model.variants import Variant

FWD_KEY = ABIS["sglang"].fwd_key
COMBINE_KEY = ABIS["sglang"].combine_key
JIT = "sglang.kernels.jit"
SM120 = "sglang.kernels.ops.attention.fa4_sm120"


class JITCache:
    """SGLang's in-memory `JITCache` (cute_aot_cache.py): a dict of compiled functions by key."""

    def __init__(self):
        self.cache: dict = {}

    def __setitem__(self, key, fn) -> None:
        self.cache[key] = fn

    def __getitem__(self, key):
        return self.cache[key]

    def __contains__(self, key) -> bool:
        return key in self.cache

    def clear(self) -> None:
        self.cache.clear()


def get_jit_cache(name=None, *, cache_dir=None, source_paths=(), enable_tvm_ffi=True):
    return JITCache()


def _target_major() -> int:
    """The arch's major the copy compiles for: FLASH_ATTENTION_ARCH (the copy's own override,
    set when cross-compiling), else CUTE_DSL_ARCH, else the current GPU's."""
    arch = os.environ.get("FLASH_ATTENTION_ARCH") or os.environ.get("CUTE_DSL_ARCH")
    if arch:
        digits = "".join(ch for ch in arch if ch.isdigit())
        return int(digits[:-1])
    import torch

    return torch.cuda.get_device_capability()[0]


def is_arch_support_pdl() -> bool:
    return _target_major() >= 9


def get_forward_host(arch: int):
    if arch // 10 == 12:
        raise NotImplementedError("SGLang's sm120 FA4 forward host is not built by fa4aot")
    return None


def try_cached_paged_decode(*, arch: int, **kwargs):
    return None


def try_cached_varlen(*, arch: int, **kwargs):
    return None


def _module(name: str, package: bool = False, **attrs) -> None:
    if name in sys.modules:  # an installed SGLang imported already: its own modules stay
        return
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    if package:
        mod.__path__ = []
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, mod)


def _no_cuda_stream(device_index: int) -> int:
    raise RuntimeError("no CUDA in this torch build: SGLang's FA4 copy compiles here, runs not")


def stand_ins() -> None:
    """Register the SGLang modules the copy imports from outside its package (this module's
    equivalents), after `sources.stub_parents` registered their parents. Modules already
    imported are left alone. On a CPU-only torch, the copy's import-time read of
    `torch._C._cuda_getCurrentRawStream` (its relative-bias workspace; absent there) gets a
    function that raises if called."""
    import torch

    if not hasattr(torch._C, "_cuda_getCurrentRawStream"):
        torch._C._cuda_getCurrentRawStream = _no_cuda_stream
    _module(JIT, package=True)
    _module(f"{JIT}.cute_aot_cache", JITCache=JITCache, get_jit_cache=get_jit_cache)
    _module(f"{JIT}.utils", is_arch_support_pdl=is_arch_support_pdl)
    _module(SM120, package=True)
    _module(f"{SM120}.dispatch", get_forward_host=get_forward_host,
            try_cached_paged_decode=try_cached_paged_decode, try_cached_varlen=try_cached_varlen)


def caches(I) -> dict[str, Any]:
    return {"fwd": I._flash_attn_fwd.compile_cache,
            "combine": I._flash_attn_fwd_combine.compile_cache}



def trace(I, call, compiles: list | None = None) -> dict[str, list[tuple[Any, Any]]]:
    """What the copy compiles for `call`: {cache: [(key, compiled fn)]} (caches cleared
    first). compiles: receives the (args, kwargs) of every cute.compile."""
    return trace_caches(caches(I), lambda: fake_copy_call(I, call), compiles)


def canonical(variant: Variant) -> Variant:
    """The features of `variant` the copy's sm90 kernel is compiled for: without the
    persistent-scheduler choice and the batch > 256 helpers, which it has neither of."""
    return replace(variant, static_persistent=False, cu_hint=False)


def kernel_id(variant: Variant) -> str:
    """The id of the kernel the copy compiles for `variant` (its canonical form's): variants of
    one id are one kernel, which the builder compiles once and stores under each variant's id."""
    return canonical(variant).id


def variant_from_key(key: tuple, arch: str) -> Variant | None:
    """The copy's forward compile key -> the canonical Variant it compiles, read by field
    name; None for a key outside what fa4aot models (score/mask mods, softcap, block sparsity,
    aux data, FP8 and block-scaled inputs, MLA, relative bias, split-KV, the sm120 host,
    batch-invariant mode)."""
    try:
        f = KeyFields(key, FWD_KEY)
        if (f["score_mod_hash"] or f["mask_mod_hash"] or f["use_block_sparsity"]
                or f["qv is not None"] or not f["q is not None"] or f["bias is not None"]
                or f["qk_blockscaled"] or f["v_blockscaled"] or f["is_split_kv"]
                or f["aux_tensor_metadata"] is not None or f["aux_scalar_metadata"] is not None
                or f["gather_kv_length"] is not None or f["sparse_kv"] or f["batch_invariant"]
                or any(f[f"{t}_descale is not None"] for t in "qkv") or f.extra
                or f["arch_forward_config.compile_key if arch_forward_config is not None "
                     "else None"] is not None
                or f["arch_forward_plan.compile_key if arch_forward_plan is not None "
                     "else None"] is not None):
            return None
        return Variant(
            arch=arch, dtype=_CUTE_DTYPES[f["dtype"].__name__],
            # (the copy takes bf16 sinks only: its key records their presence)
            sink_dtype="bfloat16" if f["learnable_sink is not None"] else None,
            cu_hint=False, static_persistent=False, **copy_key_fields(f, arch),
        )
    except (IndexError, KeyError, AttributeError, TypeError, ValueError):
        return None


def compile_variant(I, call, variant: Variant, outdir: Path) -> dict[str, Any]:
    """Compile `variant` through the copy and export its forward: -> {"parts": {"fwd":
    {"object", "key", ...}}, "compile_seconds", "fa4_key"}. RuntimeError when the copy compiles
    other than one forward (and nothing else), or one whose key reads back as another kernel
    than `canonical(variant)`."""
    t0 = time.perf_counter()
    got = trace(I, call)
    fwd = got["fwd"]
    if len(fwd) != 1 or got["combine"]:
        raise RuntimeError(f"expected one forward kernel for {variant.describe()}, SGLang's "
                           f"FA4 copy compiled {len(fwd)} and {len(got['combine'])} combine")
    back = variant_from_key(fwd[0][0], variant.arch)
    if back != canonical(variant):
        raise RuntimeError(f"SGLang's FA4 copy compiled another kernel for "
                           f"{variant.describe()}: "
                           f"{back.describe() if back else key_repr(fwd[0][0])}")
    seconds = time.perf_counter() - t0
    key, fn = fwd[0]
    obj = outdir / "fwd.o"
    fn.export_to_c(object_file_path=str(obj), function_name="fa4aot_fwd")
    problem = cubin.target_problem(obj, C.cubin_target(variant.arch))
    if problem:
        raise RuntimeError(f"{variant.describe()}: {problem}")
    parts = {"fwd": {"object": str(obj), **part_record("fwd", key)}}
    return {"parts": parts, "compile_seconds": seconds, "fa4_key": parts["fwd"]["key"]}


def part_record(name: str, key) -> dict[str, Any]:
    """A part's record: its rendered key, the ABI it is called by, and (fwd) its tile."""
    rec: dict[str, Any] = {"key": key_repr(key), "fa4_abi": "sglang"}
    if name == "fwd":
        f = KeyFields(key, FWD_KEY)
        rec["tile_m"], rec["tile_n"] = int(f["tile_m"]), int(f["tile_n"])
        rec["split_kv"] = bool(f["is_split_kv"])
    if name == "combine":
        f = KeyFields(key, COMBINE_KEY)
        rec["max_splits"] = 1 << int(f["log_max_splits"])
    return rec
