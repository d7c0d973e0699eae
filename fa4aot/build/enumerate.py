"""Enumeration: a spec x arch -> the distinct variants it needs, each with one representative
call the builder compiles it from (pure; no FA4 import, milliseconds)."""

from __future__ import annotations

from dataclasses import replace

from fa4aot.build.mla import mla_layer_plan
from fa4aot.fa4 import vllm_copy
from fa4aot.model import constraints as C
from fa4aot.model.compile_keys import Call, call_layout, representative_call, selection_sms
from fa4aot.model.needs import Need, Plan, Unsupported
from fa4aot.model.specs import Attention, Spec, layout_forms
from fa4aot.policy.select import padded_target_for_unsupported


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


def _probe_calls(spec: Spec, att: Attention, arch: str, num_sms: int | None = None,
                 fa4: str = "upstream") -> list[Call]:
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
    if fa4 == "upstream":
        # the twins on a 64-row M tile (constraints.small_m_tile: the runtime prefers them where
        # a call's rows fit) of the decode steps that run unsplit on FA4's kernel: speculative
        # ones, and one-row ones of a layer the decode fold does not take
        unfolded = att.sinks or att.window is not None or att.softcap
        rows = {1, sv.speculative} if unfolded else {sv.speculative} - {1}
        calls += [replace(c, tile_m=v.tile_m) for c in calls if c.seqlen_q in rows
                  and "decode" in sv.phases
                  and (v := c.features(num_sms).small_tile_variant(arch)) is not None]
    else:
        # fa4aot's fold and split kernels patch upstream FA4's internals: from another source
        # only its plain forwards are built (the runtime serves those calls unsplit), plus
        # FP8-KV dequant's paged kernels at page == tile_n where the spec asks for them
        fp8 = [c for c in calls if c.layout == "paged" and c.page_size == C.fwd_tile(
            arch, att.head_dim, att.head_dim_v, *C.resolve_window(
                att.causal, *window)[:2]).n]
        if C.FP8_KV in sv.kv_cache_dtypes and not C.kv_dtype_reason(
                arch, fa4, att.dtype, C.FP8_KV, att.head_dim, att.head_dim_v):
            calls += [replace(c, kv_dtype=C.FP8_KV) for c in fp8]
        return calls
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
        # the fold runs q in batch form over the call's own K/V form (select.folded_features)
        form = call_layout("batch", layout_forms(name)[1])
        if tuple(form.items()) in seen:
            continue
        seen.add(tuple(form.items()))
        pages = page_sizes_for(spec, att, arch) if form["layout"] == "paged" else [None]
        calls += [_one_to_one_call(att, p, lse, **form) for p in pages for lse in lses]
    return calls


def enumerate_variants(spec: Spec, arch: str, num_sms: int | None = None,
                       fa4: str = "upstream") -> Plan:
    """spec x arch -> the distinct variants it needs (pure; no FA4 import, milliseconds).
    A spec whose `[serving] archs` leaves `arch` out needs nothing there. fa4: the FA4 source's
    ABI (model/abis.py): what it can build (vLLM's: hd512 and FP8-KV dequant on sm90; no fold
    or split kernels)."""
    plan = Plan()
    if not spec.serving.for_arch(arch):
        return plan
    for att in spec.attention:
        if att.qv is not None:
            # checked first: on sm90 the hd 64/512 shape must not be "served" by head-dim padding
            if not C.is_blackwell(arch):
                plan.unsupported.append(Unsupported(spec.name, att.name, C.mla_reason(arch)))
                continue
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
            fa4=fa4,
        )
        if C.FP8_KV in spec.serving.kv_cache_dtypes and not reason and C.fp8_kv_applies(
                att.head_dim):
            why = C.kv_dtype_reason(arch, fa4, att.dtype, C.FP8_KV, att.head_dim,
                                    att.head_dim_v)
            if why:  # (the layer's own-dtype kernels are still built)
                plan.unsupported.append(Unsupported(spec.name, att.name + " (FP8 KV cache)",
                                                   why))
        if reason:
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
        first = len(plan.needs)
        for call in _probe_calls(spec, att, arch, num_sms, fa4):
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
        if fa4 == "vllm" and spec.serving.split_kv:
            # long decode steps split on the copy's own split forward and combines
            plan.needs += vllm_copy.split_needs(plan.needs[first:])
    return plan


def merge(plans: list[Plan]) -> Plan:
    out = Plan()
    for p in plans:
        out.needs.extend(p.needs)
        out.unsupported.extend(p.unsupported)
    return out


