"""SGLang 0.5.23 plugin: serves SGLang's FA4 forward calls from the fa4aot store.

What it wraps, and why that name: SGLang's FA4 calls go through
`sglang.kernels.ops.attention.flash_attention_v4`: the module-level dispatcher
(kernels/ops/attention/flash_attention.py, `flash_attn_with_kvcache` :9 (ver=4 branch :181) and
`flash_attn_varlen_func` :228 (ver=4 branch :296)) imports that module's two functions at call time;
the FlashAttention backend binds them when it is built (srt/layers/attention/
flashattention_backend.py:302); vision.py:64 and models/kimi_k3_vl.py:71 import them at call
time. Both functions end in one call, `_flash_attn_varlen_func(...)` (flash_attention_v4.py:282;
`flash_attn_with_kvcache` calls the module's `flash_attn_varlen_func`, :376), a module global
bound at import to the FA4 copy's `flash_attn.cute.flash_attn_varlen_func` and looked up on
each call. Wrapping that global catches every route above, after SGLang's own argument handling
(contiguity, MLA head padding, `sinks` -> `learnable_sink`, `(-1, -1)` -> no window).

Loading: the entry point `register` (group `sglang.srt.plugins`) runs in every process that
calls `sglang.srt.plugins.load_plugins()`, the scheduler (which runs the model,
srt/managers/scheduler.py:6323) included. It patches when flash_attention_v4 is first imported.
`FA4AOT_ENGINE_PLUGIN=0`, or `SGLANG_PLUGINS` naming other plugins only, leaves SGLang as is.
Elsewhere (a script calling SGLang's kernels): `import fa4aot.engines.sglang as p; p.install()`.

Served and handed back as in fa4aot.engines.vllm; SGLang's copy takes bfloat16 sinks only, so
a sink of another dtype goes back (SGLang raises its own error), and MXFP8 scale factors
(sfq/sfk/sfv), rel_bias, deterministic mode and score/mask mods go back.
"""

from __future__ import annotations

from . import _common as C

MODULE = "sglang.kernels.ops.attention.flash_attention_v4"
ATTR = "_flash_attn_varlen_func"

# SGLang 0.5.23's FA4 copy, sglang/kernels/ops/attention/flash_attn/cute/interface.py:2158
# (tests/engines check it against the wheel)
PARAMS: list[tuple[str, object]] = [
    ("q", None), ("k", None), ("v", None), ("qv", None), ("cu_seqlens_q", None),
    ("cu_seqlens_k", None), ("max_seqlen_q", None), ("max_seqlen_k", None),
    ("min_seqlen_k", None), ("seqused_q", None), ("seqused_k", None),
    ("gather_kv_indices", None), ("page_table", None), ("softmax_scale", None),
    ("causal", False), ("window_size", (None, None)), ("learnable_sink", None),
    ("softcap", 0.0), ("num_splits", 1), ("pack_gqa", None), ("deterministic", False),
    ("score_mod", None), ("score_mod_bwd", None), ("mask_mod", None),
    ("block_sparse_tensors", None), ("aux_tensors", None), ("aux_scalars", None),
    ("q_descale", None), ("k_descale", None), ("v_descale", None), ("rel_bias", None),
    ("sfq", None), ("sfk", None), ("sfv", None), ("qk_sf_vec_size", None),
    ("v_sf_vec_size", None), ("rel_bias_prep_cache", None), ("return_lse", False),
    ("out", None),
]

HAND_BACK = (
    "min_seqlen_k", "gather_kv_indices", "deterministic", "score_mod", "score_mod_bwd",
    "mask_mod", "block_sparse_tensors", "aux_tensors", "aux_scalars", "rel_bias", "sfq", "sfk",
    "sfv", "qk_sf_vec_size", "v_sf_vec_size", "rel_bias_prep_cache",
)

plugin = C.Plugin("sglang", f"{MODULE}.{ATTR}")
counters = plugin.counters


def _convert(a: dict):
    """The FA4 copy's `flash_attn_varlen_func` arguments -> (fa4aot function, kwargs) or a
    hand-back reason."""
    import fa4aot

    q, k, v = a["q"], a["k"], a["v"]
    if q is None or k is None:
        return "q or k is None"
    why = C.grad_or_fake(q, k, v, a["qv"], a["learnable_sink"])
    if why:
        return why
    sink = a["learnable_sink"]
    if sink is not None and str(sink.dtype) != "torch.bfloat16":
        return f"learnable_sink dtype {str(sink.dtype).replace('torch.', '')} (SGLang: bf16)"
    ws = a["window_size"]
    try:
        left, right = ws
    except (TypeError, ValueError):
        return "window_size not a pair"
    win = C.window(left, right)
    if isinstance(win, str):
        return win
    kw = dict(
        q=q, k=k, v=v, softmax_scale=a["softmax_scale"], causal=a["causal"], window_size=win,
        learnable_sink=sink, return_lse=a["return_lse"], out=a["out"],
        softcap=a["softcap"] or 0.0, pack_gqa=a["pack_gqa"],
    )
    for n in ("q_descale", "k_descale", "v_descale", "qv"):
        if a[n] is not None:
            kw[n] = a[n]
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


def _result(out, lse):
    # the FA4 copy's flash_attn_varlen_func returns (out, lse), lse None without return_lse
    return out, lse


def _build():
    return C.make_wrapper(plugin, PARAMS, HAND_BACK, _convert, _result)


def _patch(mod) -> None:
    C.patch(plugin, mod, ATTR, _build)


def install() -> C.Counters:
    """Wrap SGLang's FA4 entry now, or when flash_attention_v4 is first imported. Idempotent.
    Returns the counters (also `fa4aot.engines.sglang.counters`)."""
    C.apply_when_imported(MODULE, _patch)
    return counters


def uninstall() -> None:
    C.unpatch(plugin, MODULE, ATTR)


def register() -> None:
    """The `sglang.srt.plugins` entry point: install() unless FA4AOT_ENGINE_PLUGIN=0."""
    if C.disabled():
        C.log.info("fa4aot: SGLang plugin off (%s=0)", C.ENV_DISABLE)
        return
    install()
