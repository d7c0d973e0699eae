"""Drive FA4's real entry points with no GPU: the only place (with the rest of `fa4aot.fa4`)
that imports `cutlass` / `flash_attn`. Build side (and JIT fallback) only.

FA4's entry points run under torch's FakeTensorMode with the target arch and SM count set in
the environment, so FA4 itself decides the compile key and compiles it; `fa4.export` takes the
compiled function out of FA4's compile cache and exports it.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

from fa4aot.build.mla import MlaCall
from fa4aot.fa4 import cubin
from fa4aot.fa4.keys import _record_softcaps, key_repr, trace_caches
from fa4aot.model import constraints as C
from fa4aot.model.compile_keys import Call
from fa4aot.store import runtime_lib

_CONFIGURED: tuple[str, int] | None = None
_SOURCE = None  # the FA4 source configured (fa4.sources.Fa4Source); None: upstream as installed


def source():
    """The FA4 source this process compiles from (None: upstream, imported as installed)."""
    return _SOURCE


def configure(arch: str, num_sms: int, fa4: str | None = None) -> None:
    """Set the cross-compile target and FA4 source (fa4.sources.resolve; None: upstream). Must
    run before the first FA4 import in this process."""
    global _CONFIGURED, _SOURCE
    if fa4 not in (None, "upstream"):
        from fa4aot.fa4 import sources

        src = sources.resolve(fa4)
        src.require_modelled()
        if _SOURCE is not None and _SOURCE.sha256 != src.sha256:
            raise RuntimeError(f"this process already compiles from {_SOURCE.describe()}")
        _SOURCE = src
    if _CONFIGURED is not None and _CONFIGURED != (arch, num_sms):
        raise RuntimeError(
            f"this process already targets {_CONFIGURED}; use one process per target"
        )
    if _CONFIGURED is None and "flash_attn.cute" in sys.modules:
        # FA4 fixes its target arch and its disk-cache setting when it is imported
        raise RuntimeError(
            "flash_attn.cute was imported before fa4aot.fa4.driver.configure(): "
            "configure the cross-compile target first (one process per target)"
        )
    num = arch[2:]
    # FA4's own disk cache must stay off: trace() clears FA4's caches, which with it enabled
    # would delete the user's cached kernels, and keys could be served from disk unseen.
    os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "0"
    os.environ["FLASH_ATTENTION_ARCH"] = f"sm_{num}"
    os.environ["CUTE_DSL_ARCH"] = C.cubin_target(arch)
    os.environ["FLASH_ATTENTION_NUM_SMS"] = str(num_sms)
    # The DSL warns once per compile that AuxData is not a JitArgument (FA4 passes it as a
    # compile-time value on purpose); thousands of identical lines would bury real errors.

    warnings.filterwarnings("ignore", message=".*cannot be converted to a JitArgument.*")
    warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
    warnings.filterwarnings("ignore", message=".*Failed to initialize NumPy.*")
    _CONFIGURED = (arch, num_sms)


def _fa4():
    if _SOURCE is not None:  # another FA4 (an engine's copy, a tree): its own modules
        import importlib

        from fa4aot.fa4 import sources

        interface = sources.load(_SOURCE)
        if _CONFIGURED is not None:
            _cross_hardware_info(_CONFIGURED[1])
        return importlib.import_module(_SOURCE.prefix), interface
    import flash_attn.cute as fa  # noqa: PLC0415 (heavy: ~6 s; only builders pay it)
    from flash_attn.cute import interface

    if _CONFIGURED is not None:
        _cross_hardware_info(_CONFIGURED[1])
    _record_softcaps()
    return fa, interface


def softcap_hash(value: float) -> str:
    """The score_mod hash FA4 puts in its compile key for `softcap=value` (a float: FA4 hashes
    the value's repr, so softcap=30 and softcap=30.0 are two kernels to it)."""
    _fa4()
    from flash_attn.cute import utils  # noqa: PLC0415

    return utils.hash_callable(utils.create_softcap_scoremod(float(value)))


def _cross_hardware_info(num_sms: int) -> None:
    """FA4's sm100 static persistent scheduler sizes its grid at trace time with
    `cutlass.utils.HardwareInfo().get_device_multiprocessor_count()`, a CUDA driver query that
    fails with no GPU (DynamicLibNotFoundError). Cross-compiling, the target's SM count is the
    configured one (recorded in the store's fingerprint, checked at load): answer with it, and
    refuse every other driver query by name rather than guess."""
    import cutlass.utils  # noqa: PLC0415

    if getattr(cutlass.utils.HardwareInfo, "_fa4aot_cross", False):
        return

    class CrossCompileHardwareInfo:
        _fa4aot_cross = True

        def __init__(self, device_id: int = 0):
            self.device_id = device_id

        def get_device_multiprocessor_count(self) -> int:
            return num_sms

        def __getattr__(self, name: str):
            raise RuntimeError(
                f"HardwareInfo.{name} needs a GPU: fa4aot cannot cross-compile a kernel that "
                "queries it at trace time"
            )

    cutlass.utils.HardwareInfo = CrossCompileHardwareInfo


def _caches():
    _, I = _fa4()
    return {
        "fwd": I._flash_attn_fwd.compile_cache,
        "tile_cumsum": I._compute_tile_cumsum.compile_cache,
        "blocks_to_batch": I._compute_blocks_to_batch.compile_cache,
        "combine": I._flash_attn_fwd_combine.compile_cache,
    }


def fake_call(call: Call):
    """Run FA4's public entry point for `call` under FakeTensorMode (compiles, runs nothing).

    Every layout goes through the entry point a caller would use: flash_attn_func for dense,
    flash_attn_varlen_func for the rest (q packed with cu_seqlens_q unless batch_q; seqused_q
    and seqused_k as the call says; K/V packed, in batch form, or paged)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    if call.qv is not None:  # absorbed MLA: FA4's varlen entry with qv (mla.MlaCall's form)

        return fake_mla_call(MlaCall(
            call.layout, call.batch, call.seqlen_q, call.seqlen_k, call.num_heads,
            call.head_dim, call.qv, call.dtype, call.causal, call.return_lse, call.page_size,
        ))
    fa, _ = _fa4()
    dt = getattr(torch, call.dtype)
    b, sq, sk = call.batch, call.seqlen_q, call.seqlen_k
    hq, hk, d, dv = call.num_heads, call.num_heads_kv, call.head_dim, call.head_dim_v
    with FakeTensorMode():
        dev = "cuda"

        def i32(n):
            return torch.empty(n, dtype=torch.int32, device=dev)

        kw: dict[str, Any] = dict(
            causal=call.causal,
            window_size=(call.window_left, call.window_right),
            return_lse=call.return_lse,
        )
        if call.sink_dtype:
            kw["learnable_sink"] = torch.empty(
                hq, dtype=getattr(torch, call.sink_dtype), device=dev
            )
        if call.softcap is not None:
            kw["softcap"] = call.softcap
        if call.pack_gqa is not None:
            kw["pack_gqa"] = call.pack_gqa
        if call.num_splits != 1:
            kw["num_splits"] = call.num_splits
        extra = {  # arguments only _flash_attn_fwd takes
            f"{t}_descale": torch.empty(b, hk, dtype=torch.float32, device=dev)
            for t in (call.descales or "")
        }
        if call.tile_m is not None:  # (FA4's entry points do not take tile_mn)
            # (modelled on sm90 only: compile_keys.features refuses it elsewhere)
            tile = C.fwd_tile("sm90", d, dv, call.causal,
                              call.window_left is not None or call.window_right is not None)
            extra["tile_mn"] = (call.tile_m, tile.n)
        if call.layout == "dense":
            q = torch.empty(b, sq, hq, d, dtype=dt, device=dev)
            k = torch.empty(b, sk, hk, d, dtype=dt, device=dev)
            v = torch.empty(b, sk, hk, dv, dtype=dt, device=dev)
            if extra:
                _fwd_direct(q, k, v, kw, extra)
            else:
                fa.flash_attn_func(q, k, v, **kw)
            return
        if call.batch_q:
            q = torch.empty(b, sq, hq, d, dtype=dt, device=dev)
        else:
            q = torch.empty(b * sq, hq, d, dtype=dt, device=dev)
            kw.update(cu_seqlens_q=i32(b + 1), max_seqlen_q=sq)
        if call.seqused_q:
            kw["seqused_q"] = i32(b)
        if call.has_seqused_k:
            kw["seqused_k"] = i32(b)
        if call.layout == "varlen":
            k = torch.empty(b * sk, hk, d, dtype=dt, device=dev)
            v = torch.empty(b * sk, hk, dv, dtype=dt, device=dev)
            kw.update(cu_seqlens_k=i32(b + 1), max_seqlen_k=sk)
        elif call.layout == "padded":
            k = torch.empty(b, sk, hk, d, dtype=dt, device=dev)
            v = torch.empty(b, sk, hk, dv, dtype=dt, device=dev)
        else:
            p = call.page_size
            npages = -(-sk // p)
            k = torch.empty(b * npages, p, hk, d, dtype=dt, device=dev)
            v = torch.empty(b * npages, p, hk, dv, dtype=dt, device=dev)
            kw.update(page_table=torch.empty(b, npages, dtype=torch.int32, device=dev))
            kw["max_seqlen_k"] = sk
        if extra:
            _fwd_direct(q, k, v, kw, extra)
        else:
            fa.flash_attn_varlen_func(q, k, v, **kw)


def _fwd_direct(q, k, v, kw: dict, extra: dict) -> None:
    """FA4 4.0.0b36 takes FP8 descales and `tile_mn` only through `interface._flash_attn_fwd`
    (its public flash_attn_func / flash_attn_varlen_func have no such arguments): the same
    call, spelled with that function's keyword names."""
    _, I = _fa4()
    kw = dict(kw)
    wl, wr = kw.pop("window_size", (None, None))
    I._flash_attn_fwd(q, k, v, window_size_left=wl, window_size_right=wr, **kw, **extra)


def trace(call: Call, compiles: list | None = None) -> dict[str, list[tuple[Any, Any]]]:
    """Compile what FA4 compiles for `call`; -> {cache name: [(key, compiled fn)]} of new entries.

    FA4's in-process caches are cleared first, so what lands there is exactly this call's set.
    compiles: a list that receives the (args, kwargs) of every cute.compile FA4 makes.
    """
    if _SOURCE is not None and _SOURCE.abi == "vllm":
        from fa4aot.fa4 import vllm_copy

        return vllm_copy.trace(_fa4()[1], call, compiles)
    if _SOURCE is not None and _SOURCE.abi == "sglang":
        from fa4aot.fa4 import sglang_copy

        return sglang_copy.trace(_fa4()[1], call, compiles)
    return trace_caches(_caches(), lambda: fake_call(call), compiles)


def runtime_library_dirs() -> list[str]:
    """Directories of libcute_dsl_runtime.so and libtvm_ffi.so, for linking."""
    import tvm_ffi


    return [
        str(Path(runtime_lib.find_runtime_lib()).parent),
        str(Path(tvm_ffi.__file__).parent / "lib"),
    ]


def jit_flash_attn_func(*args, **kwargs):
    """FA4's own JIT path (FA4AOT_ON_MISS=jit). Imports the compiler: seconds, first time."""
    fa, _ = _fa4()
    return fa.flash_attn_func(*args, **kwargs)


def jit_flash_attn_varlen_func(*args, **kwargs):
    fa, _ = _fa4()
    return fa.flash_attn_varlen_func(*args, **kwargs)


def trace_keys(calls: list[Call]) -> list[dict[str, list[str]]]:
    """FA4's compile keys (rendered) for each call, traced under FakeTensorMode with
    cute.compile stubbed: nothing is compiled (about 10 ms a call). For coverage checks."""
    return [
        {n: [key_repr(k) for k in keys] for n, keys in got.items()} for got in trace_raw_keys(calls)
    ]


def trace_raw_keys(calls: list[Call]) -> list[dict[str, list[Any]]]:
    """As trace_keys, with FA4's key tuples themselves (for variant_from_fa4_key)."""
    import cutlass.cute as cute

    class _Stub:
        def __call__(self, *a, **k):
            return None

    real = cute.compile
    cute.compile = lambda *a, **k: _Stub()
    try:
        out = []
        for c in calls:
            got = trace(c)
            out.append({n: [k for k, _ in entries] for n, entries in got.items()})
        return out
    finally:
        cute.compile = real
        for c in _caches().values():
            c.clear()


# -- absorbed MLA (qv) on Blackwell: fa4aot/build/mla.py -------------------------------------------------


def fake_mla_call(call) -> None:
    """FA4's varlen entry for an absorbed-MLA call (mla.MlaCall) under FakeTensorMode."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    fa, _ = _fa4()
    dt = getattr(torch, call.dtype)
    b, sq, sk, h = call.batch, call.seqlen_q, call.seqlen_k, call.num_heads
    d, dv = call.head_dim, call.head_dim_v
    with FakeTensorMode():
        dev = "cuda"

        def i32(n):
            return torch.empty(n, dtype=torch.int32, device=dev)

        q = torch.empty(b * sq, h, d, dtype=dt, device=dev)
        qv = torch.empty(b * sq, h, dv, dtype=dt, device=dev)
        kw: dict[str, Any] = dict(
            qv=qv, causal=call.causal, return_lse=call.return_lse,
            cu_seqlens_q=i32(b + 1), max_seqlen_q=sq,
        )
        if call.layout == "varlen":
            k = torch.empty(b * sk, 1, d, dtype=dt, device=dev)
            v = torch.empty(b * sk, 1, dv, dtype=dt, device=dev)
            kw.update(cu_seqlens_k=i32(b + 1), max_seqlen_k=sk)
        else:
            p = call.page_size
            npages = -(-sk // p)
            k = torch.empty(b * npages, p, 1, d, dtype=dt, device=dev)
            v = torch.empty(b * npages, p, 1, dv, dtype=dt, device=dev)
            kw.update(
                page_table=torch.empty(b, npages, dtype=torch.int32, device=dev),
                seqused_k=i32(b), max_seqlen_k=sk,
            )
        fa.flash_attn_varlen_func(q, k, v, **kw)


def trace_mla(calls, compile: bool = False, outdir: Path | None = None) -> list[tuple]:
    """(call, [rendered forward keys], FA4's refusal or None) per MLA call (mla.MlaCall),
    compile stubbed unless `compile`; with
    `compile` and `outdir`, each call's forward kernel is exported to outdir/<i>/fwd.o and its
    cubin target checked (as compile_variant does)."""
    import cutlass.cute as cute

    class _Stub:
        def __call__(self, *a, **k):
            return None

    real = cute.compile
    if not compile:
        cute.compile = lambda *a, **k: _Stub()
    try:
        out = []
        for i, c in enumerate(calls):
            caches = _caches()
            for cc in caches.values():
                cc.clear()
            try:
                fake_mla_call(c)
            except (AssertionError, ValueError, NotImplementedError) as e:
                # FA4 refuses the call itself (e.g. the 2CTA kernel's head ratio must divide
                # 128): a fact about the call, reported with the call, not a failed trace

                where = traceback.extract_tb(e.__traceback__)[-1]
                out.append((c, [], f"{type(e).__name__} {e} at {Path(where.filename).name}:"
                                   f"{where.lineno}: {where.line}"))
                continue
            fwd = list(caches["fwd"].cache.items())
            if compile and outdir is not None:
                for key, fn in fwd:
                    d = Path(outdir) / str(i)
                    d.mkdir(parents=True, exist_ok=True)
                    fn.export_to_c(object_file_path=str(d / "fwd.o"), function_name="fa4aot_fwd")
                    problem = cubin.target_problem(d / "fwd.o", C.cubin_target(_CONFIGURED[0]))
                    if problem:
                        raise RuntimeError(problem)
            out.append((c, [key_repr(k) for k, _ in fwd], None))
        return out
    finally:
        cute.compile = real
        for cc in _caches().values():
            cc.clear()
