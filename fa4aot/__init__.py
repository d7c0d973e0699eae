"""fa4aot: ahead-of-time compiled FlashAttention-4 kernels, served without a compiler.

    import fa4aot
    out, lse = fa4aot.flash_attn_func(q, k, v, causal=True)

Importing fa4aot costs milliseconds: the runtime (torch, tvm-ffi) loads on first use, and
`cutlass` / `flash_attn` are never imported on the serving path.
"""

import importlib

from fa4aot.errors import (
    ArtifactMissing,
    BuildError,
    ContractViolation,
    CorruptArtifact,
    Fa4aotError,
    FingerprintMismatch,
    MergeConflict,
    RuntimeLibraryMismatch,
    RuntimeLibraryMissing,
    SettingError,
    SpecError,
    UnsafeArchive,
    UnsupportedVariant,
)

__version__ = "0.1.0"

_LAZY = {
    "flash_attn_func": "runtime",
    "flash_attn_varlen_func": "runtime",
    "Runtime": "runtime",
    "reset": "runtime",
    "supported_block_sizes": "policy.blocks",
    "preferred_block_size": "policy.blocks",
    "install": "fa4.dropin",
    "uninstall": "fa4.dropin",
}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'fa4aot' has no attribute {name!r}")

    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "ArtifactMissing",
    "BuildError",
    "ContractViolation",
    "CorruptArtifact",
    "Fa4aotError",
    "FingerprintMismatch",
    "MergeConflict",
    "RuntimeLibraryMismatch",
    "RuntimeLibraryMissing",
    "SettingError",
    "SpecError",
    "UnsafeArchive",
    "UnsupportedVariant",
    *_LAZY,
]
