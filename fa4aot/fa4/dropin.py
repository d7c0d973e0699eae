"""`fa4aot.install()`: give code that calls `flash_attn.cute` directly (custom engines, research
code) the store's kernels, with no code change beyond this call (or an env variable). vLLM and
SGLang call their own vendored copies of FA4, which this does not patch: docs/integrations.md
routes them to `flash_attn_varlen_func` instead.

    import fa4aot
    fa4aot.install(on_miss="error")      # from here on flash_attn.cute compiles nothing
    out, lse = flash_attn.cute.flash_attn_varlen_func(...)

FA4's own interface keeps running (argument checks, helper kernels, scheduling); what changes
is where its compiled functions come from: FA4's in-process compile caches are replaced by
store-backed ones keyed by FA4's own compile key, and `cute.compile` is wrapped by a monitor.
A miss follows `on_miss`: "error" raises ArtifactMissing before any compile starts (and any
compile on any other FA4 path raises CompileAttempt), "warn" logs and lets FA4 compile,
"jit" lets FA4 compile quietly. Misses go to the miss log (FA4AOT_MISS_LOG) either way.

This module imports flash_attn on install (fa4aot.fa4 is the one package allowed to): it is the
drop-in path, not the compiler-free one (`fa4aot.flash_attn_func`).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from fa4aot import settings
from fa4aot.errors import ArtifactMissing
from fa4aot.fa4.export import SHIPPED_HELPERS
from fa4aot.fa4.keys import _combine_fields, _record_softcaps, key_repr, variant_from_fa4_key
from fa4aot.settings import ON_MISS
from fa4aot.store import runtime_lib
from fa4aot.store.layers import default_roots, find_serving_store
from fa4aot.store.misses import record_miss
from fa4aot.store.toolchain import read_toolchain, runtime_expectation


def install(
    cache=None, on_miss: str = "error", *, arch: str | None = None, num_sms: int | None = None
):
    """Serve flash_attn.cute's kernels from the store. Returns counters (hits, compiles, misses).

    arch/num_sms default to GPU 0's; pass them to install on a machine with no GPU (tests)."""
    if on_miss not in ON_MISS:
        raise ValueError(f"on_miss must be one of {ON_MISS}, got {on_miss!r}")
    if cache is None:
        roots = default_roots()
    elif isinstance(cache, (str, Path)):
        roots = [Path(p) for p in str(cache).split(os.pathsep) if p]
    else:
        roots = [Path(c) for c in cache]
    return _install(roots, on_miss, arch, num_sms)


def uninstall() -> bool:
    """Restore FA4's own compile caches and cute.compile. False if nothing was installed."""
    return _uninstall()




class CompileAttempt(RuntimeError):
    """Raised by the compile monitor when FA4 tries to compile after install(on_miss="error")."""


class _Counters:
    def __init__(self):
        self.hits = 0
        self.compiles = 0
        self.misses: list[str] = []


class _StoreCache:
    """Stands in for one of FA4's JITCache objects: a key FA4 asks for is looked up (by its
    rendering, `key_repr`) among the store's records and loaded with tvm-ffi; FA4 then calls
    the loaded function with exactly the arguments it would pass its own compiled one."""

    def __init__(self, name: str, state: "_Installed"):
        self.name, self.state = name, state
        self.cache: dict = {}

    def __contains__(self, key) -> bool:
        pending = self.state.pending_helper
        if self.name in ("fwd", "tile_cumsum"):  # a forward call's first and last lookups
            self.state.pending_helper = None
        refuse = self.name == "fwd" and pending
        cached = self.cache.get(key)
        if cached is not None and cached is not _refused_helper and not refuse:
            return True
        hit = self.state.index.get((self.name, key_repr(key)))
        if hit is None and self.name == "combine":
            hit = self.state.combine_for(key)
        if hit is not None and not refuse:
            self.cache[key] = self.state.load(hit)
            self.state.counters.hits += 1
            return True
        if self.name in SHIPPED_HELPERS and self.state.on_miss == "error":
            # FA4 runs its batch > 256 helpers before it looks up the forward kernel: raising
            # here logged nothing (a helper key does not name a variant), so --from-misses
            # could not build what was missing (issue 13). A helper is shipped with every
            # forward that needs it, so its miss means the forward misses too: let FA4 go on
            # to the forward's key with a no-op helper, and refuse there, logging the variant.
            # The forward is refused even if found, so the no-op's output is never read.
            self.state.counters.misses.append(f"{self.name}: {key_repr(key)}")
            self.state.pending_helper = self.state.pending_helper or f"{self.name} {key_repr(key)}"
            self.cache[key] = _refused_helper
            return True
        self.state.miss(self.name, key, pending)
        return False

    def __getitem__(self, key):
        return self.cache[key]

    def __setitem__(self, key, fn) -> None:  # FA4 compiled it (on_miss warn/jit)
        self.cache[key] = fn

    def clear(self) -> None:
        self.cache.clear()


def _refused_helper(*args, **kwargs) -> None:
    """Stands in for a missing helper kernel until the forward lookup refuses the call."""


_CACHE_OWNERS = {  # FA4 function whose .compile_cache fa4aot serves -> record part name
    "_flash_attn_fwd": "fwd",
    "_compute_tile_cumsum": "tile_cumsum",
    "_compute_blocks_to_batch": "blocks_to_batch",
    "_flash_attn_fwd_combine": "combine",
}


class _Installed:
    def __init__(self, roots, on_miss, counters, arch=None, num_sms=None):
        self.on_miss = on_miss
        self.counters = counters
        self.pending_helper: str | None = None  # a helper missed; the forward must refuse
        self.index: dict = {}
        self.combines: dict = {}  # combine_for's: (key less heads and splits) -> [(log, hit)]
        self.loaded: dict = {}

        if arch is None:
            arch, num_sms = _device_arch()
        self.arch = arch
        sms = num_sms
        for store in find_serving_store(roots, runtime_expectation(arch, sms, compiler=True)):
            for _, art in store.iter_artifacts():
                if isinstance(art, Exception) or art.record.get("stub"):
                    continue
                for part, p in art.record["parts"].items():
                    self.index.setdefault((part, p["key"]), (art, part))
                    if part == "combine":
                        f = _combine_fields(p["key"])
                        if f is not None:
                            self.combines.setdefault(f[0], []).append((f[1], (art, part)))
        for found in self.combines.values():
            found.sort(key=lambda e: e[0])

    def combine_for(self, key):
        """A stored combine that serves FA4's combine `key` though its key differs (None: none).
        FA4 keys its combine (interface.py 4480-4495) by the call's head count and
        log_max_splits = max(ceil(log2 num_splits), 4 or 5), so a `num_splits` call whose count
        or head count differs from the stored split kernel's representative call (128 splits)
        would miss. Neither changes what the compiled kernel computes for a call in batch form
        (flash_fwd_combine.py, FA4 4.0.0b36): the head count is read from the partials' shape
        (289, 430), the constructor's `num_head` reaches only the varlen scheduler (318, packed
        q or seqused: then FA4 takes its scheduler metadata, which fa4aot refuses), and
        max_splits sizes the LSE tile in shared memory, whose loads past the call's count are
        -inf (450-470). So a combine of the same dtypes, head dim, tiles and optional tensors
        with at least the asked log_max_splits serves it (the smallest such). fa4aot's runtime
        calls its one stored combine the same way for every count. Its sums may differ from the
        combine FA4 would compile for that count in the last bit (the reduction spans more,
        -inf, entries)."""
        f = _combine_fields(key_repr(key))
        if f is None:
            return None
        for log, hit in self.combines.get(f[0], ()):
            if log >= f[1]:
                return hit
        return None

    def load(self, hit):
        art, part = hit
        k = (art.id, part)
        if k not in self.loaded:
            import tvm_ffi


            art.check_loadable(settings.allow_unsafe_dirs())  # before dlopen

            runtime_lib.check_matches(read_toolchain(art.dir.parent.parent).get("runtime_lib"))
            runtime_lib.load_runtime_lib()
            self.loaded[k] = tvm_ffi.load_module(str(art.part_path(part)))[f"fa4aot_{part}"]
        return self.loaded[k]

    def miss(self, name, key, pending_helper: str | None = None):
        rendered = key_repr(key)
        self.counters.misses.append(f"{name}: {rendered}")
        if pending_helper:
            rendered += f", and its helper kernel ({pending_helper})"
        if name == "fwd":
            v = variant_from_fa4_key(key, self.arch)
            if v is not None:
                record_miss(v)
        if self.on_miss == "error":
            raise ArtifactMissing(
                f"fa4aot.install(on_miss='error'): FA4 needs a {name} kernel the store does not hold "
                f"(FA4 compile key {rendered}); nothing was compiled. Check coverage with: fa4aot "
                f"coverage --spec <your spec>; record misses with FA4AOT_MISS_LOG and rebuild"
            )
        if self.on_miss == "warn":
            logging.getLogger("fa4aot").warning(
                "fa4aot: %s miss, FA4 compiles it: %s", name, rendered
            )


def _device_arch() -> tuple[str, int]:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}", torch.cuda.get_device_properties(0).multi_processor_count


class _CompileMonitor:
    """Wraps cute.compile: counts every compile the served FA4 package starts after install, and
    with on_miss="error" refuses it, whatever FA4 code path asked (combine, scheduler metadata,
    bwd...). A compile no frame of that package asked for (an engine's own CuTe-DSL kernels)
    passes through untouched: cute.compile is process-wide, the refusal is FA4's alone."""

    def __init__(self, inner, state, package: str):
        self.inner, self.state, self.package = inner, state, package

    def _from_fa4(self) -> bool:
        f = sys._getframe(2)
        while f is not None:
            name = f.f_globals.get("__name__", "")
            if name == self.package or name.startswith(self.package + "."):
                return True
            f = f.f_back
        return False

    def _check(self):
        if not self._from_fa4():
            return
        self.state.counters.compiles += 1
        if self.state.on_miss == "error":
            raise CompileAttempt(
                f"fa4aot.install(on_miss='error'): {self.package} tried to compile a kernel; "
                "a serving process must not compile. Build it ahead of time (fa4aot build)."
            )

    def __call__(self, *args, **kwargs):
        self._check()
        return self.inner(*args, **kwargs)

    def __getitem__(self, opts):
        inner = self.inner[opts]
        mon = self

        class _Opt:
            def __call__(self, *args, **kwargs):
                mon._check()
                return inner(*args, **kwargs)

        return _Opt()

    def __getattr__(self, name):
        return getattr(self.inner, name)


_INSTALL: dict | None = None


def _install(roots, on_miss: str, arch: str | None = None, num_sms: int | None = None) -> _Counters:
    """Serve flash_attn.cute's compile caches from the store and monitor compiles.

    arch/num_sms: the GPU to serve (default: device 0). Given explicitly (with
    `configure(arch, num_sms)` first) install works with no GPU, e.g. under FakeTensorMode."""
    global _INSTALL
    if _INSTALL is not None:
        _uninstall()
    import cutlass.cute as cute
    from flash_attn.cute import interface as I

    _record_softcaps()  # so that a softcap miss names its variant in the miss log
    counters = _Counters()
    state = _Installed(roots, on_miss, counters, arch, num_sms)
    saved = {"compile": cute.compile, "caches": {}}
    for fn_name, part in _CACHE_OWNERS.items():
        fn = getattr(I, fn_name)
        saved["caches"][fn_name] = fn.compile_cache
        fn.compile_cache = _StoreCache(part, state)
    cute.compile = _CompileMonitor(saved["compile"], state, I.__name__.rpartition(".")[0])
    _INSTALL = {"saved": saved, "state": state}
    return counters


def _uninstall() -> bool:
    global _INSTALL
    if _INSTALL is None:
        return False
    import cutlass.cute as cute
    from flash_attn.cute import interface as I

    saved = _INSTALL["saved"]
    cute.compile = saved["compile"]
    for fn_name, cache in saved["caches"].items():
        getattr(I, fn_name).compile_cache = cache
    _INSTALL = None
    return True


