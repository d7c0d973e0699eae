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
vLLM's start-up warm-up (`compile_only=True`, through `compile_flash_attn_varlen_func_from_specs`
with shape-only tensor specs, flash_attn.py:222) is answered from the store: the kernel the
matching call runs is loaded (with its split twin for num_splits > 1), nothing is launched, and
vLLM gets the (out, lse, None, None) it expects (runtime/vllm_abi.warm); a warm-up the store
cannot serve goes back, and vLLM compiles as it would. The combine warm-up that follows a
split one (`_flash_attn_fwd_combine` on fake tensors, flash_attn.py:254) is answered when the
split twin just loaded holds that exact combine, and handed back otherwise (`_combine_wrapper`;
vLLM 0.33 warms a 1-query-head combine, which no twin holds for a model with more than one
query head per rank: docs/integrations.md).
Handed back to vLLM's `_flash_attn_fwd` with the arguments it was given: mask_mod, score_mod,
aux tensors/scalars, block sparsity, dynamic_causal, gather_kv_*, output_scale, scheduler
metadata, tuning overrides (tile_mn, ...), fp8_kv_dequant where fa4aot's runtime lacks it,
q=None, autograd or fake tensors, unknown arguments, and any call fa4aot's runtime refuses
before launch (ArtifactMissing, UnsupportedVariant, ContractViolation).
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
    "output_scale", "scheduler_metadata", "seqlen_k_per_split", "disable_scheduler_metadata",
)


def _convert(a: dict):
    """vLLM's `_flash_attn_fwd` arguments -> (fa4aot function, kwargs) or a hand-back reason."""
    why = C.precheck(a)
    if why:
        return why
    win = C.window(a["window_size_left"], a["window_size_right"])
    if isinstance(win, str):
        return win
    extra = {"lse": a["lse"]}
    if a["fp8_kv_dequant"]:
        if not _takes("fp8_kv_dequant"):
            return "fp8_kv_dequant"
        extra["fp8_kv_dequant"] = True
    fn, kw = C.to_fa4aot(plugin, a, win, **extra)
    if a["compile_only"]:
        if fn.__name__ != "flash_attn_varlen_func":
            return "compile_only without a varlen or paged layout"
        return compile_only, {**kw, "num_splits": a["num_splits"]}
    return fn, kw


def compile_only(**kw):
    """vLLM's compile-only call, answered from the store: runtime/vllm_abi.warm (loads what the
    matching call runs, launches nothing) -> (out, lse) as vLLM passed them."""
    from fa4aot.runtime import default_runtime, vllm_abi

    return vllm_abi.warm(default_runtime(), **kw)


def _takes(name: str) -> bool:
    import fa4aot

    return name in inspect.signature(fa4aot.flash_attn_varlen_func).parameters


def _result(out, lse):
    # vLLM's `_flash_attn_fwd` returns (out, lse, p, row_max); p and row_max exist only on
    # the gather_kv path, which is handed back (a compile-only call: the specs it was given)
    return out, lse, None, None


# vLLM 0.33.0's combine signature, interface.py:4151
COMBINE = "_flash_attn_fwd_combine"
COMBINE_PARAMS = ("out_partial", "lse_partial", "out", "lse", "cu_seqlens", "seqused",
                  "num_splits_dynamic_ptr", "virtual_batch_idx", "semaphore_to_reset",
                  "output_scale")


def _combine_wrapper():
    """The copy's `_flash_attn_fwd_combine`, answering vLLM's combine warm-up from the store.

    The warm-up is the only caller that passes fake tensors (FA4DenseAttentionKernel.compile,
    flash_attn.py:254, under FakeTensorMode after each split compile-only call): answered when
    a split twin `warm` loaded holds that exact combine, handed back (vLLM compiles) otherwise
    or with any argument the stored combines were not compiled with. Real tensors come from the
    copy's own split forward (a call fa4aot handed back) and pass through uncounted."""
    from fa4aot.runtime import default_runtime, vllm_abi

    p = combine_plugin

    def wrapper(*args, **kwargs):
        a = dict(zip(COMBINE_PARAMS, args), **kwargs)
        if len(args) > len(COMBINE_PARAMS) or type(a.get("out_partial")).__name__ != "FakeTensor":
            return p.original(*args, **kwargs)
        extra = [n for n, v in a.items() if n not in COMBINE_PARAMS[:3] + ("cu_seqlens",)
                 and v is not None]
        call = C.describe(a.get("out_partial"), a.get("lse_partial"), a.get("out"))
        if extra:
            return p.handback(f"combine warm-up with {', '.join(sorted(extra))}", call, args,
                              kwargs)
        try:
            vllm_abi.warm_combine(default_runtime(), a["out_partial"], a["lse_partial"],
                                  a["out"], varlen=a.get("cu_seqlens") is not None)
        except C.MISS_ERRORS as e:
            return p.miss(e, None, call, args, kwargs)
        p.counters.hits += 1
        return None

    return wrapper


engine = C.Engine("vllm", "vLLM", MODULE, ATTR, PARAMS, HAND_BACK, _convert, _result)
plugin = engine.plugin
counters = plugin.counters
# the combine warm-up's own counts (hits: answered from the store; misses: vLLM compiled it)
combine_plugin = C.Plugin("vllm", f"{MODULE}.{COMBINE}")
combine_counters = combine_plugin.counters


def _patch_combine(mod) -> None:
    C.patch(combine_plugin, mod, COMBINE, _combine_wrapper)


def install() -> C.Counters:
    """Wrap vLLM's FA4 entry and its combine now, or when vllm.vllm_flash_attn.cute.interface
    is first imported (idempotent); returns the forward's counters."""
    engine.install()
    C.apply_when_imported(MODULE, _patch_combine)
    return counters


def uninstall() -> None:
    engine.uninstall()
    C.unpatch(combine_plugin, MODULE, COMBINE)


def register() -> None:
    """The `vllm.general_plugins` entry point: install() unless FA4AOT_ENGINE_PLUGIN=0."""
    if C.disabled():
        C.log.info("fa4aot: vLLM plugin off (%s=0)", C.ENV_DISABLE)
        return
    install()
