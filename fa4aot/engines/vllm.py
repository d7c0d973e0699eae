"""vLLM 0.33 plugin: serves vLLM's FA4 forward calls from the fa4aot store.

What it wraps, and why that name: every FA4 attention call of vLLM 0.33 goes through
`vllm.vllm_flash_attn.flash_attn_interface.flash_attn_varlen_func(..., fa_version=4)`, which
imports `_flash_attn_fwd` from `vllm.vllm_flash_attn.cute.interface` inside the call
(flash_attn_interface.py:454, call at :464). The backends bind `flash_attn_varlen_func` by
value when they are imported (v1/attention/backends/flash_attn.py:47-53 from fa_utils.py:24;
used by `FA4DenseAttentionKernel.kernel` :114 for the paged call at :1404, and by
`_forward_with_dcp` :1491; the MLA backends likewise), but that function looks the FA4 entry up
afresh on each call. So the module attribute `vllm.vllm_flash_attn.cute.interface.
_flash_attn_fwd` is the one binding every FA4 call resolves at call time: it is what this plugin
replaces. FA4's own wrappers in that module (`flash_attn_varlen_func`, the autograd functions)
call it through the same global.

Loading: the entry point `register` (group `vllm.general_plugins`) runs in every vLLM process
(vllm/plugins/__init__.py `load_general_plugins`, called from the engine core, the workers
(v1/worker/worker_base.py:289) and the argument parser). It patches the FA4 module when it is
first imported, so a process that never runs FA4 never imports the CuTe DSL because of us.
`FA4AOT_ENGINE_PLUGIN=0` (or vLLM's `VLLM_PLUGINS` allowlist without `fa4aot`) leaves vLLM as is.

Served: dense, varlen and paged calls with bf16/fp16 (and whatever FP8 the runtime serves),
causal/window, learnable sinks, softcap, `out=`/`lse=` buffers and return_lse, as
`fa4aot.flash_attn_varlen_func` / `fa4aot.flash_attn_func`. `num_splits` is a scheduling
hint: fa4aot serves the call with its own split choice (counted in `counters.overridden`).
Handed back to vLLM's `_flash_attn_fwd` with the arguments it was given: mask_mod, score_mod,
aux tensors/scalars, block sparsity, dynamic_causal, gather_kv_*, output_scale, compile_only,
scheduler metadata, tuning overrides (tile_mn, ...), fp8_kv_dequant (until fa4aot's runtime
takes it), q=None, autograd or fake tensors, unknown arguments, and any call fa4aot's runtime
refuses before launch (ArtifactMissing, UnsupportedVariant, ContractViolation).
"""

from __future__ import annotations

import inspect

from . import _common as C

MODULE = "vllm.vllm_flash_attn.cute.interface"
ATTR = "_flash_attn_fwd"

# vLLM 0.33.0's signature, vllm/vllm_flash_attn/cute/interface.py:648 (tests/engines check it
# against the wheel)
PARAMS: list[tuple[str, object]] = [
    ("q", None), ("k", None), ("v", None), ("qv", None), ("cu_seqlens_q", None),
    ("cu_seqlens_k", None), ("seqused_q", None), ("seqused_k", None), ("max_seqlen_q", None),
    ("max_seqlen_k", None), ("min_seqlen_k", None), ("page_table", None),
    ("softmax_scale", None), ("causal", False), ("dynamic_causal", None), ("softcap", None),
    ("window_size_left", None), ("window_size_right", None), ("learnable_sink", None),
    ("tile_mn", None), ("mma_pv_is_rs", None), ("intra_wg_overlap", None),
    ("num_threads", 384), ("num_splits", 1), ("pack_gqa", None), ("_arch", None),
    ("score_mod", None), ("mask_mod", None), ("block_sparse_tensors", None),
    ("return_lse", False), ("out", None), ("lse", None), ("aux_tensors", None),
    ("aux_tensor_leading_dims", None), ("aux_scalars", None), ("q_descale", None),
    ("k_descale", None), ("v_descale", None), ("gather_kv_indices", None),
    ("gather_kv_valid_length", None), ("output_scale", None), ("compile_only", False),
    ("fp8_kv_dequant", False), ("scheduler_metadata", None), ("seqlen_k_per_split", None),
    ("disable_scheduler_metadata", False),
]

# arguments whose non-default value fa4aot does not serve exactly: the call goes back to vLLM
HAND_BACK = (
    "min_seqlen_k", "dynamic_causal", "tile_mn", "mma_pv_is_rs", "intra_wg_overlap",
    "num_threads", "_arch", "score_mod", "mask_mod", "block_sparse_tensors", "aux_tensors",
    "aux_tensor_leading_dims", "aux_scalars", "gather_kv_indices", "gather_kv_valid_length",
    "output_scale", "compile_only", "scheduler_metadata", "seqlen_k_per_split",
    "disable_scheduler_metadata",
)

plugin = C.Plugin("vllm", f"{MODULE}.{ATTR}")
counters = plugin.counters


def _convert(a: dict):
    """vLLM's `_flash_attn_fwd` arguments -> (fa4aot function, kwargs) or a hand-back reason."""
    import fa4aot

    q, k, v = a["q"], a["k"], a["v"]
    if q is None or k is None:
        return "q or k is None"
    why = C.grad_or_fake(q, k, v, a["qv"], a["learnable_sink"])
    if why:
        return why
    win = C.window(a["window_size_left"], a["window_size_right"])
    if isinstance(win, str):
        return win
    kw = dict(
        q=q, k=k, v=v, softmax_scale=a["softmax_scale"], causal=a["causal"], window_size=win,
        learnable_sink=a["learnable_sink"], return_lse=a["return_lse"], out=a["out"],
        lse=a["lse"], softcap=a["softcap"] or 0.0, pack_gqa=a["pack_gqa"],
    )
    for n in ("q_descale", "k_descale", "v_descale", "qv"):
        if a[n] is not None:
            kw[n] = a[n]
    if a["fp8_kv_dequant"]:
        if not _takes("fp8_kv_dequant"):
            return "fp8_kv_dequant"
        kw["fp8_kv_dequant"] = True
    layout = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "page_table")
    if all(a[n] is None for n in layout):
        fn = fa4aot.flash_attn_func
    else:
        fn = fa4aot.flash_attn_varlen_func
        kw.update({n: a[n] for n in layout}, max_seqlen_q=a["max_seqlen_q"],
                  max_seqlen_k=a["max_seqlen_k"])
    if a["num_splits"] not in (0, 1):
        counters.overridden["num_splits"] += 1
    return fn, kw


def _takes(name: str) -> bool:
    import fa4aot

    return name in inspect.signature(fa4aot.flash_attn_varlen_func).parameters


def _result(out, lse):
    # vLLM's `_flash_attn_fwd` returns (out, lse, p, row_max); p and row_max exist only on
    # the gather_kv path, which is handed back
    return out, lse, None, None


def _build():
    return C.make_wrapper(plugin, PARAMS, HAND_BACK, _convert, _result)


def _patch(mod) -> None:
    C.patch(plugin, mod, ATTR, _build)


def install() -> C.Counters:
    """Wrap vLLM's FA4 entry now, or when `vllm.vllm_flash_attn.cute.interface` is first
    imported. Idempotent. Returns the counters (also `fa4aot.engines.vllm.counters`)."""
    C.apply_when_imported(MODULE, _patch)
    return counters


def uninstall() -> None:
    C.unpatch(plugin, MODULE, ATTR)


def register() -> None:
    """The `vllm.general_plugins` entry point: install() unless FA4AOT_ENGINE_PLUGIN=0."""
    if C.disabled():
        C.log.info("fa4aot: vLLM plugin off (%s=0)", C.ENV_DISABLE)
        return
    install()
