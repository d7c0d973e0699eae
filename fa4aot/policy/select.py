"""Selection with padding: serve a call from the cheapest cached variant it can reach.

Pure functions of (the call's features, the variants a store holds). A call is served by
  1. its exact variant, else
  2. the cheapest padded call whose variant is cached, where padding means
     - query heads per KV head r -> r' > r (each KV group padded with zero query heads, as
       SGLang's `_pad_mla_q_heads` does; output and LSE rows cropped back per group),
     - head_dim d -> d' > d and head_dim_v dv -> dv' >= dv (zero columns: q.k and p.v are
       unchanged; the softmax scale stays 1/sqrt(d) of the caller's head_dim; O cropped),
  ranked by extra work: (r'/r) * (d' + dv') / (d + dv) (rows x columns computed).
A decode step (s_q == 1, no window, no sinks) whose ratio r has no exact variant is first
folded, when a non-causal kernel of a ratio r' dividing r is cached: the r query heads of a KV
group become m = r/r' query rows of r' heads (head g*r + j*m + t is row t of head g*r' + j), as
FA2's seqlenq_ngroups_swapped does. One query row sees every key whether causal or not, so the
result is the same; the kernel computes the same r rows per KV head as the exact r:1 kernel, and
q, O and LSE are strided views of the caller's tensors: no padding, no copies (but for a varlen
call's LSE, whose (heads, tokens) layout the fold transposes).
The padded call's variant is recomputed from its CallFeatures (`compile_keys.features`: padding
can move a call across the decode/prefill boundary or change the tile), never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from fa4aot import settings
from fa4aot.model import constraints as C
from fa4aot.model.compile_keys import CallFeatures
from fa4aot.model.variants import MlaRefused, Variant


@dataclass(frozen=True)
class Choice:
    variant: Variant  # the variant that runs
    ratio: int  # query heads per KV head it runs with
    head_dim: int
    head_dim_v: int
    cost: float  # extra work vs the exact call (1.0 = exact)
    exact: bool
    fold: int = 1  # > 1: decode fold, query rows per folded head (ratio * fold = the call's ratio)

    def describe(self, want: Variant | None, ratio: int | None = None) -> str:
        """want: the call's own variant; None for an MLA call FA4 refuses at its ratio
        (`variants.MlaRefused`: no such kernel exists), whose head ratio is then `ratio`."""
        if self.exact:
            return f"exact: {self.variant.describe()} (id {self.variant.id})"
        r0 = want.qhead_per_kvhead if want is not None else ratio
        if self.fold > 1:
            return (
                f"decode fold ({r0} query heads per KV head -> {self.ratio} "
                f"heads x {self.fold} query rows; same work, no copies): "
                f"{self.variant.describe()} (id {self.variant.id})"
            )
        parts = []
        if self.ratio != r0:
            parts.append(f"q heads per KV head {r0} -> {self.ratio}")
        if want is not None and self.head_dim != want.head_dim:
            parts.append(f"head_dim {want.head_dim} -> {self.head_dim}")
        if want is not None and self.head_dim_v != want.head_dim_v:
            parts.append(f"head_dim_v {want.head_dim_v} -> {self.head_dim_v}")
        return (
            f"padded ({', '.join(parts)}; {self.cost:.2f}x the work): "
            f"{self.variant.describe()} (id {self.variant.id})"
        )


def padded_features(
    feat: CallFeatures, ratio: int, head_dim: int, head_dim_v: int
) -> CallFeatures:
    """The padded call: `ratio` query heads per KV head, head dims `head_dim`/`head_dim_v`."""
    return replace(
        feat, num_heads=feat.num_heads_kv * ratio, head_dim=head_dim, head_dim_v=head_dim_v
    )


def fold_from_env() -> bool:
    """FA4AOT_DECODE_FOLD: 1 (default) or 0; read by the runtime and by `fa4aot explain`."""

    return settings.decode_fold()  # SettingError (a ValueError) on a bad value


def foldable(feat: CallFeatures) -> bool:
    """A decode step the fold can serve: one query row per sequence (batch q with s_q == 1, or
    varlen q with max_seqlen_q == 1 and as many rows as sequences, i.e. cu_seqlens_q == arange),
    GQA, no window, no sinks."""
    if feat.sink_dtype is not None or feat.seqused_q or feat.qv is not None:
        return False
    if feat.window_left is not None or feat.window_right is not None:
        return False
    if feat.ratio < 2:
        return False
    if feat.cu_seqlens_q:
        return feat.max_seqlen_q == 1 and feat.total_q == feat.batch
    return feat.seqlen_q == 1


def folded_features(feat: CallFeatures, ratio: int) -> CallFeatures:
    """The folded call: ratio' = `ratio` heads per KV head, m = r / ratio' query rows each,
    q in batch form, no mask."""
    m = feat.ratio // ratio
    return replace(
        feat, num_heads=feat.num_heads_kv * ratio, causal=False, seqlen_q=m,
        total_q=feat.batch * m, max_seqlen_q=None, cu_seqlens_q=False,
    )


def choose(
    arch: str,
    feat: CallFeatures,
    available: Iterable[Variant],
    *,
    allow_padding: bool = True,
    allow_fold: bool = True,
) -> list[Choice]:
    """Every way to serve the call `feat` from `available`, cheapest first. Empty: nothing
    cached can serve it.

    An absorbed-MLA call (feat.qv; its route reads feat.num_sms) is padded in its head
    ratio only, onto MLA kernels (FA4 runs MLA at head dims 64 + 512 alone), as SGLang's
    `_pad_mla_q_heads` does: a ratio FA4's kernel refuses (MlaRefused: 20, 10, 5 on the 2CTA
    kernel) has no exact variant, and the padded ratios FA4 refuses too are skipped."""
    avail = {v.id: v for v in available}
    mla = feat.qv is not None
    try:
        want = feat.variant(arch)
    except MlaRefused:
        want = None
    if want is not None and want.id in avail:
        return [Choice(want, want.qhead_per_kvhead, want.head_dim, want.head_dim_v, 1.0, True)]
    if not allow_padding:
        return []
    r = feat.ratio
    d, dv = feat.head_dim, feat.head_dim_v
    shapes = {
        (v.qhead_per_kvhead, v.head_dim, v.head_dim_v)
        for v in avail.values()
        if v.arch == arch and v.dtype == feat.dtype and (v.mla is not None) == mla
    }
    out = []
    if allow_fold and foldable(feat):
        for r2, d2, dv2 in shapes:
            if r2 < r and r % r2 == 0 and (d2, dv2) == (d, dv):
                v = folded_features(feat, r2).variant(arch)
                if v.id in avail:
                    out.append(Choice(v, r2, d, dv, 1.0, False, fold=r // r2))
    for r2, d2, dv2 in shapes:
        if r2 < r or d2 < d or dv2 < dv or (r2, d2, dv2) == (r, d, dv):
            continue
        if mla:
            if (d2, dv2) != (d, dv):
                continue
        elif C.unsupported_reason(arch, feat.dtype, d2, dv2):
            continue
        try:
            v = padded_features(feat, r2, d2, dv2).variant(arch)
        except MlaRefused:
            continue  # FA4 refuses the padded ratio on this call's route too
        if v.id in avail:
            cost = (r2 / r) * (d2 + dv2) / (d + dv)
            out.append(Choice(v, r2, d2, dv2, cost, False))
    # folds cost 1.0 (widest packing first), any padding more; padding by cost, then ratio
    out.sort(key=lambda c: (c.cost, -c.ratio if c.fold > 1 else c.ratio, c.head_dim, c.head_dim_v))
    return out


# FA4's 2CTA MLA kernel packs a 128-row cluster tile with whole KV groups: its head ratio must
# divide 128 or be a multiple of it (flash_fwd_mla_sm100.py asserts it; tests/build/test_mla.py saw
# GLM-4.7-Flash's 20, 10 and 5 refused). Powers of two always qualify.
MLA_CLUSTER_ROWS = 128


def mla_ratio_ok(ratio: int) -> bool:
    return MLA_CLUSTER_ROWS % ratio == 0 or ratio % MLA_CLUSTER_ROWS == 0


def mla_padded_ratio(ratio: int, available: Iterable[int] | None = None) -> tuple[int, float]:
    """The head ratio an absorbed-MLA (qv) call with `ratio` query heads per latent head runs
    at, and its cost (padded rows / real rows): `ratio` itself when FA4's kernels take it, else
    the cheapest larger ratio they take, among `available` (the cached ratios) when given, else
    the next power of two (20 -> 32, 10 -> 16, 5 -> 8: SGLang's `_pad_mla_q_heads`). Each latent
    group's query heads are padded with zero heads; O and LSE are cropped back to `ratio` heads.
    Raises LookupError when no available ratio serves it."""
    if available is None:
        r2 = ratio if mla_ratio_ok(ratio) else 1 << (ratio - 1).bit_length()
        return r2, r2 / ratio
    cands = sorted(r for r in set(available) if r >= ratio and mla_ratio_ok(r))
    if not cands:
        raise LookupError(f"no cached MLA head ratio >= {ratio} that FA4 runs (divides 128)")
    return cands[0], cands[0] / ratio


def pad_heads(x, ratio: int, ratio2: int, num_kv: int = 1):
    """(..., num_kv * ratio, d) -> (..., num_kv * ratio2, d), each KV group's heads followed by
    zero heads (a torch tensor; the runtime's copy for a padded MLA call)."""
    import torch

    lead, d = x.shape[:-2], x.shape[-1]
    g = x.reshape(*lead, num_kv, ratio, d)
    # one op (one kernel on a GPU), where zeros then a slice copy were two
    out = torch.nn.functional.pad(g, (0, 0, 0, ratio2 - ratio))
    return out.reshape(*lead, num_kv * ratio2, d)


def crop_heads(x, ratio: int, ratio2: int, num_kv: int = 1, head_dim: int = -2):
    """Inverse of pad_heads on the heads axis `head_dim` (O: -2; LSE in FA4's qv layout, heads
    last: -1): keeps each group's first `ratio` heads."""
    x = x.movedim(head_dim, -1)
    lead = x.shape[:-1]
    y = x.reshape(*lead, num_kv, ratio2)[..., :ratio].reshape(*lead, num_kv * ratio)
    return y.movedim(-1, head_dim)


def nearest(want: Variant, available: Iterable[Variant], n: int = 3) -> list[Variant]:
    """Cached variants closest to `want` (for refusals): same arch and dtype, fewest differing
    fields first."""
    cands = [v for v in available if v.arch == want.arch and v.dtype == want.dtype]
    wd = want.to_dict()

    def dist(v):
        return sum(wd[k] != x for k, x in v.to_dict().items())

    return sorted(cands, key=lambda v: (dist(v), v.id))[:n]


def padded_target_for_unsupported(
    arch: str, dtype: str, head_dim: int, head_dim_v: int
) -> tuple[int, int, float] | None:
    """For a head dim FA4 cannot run on `arch`, the nearest larger supported one, with its cost."""
    best = None
    for d2 in range(head_dim, 513, 8):
        for dv2 in range(head_dim_v, 513, 8):
            if C.unsupported_reason(arch, dtype, d2, dv2) is None:
                cost = (d2 + dv2) / (head_dim + head_dim_v)
                if best is None or cost < best[2]:
                    best = (d2, dv2, cost)
                break
    return best


__all__ = [
    "Choice", "choose", "crop_heads", "fold_from_env", "foldable", "folded_features",
    "mla_padded_ratio", "mla_ratio_ok", "nearest", "pad_heads", "padded_features",
    "padded_target_for_unsupported",
]
