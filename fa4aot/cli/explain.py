"""`fa4aot explain`: how the runtime would serve one call. Its own module: the runtime's plan
kinds (exact, decode fold, padding, and later split-KV) each add a line here."""

from __future__ import annotations

import sys

import click

from .. import constraints as C
from . import main
from .common import cache_option, layers_for, loadable_artifacts, matching_stores
from .output import with_output


def _cached_artifacts(layers, arch: str, num_sms: int, python: str | None):
    """-> (loadable artifacts of the stores serving the target, {id: why} of corrupt ones, the
    Match): what the runtime would load, checked as it checks them."""
    match = matching_stores(layers, arch, num_sms, python)
    found = loadable_artifacts(match.stores)
    return found.artifacts, found.corrupt, match


@main.command()
@click.option("--arch", default="sm90", show_default=True, type=click.Choice(sorted(C.ARCHS)))
@click.option(
    "--num-sms", type=click.IntRange(1, 1024), help="SM count of the GPU (default: the arch's)."
)
@click.option(
    "--dtype", default="bfloat16", show_default=True, type=click.Choice(["bfloat16", "float16"])
)
@click.option("--heads", required=True, help="Query heads : KV heads, e.g. 20:1 or 32:8.")
@click.option("--head-dim", type=click.IntRange(1, 1024), required=True)
@click.option("--head-dim-v", type=click.IntRange(1, 1024))
@click.option(
    "--layout", default="dense", show_default=True, type=click.Choice(["dense", "varlen", "paged"])
)
@click.option("--batch", default=1, show_default=True, type=click.IntRange(1))
@click.option("--seqlen-q", default=1, show_default=True, type=click.IntRange(1))
@click.option("--page-size", type=click.IntRange(1), help="KV page size (paged layout).")
@click.option("--causal/--no-causal", default=True, show_default=True)
@click.option("--window", type=click.IntRange(0), help="Left sliding window (tokens).")
@click.option("--lse", is_flag=True, help="The call returns the LSE.")
@click.option("--sink", is_flag=True, help="The call passes float32 learnable sinks.")
@click.option("--no-padding", is_flag=True, help="As with FA4AOT_PADDING=deny.")
@cache_option("read")
@with_output
def explain(
    arch,
    num_sms,
    dtype,
    heads,
    head_dim,
    head_dim_v,
    layout,
    batch,
    seqlen_q,
    page_size,
    causal,
    window,
    lse,
    sink,
    no_padding,
    cache,
    out,
):
    """How the runtime would serve a call: its variant, then an exact hit, a decode fold, a
    padding plan (with its cost) or the refusal. Exit 1 when nothing can serve it."""
    from .. import settings
    from ..select import choose, fold_from_env, nearest
    from ..variants import Call, Variant, features

    try:
        hq, hk = (int(x) for x in heads.split(":"))
        assert hq > 0 and hk > 0 and hq % hk == 0
    except (ValueError, AssertionError):
        raise click.BadParameter(
            f"expected Q:KV with KV dividing Q, e.g. 32:8; got {heads!r}", param_hint="--heads"
        )
    if (layout == "paged") != (page_size is not None):
        raise click.BadParameter(
            "--page-size goes with --layout paged (and only with it)", param_hint="--page-size"
        )
    num_sms = num_sms or C.DEFAULT_NUM_SMS[arch]
    call = Call(
        layout=layout,
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_q,
        num_heads=hq,
        num_heads_kv=hk,
        head_dim=head_dim,
        head_dim_v=head_dim_v or head_dim,
        dtype=dtype,
        causal=causal,
        window_left=window,
        window_right=None if window is None else (0 if causal else window),
        return_lse=lse,
        sink_dtype="float32" if sink else None,
        page_size=page_size,
    )
    feat = call.feature_kwargs()
    want = features(arch=arch, **feat)
    settings.check()
    layers = layers_for(cache, out, strict=False)
    arts, corrupt, match = _cached_artifacts(layers, arch, num_sms, None)
    avail = [Variant.from_dict(a.record["variant"]) for a in arts]
    why = C.unsupported_reason(
        arch, dtype, head_dim, head_dim_v or head_dim, qhead_per_kvhead=hq // hk
    )
    allow_fold = fold_from_env()  # as the runtime reads it (SettingError: exit 1)
    choices = choose(arch, feat, avail, allow_padding=not no_padding, allow_fold=allow_fold)
    doc = {
        "variant": want.to_dict(),
        "id": want.id,
        "description": want.describe(),
        "fa4_unsupported": why,
        "choices": [
            {
                "id": c.variant.id,
                "exact": c.exact,
                "ratio": c.ratio,
                "head_dim": c.head_dim,
                "head_dim_v": c.head_dim_v,
                "cost": round(c.cost, 3),
                "fold": c.fold,
                "plan": c.describe(want),
            }
            for c in choices
        ],
        "nearest": []
        if choices
        else [{"id": v.id, "description": v.describe()} for v in nearest(want, avail)],
        "corrupt": corrupt.get(want.id),
        "stores": [str(s.dir) for s in match.stores],
    }
    if out.as_json:
        out.document(doc)
    else:
        out.text(f"call variant: {want.describe()} (id {want.id})")
        if why:
            out.text(f"FA4 cannot run it exactly: {why}")
        if choices:
            out.text(f"served by   : {choices[0].describe(want)}")
            for c in choices[1:4]:
                out.text(f"alternative : {c.describe(want)}")
        else:
            out.text("served by   : nothing cached (the runtime raises ArtifactMissing)")
            for v in nearest(want, avail):
                out.text(f"nearest     : {v.describe()} ({v.id})")
        if corrupt.get(want.id):
            out.text(f"corrupt     : the exact artifact fails its checks: {corrupt[want.id]}")
        if not match.stores:
            out.text(f"stores      : none for this target; {match.describe_others()}")
    if not choices:
        sys.exit(1)
