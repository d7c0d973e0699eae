"""Absorbed-MLA (qv) kernels on Blackwell: the calls a spec's MLA layer makes, and the FA4
kernels they compile.

Two views of one partition. `mla_layer_plan` (pure, no FA4 import) enumerates the layer's
variants from `compile_keys.mla_features`, a model of FA4's route between its three MLA kernels
(2CTA; 1CTA; 1CTA with 64-key blocks: `_mla_1cta_route`, `_mla_fwd_plan`), of the Q stages
and of the TMA page rule: `fa4aot build --arch sm100/sm103` stores those. `probe_calls` +
`driver.trace_mla` + `mla_plan` take the partition from FA4's own keys (FA4 imported,
compile stubbed); tests/build/test_mla_build.py checks the model against it call by call.
Ratios FA4's 2CTA kernel refuses (GLM-4.7-Flash's 20, 10, 5: not dividing 128) are typed
`Unsupported` rows with FA4's assertion, served by padding to the next ratio FA4 takes
(select.mla_padded_ratio: 32, 16, 8), whose kernels are built; the calls FA4 does take at the
unpadded ratio (its 1CTA kernels, at large decode batches) are built too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fa4aot.model import constraints as C
from fa4aot.model.compile_keys import Call, representative_call
from fa4aot.model.needs import Need, Unsupported
from fa4aot.model.specs import Attention, Spec, layout_forms
from fa4aot.policy.select import mla_padded_ratio, mla_ratio_ok


@dataclass(frozen=True)
class MlaCall:
    """One absorbed-MLA call: q (rope part, head_dim) and qv (latent, head_dim_v) with
    num_heads query heads over one latent K/V head; q packed with cu_seqlens_q; K/V packed
    (varlen, cu_seqlens_k) or paged (page_table + seqused_k)."""

    layout: str  # varlen | paged
    batch: int
    seqlen_q: int
    seqlen_k: int
    num_heads: int  # query heads per GPU (all over one latent KV head)
    head_dim: int
    head_dim_v: int
    dtype: str
    causal: bool
    return_lse: bool
    page_size: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def to_call(self):
        """The same call as a compile_keys.Call (what the builder and coverage take)."""
        return Call(
            layout=self.layout, batch=self.batch, seqlen_q=self.seqlen_q,
            seqlen_k=self.seqlen_k, num_heads=self.num_heads, num_heads_kv=1,
            head_dim=self.head_dim, head_dim_v=self.head_dim_v, dtype=self.dtype,
            causal=self.causal, window_left=None, window_right=None,
            return_lse=self.return_lse, sink_dtype=None, page_size=self.page_size,
            qv=self.head_dim_v,
        )


@dataclass(frozen=True)
class MlaNeed:
    key: str  # FA4's forward compile key, rendered (keys.key_repr): the variant's identity
    call: MlaCall  # the first probe call that compiled it
    calls: int  # how many probe calls share it


def _probe_calls(spec: Spec, att: Attention) -> list[MlaCall]:
    sv = spec.serving
    lses = {False: [False], True: [True], "both": [False, True]}[sv.return_lse]
    ratios = sorted({att.num_q_heads // t for t in sv.tp})  # KV: one latent head, replicated
    phases_q = {
        "decode": sorted({1, sv.speculative}),
        "prefill": [sv.speculative + 1, min(sv.max_context, 4096)],
    }
    # the 1CTA/2CTA route turns on batch x heads against the SM count: probe both sides
    batches = sorted({1, 8, 64, sv.max_batch})
    calls = []
    for name in sv.layouts:
        kv = layout_forms(name)[1].split("+")[0]
        if kv not in ("packed", "paged"):
            continue  # the probed forms: packed q over packed or paged K/V
        layout = "paged" if kv == "paged" else "varlen"
        pages = [p for p in sv.page_sizes if p != "tile"] if layout == "paged" else [None]
        if layout == "paged" and "tile" in sv.page_sizes:
            pages.append(128)
        for r in ratios:
            for phase in sv.phases:
                for sq in phases_q[phase]:
                    for b in batches:
                        for p in dict.fromkeys(pages):
                            for lse in lses:
                                calls.append(
                                    MlaCall(layout, b, sq, max(sq, 1024), r, att.head_dim,
                                            att.head_dim_v, att.dtype, att.causal, lse, p)
                                )
    return calls


def mla_layers(spec: Spec) -> list[Attention]:
    return [a for a in spec.attention if a.qv is not None]


def probe_calls(spec: Spec, arch: str) -> list[MlaCall]:
    """Every probe call of the spec's MLA layers on `arch` (Blackwell only; [] elsewhere)."""
    if not C.is_blackwell(arch):
        return []
    return [c for a in mla_layers(spec) for c in _probe_calls(spec, a)]


@dataclass(frozen=True)
class MlaRefused:
    call: MlaCall
    reason: str  # FA4's own assertion, with where it fired


def mla_plan(traced: list[tuple]) -> tuple[list[MlaNeed], list[MlaRefused]]:
    """driver.trace_mla's (call, forward keys, refusal) rows -> the distinct kernels (first
    caller kept) and the calls FA4 refuses. Raises ValueError if a call compiled other than one
    forward kernel (the partition would be ambiguous)."""
    out: dict[str, MlaNeed] = {}
    refused = []
    for call, keys, error in traced:
        if error is not None:
            refused.append(MlaRefused(call, error))
            continue
        if len(keys) != 1:
            raise ValueError(f"{call}: FA4 compiled {len(keys)} forward kernels, expected 1")
        k = keys[0]
        n = out.get(k)
        out[k] = MlaNeed(k, call, 1) if n is None else MlaNeed(k, n.call, n.calls + 1)
    return list(out.values()), refused


def _mla_forms(spec: Spec) -> list[tuple[str, int | None]]:
    """(K/V layout, page size) pairs of the spec's layouts FA4's MLA entry is probed with: q
    packed over packed (varlen) or paged K/V; "tile" pages are 128 (every MLA route's TMA page
    but kb64's, which takes any multiple of 64)."""
    sv = spec.serving
    out = []
    for name in sv.layouts:
        kv = layout_forms(name)[1].split("+")[0]
        if kv == "packed":
            out.append(("varlen", None))
        elif kv == "paged":
            out += [("paged", 128 if p == "tile" else p) for p in sv.page_sizes]
    return list(dict.fromkeys(out))


def _seqlens(lo: int, hi: int, ratio: int) -> list[int]:
    """Query lengths in [lo, hi] on both sides of every boundary FA4's MLA kernels have: one
    query row (kb64), 64 rows (1CTA), 128 and 256 rows (one or two Q stages; one M tile)."""
    pts = {lo, lo + 1, hi}
    for rows in (C.MLA_DECODE_ROWS, 128, 256):
        pts |= {rows // ratio, rows // ratio + 1}
    return sorted(p for p in pts if lo <= p <= hi)


def mla_layer_plan(spec: Spec, att: Attention, arch: str, num_sms: int | None = None):
    """The variants (Need) an MLA layer needs on Blackwell `arch`, and its Unsupported rows.

    For each TP degree's head ratio, every regime the serving envelope reaches (decode: query
    lengths 1..speculative; prefill: speculative+1..min(max_context, 4096) with the boundaries
    between; batch 1 and max_batch; each K/V form and page size; LSE as the spec says). The 1CTA
    routes are included when 2 x max_batch exceeds the SM count (`num_sms`; the arch's default;
    unknown, sm103: assumed reached). A ratio FA4's 2CTA kernel refuses is an Unsupported row
    with FA4's assertion, served by padding (select.mla_padded_ratio), whose ratio's regimes are
    added; what FA4 takes at the unpadded ratio is built as well."""

    sv = spec.serving
    lses = {False: [False], True: [True], "both": [False, True]}[sv.return_lse]
    sms = num_sms or C.DEFAULT_NUM_SMS.get(arch) or max(2, 2 * sv.max_batch - 1)
    tps: dict[int, list[int]] = {}
    for t in sv.tp:
        tps.setdefault(att.num_q_heads // t, []).append(t)
    spans = {"decode": (1, max(1, sv.speculative)),
             "prefill": (sv.speculative + 1, max(sv.speculative + 1, min(sv.max_context, 4096)))}
    needs: dict[str, Need] = {}
    unsupported = []

    def walk(ratio: int) -> tuple[int, list[str]]:
        """-> (calls probed, FA4's refusals); adds the needs"""
        n, refused = 0, []
        for layout, page in _mla_forms(spec):
            for phase in sv.phases:
                for sq in _seqlens(*spans[phase], ratio):
                    for b in sorted({1, sv.max_batch}):
                        for lse in lses:
                            call = MlaCall(layout, b, sq, max(sq, 1024), ratio, att.head_dim,
                                           att.head_dim_v, att.dtype, att.causal, lse,
                                           page).to_call()
                            n += 1
                            try:
                                v = call.variant(arch, sms)
                            except ValueError as e:
                                refused.append(str(e))
                                continue
                            if v.id not in needs:
                                needs[v.id] = Need(v, representative_call(v), spec.name, att.name)
        return n, refused

    for ratio, tp in sorted(tps.items()):
        n, refused = walk(ratio)
        if not refused:
            continue
        reasons = sorted(set(refused))
        why = (f"{ratio} query heads per latent head (TP {', '.join(map(str, tp))}): FA4 refuses "
               f"{len(refused)} of {n} probed calls: {'; '.join(reasons)}")
        if mla_ratio_ok(ratio) or any("does not model" in r for r in reasons):
            unsupported.append(Unsupported(spec.name, att.name, why))
            continue
        r2, cost = mla_padded_ratio(ratio)
        _, again = walk(r2)
        if again:  # FA4 refuses the padded ratio too: nothing serves these calls
            unsupported.append(Unsupported(spec.name, att.name, why))
            continue
        unsupported.append(Unsupported(
            spec.name, att.name, why,
            f"padding {ratio} -> {r2} query heads per latent head ({cost:.2f}x the work; zero "
            f"heads per group, O and LSE cropped): the ratio-{r2} MLA kernels are built",
        ))
    return list(needs.values()), unsupported
