"""FA4's compile-key model: a call's static features -> the Variant FA4 compiles for it.

`features()` derives a Variant from a call's shapes the way
`flash_attn.cute.interface._flash_attn_fwd` does, so the runtime picks the same kernel FA4 would
have compiled; the builder checks, for every variant it builds, that FA4's own compile key
agrees (`fa4.driver.trace`). `CallFeatures` is what of a call `features()` reads, frozen: the
one form in which a call's features travel (the runtime's planning, selection, explain).
`Call` is one concrete call (shapes and layout; `Call.features()` gives its CallFeatures), and
`representative_call` the inverse: a call that compiles exactly a given variant. Pure: no FA4
import.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from fa4aot.model import constraints as C
from fa4aot.model.variants import DESCALE_SETS, MlaRefused, Variant


@dataclass(frozen=True, slots=True)
class CallFeatures:
    """A call's static features: what decides the kernel FA4 compiles for it, i.e. the
    arguments of `features` less the arch (their meanings are there). Built once where a
    call's features are read (the runtime on a plan-cache miss, `Call.features`, `fa4aot
    explain`) and passed by name to selection (policy.select), the Blackwell split decision
    (`native_split_variant`) and the miss log's variant; a changed call is a `replace` of it."""

    dtype: str
    head_dim: int
    head_dim_v: int
    num_heads: int
    num_heads_kv: int
    causal: bool
    window_left: int | None
    window_right: int | None
    return_lse: bool
    sink_dtype: str | None
    batch: int
    seqlen_q: int | None
    total_q: int
    max_seqlen_q: int | None
    cu_seqlens_q: bool = False
    cu_seqlens_k: bool = False
    seqused_q: bool = False
    seqused_k: bool = False
    page_size: int | None = None
    softcap: float | None = None
    pack_gqa: bool | None = None
    descales: str | None = None
    num_splits: int = 1
    max_seqlen_k: int | None = None
    qv: int | None = None
    num_sms: int | None = None
    tile_m: int | None = None
    kv_dtype: str | None = None

    @property
    def ratio(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_heads_kv

    def variant(self, arch: str) -> Variant:
        """The Variant FA4 compiles for this call on `arch` (`features`; its ValueErrors)."""
        return features(arch=arch, **{n: getattr(self, n) for n in self.__slots__})

    def small_tile_variant(self, arch: str) -> Variant | None:
        """This call's variant on constraints.small_m_tile's M tile (its twin), None where no
        twin applies: not FA4's own plain forward (MLA, FP8, a split, an asked tile), or its
        packed query rows (the host's bound on the query length, as `features` reads it)
        do not fit the tile."""
        if (self.qv is not None or self.kv_dtype is not None or self.descales is not None
                or self.num_splits > 1 or self.tile_m is not None):
            return None
        pack = self.ratio > 1 if self.pack_gqa is None else self.pack_gqa
        q = _query_bound(self.seqlen_q, self.max_seqlen_q, self.total_q, self.cu_seqlens_q)
        tile = C.small_m_tile(arch, self.head_dim, self.head_dim_v,
                              (q or 0) * (self.ratio if pack else 1))
        return None if tile is None else replace(self, tile_m=tile).variant(arch)


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
    arch: str, num_sms: int, variant: Variant, feat: CallFeatures, batch: int, rows: int,
    bound: int, window_left: int | None, window_right: int | None, setting: int,
):  # fmt: skip
    """The native split decision for an exact Blackwell call with q in batch form (pure: the
    runtime's Blackwell path, runtime/blackwell.py, and `fa4aot explain` both take it):
    -> (num_splits, the split kernel's variant); (1, None) when one split it is, (n, None)
    when fa4aot models no split kernel for the call (it then runs unsplit too). setting:
    FA4AOT_SPLIT_KV as the runtime holds it (-1: FA4's heuristic over the keys the mask loads,
    as FA4's seqlen_k_loaded; N > 0: N splits, capped at FA4's 128). feat: the call's
    features; rows: its query length; bound: the host bound on its KV lengths."""
    if setting < 0:
        loaded = bound
        if variant.local:  # FA4's seqlen_k_loaded (interface.py 392-407): the window's keys
            wl, wr = window_left, window_right
            loaded = max(0, min(bound, (bound if wr is None else wr)
                                + (bound if wl is None else wl) + 1 + variant.tile.m))
        n = C.native_num_splits(
            arch, batch=batch, num_heads_kv=feat.num_heads_kv,
            qhead_per_kvhead=variant.qhead_per_kvhead, seqlen_q=rows, max_seqlen_k=loaded,
            head_dim=variant.head_dim, num_sms=num_sms, pack_gqa=variant.pack_gqa_effective,
        )  # fmt: skip
    else:
        n = min(int(setting), C.MAX_NATIVE_SPLITS)
    if n <= 1:
        return 1, None
    feat = replace(feat, batch=batch, seqlen_q=rows, total_q=batch * rows, max_seqlen_q=None,
                   num_splits=n, max_seqlen_k=bound)
    try:
        return n, feat.variant(arch)
    except ValueError:
        return n, None


def features(
    *, arch: str, dtype: str, head_dim: int, head_dim_v: int, num_heads: int,
    num_heads_kv: int, causal: bool, window_left: int | None, window_right: int | None,
    return_lse: bool, sink_dtype: str | None, batch: int, seqlen_q: int | None, total_q: int,
    max_seqlen_q: int | None, cu_seqlens_q: bool = False, cu_seqlens_k: bool = False,
    seqused_q: bool = False, seqused_k: bool = False, page_size: int | None = None,
    softcap: float | None = None, pack_gqa: bool | None = None, descales: str | None = None,
    num_splits: int = 1, max_seqlen_k: int | None = None, qv: int | None = None,
    num_sms: int | None = None, tile_m: int | None = None, kv_dtype: str | None = None,
) -> Variant:
    """A call's static features -> the Variant FA4 would compile for it (sm90 logic, FA4 b36).

    seqlen_q: the dense query length (None for varlen q); max_seqlen_q: the caller's host hint
    for varlen q (None if not given: FA4 then bounds it by total_q and cannot use the decode
    scheduler). softcap: as FA4 takes it (0 or None: none); pack_gqa: the caller's explicit
    choice (None: FA4's default, packed iff the head ratio > 1). descales: which FP8 descale
    tensors the call passes (DESCALE_SETS). num_splits: FA4's explicit split count (> 1: its
    native split-KV, Blackwell only; the heuristic's 0 is not modelled); max_seqlen_k: the K
    length bound FA4 plans with (needed when splitting). qv: absorbed MLA's latent dim
    (mla_features); num_sms: the SM count FA4's MLA route reads. tile_m: an M tile the call
    asks FA4 for (its `tile_mn`; the split chunk kernel's), None: FA4's default.

    Raises ValueError for what fa4aot does not model: descales without FP8, a split on sm90 or
    with unequal head dims (constraints.native_split_reason), a split without max_seqlen_k."""
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
        _check_split(arch, head_dim, head_dim_v, max_seqlen_k, cu_seqlens_q or seqused_q)
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
    eff_max_q = _query_bound(seqlen_q, max_seqlen_q, total_q, cu_seqlens_q)
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
        static_persistent, ping_pong = _split_kernel(
            arch, head_dim, head_dim_v, rows, tile, local, wl, wr, max_seqlen_k, page_size,
            sink_dtype is not None, bool(softcap), num_splits,
        )
    return Variant(
        arch=arch, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v,
        qhead_per_kvhead=ratio, causal=causal, local=local, has_window_left=wl is not None,
        has_window_right=wr is not None, return_lse=return_lse, sink_dtype=sink_dtype,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
        seqused_k=seqused_k, paged=page_size is not None,
        paged_tma=None if page_size is None else C.paged_tma(arch, page_size, tile),
        cu_hint=varlen_q and batch > C.BIN_BATCH_SEARCH_THRESH,
        static_persistent=static_persistent,
        softcap=float(softcap) if softcap else None,  # FA4: softcap == 0.0 means none
        pack_gqa=None if pack == default_pack else pack, descales=descales, split_kv=split,
        s_ping_pong=ping_pong, tile_m=tile_m, two_cta=two_cta, kv_dtype=kv_dtype,
    )


def _query_bound(seqlen_q, max_seqlen_q, total_q, cu_seqlens_q):
    """The query length FA4 plans a call's M blocks with: the caller's max_seqlen_q, else the
    dense length, or for a packed q (cu_seqlens_q) its total."""
    if max_seqlen_q is not None:
        return max_seqlen_q
    return total_q if cu_seqlens_q else seqlen_q


def _split_kernel(arch, head_dim, head_dim_v, rows, tile, local, wl, wr, max_seqlen_k,
                  page_size, sink, softcap, num_splits) -> tuple[bool, bool | None]:
    """A native split call's (static_persistent, s_ping_pong): FA4's split kernel schedules
    statically at one Q stage (see Variant.split_kv), and takes the S ping-pong path by the keys
    its mask loads per split (FA4's seqlen_k_loaded)."""
    stage = C.q_stage(arch, rows, tile, head_dim_v)
    loaded = max_seqlen_k
    if local:
        loaded = max(0, min(max_seqlen_k, (max_seqlen_k if wr is None else wr)
                            + (max_seqlen_k if wl is None else wl) + 1 + tile.m))
    ping_pong = C.split_s_ping_pong(
        head_dim, head_dim_v, tile, stage, page_size, sink, softcap, loaded, num_splits,
    )
    return stage == 1, ping_pong


def _check_split(arch, head_dim, head_dim_v, max_seqlen_k, packed_q) -> None:
    """Refuse the native split calls fa4aot does not model (ValueError)."""
    why = C.native_split_reason(arch, head_dim, head_dim_v)
    if why:
        raise ValueError(why)
    if max_seqlen_k is None:
        raise ValueError("a split call's variant needs max_seqlen_k (FA4 plans with it)")
    if packed_q:
        # FA4 then computes per-batch split counts with its scheduler-metadata kernel
        # (`_get_scheduler_metadata`), another kernel and four more key fields
        raise ValueError(
            "native split-KV with packed q (cu_seqlens_q / seqused_q) is not modelled: "
            "fa4aot builds split kernels with q in batch form (a decode step's packed q "
            "with equal rows per sequence is a view of it)"
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



def mla_features(
    *, arch, dtype, head_dim, head_dim_v, qv, num_heads, num_heads_kv, causal, window_left,
    window_right, return_lse, sink_dtype, batch, total_q, max_seqlen_q, cu_seqlens_q,
    cu_seqlens_k, seqused_q, seqused_k, page_size, softcap, pack_gqa, descales, num_splits,
    num_sms,
) -> Variant:
    """An absorbed-MLA call (FA4's `qv`) -> the Variant of the MLA kernel FA4 compiles for it
    (4.0.0b36: constraints.mla_route; tests/build/test_mla_build.py checks it against FA4's keys).

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
    # sequences mostly have no query rows takes the 1CTA kernel (tests/build/test_mla_build.py)
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
    # K/V packed or paged, one latent head): driver.fake_call passes qv of (tokens, h, qv)
    qv: int | None = None
    tile_m: int | None = None  # an M tile asked of FA4 (`tile_mn`): the split chunk kernel's
    kv_dtype: str | None = None  # FP8-KV dequant's e4m3 K/V (vLLM's copy; Variant.kv_dtype)

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

    def features(self, num_sms: int | None = None) -> CallFeatures:
        """The call's static features (num_sms: the SM count FA4's per-call choices read)."""
        varlen = self.packed_q
        return CallFeatures(
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
            # the K bound only where it decides the kernel (a split), as the runtime's features
            max_seqlen_k=self.max_seqlen_k if self.num_splits > 1 else None,
            qv=self.qv,
            num_sms=num_sms,
            tile_m=self.tile_m,
            kv_dtype=self.kv_dtype,
        )

    @property
    def max_seqlen_k(self) -> int:
        """The K length bound FA4 plans with for this call: driver.fake_call passes seqlen_k
        as max_seqlen_k to the varlen entry, and a dense/padded K's length is seqlen_k."""
        return self.seqlen_k

    def variant(self, arch: str, num_sms: int | None = None) -> Variant:
        return self.features(num_sms).variant(arch)

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
        kv_dtype=v.kv_dtype,
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
