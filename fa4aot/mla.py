"""Absorbed-MLA (qv) kernels on Blackwell: the calls a spec's MLA layer makes, and the FA4
kernels they compile, found by tracing FA4's own entry point (compiler.trace_mla).

Why tracing, not a feature model as variants.features() is for sm90: FA4 routes an MLA call to
one of three kernels (2CTA; 1CTA; 1CTA with 64-key blocks) from the batch, the head ratio, the
query length and the SM count (`_mla_1cta_route`, `_mla_fwd_plan`), and its key holds the real
head ratio. Modelling that by hand would drift with every FA4 release; FA4's own key is the
partition. `fa4aot build` does not store these kernels yet (the runtime does not serve qv calls yet:
constraints.mla_reason); `mla_plan` + `compiler.compile_mla` cross-compile them on request.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from . import constraints as C
from .specs import Attention, Spec, layout_forms


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


@dataclass(frozen=True)
class MlaNeed:
    key: str  # FA4's forward compile key, rendered (compiler.key_repr): the variant's identity
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
    """compiler.trace_mla's (call, forward keys, refusal) rows -> the distinct kernels (first
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
