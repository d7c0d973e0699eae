"""Kernel variants: what distinguishes one compiled FA4 forward kernel from another.

A `Variant` holds exactly the static features of a call that change which kernel FA4 (the
pinned release) compiles on sm90: dtype, head dims, head ratio, causal/local, LSE, sink dtype,
which of the varlen / paged tensors are present, the TMA paged path, the varlen batch > 256
scheduler aid, and the decode/prefill scheduler choice. `features()` derives them from a
call's shapes the way `flash_attn.cute.interface._flash_attn_fwd` does, so the runtime picks
the same kernel FA4 would have compiled; the builder checks, for every variant it builds, that
FA4's own compile key agrees (`compiler.trace`).

`enumerate_variants(spec, arch)` walks a spec's serving envelope and returns the distinct
variants it needs, each with one representative call the builder uses to compile it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace

from . import constraints as C
from .specs import Attention, Spec, layout_forms

SCHEMA = 1  # bump when the meaning of a field changes: it is part of every variant id
# Variant fields added after SCHEMA 1, with the default that leaves them out of the id
NEW_FIELD_DEFAULTS = {"softcap": None, "pack_gqa": None, "descales": None, "split_kv": False,
                      "s_ping_pong": None, "mla": None, "mla_q_stage": None, "tile_m": None,
                      "two_cta": None}
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
        (compiler.trace_merge; FA4's combine for head dims the merge has no layout for)."""
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


def split_kernel_variant(
    arch: str, dtype: str, head_dim: int, head_dim_v: int, page_size: int | None
) -> Variant:
    """The kernel split-KV plans run on for a K layout (packed when page_size is None)."""
    return features(
        arch=arch, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, num_heads=1,
        num_heads_kv=1, causal=False, window_left=None, window_right=None, return_lse=True,
        sink_dtype=None, batch=1, seqlen_q=1, total_q=1, max_seqlen_q=None,
        cu_seqlens_k=page_size is None, seqused_k=page_size is not None, page_size=page_size,
        tile_m=C.split_tile_m(arch, head_dim, head_dim_v),
    )


def native_split_variant(
    arch: str, num_sms: int, variant: "Variant", feat: dict, batch: int, rows: int, bound: int,
    window_left: int | None, window_right: int | None, setting: int,
):  # fmt: skip
    """The native split decision for an exact Blackwell call with q in batch form (pure: the
    runtime's Blackwell path, runtime/blackwell.py, and `fa4aot explain` both take it):
    -> (num_splits, the split kernel's variant); (1, None) when one split it is, (n, None)
    when fa4aot models no split kernel for the call (it then runs unsplit too). setting: FA4AOT_SPLIT_KV as the runtime holds it (-1: FA4's
    heuristic over the keys the mask loads, as FA4's seqlen_k_loaded; N > 0: N splits, capped
    at FA4's 128). feat: the call's `features` arguments; rows: its query length; bound: the
    host bound on its KV lengths."""
    if setting < 0:
        loaded = bound
        if variant.local:  # FA4's seqlen_k_loaded (interface.py 392-407): the window's keys
            wl, wr = window_left, window_right
            loaded = max(0, min(bound, (bound if wr is None else wr)
                                + (bound if wl is None else wl) + 1 + variant.tile.m))
        n = C.native_num_splits(
            arch, batch=batch, num_heads_kv=feat["num_heads_kv"],
            qhead_per_kvhead=variant.qhead_per_kvhead, seqlen_q=rows, max_seqlen_k=loaded,
            head_dim=variant.head_dim, num_sms=num_sms, pack_gqa=variant.pack_gqa_effective,
        )  # fmt: skip
    else:
        n = min(int(setting), C.MAX_NATIVE_SPLITS)
    if n <= 1:
        return 1, None
    feat = {k: x for k, x in feat.items() if k not in ("num_splits", "max_seqlen_k")}
    feat.update(batch=batch, seqlen_q=rows, total_q=batch * rows, max_seqlen_q=None)
    try:
        return n, features(arch=arch, **feat, num_splits=n, max_seqlen_k=bound)
    except ValueError:
        return n, None


def features(
    *,
    arch: str,
    dtype: str,
    head_dim: int,
    head_dim_v: int,
    num_heads: int,
    num_heads_kv: int,
    causal: bool,
    window_left: int | None,
    window_right: int | None,
    return_lse: bool,
    sink_dtype: str | None,
    batch: int,
    seqlen_q: int | None,
    total_q: int,
    max_seqlen_q: int | None,
    cu_seqlens_q: bool = False,
    cu_seqlens_k: bool = False,
    seqused_q: bool = False,
    seqused_k: bool = False,
    page_size: int | None = None,
    softcap: float | None = None,
    pack_gqa: bool | None = None,
    descales: str | None = None,
    num_splits: int = 1,
    max_seqlen_k: int | None = None,
    qv: int | None = None,
    num_sms: int | None = None,
    tile_m: int | None = None,
) -> Variant:
    """A call's static features -> the Variant FA4 would compile for it (sm90 logic, FA4 b36).

    seqlen_q: the dense query length (None for varlen q); max_seqlen_q: the caller's host hint
    for varlen q (None if not given: FA4 then bounds it by total_q and cannot use the decode
    scheduler). softcap: as FA4 takes it (0 or None: none); pack_gqa: the caller's explicit
    choice (None: FA4's default, packed iff the head ratio > 1). descales: which FP8 descale
    tensors the call passes (DESCALE_SETS). num_splits: FA4's explicit split count (> 1: its
    native split-KV, Blackwell only; the heuristic's 0 is not modelled); max_seqlen_k: the K
    length bound FA4 plans with (needed when splitting).

    Raises ValueError for what fa4aot does not model: descales without FP8, a split on sm90 or
    with unequal head dims (constraints.native_split_reason), a split without max_seqlen_k.

    qv: absorbed MLA's latent dim (mla_features); num_sms: the SM count FA4's MLA route reads.
    tile_m: an M tile the call asks FA4 for (its `tile_mn`; the split chunk kernel's), None:
    FA4's default.
    """
    if qv is not None:
        return mla_features(
            arch=arch, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, qv=qv,
            num_heads=num_heads, num_heads_kv=num_heads_kv, causal=causal,
            window_left=window_left, window_right=window_right, return_lse=return_lse,
            sink_dtype=sink_dtype, batch=batch, total_q=total_q, max_seqlen_q=max_seqlen_q,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
            seqused_k=seqused_k, page_size=page_size, softcap=softcap, pack_gqa=pack_gqa,
            descales=descales, num_splits=num_splits, num_sms=num_sms,
        )
    fp8 = dtype.startswith("float8")
    if descales is not None and (descales not in DESCALE_SETS or not fp8):
        raise ValueError(f"descales {descales!r}: a subset of 'qkv', for FP8 q/k/v only")
    if num_splits > 1:
        why = C.native_split_reason(arch, head_dim, head_dim_v)
        if why:
            raise ValueError(why)
        if max_seqlen_k is None:
            raise ValueError("a split call's variant needs max_seqlen_k (FA4 plans with it)")
        if cu_seqlens_q or seqused_q:
            # FA4 then computes per-batch split counts with its scheduler-metadata kernel
            # (`_get_scheduler_metadata`), another kernel and four more key fields
            raise ValueError(
                "native split-KV with packed q (cu_seqlens_q / seqused_q) is not modelled: "
                "fa4aot builds split kernels with q in batch form (a decode step's packed q "
                "with equal rows per sequence is a view of it)"
            )
    causal, local, wl, wr = C.resolve_window(causal, window_left, window_right)
    ratio = num_heads // num_heads_kv
    tile = C.fwd_tile(arch, head_dim, head_dim_v, causal, local)
    if tile_m == tile.m:
        tile_m = None
    elif tile_m is not None:
        if C.is_blackwell(arch) or num_splits > 1:
            raise ValueError(f"an M tile of {tile_m} is modelled for sm90's forward only")
        tile = C.Tile(tile_m, tile.n)
    default_pack = ratio > 1
    pack = default_pack if pack_gqa is None else bool(pack_gqa)
    varlen_q = cu_seqlens_q or seqused_q
    if not cu_seqlens_q:
        eff_max_q = seqlen_q if max_seqlen_q is None else max_seqlen_q
    else:
        eff_max_q = total_q if max_seqlen_q is None else max_seqlen_q
    hd256 = C.is_blackwell(arch) and head_dim == head_dim_v == 256
    sms = selection_sms(arch, num_sms)
    if (
        hd256 and pack_gqa is None and 128 % ratio and not seqused_q
        and (eff_max_q > 128 or (num_splits == 1 and 2 * batch * num_heads <= sms))
    ):
        pack = False  # interface.py 998-1010: FA4 prefers the 2CTA kernel over packed GQA
    rows = eff_max_q * (ratio if pack else 1)
    # FA4's `max_m_blocks_leq_one`: the rows fit the CTA's Q tiles (two on Blackwell: q_stage)
    one_m_block = rows <= C.q_stage(arch, rows, tile, head_dim_v) * tile.m
    split = num_splits > 1
    two_cta = None
    if hd256 and not split:
        # interface.py 1062-1100: `use_2cta_instrs` for hd256 (one M block: while the doubled
        # grid of (batch, KV heads or query heads) fits one wave of the SMs)
        two_cta = (
            not seqused_q
            and page_size in (None, 128)
            and (not one_m_block or 2 * batch * (num_heads_kv if pack else num_heads) <= sms)
            and (tile.m % ratio == 0 or not pack)
        )
    static_persistent = (not causal and not local and not cu_seqlens_q and not seqused_q) or (
        one_m_block and (not cu_seqlens_q or max_seqlen_q is not None)
        # dense causal/local runs the LPT scheduler, which maps 2CTA clusters only unpersistent
        and not (two_cta and not cu_seqlens_q and (causal or local))
    )
    ping_pong = None
    if split:
        stage = C.q_stage(arch, rows, tile, head_dim_v)
        static_persistent = stage == 1  # see Variant.split_kv
        loaded = max_seqlen_k
        if local:
            loaded = max(0, min(max_seqlen_k, (max_seqlen_k if wr is None else wr)
                                + (max_seqlen_k if wl is None else wl) + 1 + tile.m))
        ping_pong = C.split_s_ping_pong(
            head_dim, head_dim_v, tile, stage, page_size, sink_dtype is not None,
            bool(softcap), loaded, num_splits,
        )
    return Variant(
        arch=arch,
        dtype=dtype,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        qhead_per_kvhead=ratio,
        causal=causal,
        local=local,
        has_window_left=wl is not None,
        has_window_right=wr is not None,
        return_lse=return_lse,
        sink_dtype=sink_dtype,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        seqused_q=seqused_q,
        seqused_k=seqused_k,
        paged=page_size is not None,
        paged_tma=None if page_size is None else C.paged_tma(arch, page_size, tile),
        cu_hint=varlen_q and batch > C.BIN_BATCH_SEARCH_THRESH,
        static_persistent=static_persistent,
        softcap=float(softcap) if softcap else None,  # FA4: softcap == 0.0 means none
        pack_gqa=None if pack == default_pack else pack,
        descales=descales,
        split_kv=split,
        s_ping_pong=ping_pong,
        tile_m=tile_m,
        two_cta=two_cta,
    )


# The SM count an MLA call's route (and an hd256 Blackwell call's 2CTA choice) is computed with
# when none is given: the arch's default, else B200's. The representative calls fa4aot builds
# MLA kernels from (batch 1: 2CTA; batch MLA_1CTA_BATCH: 1CTA) route the same on any count
# from 3 to 2 * MLA_1CTA_BATCH - 1.
MLA_FALLBACK_NUM_SMS = 148
MLA_1CTA_BATCH = 1024


def selection_sms(arch: str, num_sms: int | None) -> int:
    """The SM count FA4's per-call kernel choices are modelled with: `num_sms`, else the arch's
    default, else MLA_FALLBACK_NUM_SMS (sm103 has no default)."""
    return num_sms or C.DEFAULT_NUM_SMS.get(arch) or MLA_FALLBACK_NUM_SMS


class MlaRefused(ValueError):
    """An absorbed-MLA call FA4 itself refuses (its kernel's assertion, constraints.mla_refusal),
    as opposed to one fa4aot does not model: the refused ones are what head-ratio padding serves
    (select.choose), the unmodelled ones are refused outright."""


def mla_features(
    *, arch, dtype, head_dim, head_dim_v, qv, num_heads, num_heads_kv, causal, window_left,
    window_right, return_lse, sink_dtype, batch, total_q, max_seqlen_q, cu_seqlens_q,
    cu_seqlens_k, seqused_q, seqused_k, page_size, softcap, pack_gqa, descales, num_splits,
    num_sms,
) -> Variant:
    """An absorbed-MLA call (FA4's `qv`) -> the Variant of the MLA kernel FA4 compiles for it
    (4.0.0b36: constraints.mla_route; tests/test_mla_build.py checks it against FA4's keys).

    Modelled: Blackwell, bf16/fp16, rope 64 + latent 512, one latent KV head, q packed
    (cu_seqlens_q), K/V packed (cu_seqlens_k) or paged (page_table + seqused_k), causal or not,
    LSE or not, no split. Raises ValueError for anything else, and MlaRefused (a ValueError) for
    a call FA4 itself refuses (the message is FA4's assertion: constraints.mla_refusal)."""
    problems = []
    if not C.is_blackwell(arch):
        raise ValueError(C.mla_reason(arch))
    if (head_dim, head_dim_v, qv) != (64, 512, 512):
        problems.append(f"head dims {head_dim}/{qv} (FA4 runs MLA at 64 + 512 only)")
    if num_heads_kv != 1:
        problems.append(f"{num_heads_kv} latent KV heads (one)")
    if dtype not in ("bfloat16", "float16") or descales is not None:
        problems.append(f"dtype {dtype} (FP8 MLA runs FA4's 1CTA kernel with descales)")
    if not cu_seqlens_q or seqused_q:
        problems.append("q not packed with cu_seqlens_q alone")
    if (page_size is not None) == bool(cu_seqlens_k) or seqused_k != (page_size is not None):
        problems.append("K/V neither packed (cu_seqlens_k) nor paged (page_table + seqused_k)")
    if window_left is not None or window_right is not None or softcap or sink_dtype:
        problems.append("a window, softcap or sink (FA4 takes none with qv)")
    if pack_gqa is not None or num_splits != 1:
        problems.append("an explicit pack_gqa or num_splits")
    if problems:
        raise ValueError("absorbed MLA call fa4aot does not model: " + "; ".join(problems))
    ratio = num_heads // num_heads_kv
    sms = selection_sms(arch, num_sms)
    # FA4 routes by the host hint, or total_q without one: its max_seqlen_q defaults to total_q
    # before seqlen_q_hint is read (interface.py 950-962), whatever `_mla_1cta_route`'s
    # docstring says ("varlen without a host max_seqlen_q counts as prefill"): a call whose
    # sequences mostly have no query rows takes the 1CTA kernel (tests/test_mla_build.py)
    route = C.mla_route(ratio, total_q if max_seqlen_q is None else max_seqlen_q, batch, sms)
    why = C.mla_refusal(route, ratio)
    if why:
        raise MlaRefused(why)
    tile = C.mla_tile(route)
    rows = (total_q if max_seqlen_q is None else max_seqlen_q) * (ratio if ratio > 1 else 1)
    stage = 1 if route == "1cta-kb64" else C.q_stage(arch, rows, tile, head_dim_v)
    return Variant(
        arch=arch, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v,
        qhead_per_kvhead=ratio, causal=causal, local=False, has_window_left=False,
        has_window_right=False, return_lse=return_lse, sink_dtype=None, cu_seqlens_q=True,
        cu_seqlens_k=bool(cu_seqlens_k), seqused_q=False, seqused_k=seqused_k,
        paged=page_size is not None,
        paged_tma=None if page_size is None else C.mla_paged_tma(route, page_size),
        cu_hint=False,  # FA4's MLA path runs no batch > 256 helper
        static_persistent=max_seqlen_q is not None and rows <= stage * tile.m,
        mla=route, mla_q_stage=stage,
    )


CALL_LAYOUTS = ("dense", "varlen", "padded", "paged")


@dataclass(frozen=True)
class Call:
    """One representative call: concrete shapes that make FA4 compile exactly one variant.

    layout is the K/V form: dense (batch form through flash_attn_func, q in batch form too),
    varlen (packed, cu_seqlens_k), padded (batch form (b, s_k, h, d) through the varlen entry
    point: a padded KV cache), paged (page_table). q is packed with cu_seqlens_q unless the
    layout is dense or batch_q. Fields after page_size were added later (defaults: the layouts'
    first meaning), so records holding an older call still load."""

    layout: str  # dense | varlen | padded | paged
    batch: int
    seqlen_q: int  # per sequence
    seqlen_k: int
    num_heads: int
    num_heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: str
    causal: bool
    window_left: int | None
    window_right: int | None
    return_lse: bool
    sink_dtype: str | None
    page_size: int | None = None
    batch_q: bool = False  # varlen/padded/paged K with q in batch form (b, s_q, hq, d)
    seqused_q: bool = False
    seqused_k: bool | None = None  # None: the layout's own (paged and padded: yes; else no)
    softcap: float | None = None
    pack_gqa: bool | None = None  # the caller's explicit pack_gqa (None: FA4's default)
    descales: str | None = None  # FP8: which descale tensors are passed (DESCALE_SETS)
    num_splits: int = 1  # > 1: FA4's native split-KV (Blackwell)
    # absorbed MLA: the latent dim FA4 takes as `qv` (q then holds the rope part; q packed,
    # K/V packed or paged, one latent head): compiler.fake_call passes qv of (tokens, h, qv)
    qv: int | None = None
    tile_m: int | None = None  # an M tile asked of FA4 (`tile_mn`): the split chunk kernel's

    def __post_init__(self):
        if self.layout not in CALL_LAYOUTS:
            raise ValueError(f"layout must be one of {CALL_LAYOUTS}, got {self.layout!r}")
        if self.layout == "dense" and (self.seqused_q or self.seqused_k):
            raise ValueError("a dense call (flash_attn_func) takes no seqused_q / seqused_k")
        if (self.layout == "paged") != (self.page_size is not None):
            raise ValueError("page_size goes with layout paged, and only with it")
        if self.qv is not None and (self.layout not in ("varlen", "paged") or self.batch_q):
            raise ValueError("an MLA (qv) call packs q (cu_seqlens_q) over packed or paged K/V")

    @property
    def packed_q(self) -> bool:
        return self.layout != "dense" and not self.batch_q

    @property
    def has_seqused_k(self) -> bool:
        if self.seqused_k is None:
            return self.layout in ("paged", "padded")
        return self.seqused_k

    def feature_kwargs(self) -> dict:
        """The call's static features: `features()` arguments, less the arch."""
        varlen = self.packed_q
        return dict(
            dtype=self.dtype,
            head_dim=self.head_dim,
            head_dim_v=self.head_dim_v,
            num_heads=self.num_heads,
            num_heads_kv=self.num_heads_kv,
            causal=self.causal,
            window_left=self.window_left,
            window_right=self.window_right,
            return_lse=self.return_lse,
            sink_dtype=self.sink_dtype,
            batch=self.batch,
            seqlen_q=None if varlen else self.seqlen_q,
            total_q=self.batch * self.seqlen_q,
            max_seqlen_q=self.seqlen_q if varlen else None,
            cu_seqlens_q=varlen,
            cu_seqlens_k=self.layout == "varlen",
            seqused_q=self.seqused_q,
            seqused_k=self.has_seqused_k,
            page_size=self.page_size,
            softcap=self.softcap,
            pack_gqa=self.pack_gqa,
            descales=self.descales,
            num_splits=self.num_splits,
            max_seqlen_k=self.max_seqlen_k,
            qv=self.qv,
            tile_m=self.tile_m,
        )

    @property
    def max_seqlen_k(self) -> int:
        """The K length bound FA4 plans with for this call: compiler.fake_call passes seqlen_k
        as max_seqlen_k to the varlen entry, and a dense/padded K's length is seqlen_k."""
        return self.seqlen_k

    def variant(self, arch: str, num_sms: int | None = None) -> Variant:
        return features(arch=arch, num_sms=num_sms, **self.feature_kwargs())

    def to_dict(self) -> dict:
        return asdict(self)


def call_layout(q_form: str, kv_form: str) -> dict:
    """A spec layout's (q form, K/V form) (specs.Q_FORMS, specs.KV_FORMS) -> the Call fields
    that express it, in the canonical spelling (seqused_k None where it is the layout's own)."""
    batch_q = q_form.startswith("batch")
    seqused_q = q_form.endswith("+seqused")
    seqused_k = kv_form.endswith("+seqused")
    kv = kv_form.split("+")[0]
    if kv == "batch":
        layout = "dense" if batch_q and not seqused_q and not seqused_k else "padded"
    else:
        layout = {"packed": "varlen", "paged": "paged"}[kv]
    own = layout in ("paged", "padded")
    return dict(
        layout=layout,
        batch_q=batch_q and layout != "dense",
        seqused_q=seqused_q,
        seqused_k=None if seqused_k == own else seqused_k,
    )


@dataclass(frozen=True)
class Need:
    """A variant a spec needs, with the call that compiles it and who asked for it."""

    variant: Variant
    call: Call
    spec: str
    layer: str


@dataclass(frozen=True)
class Unsupported:
    spec: str
    layer: str
    reason: str
    served_by: str | None = None  # the padded variant that serves it instead, if any


@dataclass
class Plan:
    needs: list[Need] = field(default_factory=list)
    unsupported: list[Unsupported] = field(default_factory=list)

    def variants(self) -> dict[str, Need]:
        """Distinct variants by id (first asker wins)."""
        out: dict[str, Need] = {}
        for n in self.needs:
            out.setdefault(n.variant.id, n)
        return out


def _window(att: Attention) -> tuple[int | None, int | None]:
    """A layer's (left, right) window as FA4 takes it: causal windows look back only,
    bidirectional ones (non-causal layers) both ways."""
    if att.window is None:
        return None, None
    return att.window, 0 if att.causal else att.window


def page_sizes_for(spec: Spec, att: Attention, arch: str) -> list[int]:
    causal_r, local, _, _ = C.resolve_window(att.causal, *_window(att))
    tile = C.fwd_tile(arch, att.head_dim, att.head_dim_v, causal_r, local)
    out = []
    for p in spec.serving.page_sizes:
        p = tile.n if p == "tile" else p
        if p not in out:
            out.append(p)
    return out


def _probe_calls(spec: Spec, att: Attention, arch: str, num_sms: int | None = None) -> list[Call]:
    """Shapes on both sides of every regime boundary inside the serving envelope."""
    sv = spec.serving
    lses = {False: [False], True: [True], "both": [False, True]}[sv.return_lse]
    # Head counts are dynamic in the kernel; only the ratio is static. TP keeps it unless the
    # TP degree exceeds the KV heads (KV heads are then replicated: 1 per rank).
    ratios = sorted({(att.num_q_heads // t) // max(1, att.num_kv_heads // t) for t in sv.tp})
    window = _window(att)
    long_q = min(sv.max_context, 4096)
    phases_q = {
        "decode": sorted({1, sv.speculative}),
        "prefill": [max(2, sv.speculative + 1), long_q],
    }
    batches = sorted(
        {1, sv.max_batch}
        | ({C.BIN_BATCH_SEARCH_THRESH + 1} if sv.max_batch > C.BIN_BATCH_SEARCH_THRESH else set())
    )
    sink = att.sink_dtype if att.sinks else None
    descales = _descales(att)
    # (query heads, KV heads) of the probes: the ratio over one KV head, except for hd256 on
    # Blackwell, where FA4 picks pack_gqa and the 2CTA kernel by batch x heads against the SM
    # count (features): each TP degree's own heads, at the batches where its choice turns
    heads = {(r, 1): batches for r in ratios}
    by_batch = C.is_blackwell(arch) and att.head_dim == att.head_dim_v == 256
    if by_batch:
        sms = selection_sms(arch, num_sms)
        heads = {}
        for t in sv.tp:
            hq, hk = att.num_q_heads // t, max(1, att.num_kv_heads // t)
            turns = {sms // (2 * h) + 1 for h in (hq, hk)}
            heads[(hq, hk)] = sorted(set(batches) | {b for b in turns if b <= sv.max_batch})
    calls = []
    for (hq, hk), head_batches in heads.items():
        for name in sv.layouts:
            form = call_layout(*layout_forms(name))
            layout = form["layout"]
            pages = page_sizes_for(spec, att, arch) if layout == "paged" else [None]
            for phase in sv.phases:
                for sq in phases_q[phase]:
                    for b in head_batches if layout != "dense" or by_batch else [1]:
                        for p in pages:
                            for lse in lses:
                                calls.append(
                                    Call(
                                        batch=b,
                                        seqlen_q=sq,
                                        seqlen_k=max(sq, 256),
                                        num_heads=hq,
                                        num_heads_kv=hk,
                                        head_dim=att.head_dim,
                                        head_dim_v=att.head_dim_v,
                                        dtype=att.dtype,
                                        causal=att.causal,
                                        window_left=window[0],
                                        window_right=window[1],
                                        return_lse=lse,
                                        sink_dtype=sink,
                                        page_size=p,
                                        softcap=att.softcap,
                                        descales=descales,
                                        **form,
                                    )
                                )
    gqa = att.num_q_heads > att.num_kv_heads
    if sv.decode_fold and gqa and "decode" in sv.phases and not att.sinks and att.window is None:
        calls += _fold_calls(spec, att, arch, lses)
    if C.is_blackwell(arch):
        # FA4 splits natively there: its own split kernels, for any mask, sink and softcap
        if sv.split_kv and "decode" in sv.phases and not C.native_split_reason(
            arch, att.head_dim, att.head_dim_v
        ):
            calls += _native_split_calls(spec, att, arch, lses, ratios)
    # (softcap layers: the split's chunk kernel has none, and the runtime does not split them)
    elif sv.split_kv and "decode" in sv.phases and att.window is None and att.softcap is None:
        calls += _split_calls(spec, att, arch)
    return calls


def _descales(att: Attention) -> str | None:
    """FP8 layers take all three descales (FA3's and vLLM's convention: q, k and v scales per
    (batch, KV head)); other dtypes none (FA4 asserts descales only with FP8)."""
    return "qkv" if att.dtype.startswith("float8") else None


def _native_split_calls(
    spec: Spec, att: Attention, arch: str, lses: list[bool], ratios: list[int]
) -> list[Call]:
    """FA4's own split-KV kernels (Blackwell; `num_splits > 1`) for the decode phase: q in
    batch form (a packed q would add FA4's scheduler-metadata kernel), over each K/V form of
    the spec's layouts and page sizes, per head ratio, decode length and LSE choice.

    FA4's forward key holds only `is_split_kv` and `use_s_ping_pong`: the split count is a run-
    time size, so one kernel serves every num_splits, and FA4's combine kernel (built beside it
    for 128 partials, the heuristic's cap) merges any count. Ping-pong is a second kernel, taken
    when each split holds enough key blocks: built too when some split of a `max_context` KV
    reaches that (at 2 splits)."""
    sv = spec.serving
    causal_r, local, _, _ = C.resolve_window(att.causal, *_window(att))
    tile = C.fwd_tile(arch, att.head_dim, att.head_dim_v, causal_r, local)
    need = C.S_PING_PONG_MIN_BLOCKS_PER_SPLIT.get(att.head_dim)
    long_k = 2 * need * tile.n if need and 2 * need * tile.n <= sv.max_context else None
    sink = att.sink_dtype if att.sinks else None
    kv_forms = dict.fromkeys(layout_forms(n)[1] for n in sv.layouts)
    calls = []
    for r in ratios:
        for kv in kv_forms:
            form = call_layout("batch", kv)
            pages = page_sizes_for(spec, att, arch) if form["layout"] == "paged" else [None]
            for sq in sorted({1, sv.speculative}):
                for p in pages:
                    for lse in lses:
                        for sk in [4 * tile.n] + ([long_k] if long_k else []):
                            calls.append(
                                Call(
                                    batch=1, seqlen_q=sq, seqlen_k=sk, num_heads=r,
                                    num_heads_kv=1, head_dim=att.head_dim,
                                    head_dim_v=att.head_dim_v, dtype=att.dtype,
                                    causal=att.causal, window_left=_window(att)[0],
                                    window_right=_window(att)[1], return_lse=lse,
                                    sink_dtype=sink, page_size=p, softcap=att.softcap,
                                    descales=_descales(att), num_splits=2, **form,
                                )
                            )
    return calls


def _split_calls(spec: Spec, att: Attention, arch: str) -> list[Call]:
    """The split-KV kernels (split.py): the non-causal 1:1 kernel returning LSE, with q in batch
    form and the chunk kernel's M tile (constraints.split_tile_m: 64 on sm90 up to hd128, where
    the decode fold's kernel has FA4's default), on a packed K (which also serves dense K,
    viewed packed) and on every page size, for any head ratio, mask and sink of the layer (the
    split runs chunks unmasked and merges sinks itself)."""
    paged = any(layout_forms(n)[1] == "paged+seqused" for n in spec.serving.layouts)
    pages = page_sizes_for(spec, att, arch) if paged else []
    tile_m = C.split_tile_m(arch, att.head_dim, att.head_dim_v)
    return [
        replace(
            _one_to_one_call(att, p, True, **call_layout("batch", "paged+seqused" if p else "packed")),
            tile_m=tile_m,
        )
        for p in [None, *pages]
    ]


def _one_to_one_call(att: Attention, page_size: int | None, return_lse: bool, **form) -> Call:
    """The non-causal 1:1 kernel with q in batch form that the decode fold and the split-KV
    plans run on (one query row per query head of a KV head), for `att`'s head dims."""
    return Call(
        batch=1,
        seqlen_q=1,
        seqlen_k=256,
        num_heads=1,
        num_heads_kv=1,
        head_dim=att.head_dim,
        head_dim_v=att.head_dim_v,
        dtype=att.dtype,
        causal=False,
        window_left=None,
        window_right=None,
        return_lse=return_lse,
        sink_dtype=None,
        page_size=page_size,
        softcap=att.softcap,
        descales=_descales(att),
        **form,
    )


def _fold_calls(spec: Spec, att: Attention, arch: str, lses: list[bool]) -> list[Call]:
    """The decode-fold kernels: non-causal 1:1, q in batch form, one per K layout. A decode step
    (s_q == 1) at any head ratio r runs on them with the r query heads of each KV group as r
    query rows (select.py): the same rows as the r:1 kernel, and q, O and LSE stay views."""
    calls = []
    seen = set()
    for name in spec.serving.layouts:
        # the fold runs q in batch form over the call's own K/V form (select._fold_features)
        form = call_layout("batch", layout_forms(name)[1])
        if tuple(form.items()) in seen:
            continue
        seen.add(tuple(form.items()))
        pages = page_sizes_for(spec, att, arch) if form["layout"] == "paged" else [None]
        calls += [_one_to_one_call(att, p, lse, **form) for p in pages for lse in lses]
    return calls


def enumerate_variants(spec: Spec, arch: str, num_sms: int | None = None) -> Plan:
    """spec x arch -> the distinct variants it needs (pure; no FA4 import, milliseconds).
    A spec whose `[serving] archs` leaves `arch` out needs nothing there."""
    plan = Plan()
    if not spec.serving.for_arch(arch):
        return plan
    for att in spec.attention:
        if att.qv is not None:
            # checked first: on sm90 the hd 64/512 shape must not be "served" by head-dim padding
            if not C.is_blackwell(arch):
                plan.unsupported.append(Unsupported(spec.name, att.name, C.mla_reason(arch)))
                continue
            from .mla import mla_layer_plan

            needs, unsupported = mla_layer_plan(spec, att, arch, num_sms)
            plan.needs += needs
            plan.unsupported += unsupported
            continue
        reason = C.unsupported_reason(
            arch,
            att.dtype,
            att.head_dim,
            att.head_dim_v,
            qhead_per_kvhead=att.num_q_heads // att.num_kv_heads,
        )
        if reason:
            from .select import padded_target_for_unsupported

            target = padded_target_for_unsupported(arch, att.dtype, att.head_dim, att.head_dim_v)
            if target is None or att.dtype not in ("bfloat16", "float16"):
                plan.unsupported.append(Unsupported(spec.name, att.name, reason))
                continue
            d2, dv2, cost = target
            plan.unsupported.append(
                Unsupported(
                    spec.name,
                    att.name,
                    reason,
                    f"padding head dims {att.head_dim}/{att.head_dim_v} -> {d2}/{dv2} ({cost:.2f}x the work)",
                )
            )
            att = replace(att, head_dim=d2, head_dim_v=dv2)
        seen = set()
        for call in _probe_calls(spec, att, arch, num_sms):
            v = call.variant(arch, num_sms)
            if v.id in seen:
                continue
            seen.add(v.id)
            # compile from the smallest call with the same features: it only has to cross the
            # same boundaries, and the builder traces it
            try:
                call = representative_call(v, num_sms)
            except ValueError:
                pass
            plan.needs.append(Need(v, call, spec.name, att.name))
    return plan


def merge(plans: list[Plan]) -> Plan:
    out = Plan()
    for p in plans:
        out.needs.extend(p.needs)
        out.unsupported.extend(p.unsupported)
    return out


def representative_call(v: Variant, num_sms: int | None = None) -> Call:
    """A call that compiles exactly `v` (for variants met at run time: the miss log) on a GPU
    of num_sms SMs (None: the arch's default; only hd256 on Blackwell depends on it, two_cta).

    Every q form (batch or packed, with or without seqused_q) meets every K/V form (batch,
    packed or paged, with or without seqused_k), as FA4's `_flash_attn_fwd` takes them.
    Raises ValueError only for feature combinations FA4's own logic never produces (e.g. a dense
    non-causal kernel that is not persistent).
    """
    if v.mla is not None:
        return _mla_representative_call(v)
    tile = v.tile
    r = v.qhead_per_kvhead
    rows = r if v.pack_gqa_effective else 1  # query rows per query position in an M tile
    # one row past what the CTA's Q tiles hold (two tiles on Blackwell: q_stage)
    tiles = C.q_stage(v.arch, tile.m + 1, tile, v.head_dim_v)
    sq = tiles * tile.m // rows + 1 if v.phase == "prefill" else 1
    if v.local:
        # a right-only window must not be 0: FA4 resolves (None, 0) to plain causal
        wl = 128 if v.has_window_left else None
        wr = (0 if v.has_window_left else 128) if v.has_window_right else None
        causal = False
    else:
        causal, wl, wr = v.causal, None, None
    layout = v.layout
    page = None
    if v.paged:
        page = tile.n if v.paged_tma else (16 if tile.n != 16 else 32)
    own_seqused_k = layout in ("paged", "padded")
    seqlen_k, num_splits = max(sq, 256), 1
    if v.split_kv:
        # FA4's heuristic maximum, so the combine FA4 compiles beside it takes every split
        # count (its key holds log2 of the largest); enough keys per split for the ping-pong
        # kernel, or 2 blocks per split without it
        num_splits = C.MAX_NATIVE_SPLITS
        per_split = C.S_PING_PONG_MIN_BLOCKS_PER_SPLIT.get(v.head_dim, 2) if v.s_ping_pong else 2
        seqlen_k = num_splits * per_split * tile.n
    call = Call(
        layout=layout,
        batch=C.BIN_BATCH_SEARCH_THRESH + 1 if v.cu_hint else 1,
        seqlen_q=sq,
        seqlen_k=seqlen_k,
        num_heads=r,
        num_heads_kv=1,
        head_dim=v.head_dim,
        head_dim_v=v.head_dim_v,
        dtype=v.dtype,
        causal=causal,
        window_left=wl,
        window_right=wr,
        return_lse=v.return_lse,
        sink_dtype=v.sink_dtype,
        page_size=page,
        batch_q=layout != "dense" and not v.cu_seqlens_q,
        seqused_q=v.seqused_q,
        seqused_k=None if v.seqused_k == own_seqused_k else v.seqused_k,
        softcap=v.softcap,
        pack_gqa=v.pack_gqa,
        descales=v.descales,
        num_splits=num_splits,
        tile_m=v.tile_m,
    )
    if v.two_cta is not None and not v.cu_hint:
        # FA4 picks pack_gqa and the 2CTA kernel by batch x heads against the SM count
        # (features): the first batch at which it picks v's
        sms = selection_sms(v.arch, num_sms)
        for b in sorted({1, sms // 2, sms // 2 + 1, sms // (2 * r) + 1}):
            c = replace(call, batch=b)
            if 0 < b <= C.BIN_BATCH_SEARCH_THRESH and c.variant(v.arch, sms) == v:
                return c
    return _compiles(
        call, v, "these features together (no call to its forward produces them)", num_sms
    )


def _compiles(call: Call, v: Variant, what: str, num_sms: int | None = None) -> Call:
    """`call` if its features are exactly `v`, else ValueError: FA4 never compiles `what`."""
    try:
        got = call.variant(v.arch, num_sms)
    except ValueError:
        got = None
    if got != v:
        raise ValueError(f"no representative call for {v.describe()}: FA4 never compiles {what}")
    return call


def _mla_representative_call(v: Variant) -> Call:
    """An absorbed-MLA call that compiles exactly `v` on any SM count from 3 to 2047: batch 1
    for the 2CTA kernel (2 CTAs, one wave), MLA_1CTA_BATCH sequences for the 1CTA ones; the
    query length picks the Q stages and whether one M tile holds the rows."""
    r = v.qhead_per_kvhead
    rows = r if r > 1 else 1
    if v.mla == "2cta":
        limit = v.mla_q_stage * v.tile.m
        if v.static_persistent:
            sq = 1 if v.mla_q_stage == 1 else v.tile.m // rows + 1  # one or two Q tiles
        else:
            sq = limit // rows + 1  # past the CTA's Q tiles
        batch = 1
    else:
        sq = 1 if v.mla == "1cta-kb64" and r < 64 else 2 if v.mla == "1cta" else 1
        batch = MLA_1CTA_BATCH
    page = None
    if v.paged:
        page = (64 if v.mla == "1cta-kb64" else 128) if v.paged_tma else 32 if v.mla == "1cta-kb64" else 64
    call = Call(
        layout="paged" if v.paged else "varlen", batch=batch, seqlen_q=sq, seqlen_k=max(sq, 256),
        num_heads=r, num_heads_kv=1, head_dim=v.head_dim, head_dim_v=v.head_dim_v, dtype=v.dtype,
        causal=v.causal, window_left=None, window_right=None, return_lse=v.return_lse,
        sink_dtype=None, page_size=page, qv=v.head_dim_v,
    )
    return _compiles(call, v, "these MLA features together")
