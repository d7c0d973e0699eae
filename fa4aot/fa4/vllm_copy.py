"""Building from vLLM's FA4 copy (`fa4aot build --fa4 vllm`): its calls, its compile keys read
by field name, and its kernels exported.

Every call goes through the copy's `_flash_attn_fwd` with the arguments vLLM's
`flash_attn_varlen_func` passes it (vllm_flash_attn/flash_attn_interface.py, fa_version 4):
packed or batch q, K/V packed, in batch form or paged, `fp8_kv_dequant` with e4m3 K/V and
(batch, kv_heads) fp32 descales. The copy's keys differ from upstream's in order and content
(model/abis.py), so `variant_from_key` reads them by name. fa4aot's own kernels (split chunks,
folds, merge) patch upstream FA4's internals and are not built from the copy: a long decode step
runs the copy's own split forward and combine instead (`split_twin`, `split_needs`): the split
forward (`Variant.split_kv`; the split count is a run-time size) with combines for each count
bucket and query-head count the runtime may pick (`compile_variant`, parts `combine_h*_s*`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from dataclasses import replace

from fa4aot.fa4 import cubin
from fa4aot.fa4.keys import (
    _CUTE_DTYPES, copy_key_fields, fake_copy_call, key_repr, trace_caches,
)
from fa4aot.model import constraints as C
from fa4aot.model.abis import ABIS, KeyFields
from fa4aot.model.needs import Need
from fa4aot.model.variants import Variant

FWD_KEY = ABIS["vllm"].fwd_key
COMBINE_KEY = ABIS["vllm"].combine_key
FP8_KV = "float8_e4m3fn"
SINK_FIELD = "torch2cute_dtype_map[learnable_sink.dtype] if learnable_sink is not None else None"
# The combines a split variant ships: the copy compiles one per log2 of the largest split count
# (at least 5 at these head dims) and per query-head count (its varlen scheduler packs the heads
# statically). The runtime's count is at most 128 (policy/split.MAX_SLOTS); the query heads are
# the ratio times 1, 2, 4 or 8 KV heads per rank (Gemma-4's 4 KV heads at TP 1..8). A call with
# other heads runs unsplit.
COMBINE_SPLITS = (32, 64, 128)
COMBINE_KV_HEADS = (1, 2, 4, 8)
# the split count of a split variant's build call: any count > 1 compiles the same forward
TRACE_SPLITS = 32


def caches(I) -> dict[str, Any]:
    return {"fwd": I._flash_attn_fwd.compile_cache,
            "combine": I._flash_attn_fwd_combine.compile_cache,
            "tile_cumsum": I._compute_tile_cumsum.compile_cache,
            "blocks_to_batch": I._compute_blocks_to_batch.compile_cache}



def trace(I, call, compiles: list | None = None) -> dict[str, list[tuple[Any, Any]]]:
    """What the copy compiles for `call`: {cache: [(key, compiled fn)]} (caches cleared
    first). compiles: receives the (args, kwargs) of every cute.compile."""
    return trace_caches(caches(I), lambda: fake_copy_call(I, call), compiles)


def variant_from_key(key: tuple, arch: str) -> Variant | None:
    """The copy's forward compile key -> the Variant it compiles, read by field name; None for
    a key outside what fa4aot models (score/mask mods, block sparsity, aux tensors, MLA,
    gathered KV, fused FP8 output, FP8 Q, dynamic split counts)."""
    try:
        f = KeyFields(key, FWD_KEY)
        if (f["score_mod_hash"] or f["mask_mod_hash"] or f["use_block_sparsity"]
                or f["qv is not None"] or f["gather_kv_valid_length is not None"]
                or f["output_quant_key"] is not None or f["num_splits_dynamic is not None"]
                or f["aux_tensor_metadata"] or f.extra):
            return None
        if f["tensor_broadcast_patterns"] and any(
                p is not None and any(p) for p in f["tensor_broadcast_patterns"]):
            return None  # a stride-0 tensor compiles its own kernel; fa4aot never makes one
        fp8_kv = bool(f["fp8_kv_dequant"])
        q_dtype = str(f["q.dtype"]).removeprefix("torch.")
        if not fp8_kv and any(f[f"{t}_descale is not None"] for t in "qkv"):
            return None  # FP8 Q/K/V: the copy's sm100 path
        split = bool(f["is_split_kv"])
        sink = f[SINK_FIELD]
        return Variant(
            arch=arch, dtype=q_dtype,
            sink_dtype=None if sink is None else _CUTE_DTYPES[sink.__name__],
            cu_hint=bool(f["cu_total_m_blocks is not None"]),
            static_persistent=int(f["q_stage"]) == 1 if split else bool(f["is_static_persistent"]),
            split_kv=split, kv_dtype=FP8_KV if fp8_kv else None, **copy_key_fields(f, arch),
        )
    except (IndexError, KeyError, AttributeError, TypeError, ValueError):
        return None


def split_twin(v: Variant) -> Variant | None:
    """The split forward that serves `v`'s long decode steps (the copy's `num_splits > 1`), or
    None where fa4aot does not split: `v` not a paged decode kernel on sm90 (one M block: the
    key's q_stage 1 holds), a window, a sink, LSE returned (the combine's LSE layout then
    depends on the batch), the batch > 256 helpers, or already split."""
    if (v.arch != "sm90" or v.split_kv or not v.paged or v.phase != "decode" or v.local
            or v.sink_dtype or v.return_lse or v.cu_hint or v.mla is not None):
        return None
    return replace(v, split_kv=True)


def split_needs(needs: list[Need]) -> list[Need]:
    """The split twins (split_twin) of `needs` not already among them, each with its build
    call: the need's call with TRACE_SPLITS splits over enough keys for each to hold two
    blocks."""
    have = {n.variant.id for n in needs}
    out = []
    for n in needs:
        twin = split_twin(n.variant)
        if twin is None or twin.id in have:
            continue
        have.add(twin.id)
        keys = max(n.call.seqlen_k, TRACE_SPLITS * 2 * twin.tile.n)
        out.append(Need(twin, replace(n.call, num_splits=TRACE_SPLITS, seqlen_k=keys), n.spec,
                        n.layer))
    return out


def combine_part(num_head: int, max_splits: int) -> str:
    """The part name of a split variant's combine for `num_head` query heads and at most
    `max_splits` splits."""
    return f"combine_h{num_head}_s{max_splits}"


def fake_combine(I, variant: Variant, num_head: int, num_splits: int) -> None:
    """The copy's `_flash_attn_fwd_combine` as its `_flash_attn_fwd` calls it after `variant`'s
    split forward (fp32 partials, LSE not returned, q packed with cu_seqlens_q or in batch
    form), under FakeTensorMode: compiles, runs nothing."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    dv, dt = variant.head_dim_v, getattr(torch, variant.dtype)
    f32 = torch.float32
    with FakeTensorMode():
        rows = (4,) if variant.cu_seqlens_q else (2, 1)
        op = torch.empty(num_splits, *rows, num_head, dv, dtype=f32, device="cuda")
        lse_shape = (num_head, rows[0]) if variant.cu_seqlens_q else (rows[0], num_head, 1)
        lp = torch.empty(num_splits, *lse_shape, dtype=f32, device="cuda")
        out = torch.empty(*rows, num_head, dv, dtype=dt, device="cuda")
        cu = torch.empty(rows[0] + 1, dtype=torch.int32, device="cuda") \
            if variant.cu_seqlens_q else None
        I._flash_attn_fwd_combine(op, lp.transpose(-1, -2), out, None, cu, None)


def _combines(I, variant: Variant, traced: list) -> list[tuple[str, tuple[Any, Any]]]:
    """A split variant's combines: the one its build call compiled (`traced`) and one per
    (COMBINE_KV_HEADS x ratio, COMBINE_SPLITS) pair, named by combine_part."""
    got = {}
    for key, fn in traced:
        f = KeyFields(key, COMBINE_KEY)
        got[combine_part(int(f["num_head"]), 1 << int(f["log_max_splits"]))] = (key, fn)
    for hk in COMBINE_KV_HEADS:
        for n in COMBINE_SPLITS:
            name = combine_part(hk * variant.qhead_per_kvhead, n)
            if name not in got:
                one = trace_caches({"combine": I._flash_attn_fwd_combine.compile_cache},
                                   lambda: fake_combine(I, variant, hk * variant.qhead_per_kvhead,
                                                        n))["combine"]
                if len(one) != 1:
                    raise RuntimeError(f"expected one combine for {name}, the copy compiled "
                                       f"{len(one)}")
                got[name] = one[0]
    return sorted(got.items())


def compile_variant(I, call, variant: Variant, outdir: Path) -> dict[str, Any]:
    """Compile `variant` through the copy and export its kernels (fwd; for a split variant also
    the copy's combines, `_combines`): -> {"parts": {name: {"object", "key", ...}},
    "compile_seconds", "fa4_key"}. RuntimeError when the copy compiles other than one forward,
    or one whose key reads back as another variant."""
    t0 = time.perf_counter()
    got = trace(I, call)
    fwd = got["fwd"]
    if len(fwd) != 1:
        raise RuntimeError(f"expected one forward kernel for {variant.describe()}, vLLM's FA4 "
                           f"copy compiled {len(fwd)}")
    back = variant_from_key(fwd[0][0], variant.arch)
    if back != variant:
        raise RuntimeError(f"vLLM's FA4 copy compiled another kernel for {variant.describe()}: "
                           f"{back.describe() if back else key_repr(fwd[0][0])}")
    entries = [("fwd", fwd[0])]
    if variant.split_kv:
        if len(got["combine"]) != 1:
            raise RuntimeError(f"expected the copy's combine beside {variant.describe()}, it "
                               f"compiled {len(got['combine'])}")
        entries += _combines(I, variant, got["combine"])
    for helper in ("tile_cumsum", "blocks_to_batch"):
        if bool(got[helper]) != variant.cu_hint:
            raise RuntimeError(f"{helper} presence disagrees with cu_hint for "
                               f"{variant.describe()}")
        if got[helper]:
            entries.append((helper, got[helper][0]))
    seconds = time.perf_counter() - t0
    parts: dict[str, Any] = {}
    for name, (key, fn) in entries:
        obj = outdir / f"{name}.o"
        fn.export_to_c(object_file_path=str(obj), function_name=f"fa4aot_{name}")
        problem = cubin.target_problem(obj, C.cubin_target(variant.arch))
        if problem:
            raise RuntimeError(f"{variant.describe()}: {problem}")
        parts[name] = {"object": str(obj), **part_record(name, key)}
    return {"parts": parts, "compile_seconds": seconds, "fa4_key": parts["fwd"]["key"]}


def part_record(name: str, key) -> dict[str, Any]:
    """A part's record: its rendered key, the ABI it is called by, and (combine) what the
    runtime sizes partials by."""
    rec: dict[str, Any] = {"key": key_repr(key), "fa4_abi": "vllm"}
    if name == "fwd":
        f = KeyFields(key, FWD_KEY)
        rec["tile_m"], rec["tile_n"] = int(f["tile_m"]), int(f["tile_n"])
        rec["split_kv"] = bool(f["is_split_kv"])
    if name.startswith("combine"):
        f = KeyFields(key, COMBINE_KEY)
        rec["max_splits"] = 1 << int(f["log_max_splits"])
        rec["num_head"] = int(f["num_head"])
        rec["partial_dtype"] = _CUTE_DTYPES[f["dtype_partial"].__name__]
    return rec
