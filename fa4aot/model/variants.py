"""Kernel variants: what distinguishes one compiled FA4 forward kernel from another.

A `Variant` holds exactly the static features of a call that change which kernel FA4 (the
pinned release) compiles: dtype, head dims, head ratio, causal/local, LSE, sink dtype, which of
the varlen / paged tensors are present, the TMA paged path, the varlen batch > 256 scheduler
aid, and the decode/prefill scheduler choice. `model.compile_keys.features` derives them from
a call's shapes the way FA4 does; its id is a hash of their canonical JSON.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from fa4aot.model import constraints as C

SCHEMA = 1  # bump when the meaning of a field changes: it is part of every variant id
# Variant fields added after SCHEMA 1, with the default that leaves them out of the id
NEW_FIELD_DEFAULTS = {"softcap": None, "pack_gqa": None, "descales": None, "split_kv": False,
                      "s_ping_pong": None, "mla": None, "mla_q_stage": None, "tile_m": None,
                      "two_cta": None, "kv_dtype": None}
# FP8 descale tensors a kernel takes, as FA4's key records them (q_descale, k_descale, v_descale
# present or not): a subset of "qkv", in that order. FA4 (4.0.0b36) takes them only through
# `interface._flash_attn_fwd` (its public entry points have no descale arguments).
DESCALE_SETS = ("q", "k", "v", "qk", "qv", "kv", "qkv")


@dataclass(frozen=True)
class Variant:
    arch: str
    dtype: str
    head_dim: int
    head_dim_v: int
    qhead_per_kvhead: int
    causal: bool
    local: bool
    has_window_left: bool
    has_window_right: bool
    return_lse: bool
    sink_dtype: str | None
    cu_seqlens_q: bool
    cu_seqlens_k: bool
    seqused_q: bool
    seqused_k: bool
    paged: bool
    paged_tma: bool | None  # None when not paged
    cu_hint: bool  # varlen q with batch > 256: per-batch tile cumsum computed by a helper kernel
    static_persistent: bool  # FA4's persistent scheduler: dense non-causal, or one m-block
    # FA4 turns softcap into a score_mod whose closure holds the value: each value is a kernel
    softcap: float | None = None
    # the caller's explicit pack_gqa when it differs from FA4's default (qhead_per_kvhead > 1);
    # None: the default. FA4's key holds the effective value, so True at ratio 4 is None here.
    pack_gqa: bool | None = None
    # FP8 (Blackwell): which of q/k/v descale tensors the kernel takes (DESCALE_SETS); None: none
    descales: str | None = None
    # FA4's native split-KV (Blackwell, num_splits > 1: `is_split_kv` in its key). The forward
    # writes float32 partials and FA4's combine kernel (a part of the same artifact) merges
    # them; num_splits itself is a run-time size (the partials' first dim), not in the key. A
    # split kernel is never persistent: static_persistent then holds whether the query rows
    # fit one M tile (FA4's q_stage == 1), which the key records instead.
    split_kv: bool = False
    # split kernels only: FA4's S ping-pong path (`use_s_ping_pong`, a separate kernel): taken
    # when each split holds enough key blocks (constraints.split_s_ping_pong); None otherwise
    s_ping_pong: bool | None = None
    # absorbed MLA (FA4's `qv`, Blackwell): which of FA4's MLA kernels (constraints.MLA_ROUTES:
    # "2cta", "1cta", "1cta-kb64"; FA4's key fields mla_1cta and mla_1cta_kb64) and its Q stages
    # (1 or 2: the key's q_stage, which for the 2CTA kernel is not implied by static_persistent).
    # None: not an MLA kernel. head_dim is then the rope part (64), head_dim_v the latent (512).
    mla: str | None = None
    mla_q_stage: int | None = None
    # the M tile, where it is not FA4's default for the head dims (FA4's `tile_mn`, its key's
    # tile_m): the sm90 split-KV chunk kernel's (constraints.split_tile_m). None: the default.
    tile_m: int | None = None
    # Blackwell hd256 (not MLA, not split): FA4's `use_2cta_instrs`, which for one M block it
    # turns on by the batch x heads against the SM count (`hd256_decode_2cta`), so a decode
    # call's kernel depends on its batch (features). None elsewhere (implied by the rest).
    two_cta: bool | None = None
    # FP8-KV dequant (vLLM's FA4 copy on sm90, `fa4aot build --fa4 vllm`): the K/V dtype
    # ("float8_e4m3fn") where it is not `dtype`, the Q/O dtype; the kernel takes (batch,
    # kv_heads) K/V descales and computes in fp16. None: K/V in `dtype`.
    kv_dtype: str | None = None

    @property
    def id(self) -> str:
        """Stable id: sha256 of canonical JSON of the fields (and the schema), not of a pickle.
        Fields added after schema 1 are left out at their defaults: every variant that existed
        before them keeps its id (and stores built before them stay valid)."""
        d = asdict(self)
        for k, dflt in NEW_FIELD_DEFAULTS.items():
            if d[k] == dflt:
                del d[k]
        blob = json.dumps({"schema": SCHEMA, **d}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def pack_gqa_effective(self) -> bool:
        return self.qhead_per_kvhead > 1 if self.pack_gqa is None else self.pack_gqa

    @property
    def tile(self) -> C.Tile:
        if self.mla is not None:
            return C.mla_tile(self.mla)
        tile = C.fwd_tile(self.arch, self.head_dim, self.head_dim_v, self.causal, self.local)
        return tile if self.tile_m is None else C.Tile(self.tile_m, tile.n)

    @property
    def layout(self) -> str:
        """The K/V form (Call.layout): paged, varlen (packed, cu_seqlens_k), padded (batch form
        under the varlen entry point: with seqused_k, or with a varlen q) or dense."""
        if self.paged:
            return "paged"
        if self.cu_seqlens_k:
            return "varlen"
        if self.cu_seqlens_q or self.seqused_q or self.seqused_k:
            return "padded"
        return "dense"

    @property
    def batch_q(self) -> bool:
        """K/V not dense and q in batch form (no cu_seqlens_q; seqused_q or not): Call.batch_q."""
        return self.layout != "dense" and not self.cu_seqlens_q

    @property
    def split_kernel(self) -> bool:
        """The kernel split-KV plans run chunks on (split.py): 1:1, no mask, q in batch form,
        K packed or paged, LSE returned, no sink. Built with fa4aot's merge kernel beside it
        (kernels.trace_merge; FA4's combine for head dims the merge has no layout for)."""
        return (
            not self.split_kv
            and self.descales is None
            and self.batch_q
            and self.qhead_per_kvhead == 1
            and not self.causal
            and not self.local
            and self.return_lse
            and self.sink_dtype is None
            and not self.seqused_q
            and self.pack_gqa is None
            and ((self.paged and self.seqused_k) or (self.cu_seqlens_k and not self.seqused_k))
        )

    @property
    def phase(self) -> str:
        """decode: one query tile per (batch, kv head); prefill: more; any: same kernel for both."""
        if self.split_kv:
            return "decode" if self.static_persistent else "prefill"
        if not self.causal and not self.local and self.layout == "dense":
            return "any"
        if self.two_cta and not self.static_persistent and not self.cu_seqlens_q:
            # hd256 on Blackwell, causal/local, q in batch form: FA4's 2CTA kernel runs the LPT
            # scheduler unpersistent for one M block too, the same key at any query length
            return "any"
        return "decode" if self.static_persistent else "prefill"

    @property
    def mask(self) -> str:
        if self.local:
            return "window"
        return "causal" if self.causal else "full"

    def describe(self) -> str:
        parts = [
            self.arch,
            self.dtype,
            f"hd{self.head_dim}"
            + (f"/{self.head_dim_v}" if self.head_dim_v != self.head_dim else ""),
            f"ratio{self.qhead_per_kvhead}",
            self.mask,
            self.layout,
            self.phase,
        ]
        if self.batch_q:
            parts.append("q:batch")
        if self.seqused_q:
            parts.append("seqused_q")
        if self.seqused_k != (self.layout in ("paged", "padded")):
            parts.append("seqused_k" if self.seqused_k else "no-seqused_k")
        if self.paged:
            parts.append("page=tile_n(TMA)" if self.paged_tma else "page!=tile_n")
        if self.cu_hint:
            parts.append(f"batch>{C.BIN_BATCH_SEARCH_THRESH}")
        if self.return_lse:
            parts.append("lse")
        if self.sink_dtype:
            parts.append(f"sink:{self.sink_dtype}")
        if self.softcap is not None:
            parts.append(f"softcap:{self.softcap:g}")
        if self.pack_gqa is not None:
            parts.append(f"pack_gqa={self.pack_gqa}")
        if self.descales is not None:
            parts.append(f"descale:{self.descales}")
        if self.split_kv:
            parts.append("split-kv" + ("(ping-pong)" if self.s_ping_pong else ""))
        if self.mla is not None:
            parts.append(f"mla:{self.mla}/q_stage{self.mla_q_stage}")
        if self.tile_m is not None:
            parts.append(f"tile_m={self.tile_m}")
        if self.two_cta is not None:
            parts.append("2cta" if self.two_cta else "1cta")
        if self.kv_dtype is not None:
            parts.append(f"kv:{self.kv_dtype}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Variant":
        names = set(cls.__dataclass_fields__)
        # records and miss logs written before the newer fields hold none of them
        d = {**{k: v for k, v in NEW_FIELD_DEFAULTS.items() if k not in d}, **d}
        if set(d) != names:
            raise ValueError(
                f"variant fields differ: missing {sorted(names - set(d))}, extra {sorted(set(d) - names)}"
            )
        return cls(**d)



class MlaRefused(ValueError):
    """An absorbed-MLA call FA4 itself refuses (its kernel's assertion, constraints.mla_refusal),
    as opposed to one fa4aot does not model: the refused ones are what head-ratio padding serves
    (select.choose), the unmodelled ones are refused outright."""


