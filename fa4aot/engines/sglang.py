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
(sfq/sfk/sfv), rel_bias, deterministic mode and score/mask mods go back. So does a call the copy
would split on sm90 (SGLang passes num_splits=0: the copy's heuristic, `copy_splits`): fa4aot
builds no split kernels from SGLang's copy and would run it unsplit, many times slower on a long
context.
"""

from __future__ import annotations

import functools

from . import _common as C
from ..model.constraints import fwd_tile

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


SPLIT_HANDBACK = "the copy splits this step (no split kernels are built from SGLang's copy)"


def copy_splits(a: dict, num_sms: int) -> int:
    """The split count SGLang 0.5.23's copy runs a call at on sm90 (interface.py:474-503 for the
    shapes, :794-891 for the tile, the keys' bound and num_splits_heuristic(_sm90_decode)): a
    paged K's bound is its whole pool unless max_seqlen_k is given, as the copy reads it."""
    n = a["num_splits"]
    if n == 1 or a["qv"] is not None:
        return 1
    q, v, cu_q = a["q"], a["v"], a["cu_seqlens_q"]
    hq, d = q.shape[-2:]
    hk, dv = v.shape[-2:]
    if cu_q is None:
        b, sq = q.shape[:2]
        msq = sq if a["max_seqlen_q"] is None else a["max_seqlen_q"]
    else:
        b = cu_q.shape[0] - 1
        msq = q.shape[0] if a["max_seqlen_q"] is None else a["max_seqlen_q"]
    msk = a["max_seqlen_k"]
    if msk is None:
        msk = v.shape[0] * v.shape[1] if a["page_table"] is not None else v.shape[-3]
    causal = bool(a["causal"])
    wl, wr = a["window_size"]  # (a pair: _convert hands back any other first)
    # interface.py _resolve_causal_local_window
    if causal:
        wr = 0
    if wl is not None and wr is not None and wl + wr < 0:
        wl = wr = None
    local = False
    if wl is not None or wr is not None:
        causal, local = (True, False) if wl is None and wr == 0 else (False, True)
    if n > 1:
        return n
    tile = fwd_tile("sm90", d, dv, causal, local)
    total = b * hk * -(-(msq * (hq // hk)) // tile.m)
    keys = msk
    if local:
        keys = max(0, min(msk, (msk if wr is None else wr) + (msk if wl is None else wl) + 1
                          + tile.m))
    blocks = -(-keys // tile.n)
    if msq == 1 and blocks <= 32 and total * 4 >= num_sms:
        return 1
    if blocks <= 4 or total == 0:
        return 1
    return max(1, min(num_sms // total, 128, blocks))


@functools.cache
def _sm90_sms(device) -> int:
    """The device's SM count where it is an sm90 GPU, else 0 (the split check does not apply)."""
    import torch

    if device.type != "cuda":
        return 0
    p = torch.cuda.get_device_properties(device)
    return p.multi_processor_count if p.major == 9 else 0


def _convert(a: dict):
    """The FA4 copy's `flash_attn_varlen_func` arguments -> (fa4aot function, kwargs) or a
    hand-back reason."""
    why = C.precheck(a)
    if why:
        return why
    sink = a["learnable_sink"]
    if sink is not None and str(sink.dtype) != "torch.bfloat16":
        return f"learnable_sink dtype {str(sink.dtype).replace('torch.', '')} (SGLang: bf16)"
    try:
        left, right = a["window_size"]
    except (TypeError, ValueError):
        return "window_size not a pair"
    win = C.window(left, right)
    if isinstance(win, str):
        return win
    sms = _sm90_sms(a["q"].device)
    if sms and copy_splits(a, sms) > 1:
        return SPLIT_HANDBACK
    return C.to_fa4aot(plugin, a, win)


def _result(out, lse):
    # the FA4 copy's flash_attn_varlen_func returns (out, lse), lse None without return_lse
    return out, lse


engine = C.Engine("sglang", "SGLang", MODULE, ATTR, PARAMS, HAND_BACK, _convert, _result)
plugin = engine.plugin
counters = plugin.counters
# install(): wrap SGLang's FA4 entry now, or when flash_attention_v4 is first imported
# (idempotent; returns the counters); register: the `sglang.srt.plugins` entry point
install, uninstall, register = engine.install, engine.uninstall, engine.register
