"""The FA4 kernel ABIs fa4aot models, one per FA4 source family: the fields of FA4's forward
and combine compile keys, by name (each the source text of one element of the `compile_key`
tuple in the source's interface.py), and the positional slots of the compiled sm90 forward and
combine functions.

A source's ABI is recognised from its own interface.py (`detect_abi`: the key fields read with
`ast`, nothing imported); code that reads a key indexes it by field name (`KeyFields`), never by
position, because the copies reorder, add and drop fields. Pure: no FA4 import.
`tests/fa4/test_vllm_abi.py` checks each table against the copy it names, slot by slot.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# -- compile keys (interface.py, `_flash_attn_fwd` / `_flash_attn_fwd_combine`) --------------------

UPSTREAM_FWD_KEY = (
    "mla_1cta", "mla_1cta_kb64", "mla_1cta_s_ahead if mla_1cta else None", "dtype", "head_dim",
    "head_dim_v", "nheads_per_kv", "num_head_kv if qv is not None else None", "causal",
    "score_mod_hash", "mask_mod_hash", "use_block_sparsity", "block_sparse_broadcast_pattern",
    "tensor_broadcast_patterns", "aux_tensor_metadata", "aux_scalar_metadata", "lse is None",
    "cu_seqlens_q is None", "cu_seqlens_k is None", "seqused_q is None", "seqused_k is None",
    "page_table is not None", "window_size_left is not None", "window_size_right is not None",
    "torch2cute_dtype_map[learnable_sink.dtype] if learnable_sink is not None else None",
    "q_descale is not None", "k_descale is not None", "v_descale is not None",
    "block_sparse_tensors is None or block_sparse_tensors.cu_total_m_blocks is None",
    "block_sparse_tensors is None or block_sparse_tensors.cu_block_idx_offsets is None",
    "tile_m", "tile_n", "q_stage", "num_threads", "is_split_kv", "pack_gqa", "arch",
    "paged_kv_tma", "use_2cta_instrs", "q_subtile_factor", "kv_subtile_factor", "mma_pv_is_rs",
    "intra_wg_overlap", "use_clc_scheduler", "use_s_ping_pong", "num_splits_dynamic is not None",
    "mla_fwd_rescale_threshold", "o_lo is not None", "virtual_batch_idx is not None",
    "num_nheads_in_l2 is not None", "tile_count_semaphore is not None",
    "cu_total_m_blocks is not None", "cu_total_splits_m_blocks is not None",
    "blocks_to_batch_idx is not None", "seqlen_k_per_split", "is_static_persistent",
    "q is not None", "qv is not None", "p is not None", "row_max is not None", "gather_kv_length",
    "sparse_kv", "disable_sparse_kv_bitmask", "fa_logging.get_fa_log_level()",
)  # fmt: skip

# vLLM 0.33.0 (vllm/vllm_flash_attn/cute/interface.py 1421-1500): no MLA-1CTA fields; the paged
# field inverted ("not TMA"); fp8_kv_dequant, the Q/O torch dtypes and the output quant key added
VLLM_FWD_KEY = (
    "dtype", "head_dim", "head_dim_v", "qhead_per_kvhead", "causal", "score_mod_hash",
    "mask_mod_hash", "use_block_sparsity", "block_sparse_broadcast_pattern",
    "tensor_broadcast_patterns", "aux_tensor_metadata", "aux_scalar_metadata", "lse is None",
    "cu_seqlens_q is None", "cu_seqlens_k is None", "seqused_q is None", "seqused_k is None",
    "page_table is not None", "window_size_left is not None", "window_size_right is not None",
    "torch2cute_dtype_map[learnable_sink.dtype] if learnable_sink is not None else None",
    "q_descale is not None", "k_descale is not None", "v_descale is not None",
    "block_sparse_tensors is None or block_sparse_tensors.cu_total_m_blocks is None",
    "block_sparse_tensors is None or block_sparse_tensors.cu_block_idx_offsets is None",
    "tile_m", "tile_n", "q_stage", "num_threads", "is_split_kv", "pack_gqa", "arch",
    "page_size not in [None, tile_n]", "use_2cta_instrs", "q_subtile_factor", "kv_subtile_factor",
    "mma_pv_is_rs", "intra_wg_overlap", "use_clc_scheduler", "num_splits_dynamic is not None",
    "virtual_batch_idx is not None", "num_nheads_in_l2 is not None",
    "tile_count_semaphore is not None", "cu_total_m_blocks is not None",
    "cu_total_splits_m_blocks is not None", "blocks_to_batch_idx is not None",
    "seqlen_k_per_split", "is_static_persistent", "q is not None", "qv is not None",
    "p is not None", "row_max is not None", "gather_kv_length", "sparse_kv",
    "gather_kv_valid_length is not None", "disable_sparse_kv_bitmask",
    "fa_logging.get_fa_log_level()", "output_quant_key", "fp8_kv_dequant", "q.dtype",
    "out_torch_dtype", "decode_splits",
)  # fmt: skip

# SGLang 0.5.23 (sglang/kernels/ops/attention/flash_attn/cute/interface.py 1283-1349): no
# persistent-scheduler, cu_total or split-count fields (its sm90 forward has none); the sink by
# presence (bf16 only); its sm120 host's config and plan keys, bias, block-scaled FP8 fields added
SGLANG_FWD_KEY = (
    "dtype", "head_dim", "head_dim_v", "qhead_per_kvhead", "causal", "score_mod_hash",
    "mask_mod_hash", "use_block_sparsity", "block_sparse_broadcast_pattern",
    "aux_tensor_metadata", "aux_scalar_metadata", "lse is None", "cu_seqlens_q is None",
    "cu_seqlens_k is None", "seqused_q is None", "seqused_k is None", "page_table is not None",
    "window_size_left is not None", "window_size_right is not None",
    "learnable_sink is not None", "q_descale is not None", "k_descale is not None",
    "v_descale is not None",
    "block_sparse_tensors is None or block_sparse_tensors.cu_total_m_blocks is None",
    "block_sparse_tensors is None or block_sparse_tensors.cu_block_idx_offsets is None",
    "tile_m", "tile_n", "q_stage", "num_threads", "is_split_kv", "pack_gqa", "arch",
    "arch_forward_config.compile_key if arch_forward_config is not None else None",
    "arch_forward_plan.compile_key if arch_forward_plan is not None else None",
    "page_size not in [None, tile_n]", "use_2cta_instrs", "q_subtile_factor", "mma_pv_is_rs",
    "intra_wg_overlap", "use_clc_scheduler", "q is not None", "qv is not None", "p is not None",
    "row_max is not None", "gather_kv_length", "sparse_kv", "disable_sparse_kv_bitmask",
    "bias is not None", "tile_bias", "rel_extent", "qk_blockscaled", "qk_sf_vec_size",
    "v_blockscaled", "v_sf_vec_size", "q_sf_interleaved", "kv_sf_interleaved",
    "sfq.ndim if sfq is not None else None", "sfk.ndim if sfk is not None else None",
    "sfv.ndim if sfv is not None else None", "batch_invariant", "tmem_load_red_max",
    "fa_logging.get_fa_log_level()",
)  # fmt: skip

# SGLang: `_fwd_combine_compile_key`'s returned tuple (no arch, num_head or dynamic-split fields)
SGLANG_COMBINE_KEY = (
    "torch2cute_dtype_map[out.dtype]", "torch2cute_dtype_map[out_partial.dtype]", "head_dim",
    "tile_m", "k_block_size", "log_max_splits", "cu_seqlens is not None", "seqused is not None",
    "lse is not None", "varlen_batch_idx is not None",
)  # fmt: skip

UPSTREAM_COMBINE_KEY = (
    "_get_device_arch() if _arch is None else _arch", "dtype", "dtype_partial", "head_dim",
    "num_head", "tile_m", "k_block_size", "log_max_splits", "cu_seqlens is not None",
    "seqused is not None", "lse is not None", "virtual_batch_idx is not None",
    "num_splits_dynamic_ptr is not None", "semaphore_to_reset is not None",
)  # fmt: skip

# vLLM: `lse is not None` became the LSE's leading dim (None or an int); the output quant key added
VLLM_COMBINE_KEY = (
    "_get_device_arch() if _arch is None else _arch", "dtype", "dtype_partial", "head_dim",
    "num_head", "tile_m", "k_block_size", "log_max_splits", "cu_seqlens is not None",
    "seqused is not None", "lse_leading_dim", "virtual_batch_idx is not None",
    "num_splits_dynamic_ptr is not None", "semaphore_to_reset is not None", "output_quant_key",
)  # fmt: skip

# -- launch slots (what the interface passes the compiled sm90 functions, in order) ----------------

# (runtime/abi.py's SM90_FWD: the order its hot-path builders spell out)
UPSTREAM_SM90_FWD = (
    "q", "k", "v", "out", "lse", "softmax_scale",
    "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "page_table",
    "window_left", "window_right", "learnable_sink",
    "block_sparse", "aux",
    "cu_total_m_blocks", "cu_total_splits_m_blocks",
)  # fmt: skip

# vLLM 0.33.0 interface.py 1930-1989: dynamic_causal after seqused_k; the FP8-KV descales and
# the fused-output scale between the aux data and the cu_total slots
VLLM_SM90_FWD = (
    "q", "k", "v", "out", "lse", "softmax_scale",
    "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "dynamic_causal", "page_table",
    "window_left", "window_right", "learnable_sink",
    "block_sparse", "aux",
    "descales", "output_scale",
    "cu_total_m_blocks", "cu_total_splits_m_blocks",
)  # fmt: skip

# SGLang 0.5.23 interface.py 1731-1770 (arch 9): upstream's list through the aux data, then the
# relative-attention bias (mBias); no cu_total slots (its sm90 scheduler takes none)
SGLANG_SM90_FWD = (
    "q", "k", "v", "out", "lse", "softmax_scale",
    "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "page_table",
    "window_left", "window_right", "learnable_sink",
    "block_sparse", "aux",
    "bias",
)  # fmt: skip

UPSTREAM_COMBINE = (
    "out_partial", "lse_partial", "out", "lse", "cu_seqlens", "seqused",
    "num_splits_dynamic", "virtual_batch_idx", "semaphore_to_reset",
)  # fmt: skip
VLLM_COMBINE = UPSTREAM_COMBINE + ("output_scale",)
SGLANG_COMBINE = UPSTREAM_COMBINE


@dataclass(frozen=True)
class Abi:
    """One modelled FA4 ABI. buildable: fa4aot can build and serve from it; note: why not."""

    name: str
    fwd_key: tuple[str, ...]
    combine_key: tuple[str, ...] | None
    sm90_fwd: tuple[str, ...] | None
    combine: tuple[str, ...] | None
    buildable: bool
    note: str = ""
    # the function whose compile-key tuple is the combine's (SGLang builds it in a helper)
    combine_key_func: str = "_flash_attn_fwd_combine"
    # learnable-sink dtypes its forward takes (None: any FA4 takes)
    sink_dtypes: tuple[str, ...] | None = None
    # whether fa4aot builds the source's own split-KV forward and combine (Variant.split_kv)
    split_kv: bool = True


ABIS: dict[str, Abi] = {
    "upstream": Abi("upstream", UPSTREAM_FWD_KEY, UPSTREAM_COMBINE_KEY, UPSTREAM_SM90_FWD,
                    UPSTREAM_COMBINE, True),
    "vllm": Abi("vllm", VLLM_FWD_KEY, VLLM_COMBINE_KEY, VLLM_SM90_FWD, VLLM_COMBINE, True),
    "sglang": Abi("sglang", SGLANG_FWD_KEY, SGLANG_COMBINE_KEY, SGLANG_SM90_FWD, SGLANG_COMBINE,
                  True, combine_key_func="_fwd_combine_compile_key", sink_dtypes=("bfloat16",),
                  split_kv=False),
}


def source_reason(fa4: str, *, sink_dtype: str | None = None, split_kv: bool = False
                  ) -> str | None:
    """Why FA4 source `fa4`'s forward (an ABI name) cannot compile a kernel with these features
    though upstream's can, or None: SGLang's copy asserts bf16 sinks, and its split-KV kernels
    are not modelled."""
    abi = ABIS.get(fa4)
    if abi is None:
        return None
    if sink_dtype is not None and abi.sink_dtypes is not None and sink_dtype not in (
            abi.sink_dtypes):
        return (f"{sink_dtype} sinks: the {fa4} FA4 source's forward takes "
                f"{'/'.join(abi.sink_dtypes)} sinks only (sink_dtype in the spec)")
    if split_kv and not abi.split_kv:
        return f"split-KV: fa4aot does not model the {fa4} FA4 source's split kernels"
    return None


def key_field_names(interface: Path, func: str, *, _src: str | None = None,
                    _tree: ast.Module | None = None) -> tuple[str, ...]:
    """The `compile_key = (...)` tuple of `func` in `interface` (interface.py's source text of
    each element, whitespace collapsed), in order; else the tuple `func` returns (a key-building
    helper's); () when there is neither."""
    src = _src if _src is not None else Path(interface).read_text()
    tree = _tree or ast.parse(src)
    lines = src.splitlines(keepends=True)

    def text(e: ast.expr) -> str:  # (ast.get_source_segment re-splits the file per call)
        if e.lineno == e.end_lineno:
            seg = lines[e.lineno - 1].encode()[e.col_offset:e.end_col_offset].decode()
        else:
            first = lines[e.lineno - 1].encode()[e.col_offset:].decode()
            last = lines[e.end_lineno - 1].encode()[:e.end_col_offset].decode()
            seg = first + "".join(lines[e.lineno:e.end_lineno - 1]) + last
        return " ".join(seg.split())

    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and fn.name == func:
            for node in ast.walk(fn):
                if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple)
                        and any(isinstance(t, ast.Name) and t.id == "compile_key"
                                for t in node.targets)):
                    return tuple(text(e) for e in node.value.elts)
            for node in ast.walk(fn):
                if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
                    return tuple(text(e) for e in node.value.elts)
    return ()


def detect_abi(interface: Path) -> str | None:
    """The name of the modelled ABI whose forward (and, where modelled, combine) compile-key
    fields are exactly those of `interface`; None for none."""
    src = Path(interface).read_text()
    tree = ast.parse(src)
    fwd = key_field_names(interface, "_flash_attn_fwd", _src=src, _tree=tree)
    for name, abi in ABIS.items():
        if fwd == abi.fwd_key and (abi.combine_key is None or key_field_names(
                interface, abi.combine_key_func, _src=src, _tree=tree) == abi.combine_key):
            return name
    return None


class KeyFields:
    """A compile key read by field name: `KeyFields(key, ABIS["vllm"].fwd_key)["fp8_kv_dequant"]`.
    The key may carry trailing fields the table does not name (vLLM's hd256 extension): they are
    reachable as `extra`. KeyError names the field and the ABI for a name the table lacks."""

    def __init__(self, key: tuple, fields: tuple[str, ...]):
        if len(key) < len(fields):
            raise ValueError(f"a compile key of {len(key)} fields, the ABI names {len(fields)}")
        self.key, self.fields = key, fields
        self._at = {n: i for i, n in enumerate(fields)}
        self.extra = tuple(key[len(fields):])

    def __getitem__(self, name: str) -> Any:
        try:
            return self.key[self._at[name]]
        except KeyError:
            raise KeyError(f"no compile-key field {name!r} in this ABI") from None

    def __contains__(self, name: str) -> bool:
        return name in self._at

    def as_dict(self) -> dict[str, Any]:
        return {n: self.key[i] for n, i in self._at.items()}
