"""`fa4aot explain`: how the runtime would serve one call. Its own module: the runtime's plan
kinds (exact, decode fold, padding, and later split-KV) each add a line here."""

from __future__ import annotations

import sys
from dataclasses import replace

import click

from fa4aot import settings
from .app import main
from .common import (
    apply_gpu,
    cache_option,
    gpu_option,
    layers_for,
    loadable_artifacts,
    matching_stores,
    source_abi,
)
from .output import with_output
from fa4aot.model import constraints as C
from fa4aot.model.abis import source_reason
from fa4aot.store.toolchain import mismatches, runtime_expectation
from fa4aot.model.compile_keys import Call, native_split_variant, split_kernel_variant
from fa4aot.model.variants import MlaRefused, Variant
from fa4aot.policy import ragged as RG
from fa4aot.policy import split as S
from fa4aot.policy.select import (
    choose, fold_from_env, mla_padded_ratio, nearest, padded_features,
)


def _cached_artifacts(layers, arch: str, num_sms: int, python: str | None):
    """-> (loadable artifacts of the stores serving the target, {id: why} of corrupt ones, the
    Match): what the runtime would load, checked as it checks them."""
    match = matching_stores(layers, arch, num_sms, python)
    if settings.fa4_source() not in ("auto", "upstream"):
        # an engine copy's stores (their `fa4` names the copy, not the installed flash-attn-4):
        # those the runtime serves under FA4AOT_KERNEL_SOURCE, matched as it matches them
        want = runtime_expectation(arch, num_sms)
        every = match.stores + match.others
        match.stores = [s for s in every if not mismatches(s.toolchain, want)]
        match.others = [s for s in every if s not in match.stores]
    found = loadable_artifacts(match.stores)
    return found.artifacts, found.corrupt, match


@main.command()
@click.option("--arch", default="sm90", show_default=True, type=click.Choice(sorted(C.ARCHS)))
@click.option(
    "--num-sms", type=click.IntRange(1, 1024), help="SM count of the GPU (default: the arch's)."
)
@gpu_option()
@click.option(
    "--dtype", default="bfloat16", show_default=True,
    type=click.Choice(["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"]),
    help="q/k/v dtype; FP8 (Blackwell) calls pass descales (--descales).",
)
@click.option(
    "--descales", type=click.Choice(["q", "k", "v", "qk", "qv", "kv", "qkv"]),
    help="FP8: which of q/k/v_descale the call passes (a kernel per set; default qkv, what "
    "`fa4aot build` makes for an FP8 layer).",
)
@click.option("--heads", required=True, help="Query heads : KV heads, e.g. 20:1 or 32:8.")
@click.option("--head-dim", type=click.IntRange(1, 1024), required=True)
@click.option("--head-dim-v", type=click.IntRange(1, 1024))
@click.option(
    "--layout", type=click.Choice(["dense", "varlen", "padded", "paged"]),
    help="K/V layout (q packed but for dense; padded: a KV cache in batch form with "
    "seqused_k). Default: dense; varlen with --qv (the MLA kernels take q packed).",
)
@click.option("--batch", default=1, show_default=True, type=click.IntRange(1))
@click.option("--seqlen-q", default=1, show_default=True, type=click.IntRange(1))
@click.option(
    "--seqlen-k",
    type=click.IntRange(1),
    help="KV length (the bound the runtime sees: max_seqlen_k, the page table's capacity, the "
    "dense K's length, or a padded KV cache's capacity): shows the split-KV plan of a decode "
    "step.",
)
@click.option("--page-size", type=click.IntRange(1), help="KV page size (paged layout).")
@click.option("--causal/--no-causal", default=True, show_default=True)
@click.option("--window", type=click.IntRange(0), help="Left sliding window (tokens).")
@click.option("--lse", is_flag=True, help="The call returns the LSE.")
@click.option("--sink", is_flag=True, help="The call passes float32 learnable sinks.")
@click.option("--no-padding", is_flag=True, help="As with FA4AOT_PADDING=deny.")
@click.option(
    "--hbm-tbps", type=click.FloatRange(0, min_open=True),
    help="HBM peak of the GPU in TB/s, which scales the split plans' cost model (default: "
    "--gpu's, else the H200's 4.8; the runtime reads its card's own).",
)
@click.option(
    "--qv",
    type=click.IntRange(1, 1024),
    help="Absorbed MLA: the latent head dim FA4 takes as qv (512; --head-dim is then the rope "
    "part, 64). Shows FA4's MLA route and the head-ratio padding the runtime serves it with.",
)
@click.option(
    "--fa4",
    "fa4",
    help="The FA4 source whose stores serve the call (as FA4AOT_KERNEL_SOURCE picks them): "
    "upstream, vllm, sglang, or a path to a source tree's cute/ directory (its ABI is read "
    "from it). Default: FA4AOT_KERNEL_SOURCE.",
)
@cache_option("read")
@with_output
def explain(
    arch, num_sms, gpu, dtype, descales, heads, head_dim, head_dim_v, layout, batch, seqlen_q,
    seqlen_k, page_size, causal, window, lse, sink, no_padding, hbm_tbps, qv, fa4, cache, out,
):  # fmt: skip
    """How the runtime would serve a call: its variant, then an exact hit, a decode fold, a
    padding plan (with its cost) or the refusal; with --seqlen-k, whether a decode step splits
    its KV (split-KV on sm90; FA4's native split on sm100/sm103) and how. FP8 calls (Blackwell)
    are served by kernels of their descale set. Exit 1 when nothing can serve it."""

    with settings.scope(**({} if fa4 is None else {"kernel_source": source_abi(fa4)})):
        _explain(
            arch, num_sms, gpu, dtype, descales, heads, head_dim, head_dim_v, layout, batch,
            seqlen_q, seqlen_k, page_size, causal, window, lse, sink, no_padding, hbm_tbps, qv,
            cache, out,
        )  # fmt: skip


def _explain(
    arch, num_sms, gpu, dtype, descales, heads, head_dim, head_dim_v, layout, batch, seqlen_q,
    seqlen_k, page_size, causal, window, lse, sink, no_padding, hbm_tbps, qv, cache, out,
):  # fmt: skip
    hq, hk = _heads(heads)
    if (layout == "paged") != (page_size is not None):
        raise click.BadParameter(
            "--page-size goes with --layout paged (and only with it)", param_hint="--page-size"
        )
    fp8 = dtype.startswith("float8")
    if descales is not None and not fp8:
        raise click.BadParameter(
            "descales scale FP8 q/k/v only (FA4 asserts the same)", param_hint="--descales"
        )
    if fp8 and descales is None:
        descales = "qkv"
    arch, num_sms = apply_gpu(gpu, arch, num_sms)
    num_sms = num_sms or C.default_num_sms(arch)
    if qv is not None:
        return _explain_mla(
            out, arch, num_sms, dtype, hq, hk, head_dim, qv, layout or "varlen", batch,
            seqlen_q, page_size, causal, lse, no_padding, cache,
        )
    layout = layout or "dense"
    call = Call(
        layout=layout, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_q, num_heads=hq,
        num_heads_kv=hk, head_dim=head_dim, head_dim_v=head_dim_v or head_dim, dtype=dtype,
        causal=causal, window_left=window,
        window_right=None if window is None else (0 if causal else window), return_lse=lse,
        sink_dtype="float32" if sink else None, page_size=page_size, descales=descales,
    )
    # hd256 on Blackwell: FA4 picks pack_gqa and 2CTA by batch x heads vs SMs
    feat = call.features(num_sms if C.is_blackwell(arch) else None)
    want = feat.variant(arch)
    settings.check()
    layers = layers_for(cache, out, strict=False)
    arts, corrupt, match = _cached_artifacts(layers, arch, num_sms, None)
    avail = [Variant.from_dict(a.record["variant"]) for a in arts]
    # the FA4 source the served stores were built from (FA4AOT_KERNEL_SOURCE, or --fa4)
    fa4 = settings.fa4_source()
    if fa4 == "auto":
        fa4 = match.stores[0].fa4_abi if match.stores else "upstream"
    why = C.unsupported_reason(
        arch, dtype, head_dim, head_dim_v or head_dim, qhead_per_kvhead=hq // hk, fa4=fa4
    ) or source_reason(fa4, sink_dtype=call.sink_dtype)
    allow_fold = fold_from_env()  # as the runtime reads it (SettingError: exit 1)
    choices = choose(arch, feat, avail, allow_padding=not no_padding, allow_fold=allow_fold)
    split_doc = None
    hbm = hbm_tbps * 1e12 if hbm_tbps else C.GPU_HBM.get(gpu)
    if seqlen_k is not None and C.is_blackwell(arch):
        split_doc = _native_split_plan(
            arch, num_sms, feat, choices, arts, layout, batch, seqlen_q, seqlen_k
        )
    elif seqlen_k is not None:
        split_doc = _split_plan(
            arch, num_sms, dtype, hq, hk, head_dim, head_dim_v or head_dim, layout, batch,
            seqlen_q, seqlen_k, page_size, causal, window, sink, arts, hbm,
        )
        split_doc["hbm_tbps"] = round((hbm or S.H200_HBM_PEAK) / 1e12, 3)
    fp8_doc = _fp8_doc(dtype, descales) if fp8 else None
    # the call's twin on a 64-row M tile, which the runtime serves first where cached
    # (plan.resolve), whatever else the store holds
    twin = None if why else feat.small_tile_variant(arch)
    if twin is not None and twin.id not in {v.id for v in avail}:
        twin = None
    doc = {
        "variant": want.to_dict(),
        "id": want.id,
        "fa4": fa4,
        "description": want.describe(),
        "fa4_unsupported": why,
        "choices": [_choice_doc(c, want) for c in choices],
        "small_tile": None if twin is None else {"id": twin.id, "description": twin.describe()},
        "nearest": []
        if choices or twin
        else [{"id": v.id, "description": v.describe()} for v in nearest(want, avail)],
        "corrupt": corrupt.get(want.id),
        "stores": [str(s.dir) for s in match.stores],
        "split": split_doc,
        "fp8": fp8_doc,
    }
    split_serves = bool(split_doc and (split_doc["splits"] or split_doc.get("fold")))
    if out.as_json:
        out.document(doc)
    else:
        if fa4 != "upstream":
            out.text(f"FA4 source  : {fa4} (stores built with `fa4aot build --fa4 {fa4}`)")
        _print(out, want, why, fp8_doc, split_doc, split_serves, hbm, choices, avail, corrupt,
               match, twin)
    if not choices and twin is None and not split_serves:
        sys.exit(1)


def _fp8_doc(dtype: str, descales: str) -> dict:
    return {
        "descales": descales,
        "out_dtype": "bfloat16",
        "plan": f"FP8 {dtype} with {', '.join(f'{n}_descale' for n in descales)} (float32 "
        "(batch, num_kv_heads) each; another set is another kernel); padding and the decode "
        "fold keep the batch and the KV heads, so the descales pass on unchanged; O is "
        "bfloat16",
    }


def _choice_doc(c, want) -> dict:
    return {
        "id": c.variant.id, "exact": c.exact, "ratio": c.ratio, "head_dim": c.head_dim,
        "head_dim_v": c.head_dim_v, "cost": round(c.cost, 3), "fold": c.fold,
        "plan": c.describe(want),
    }


def _heads(heads: str) -> tuple[int, int]:
    """--heads Q:KV -> (Q, KV), KV dividing Q."""
    try:
        hq, hk = (int(x) for x in heads.split(":"))
        assert hq > 0 and hk > 0 and hq % hk == 0
    except (ValueError, AssertionError):
        raise click.BadParameter(
            f"expected Q:KV with KV dividing Q, e.g. 32:8; got {heads!r}", param_hint="--heads"
        )
    return hq, hk


def _print(out, want, why, fp8_doc, split_doc, split_serves, hbm, choices, avail, corrupt, match,
           twin):
    """explain's text form."""

    out.text(f"call variant: {want.describe()} (id {want.id})")
    if why:
        out.text(f"FA4 cannot run it exactly: {why}")
    if fp8_doc and not why:
        out.text(f"fp8         : {fp8_doc['plan']}")
    if split_serves:
        out.text(f"served by   : {split_doc.get('plan') or split_doc['fold']}")
    if split_doc and not split_doc["splits"]:
        out.text(f"split-KV    : no ({split_doc['why']})")
    if split_doc and split_doc.get("ragged_why"):
        out.text(f"ragged plan : no ({split_doc['ragged_why']})")
    if split_doc and hbm:
        out.text(f"cost model  : the split plans' for HBM at {split_doc['hbm_tbps']} TB/s")
    if choices or twin is not None:
        head = "unsplit     :" if split_serves else "served by   :"
        if twin is not None:
            out.text(f"{head} {twin.describe()} (id {twin.id}): the rows fit a 64-row M tile")
        else:
            out.text(f"{head} {choices[0].describe(want)}")
        # beside the twin, FA4's own tile is an alternative too
        for c in (choices if twin is not None else choices[1:])[:3]:
            out.text(f"alternative : {c.describe(want)}")
    elif not split_serves:
        out.text("served by   : nothing cached (the runtime raises ArtifactMissing)")
        for v in nearest(want, avail):
            out.text(f"nearest     : {v.describe()} ({v.id})")
    if corrupt.get(want.id):
        out.text(f"corrupt     : the exact artifact fails its checks: {corrupt[want.id]}")
    if not match.stores:
        out.text(f"stores      : none for this target; {match.describe_others()}")


_MLA_NO_SPLIT = ("absorbed MLA runs unsplit whatever FA4AOT_SPLIT_KV says: FA4 splits it only "
                 "on its 1CTA kernel with its own plan, which fa4aot does not build")


def _explain_mla(
    out, arch, num_sms, dtype, hq, hk, head_dim, qv, layout, batch, seqlen_q, page_size, causal,
    lse, no_padding, cache,
) -> None:  # fmt: skip
    """An absorbed-MLA (qv) call, as the runtime serves it (runtime/mla.py): the call's own
    variant (FA4's route: 2CTA, 1CTA or 1CTA-kb64, from batch x heads against the SM count), or
    FA4's refusal at its head ratio; then what select.choose finds among the cached kernels
    (exact, or the head ratio padded: 20 -> 32...), as the runtime's plan step calls it. Exit 1
    when nothing serves it."""

    ratio = hq // hk
    doc: dict = {"arch": arch, "mla": True, "ratio": ratio, "head_dim": head_dim, "qv": qv}
    problems = []
    if hk != 1:
        problems.append(f"absorbed MLA shares one latent K/V head, got {hk}")
    if (head_dim, qv) != (64, 512):
        problems.append(f"FA4 runs MLA at head_dim 64 with qv 512 only, got {head_dim}/{qv}")
    if not C.is_blackwell(arch):
        problems.append(C.mla_reason(arch))
    if layout == "dense":
        problems.append("the MLA kernels take q packed (the runtime's flash_attn_func refuses "
                        "qv): --layout varlen or paged")
    r2, cost = mla_padded_ratio(ratio)
    want = refused = None
    choices = []
    stores: list = []
    if not problems:
        call = Call(
            layout=layout, batch=batch, seqlen_q=seqlen_q, seqlen_k=max(seqlen_q, 1024),
            num_heads=hq, num_heads_kv=hk, head_dim=head_dim, head_dim_v=qv, dtype=dtype,
            causal=causal, window_left=None, window_right=None, return_lse=lse,
            sink_dtype=None, page_size=page_size, qv=qv,
        )  # fmt: skip
        feat = call.features(num_sms)  # the route reads the SM count
        try:
            want = feat.variant(arch)
        except MlaRefused as e:
            refused = str(e)
        except ValueError as e:
            problems.append(str(e))
    if refused and no_padding:
        problems.append(f"ratio {ratio} needs padding to {r2} (FA4's 2CTA MLA kernel takes "
                        "ratios dividing 128) and --no-padding refuses it")
    if not problems:
        layers = layers_for(cache, out, strict=False)
        arts, _, match = _cached_artifacts(layers, arch, num_sms, None)
        stores = [str(s.dir) for s in match.stores]
        avail = [Variant.from_dict(a.record["variant"]) for a in arts]
        choices = choose(arch, feat, avail, allow_padding=not no_padding, allow_fold=False)
    if choices and not choices[0].exact:
        r2, cost = choices[0].ratio, choices[0].cost
    doc.update(
        padded_ratio=r2, cost=cost, problems=problems,
        variant=None if want is None else want.to_dict(), id=None if want is None else want.id,
        description=None if want is None else want.describe(), fa4_refuses=refused,
        choices=[{"id": c.variant.id, "exact": c.exact, "ratio": c.ratio,
                  "cost": round(c.cost, 3), "plan": c.describe(want, ratio)} for c in choices],
        stores=stores,
        split={"splits": 0, "why": _MLA_NO_SPLIT},
    )  # fmt: skip
    if out.as_json:
        out.document(doc)
    else:
        out.text(f"MLA call    : {arch} {hq}:{hk} heads, rope {head_dim} + latent {qv}")
        if want is not None:
            out.text(f"call variant: {want.describe()} (id {want.id})")
        if refused:
            out.text(f"FA4 refuses : {refused}")
            out.text(
                f"padding     : q heads per latent head {ratio} -> {r2} ({cost:.2f}x the work; "
                "zero heads per group, O and LSE cropped)"
            )
        for c in choices[:1]:
            out.text(f"served by   : {c.describe(want, ratio)}")
        for c in choices[1:4]:
            out.text(f"alternative : {c.describe(want, ratio)}")
        if not problems and not choices:
            out.text("served by   : nothing cached (the runtime raises ArtifactMissing)")
        if not problems:
            out.text(f"split-KV    : no ({_MLA_NO_SPLIT})")
        for p in problems:
            out.text(f"refused     : {p}")
    if problems or not choices:
        sys.exit(1)


def _native_split_plan(
    arch, num_sms, feat, choices, arts, layout, batch, seqlen_q, seqlen_k
) -> dict:
    """The runtime's native split-KV decision on Blackwell (runtime/blackwell.py: FA4's own
    split kernels, `compile_keys.native_split_variant`) for the kernel that serves the call
    (`choices[0]`; a padded call splits on its padded re-entry): {"splits": n or 0,
    "plan"/"why": text}."""

    setting = settings.split_kv()
    setting = -1 if setting == "auto" else setting
    how = "FA4's heuristic" if setting < 0 else f"FA4AOT_SPLIT_KV={setting}"
    c = choices[0] if choices else None
    why = None
    if setting == 0:
        why = "FA4AOT_SPLIT_KV=0"
    elif c is None:
        why = "no kernel serves the call (a split runs on the kernel the call is served by)"
    elif c.fold > 1:
        why = "a decode fold runs unsplit"
    elif feat.cu_seqlens_q and batch > C.BIN_BATCH_SEARCH_THRESH:
        why = ("q packed (cu_seqlens_q) at batch > 256: FA4 would compute per-batch split "
               "counts with its scheduler-metadata kernel, which fa4aot does not ship")
    elif c.variant.head_dim != c.variant.head_dim_v:
        why = "unequal head dims: FA4 re-tiles that split, which fa4aot does not build"
    if why is None:
        f = feat if c.exact else padded_features(feat, c.ratio, c.head_dim, c.head_dim_v)
        if f.cu_seqlens_q:  # seqlen_q rows per sequence: split as q in batch form
            f = replace(f, cu_seqlens_q=False)
        _, _, wl, wr = C.resolve_window(feat.causal, feat.window_left, feat.window_right)
        n, sv = native_split_variant(
            arch, num_sms, c.variant, f, batch, seqlen_q, seqlen_k, wl, wr, setting
        )
        rec = None if sv is None else _record(arts, sv.id)
        if n <= 1:
            why = (f"{how}: one split ({batch} x {feat.num_heads_kv} KV heads over "
                   f"{seqlen_k} keys on {num_sms} SMs)")
        elif sv is None:
            why = f"{how} says {n} splits, but fa4aot models no split kernel for this call"
        elif rec is None or "combine" not in rec["parts"]:
            why = (f"{how} says {n} splits, but the split kernel {sv.describe()} (id {sv.id}) "
                   "is not cached with its combine")
    if why is not None:
        return {"splits": 0, "why": why}
    return {
        "splits": n,
        "kernel": sv.id,
        "plan": f"FA4's native split-KV, {n} splits ({how}): {sv.describe()} (id {sv.id}), "
        "float32 partials merged by its combine kernel",
    }


def _record(arts, vid: str) -> dict | None:
    """The record of cached artifact `vid` among `arts`, or None."""
    return next((a.record for a in arts if a.id == vid), None)


def _split_plan(
    arch, num_sms, dtype, hq, hk, d, dv, layout, batch, seqlen_q, seqlen_k, page_size, causal,
    window, sink, arts, hbm=None,
) -> dict:
    """The runtime's split-KV decision for this call (runtime.Runtime.split_for and the entry
    points' checks, from the same pure functions) on a card whose HBM peaks at `hbm` bytes/s
    (None: the H200's): {"splits": n or 0, "plan"/"why": text}."""

    setting = settings.split_kv()
    setting = -1 if setting == "auto" else setting
    dense_pages = ""
    padded = layout == "padded"  # a KV cache in batch form: its own page pool at any rows
    if padded or (layout == "dense" and seqlen_q > 1):  # several rows: a dense K as pages

        def cached(p):
            v = split_kernel_variant(arch, dtype, d, dv, p)
            rec = _record(arts, v.id)
            return S.merge_part(rec["parts"] if rec else {}, dtype)[0] is not None

        page_size = S.dense_page_size(seqlen_k, cached)
        if page_size:
            dense_pages = (f", the {'KV cache' if padded else 'dense K'} viewed as pages of "
                           f"{page_size}")
    row_bounds = True
    if seqlen_q > 1 and layout not in ("paged", "padded") and not dense_pages:  # (likewise)
        rec = _record(arts, split_kernel_variant(arch, dtype, d, dv, None).id)
        row_bounds = bool(rec and S.bounds_part(rec["parts"]))
    why = S.split_refusal(
        causal=causal, window=window is not None, seqlen_q=seqlen_q,
        paged=layout == "paged" or bool(dense_pages), max_seqlen_q_known=True,
        row_bounds=row_bounds,
    )
    if why is None and padded and not dense_pages:
        why = (f"no cached paged split kernel's page size ({', '.join(map(str, S.DENSE_PAGES))})"
               f" divides the KV cache's {seqlen_k} keys")
    if why is None and seqlen_q > S.MAX_ROWS:
        why = f"{seqlen_q} query rows: split-KV plans take decode steps of at most {S.MAX_ROWS}"
    if why is None and seqlen_k <= S.NEVER_SPLIT_KEYS:
        why = f"{seqlen_k} keys: at most {S.NEVER_SPLIT_KEYS} never split"
    kern = split_kernel_variant(arch, dtype, d, dv, page_size)
    rec = _record(arts, kern.id)
    merge_name, _ = S.merge_part(rec["parts"] if rec else {}, dtype)
    if why is None and merge_name is None:
        why = (f"the split kernel {kern.describe()} (id {kern.id}) is not cached with its "
               "merge kernel")
    sp = doc = None
    fold_why = S.fold_refusal(arch=arch, head_dim=d, head_dim_v=dv, ratio=hq // hk,
                              rows=seqlen_q, sink=sink)
    rg = ragged_why = None
    if why is None and layout != "dense" and RG.ragged_parts(rec["parts"]):
        # (runtime/splitkv._new_run: the ragged plan, from the same functions)
        rg_slots = int(rec["parts"][merge_name].get("max_splits", S.MAX_SLOTS))
        rg = RG.plan_ragged(
            batch=batch, rows=seqlen_q, kv_heads=hk, seqlen_k=S.plan_bucket(seqlen_k),
            bytes_per_key=(d + dv) * 2, page_size=page_size, sink=sink, num_sms=num_sms,
            setting=setting, max_slots=rg_slots, causal=causal,
        )
    if why is None:
        bucket = S.plan_bucket(seqlen_k)  # as the runtime plans it
        # the runtime's own decision (runtime/splitkv.split_step takes the same two steps)
        sp = S.plan_step(
            S.kernel_facts(rec["parts"], kern, page_size, dtype), batch=batch, rows=seqlen_q,
            kv_heads=hk, ratio=hq // hk, tile_m=C.split_tile_m(arch, d, dv), seqlen_k=seqlen_k,
            bytes_per_key=(d + dv) * 2, page_size=page_size, sink=sink, causal=causal,
            num_sms=num_sms, setting=setting, fold=fold_why is None,
            meta=padded or not dense_pages, model=S.model_for(hbm),
        )
        if rg is not None:
            uniform = False  # (several rows keep the ragged plan)
            if seqlen_q == 1:
                uniform, sp = RG.uniform_instead(
                    sp, batch=batch, kv_heads=hk, seqlen_k=bucket, bytes_per_key=(d + dv) * 2,
                    num_sms=num_sms, max_slots=rg_slots, sink=sink, page_size=page_size)
            if not uniform:
                return _ragged_doc(rg, kern, rec["parts"], page_size, hk, num_sms, dense_pages)
            ragged_why = (f"one row a sequence in chunks of at most "
                          f"{RG.RAGGED_MIN_CHUNK_BYTES >> 20} MiB a KV head, at most "
                          f"{RG.RAGGED_UNIFORM_CTAS_PER_SM} CTAs an SM: no tail for the ragged "
                          "plan to cut")
        if sp is None:
            why = ("FA4AOT_SPLIT_KV=0" if setting == 0 else
                   f"the cost model: {batch * seqlen_q * hk} CTAs over {seqlen_k} keys gain "
                   f"nothing on {num_sms} SMs")
            if setting != 0 and fold_why is None:
                doc = _fold_doc(why, kern, rec["parts"], batch * hk, hq // hk, num_sms,
                                page_size, bucket)
    if doc is None and sp is None:
        doc = {"splits": 0, "why": why}
    elif doc is None:
        doc = _plan_doc(sp, kern, rec["parts"], merge_name, batch, seqlen_q, hk, page_size,
                        num_sms, dense_pages)
    if ragged_why:
        doc["ragged_why"] = ragged_why
    return doc


def _ragged_doc(rg, kern, parts, page_size, hk, num_sms, dense_pages) -> dict:
    """explain's split doc for a step the ragged plan serves (runtime/ragged.RaggedRun: its
    entries on a split step's chunk kernel)."""
    part = S.tma_part(parts, page_size) or "fwd"
    return {
        "splits": rg.n, "ragged": True, "entries": rg.entries, "kernel": kern.id,
        "chunk_kernel": part, "merge": "ragged_merge",
        "plan": f"{rg.describe()}{dense_pages}; the metadata kernel maps them on the GPU; "
        f"entries on {part} of {kern.describe()} (id {kern.id}), at most "
        f"{rg.entries * hk} CTAs on {num_sms} SMs",
    }


def _fold_doc(why, kern, parts, ctas, ratio, num_sms, page_size, bucket) -> dict:
    """explain's split doc for an unsplit step that runs as the fold (runtime/splitruns.FoldRun,
    on the part constraints.fold_part picks, as the runtime does)."""
    part = C.fold_part(ctas, num_sms, page_size is not None, bucket, parts)
    w = parts.get(part) or {}
    if part:
        on = (f"the wide fold kernel {part} ({w.get('tile_n')}-key tiles, "
              f"{w.get('ctas_per_sm')} CTA(s) per SM: {ctas} CTAs fill its "
              f"waves on {num_sms} SMs) of {kern.describe()}")
    elif any(w.part in parts for w in C.WIDE_FOLDS):
        on = kern.describe() + (
            f" (the chunk kernel: {ctas} CTAs fit one wave at one CTA per SM on "
            f"{num_sms} SMs" if ctas <= num_sms else
            f" (the chunk kernel: {ctas} CTAs would leave the wide fold kernels "
            f"a thin last wave on {num_sms} SMs") + "; constraints.fold_kernel)"
    else:
        on = kern.describe()
    return {"splits": 0, "why": why, "wide": part is not None, "fold_kernel": part or "fwd",
            "fold": (f"the fold: one chunk per sequence on {on} (id {kern.id}), "
                     f"the {ratio} query heads of each KV head as its rows, no combine")}


def _plan_doc(sp, kern, parts, merge_name, batch, seqlen_q, hk, page_size, num_sms,
              dense_pages) -> dict:
    """explain's split doc for a step that splits by `sp`."""
    rows = f", {seqlen_q} query rows unrolled{dense_pages}" if seqlen_q > 1 else dense_pages
    if rows and page_size is None:
        rows += " (each row's chunk bounds read from cu_seqlens_k by the bounds mode)"
    ctas = f"{batch * seqlen_q * hk * sp.slots}"
    if sp.packed:
        rows = (f", {seqlen_q} query rows packed as rows of each chunk{dense_pages}"
                + ("" if not sp.tail else ", the causal tail unrolled over two pages"
                   if page_size else ", the causal tail unrolled over each sequence's last "
                   f"{seqlen_q - 1} keys (the bounds mode)"))
        ctas = f"{batch * hk * sp.slots}" + (
            f" (then {batch * seqlen_q * hk} for the tail)" if sp.tail else "")
    merged = ("fa4aot's merge kernel" if merge_name == "merge" else
              "FA4's combine (a store built before fa4aot's merge kernel: `fa4aot build` "
              "replaces it)")
    q_broadcast = bool(parts["fwd"].get("q_broadcast"))
    q_read = ("q read in place through a chunk mode" if q_broadcast or batch * seqlen_q == 1
              else "q copied over the chunks (a store built before the chunk mode: "
              "`fa4aot build` replaces it)")
    part = S.tma_part(parts, page_size)  # (as runtime/plan.Runtime.split_kernel)
    on = (f"fwd_tma ({page_size}-key tiles on FA4's TMA paged path) of " if part else "")
    if sp.wide:  # (runtime/splitruns.SplitRun, likewise)
        w = C.WIDE_SPLIT
        part, on = w.part, (f"{w.part} (fwd_wide through the chunk modes: {w.tile_n}-key tiles, "
                            f"{w.ctas_per_sm} CTAs per SM) of ")
    return {
        "splits": sp.n,
        "chunk": sp.chunk,
        "slots": sp.slots,
        "kernel": kern.id,
        "chunk_kernel": part or "fwd",
        "merge": merge_name,
        "q_broadcast": q_broadcast,
        "packed": sp.packed,
        "plan": f"{sp.describe()}{rows}; chunks on {on}{kern.describe()} (id {kern.id}), "
        f"{ctas} CTAs on {num_sms} SMs, {q_read}; merged by "
        f"{merged}",
    }
