"""FA4's compile keys read back: a key's printable form, and the Variant a forward key
compiles (the drop-in's miss log)."""

from __future__ import annotations

from typing import Any

from fa4aot.model import constraints as C
from fa4aot.model.variants import Variant

# FA4 compiles softcap as a score_mod and keys it by a hash of that function (its source and
# the captured value), so a key does not say which softcap it was: the value is recorded here
# as FA4 makes the function, for variant_from_fa4_key (install()'s miss log). The hash is
# stable across processes (source + repr of the float).
SOFTCAP_BY_HASH: dict[str, float] = {}


def _record_softcaps() -> None:
    from flash_attn.cute import utils  # noqa: PLC0415

    make = utils.create_softcap_scoremod
    if getattr(make, "_fa4aot_recording", False):
        return

    def create_softcap_scoremod(softcap_val):
        fn = make(softcap_val)
        SOFTCAP_BY_HASH[utils.hash_callable(fn)] = float(softcap_val)
        return fn

    create_softcap_scoremod._fa4aot_recording = True
    utils.create_softcap_scoremod = create_softcap_scoremod


def key_repr(key: Any) -> str:
    """A readable, stable rendering of an FA4 compile key (it holds cutlass type objects)."""

    def r(x):
        if isinstance(x, tuple):
            return "(" + ", ".join(r(i) for i in x) + ("," if len(x) == 1 else "") + ")"
        if isinstance(x, type):
            return x.__name__
        return repr(x)

    return r(key)


_CUTE_DTYPES = {
    "BFloat16": "bfloat16", "Float16": "float16", "Float32": "float32",
    "Float8E4M3FN": "float8_e4m3fn", "Float8E5M2": "float8_e5m2",
}


def variant_from_fa4_key(key, arch: str) -> Variant | None:
    """FA4 (4.0.0b36) forward compile key -> our Variant, for the miss log of install().

    Positions follow `_flash_attn_fwd`'s compile_key tuple (one tuple for every arch);
    `tests/fa4/test_dropin.py` checks the mapping against every default sm90 variant's traced key,
    `tests/build/test_sm100_build.py` against the Blackwell FP8 and native split-KV variants,
    `tests/build/test_mla_build.py` against the MLA ones. None for keys outside what fa4aot models
    (MLA keys other than _mla_variant_from_key's, score/mask mods other than a softcap FA4 made
    in this process, block sparsity, broadcast (stride-0) descales, split-KV on sm90)."""
    try:
        if key[57]:  # qv: absorbed MLA
            return _mla_variant_from_key(key, arch)
        if key[0] or key[1] or key[10] or key[11]:
            return None
        split = bool(key[34])
        if split and (not C.is_blackwell(arch) or key[45] or any(key[48:51])):
            return None  # sm90 has none; packed-q splits take FA4's scheduler metadata
        descales = "".join(t for t, on in zip("qkv", key[25:28]) if on) or None
        if descales and any(p is not None and any(p) for p in key[13][5:8]):
            return None  # a stride-0 descale compiles its own kernel; fa4aot never makes one
        softcap = None
        if key[9]:
            softcap = SOFTCAP_BY_HASH.get(key[9])
            if softcap is None:  # a user score_mod, or a softcap made before install
                return None
        ratio = int(key[6])
        causal = bool(key[8])
        has_wl, has_wr = bool(key[22]), bool(key[23])
        local = not causal and (has_wl or has_wr)
        tile_m = None
        if arch == "sm90":  # an M tile other than FA4's default: asked for (`tile_mn`)
            dflt = C.fwd_tile(arch, int(key[4]), int(key[5]), causal, local)
            tile_m = None if int(key[30]) == dflt.m else int(key[30])
        sink = key[24]
        paged = bool(key[21])
        return Variant(
            arch=arch,
            dtype=_CUTE_DTYPES[key[3].__name__],
            head_dim=int(key[4]),
            head_dim_v=int(key[5]),
            qhead_per_kvhead=int(key[6]),
            causal=causal,
            local=local,
            has_window_left=has_wl,
            has_window_right=has_wr,
            return_lse=not key[16],
            sink_dtype=None if sink is None else _CUTE_DTYPES[sink.__name__],
            cu_seqlens_q=not key[17],
            cu_seqlens_k=not key[18],
            seqused_q=not key[19],
            seqused_k=not key[20],
            paged=paged,
            paged_tma=bool(key[37]) if paged else None,
            cu_hint=bool(key[51]),
            # a split kernel is never persistent: the field holds q_stage == 1 (Variant.split_kv)
            static_persistent=int(key[32]) == 1 if split else bool(key[55]),
            softcap=softcap,
            pack_gqa=None if bool(key[35]) == (ratio > 1) else bool(key[35]),
            descales=descales,
            split_kv=split,
            s_ping_pong=bool(key[44]) if split else None,
            tile_m=tile_m,
            # use_2cta_instrs, which only hd256 on Blackwell chooses by the batch (Variant.two_cta)
            two_cta=(bool(key[38]) if C.is_blackwell(arch) and not split
                     and int(key[4]) == int(key[5]) == 256 else None),
        )
    except (IndexError, KeyError, AttributeError, TypeError):
        return None


def _mla_variant_from_key(key, arch: str) -> Variant | None:
    """variant_from_fa4_key for FA4's MLA keys (key[57]: qv): the kernels compile_keys.mla_features
    models (rope + latent q, one latent KV head, no FP8, split, sparsity, window, sink or
    score_mod; the inference rescale threshold). None for the rest."""
    if (
        not key[56] or key[58] or key[59] or key[61]  # q; p, row_max; sparse (key[60]: a dummy)
        or int(key[7]) != 1 or key[2] or key[9] or key[10] or key[11]  # one kv head; s_ahead; mods
        or key[22] or key[23] or key[24] is not None or any(key[25:28]) or key[34]
        or key[17] or not key[19] or float(key[46]) != 8.0  # packed q, no seqused_q
        or bool(key[35]) != (int(key[6]) > 1)  # FA4's default pack_gqa
    ):
        return None
    route = "1cta-kb64" if key[1] else "1cta" if key[0] else "2cta"
    paged = bool(key[21])
    return Variant(
        arch=arch, dtype=_CUTE_DTYPES[key[3].__name__], head_dim=int(key[4]),
        head_dim_v=int(key[5]), qhead_per_kvhead=int(key[6]), causal=bool(key[8]), local=False,
        has_window_left=False, has_window_right=False, return_lse=not key[16], sink_dtype=None,
        cu_seqlens_q=True, cu_seqlens_k=not key[18], seqused_q=False, seqused_k=not key[20],
        paged=paged, paged_tma=bool(key[37]) if paged else None, cu_hint=bool(key[51]),
        static_persistent=bool(key[55]), mla=route, mla_q_stage=int(key[32]),
    )


def copy_key_fields(f, arch: str) -> dict[str, Any]:
    """The Variant fields an engine copy's forward key (KeyFields f) spells as upstream's
    names them: head dims, ratio, causal and window, LSE, the varlen and paged inputs, pack_gqa
    and a non-default tile_m (None where the default)."""
    ratio = int(f["qhead_per_kvhead"])
    causal = bool(f["causal"])
    has_wl = bool(f["window_size_left is not None"])
    has_wr = bool(f["window_size_right is not None"])
    local = not causal and (has_wl or has_wr)
    d, dv = int(f["head_dim"]), int(f["head_dim_v"])
    tile_m = int(f["tile_m"])
    paged = bool(f["page_table is not None"])
    return dict(
        head_dim=d, head_dim_v=dv, qhead_per_kvhead=ratio, causal=causal, local=local,
        has_window_left=has_wl, has_window_right=has_wr, return_lse=not f["lse is None"],
        cu_seqlens_q=not f["cu_seqlens_q is None"], cu_seqlens_k=not f["cu_seqlens_k is None"],
        seqused_q=not f["seqused_q is None"], seqused_k=not f["seqused_k is None"],
        paged=paged, paged_tma=(not f["page_size not in [None, tile_n]"]) if paged else None,
        pack_gqa=None if bool(f["pack_gqa"]) == (ratio > 1) else bool(f["pack_gqa"]),
        tile_m=None if tile_m == C.fwd_tile(arch, d, dv, causal, local).m else tile_m,
    )


def _combine_fields(rendered: str):
    """A rendered FA4 combine key (interface.py 4480-4495: arch, dtype, partial dtype, head dim,
    num_head, tile_m, k_block, log_max_splits, then six flags: cu_seqlens, seqused, lse,
    virtual batch, dynamic splits, semaphore) -> (its fields less num_head and log_max_splits,
    log_max_splits), or None when it is not such a key or is varlen (cu_seqlens or seqused)."""
    f = rendered.strip("()").split(", ")
    if len(f) != 14 or f[8] != "False" or f[9] != "False" or not f[7].isdigit():
        return None
    return (*f[:4], *f[5:7], *f[8:]), int(f[7])


def trace_caches(caches: dict, run, compiles: list | None = None) -> dict[str, list]:
    """Clear FA4's compile `caches` ({name: cached function}), call `run()` (an entry point
    driven under FakeTensorMode), and return {name: [(key, compiled fn)]} of what it compiled.
    compiles: receives the (args, kwargs) of every cute.compile meanwhile."""
    import cutlass.cute as cute

    for c in caches.values():
        c.clear()
    real = cute.compile
    if compiles is not None:
        def spy(*a, **kw):
            compiles.append((a, kw))
            return real(*a, **kw)

        cute.compile = spy
    try:
        run()
    finally:
        cute.compile = real
    return {n: list(c.cache.items()) for n, c in caches.items()}


def fake_copy_call(I, call) -> None:
    """An engine's FA4 copy's `_flash_attn_fwd` (interface module `I`: vLLM's, SGLang's) for
    `call` (model.compile_keys.Call; `kv_dtype` "float8_e4m3fn": vLLM's FP8-KV dequant), with
    the arguments the engines' FA4 wrappers pass it, under FakeTensorMode: compiles, runs
    nothing."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    dt = getattr(torch, call.dtype)
    kv_dtype = getattr(call, "kv_dtype", None)
    kdt = getattr(torch, kv_dtype) if kv_dtype else dt
    b, sq, sk = call.batch, call.seqlen_q, call.seqlen_k
    hq, hk, d, dv = call.num_heads, call.num_heads_kv, call.head_dim, call.head_dim_v
    with FakeTensorMode():
        dev = "cuda"

        def i32(*n):
            return torch.empty(*n, dtype=torch.int32, device=dev)

        kw: dict[str, Any] = dict(
            causal=call.causal, window_size_left=call.window_left,
            window_size_right=call.window_right, return_lse=call.return_lse,
            num_splits=call.num_splits,
        )
        if call.sink_dtype:
            kw["learnable_sink"] = torch.empty(hq, dtype=getattr(torch, call.sink_dtype),
                                               device=dev)
        if call.softcap is not None:
            kw["softcap"] = call.softcap
        if call.pack_gqa is not None:
            kw["pack_gqa"] = call.pack_gqa
        if call.tile_m is not None:
            tile = C.fwd_tile("sm90", d, dv, call.causal,
                              call.window_left is not None or call.window_right is not None)
            kw["tile_mn"] = (call.tile_m, tile.n)
        if call.layout == "dense" or call.batch_q:
            q = torch.empty(b, sq, hq, d, dtype=dt, device=dev)
        else:
            q = torch.empty(b * sq, hq, d, dtype=dt, device=dev)
            kw.update(cu_seqlens_q=i32(b + 1), max_seqlen_q=sq)
        if call.seqused_q:
            kw["seqused_q"] = i32(b)
        if call.has_seqused_k:
            kw["seqused_k"] = i32(b)
        if call.layout == "varlen":
            shape = (b * sk, hk)
            kw.update(cu_seqlens_k=i32(b + 1), max_seqlen_k=sk)
        elif call.layout in ("dense", "padded"):
            shape = (b, sk, hk)
        else:
            npages = -(-sk // call.page_size)
            shape = (b * npages, call.page_size, hk)
            kw.update(page_table=i32(b, npages), max_seqlen_k=sk)
        k = torch.empty(*shape, d, dtype=kdt, device=dev)
        v = torch.empty(*shape, dv, dtype=kdt, device=dev)
        if kv_dtype:
            kw.update(fp8_kv_dequant=True,
                      k_descale=torch.empty(b, hk, dtype=torch.float32, device=dev),
                      v_descale=torch.empty(b, hk, dtype=torch.float32, device=dev))
        I._flash_attn_fwd(q, k, v, **kw)
