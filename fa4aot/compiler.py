"""The only module that imports `cutlass` / `flash_attn`. Build side (and JIT fallback) only.

Cross-compiles FA4 kernels with no GPU: FA4's real entry points are driven under torch's
FakeTensorMode with the target arch and SM count set in the environment, so FA4 itself decides
the compile key and compiles it; we take the compiled function out of FA4's compile cache and
export it (`export_to_c`) as an object file with the cubin embedded.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from .variants import Call, Variant

_CONFIGURED: tuple[str, int] | None = None


def configure(arch: str, num_sms: int) -> None:
    """Set the cross-compile target. Must run before the first FA4 import in this process."""
    global _CONFIGURED
    if _CONFIGURED is not None and _CONFIGURED != (arch, num_sms):
        raise RuntimeError(f"this process already targets {_CONFIGURED}; use one process per target")
    num = arch[2:]
    os.environ["FLASH_ATTENTION_ARCH"] = f"sm_{num}"
    os.environ["CUTE_DSL_ARCH"] = f"sm_{num}a"
    os.environ["FLASH_ATTENTION_NUM_SMS"] = str(num_sms)
    # The DSL warns once per compile that AuxData is not a JitArgument (FA4 passes it as a
    # compile-time value on purpose); thousands of identical lines would bury real errors.
    import warnings

    warnings.filterwarnings("ignore", message=".*cannot be converted to a JitArgument.*")
    warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
    warnings.filterwarnings("ignore", message=".*Failed to initialize NumPy.*")
    _CONFIGURED = (arch, num_sms)


def _fa4():
    import flash_attn.cute as fa  # noqa: PLC0415 (heavy: ~6 s; only builders pay it)
    from flash_attn.cute import interface

    return fa, interface


def _caches():
    _, I = _fa4()
    return {"fwd": I._flash_attn_fwd.compile_cache, "tile_cumsum": I._compute_tile_cumsum.compile_cache,
            "blocks_to_batch": I._compute_blocks_to_batch.compile_cache}


def key_repr(key: Any) -> str:
    """A readable, stable rendering of an FA4 compile key (it holds cutlass type objects)."""
    def r(x):
        if isinstance(x, tuple):
            return "(" + ", ".join(r(i) for i in x) + ("," if len(x) == 1 else "") + ")"
        if isinstance(x, type):
            return x.__name__
        return repr(x)
    return r(key)


def fake_call(call: Call):
    """Run FA4's public entry point for `call` under FakeTensorMode (compiles, runs nothing)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    fa, _ = _fa4()
    dt = getattr(torch, call.dtype)
    b, sq, sk = call.batch, call.seqlen_q, call.seqlen_k
    hq, hk, d, dv = call.num_heads, call.num_heads_kv, call.head_dim, call.head_dim_v
    with FakeTensorMode():
        dev = "cuda"
        kw: dict[str, Any] = dict(causal=call.causal, window_size=(call.window_left, call.window_right),
                                  return_lse=call.return_lse)
        if call.sink_dtype:
            kw["learnable_sink"] = torch.empty(hq, dtype=getattr(torch, call.sink_dtype), device=dev)
        if call.layout == "dense":
            q = torch.empty(b, sq, hq, d, dtype=dt, device=dev)
            k = torch.empty(b, sk, hk, d, dtype=dt, device=dev)
            v = torch.empty(b, sk, hk, dv, dtype=dt, device=dev)
            fa.flash_attn_func(q, k, v, **kw)
            return
        q = torch.empty(b * sq, hq, d, dtype=dt, device=dev)
        kw.update(cu_seqlens_q=torch.empty(b + 1, dtype=torch.int32, device=dev), max_seqlen_q=sq)
        if call.layout == "varlen":
            k = torch.empty(b * sk, hk, d, dtype=dt, device=dev)
            v = torch.empty(b * sk, hk, dv, dtype=dt, device=dev)
            kw.update(cu_seqlens_k=torch.empty(b + 1, dtype=torch.int32, device=dev), max_seqlen_k=sk)
        else:
            p = call.page_size
            npages = -(-sk // p)
            k = torch.empty(b * npages, p, hk, d, dtype=dt, device=dev)
            v = torch.empty(b * npages, p, hk, dv, dtype=dt, device=dev)
            kw.update(page_table=torch.empty(b, npages, dtype=torch.int32, device=dev),
                      seqused_k=torch.empty(b, dtype=torch.int32, device=dev), max_seqlen_k=sk)
        fa.flash_attn_varlen_func(q, k, v, **kw)


def trace(call: Call) -> dict[str, list[tuple[Any, Any]]]:
    """Compile what FA4 compiles for `call`; -> {cache name: [(key, compiled fn)]} of new entries.

    FA4's in-process caches are cleared first, so what lands there is exactly this call's set.
    """
    caches = _caches()
    for c in caches.values():
        c.clear()
    fake_call(call)
    return {n: list(c.cache.items()) for n, c in caches.items()}


# Helper kernels the sm90 forward consumes. blocks_to_batch is compiled by FA4 for batch > 256
# too, but its output is not an argument of the sm90 forward kernel, so it is not shipped.
SHIPPED_HELPERS = ("tile_cumsum",)


def compile_variant(call: Call, variant: Variant, outdir: Path) -> dict[str, Any]:
    """Compile and export one variant: -> {"parts": {name: {"object": path, "key": str}}, ...}.

    Raises RuntimeError when FA4 compiles other than one forward kernel for the call: the
    runtime's feature model and FA4's compile key would then disagree, and shipping it would
    risk calling the wrong kernel.
    """
    t0 = time.perf_counter()
    got = trace(call)
    seconds = time.perf_counter() - t0
    fwd = got["fwd"]
    if len(fwd) != 1:
        raise RuntimeError(f"expected one forward kernel for {variant.describe()}, FA4 compiled {len(fwd)}")
    helpers = {n: got[n] for n in SHIPPED_HELPERS}
    if variant.cu_hint != bool(helpers["tile_cumsum"]):
        raise RuntimeError(f"tile_cumsum helper presence disagrees with cu_hint for {variant.describe()}")
    parts: dict[str, Any] = {}
    for name, entries in [("fwd", fwd), *helpers.items()]:
        for key, fn in entries:
            obj = outdir / f"{name}.o"
            fn.export_to_c(object_file_path=str(obj), function_name=f"fa4aot_{name}")
            parts[name] = {"object": str(obj), "key": key_repr(key)}
            if name == "tile_cumsum":
                # (tile, seqlen_q_multiplier, cu_seqlens?, seqused?, splits?, virtual batch?)
                parts[name]["tile"], parts[name]["seqlen_q_multiplier"] = int(key[0]), int(key[1])
                parts[name]["cu_seqlens"], parts[name]["seqused"] = bool(key[2]), bool(key[3])
    return {"parts": parts, "compile_seconds": seconds, "fa4_key": parts["fwd"]["key"]}


def runtime_library_dirs() -> list[str]:
    """Directories of libcute_dsl_runtime.so and libtvm_ffi.so, for linking."""
    import tvm_ffi

    from . import runtime_lib

    return [str(Path(runtime_lib.find_runtime_lib()).parent), str(Path(tvm_ffi.__file__).parent / "lib")]


def jit_flash_attn_func(*args, **kwargs):
    """FA4's own JIT path (FA4AOT_ON_MISS=jit). Imports the compiler: seconds, first time."""
    fa, _ = _fa4()
    return fa.flash_attn_func(*args, **kwargs)


def jit_flash_attn_varlen_func(*args, **kwargs):
    fa, _ = _fa4()
    return fa.flash_attn_varlen_func(*args, **kwargs)
