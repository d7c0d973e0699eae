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

This module imports flash_attn (through `compiler`, the one module allowed to): it is the
drop-in path, not the compiler-free one (`fa4aot.flash_attn_func`).
"""

from __future__ import annotations

import os
from pathlib import Path

from .store import default_roots

ON_MISS = ("error", "warn", "jit")


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
    from . import compiler

    return compiler.install(roots, on_miss, arch, num_sms)


def uninstall() -> bool:
    """Restore FA4's own compile caches and cute.compile. False if nothing was installed."""
    from . import compiler

    return compiler.uninstall()
