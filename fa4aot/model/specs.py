"""Model attention specs: TOML files -> frozen dataclasses, validated with one-line errors.

A spec names a model's attention layer types (heads, head dims, dtype, window, sinks) and the
serving envelope an engine will call them in (layouts, phases, batch, context, KV page sizes,
tensor-parallel degrees). Specs are plain data: what kernels they need is decided in
`variants.py`, what FA4 can run in `constraints.py`.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from fa4aot.errors import SpecError
from fa4aot.model.constraints import ARCHS

DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")  # fp8: sm100 only (constraints)
# How a call passes q and K/V (FA4's `_flash_attn_fwd` takes any q form with any K/V form):
# q in batch form (b, s_q, h, d) or packed (total_q, h, d) with cu_seqlens_q, either one with
# per-sequence lengths (seqused_q); K/V in batch form (b, s_k, h, d), packed with cu_seqlens_k, or
# paged with a page_table, each with or without seqused_k. A spec layout is "Q/KV" over these
# forms, or one of the names below. FA4's own tests ran 43 variants through fa4aot with forms
# its first three layouts did not cover (issue 13), e.g. a padded KV cache with cu_seqlens_q.
Q_FORMS = ("batch", "batch+seqused", "packed", "packed+seqused")
KV_FORMS = ("batch", "batch+seqused", "packed", "packed+seqused", "paged", "paged+seqused")
LAYOUT_NAMES = {
    "dense": ("batch", "batch"),  # flash_attn_func
    "varlen": ("packed", "packed"),  # cu_seqlens_q + cu_seqlens_k
    "paged": ("packed", "paged+seqused"),  # cu_seqlens_q + page_table + seqused_k
    "padded": ("packed", "batch+seqused"),  # a padded KV cache: FA2/FA3's flash_attn_with_kvcache
}
LAYOUTS = tuple(LAYOUT_NAMES) + tuple(
    f"{q}/{kv}" for q in Q_FORMS for kv in KV_FORMS if (q, kv) not in LAYOUT_NAMES.values()
)
DEFAULT_LAYOUTS = ("dense", "varlen", "paged")
SINK_DTYPES = ("float32", "bfloat16", "float16")
PHASES = ("decode", "prefill")
LSE_CHOICES = (False, True, "both")
KV_CACHE_DTYPES = ("auto", "float8_e4m3fn")


@dataclass(frozen=True)
class Attention:
    """One attention layer type of a model (full, sliding, ...)."""

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype: str = "bfloat16"
    causal: bool = True
    window: int | None = None  # left window in tokens; None = unbounded
    sinks: bool = False  # learnable per-head attention sinks (gpt-oss)
    sink_dtype: str = "float32"  # the sinks tensor's dtype (FA4 takes float32, bfloat16, float16)
    softcap: float | None = None  # tanh logit soft-capping (Gemma-2, Grok); baked into the kernel
    # Absorbed MLA (DeepSeek-V3, GLM-4.7-Flash): the latent head dim (the model's kv_lora_rank,
    # 512) FA4 takes as its `qv` argument; head_dim is then the rope part (qk_rope_head_dim, 64),
    # head_dim_v the latent one, and K/V one latent head shared by every query head (MQA).
    qv: int | None = None


# Attention fields added after specs were first stored: left out of a spec's identity at their
# defaults, so stores built before them keep their spec index (build refuses a changed spec).
_NEW_ATTENTION_DEFAULTS = {"sink_dtype": "float32", "softcap": None, "qv": None}
_NEW_SERVING_DEFAULTS = {"archs": None, "kv_cache_dtypes": ("auto",)}  # likewise, [serving]
# The one absorbed-MLA shape FA4 (4.0.0b36) compiles: `_flash_attn_fwd` asserts head_dim_v == 512
# and head_dim == 64 with qv (and no local window, no softcap).
MLA_LATENT_DIM, MLA_ROPE_DIM = 512, 64


def layout_forms(layout: str) -> tuple[str, str]:
    """A spec layout name -> (q form, K/V form) (see Q_FORMS, KV_FORMS)."""
    if layout in LAYOUT_NAMES:
        return LAYOUT_NAMES[layout]
    q, _, kv = layout.partition("/")
    if q not in Q_FORMS or kv not in KV_FORMS:
        raise ValueError(f"unknown layout {layout!r}")
    return q, kv


@dataclass(frozen=True)
class Serving:
    """The envelope of calls an engine makes: it decides which regimes get built."""

    tp: tuple[int, ...] = (1,)
    layouts: tuple[str, ...] = DEFAULT_LAYOUTS
    phases: tuple[str, ...] = PHASES
    max_batch: int = 256
    max_context: int = 32768
    page_sizes: tuple[int | str, ...] = (128,)  # ints, or "tile" for the kernel's tile_n
    speculative: int = 1  # largest query length of a decode step (1 + draft tokens)
    return_lse: bool | str = False  # False, True or "both"
    # also build the non-causal 1:1 kernels that serve s_q == 1 decode at any head ratio with
    # no copies (query heads folded into query rows; see select.py)
    decode_fold: bool = True
    # also build the kernels split-KV decode plans run on (split.py): the 1:1 kernel with LSE
    # per K layout, with FA4's combine kernel beside it
    split_kv: bool = True
    # the archs this envelope is deployed on (None: every arch). A spec of layers only one arch
    # family runs (FP8 Q/K/V: Blackwell) builds nothing elsewhere instead of reporting every
    # layer unsupported there.
    archs: tuple[str, ...] | None = None
    # the KV cache dtypes the engine may run each layer with: "auto" (the layer's dtype) and
    # "float8_e4m3fn" (an FP8 cache under a bf16/fp16 Q: FP8-KV dequant, built from vLLM's
    # FA4 copy on sm90 only, paged at page == tile_n; constraints.kv_dtype_reason)
    kv_cache_dtypes: tuple[str, ...] = ("auto",)

    def for_arch(self, arch: str) -> bool:
        return self.archs is None or arch in self.archs


@dataclass(frozen=True)
class Spec:
    name: str
    model: str
    attention: tuple[Attention, ...]
    serving: Serving
    source: str = ""  # file it was read from; not part of its identity

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("source")
        for a in d["attention"]:
            for k, dflt in _NEW_ATTENTION_DEFAULTS.items():
                if a[k] == dflt:
                    del a[k]
        for k, dflt in _NEW_SERVING_DEFAULTS.items():
            if d["serving"][k] == dflt:
                del d["serving"][k]
        return d

    def identity(self) -> str:
        """Canonical JSON of the spec's fields (never a pickle): equal specs, equal strings."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))


def _fail(src: str, field: str, msg: str) -> SpecError:
    return SpecError(f"{src}: {field}: {msg}")


def _int(src, field, v, lo, hi=None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _fail(src, field, f"must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise _fail(src, field, f"must be {rng}, got {v}")
    return v


def _bool(src, field, v) -> bool:
    if not isinstance(v, bool):
        raise _fail(src, field, f"must be true or false, got {v!r}")
    return v


def _choice(src, field, v, allowed) -> Any:
    # type-exact: TOML's `1` must not pass for `true`
    if not any(v == a and type(v) is type(a) for a in allowed):
        raise _fail(src, field, f"must be one of {', '.join(map(repr, allowed))}; got {v!r}")
    return v


def _list(src, field, v, item) -> tuple:
    if not isinstance(v, list) or not v:
        raise _fail(src, field, f"must be a non-empty list, got {v!r}")
    out = tuple(item(f"{field}[{i}]", x) for i, x in enumerate(v))
    if len(set(out)) != len(out):
        raise _fail(src, field, f"has duplicates: {v!r}")
    return out


def _check_keys(src, where, d, allowed):
    for k in d:
        if k not in allowed:
            raise _fail(src, f"{where}{k}", f"unknown field; allowed: {', '.join(sorted(allowed))}")


def _attention(src: str, i: int, d: Any) -> Attention:
    where = f"attention[{i}]."
    if not isinstance(d, dict):
        raise _fail(src, f"attention[{i}]", "must be a table ([[attention]])")
    _check_keys(src, where, d, set(Attention.__dataclass_fields__))
    for req in ("num_q_heads", "num_kv_heads", "head_dim"):
        if req not in d:
            raise _fail(src, where + req, "is required")
    name = d.get("name", f"layer{i}")
    if not isinstance(name, str) or not name:
        raise _fail(src, where + "name", "must be a non-empty string")
    hq = _int(src, where + "num_q_heads", d["num_q_heads"], 1, 1024)
    hk = _int(src, where + "num_kv_heads", d["num_kv_heads"], 1, 1024)
    if hq % hk:
        raise _fail(src, where + "num_kv_heads", f"must divide num_q_heads ({hq}), got {hk}")
    hd = _int(src, where + "head_dim", d["head_dim"], 1, 1024)
    hdv = _int(src, where + "head_dim_v", d.get("head_dim_v", hd), 1, 1024)
    dtype = _choice(src, where + "dtype", d.get("dtype", "bfloat16"), DTYPES)
    causal = _bool(src, where + "causal", d.get("causal", True))
    window = d.get("window")
    if window is not None:
        window = _int(src, where + "window", window, 0)
    sinks = _bool(src, where + "sinks", d.get("sinks", False))
    sink_dtype = _choice(src, where + "sink_dtype", d.get("sink_dtype", "float32"), SINK_DTYPES)
    if "sink_dtype" in d and not sinks:
        raise _fail(src, where + "sink_dtype", "needs sinks = true")
    softcap = d.get("softcap")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap <= 0:
            # FA4 reads softcap = 0 as "no softcap"; a spec says that by leaving it out
            raise _fail(src, where + "softcap", f"must be a number > 0, got {softcap!r}")
        softcap = float(softcap)
    qv = d.get("qv")
    if qv is not None:
        qv = _int(src, where + "qv", qv, 1, 1024)
        _mla_checks(src, where, d, qv, hk, hd, window, softcap)
        hdv = qv
    return Attention(name, hq, hk, hd, hdv, dtype, causal, window, sinks, sink_dtype, softcap, qv)


def _mla_checks(src, where, d, qv, hk, hd, window, softcap) -> None:
    """An absorbed-MLA layer as FA4 takes it: q/k the rope part, qv/v the latent part."""
    if qv != MLA_LATENT_DIM:
        raise _fail(
            src, where + "qv", f"FA4 runs absorbed MLA with a {MLA_LATENT_DIM}-wide latent "
            f"(kv_lora_rank) only, got {qv}"
        )
    if hd != MLA_ROPE_DIM:
        raise _fail(
            src, where + "head_dim", f"with qv, head_dim is the rope part (qk_rope_head_dim): "
            f"FA4 needs {MLA_ROPE_DIM}, got {hd}"
        )
    if "head_dim_v" in d and d["head_dim_v"] != qv:
        raise _fail(src, where + "head_dim_v", f"with qv it is the latent dim {qv} (leave it out)")
    if hk != 1:
        raise _fail(
            src, where + "num_kv_heads", f"absorbed MLA shares one latent K/V head, got {hk}"
        )
    if window is not None:
        raise _fail(src, where + "window", "FA4 has no local window with qv")
    if softcap is not None:
        raise _fail(src, where + "softcap", "FA4 takes no softcap with qv")


def _page_size(src, field, v):
    if v == "tile":
        return v
    return _int(src, field, v, 1, 4096)


def _serving(src: str, d: Any, attention: tuple[Attention, ...]) -> Serving:
    if not isinstance(d, dict):
        raise _fail(src, "serving", "must be a table ([serving])")
    _check_keys(src, "serving.", d, set(Serving.__dataclass_fields__))
    dflt = Serving()
    tp = _list(src, "serving.tp", d.get("tp", list(dflt.tp)), lambda f, x: _int(src, f, x, 1, 64))
    for t in tp:
        for a in attention:
            if a.num_q_heads % t:
                raise _fail(
                    src, "serving.tp", f"{t} does not divide {a.name}'s {a.num_q_heads} query heads"
                )
            # engines shard KV heads evenly, or replicate them when TP exceeds them (vLLM)
            hk = a.num_kv_heads
            if (hk % t) if hk >= t else (t % hk):
                raise _fail(
                    src,
                    "serving.tp",
                    f"{t} neither divides nor is a multiple of {a.name}'s {hk} KV heads",
                )
    layouts = _list(
        src,
        "serving.layouts",
        d.get("layouts", list(dflt.layouts)),
        lambda f, x: _choice(src, f, x, LAYOUTS),
    )
    phases = _list(
        src,
        "serving.phases",
        d.get("phases", list(dflt.phases)),
        lambda f, x: _choice(src, f, x, PHASES),
    )
    max_batch = _int(src, "serving.max_batch", d.get("max_batch", dflt.max_batch), 1, 1 << 20)
    max_context = _int(
        src, "serving.max_context", d.get("max_context", dflt.max_context), 1, 1 << 24
    )
    pages = _list(
        src,
        "serving.page_sizes",
        d.get("page_sizes", list(dflt.page_sizes)),
        lambda f, x: _page_size(src, f, x),
    )
    spec_len = _int(src, "serving.speculative", d.get("speculative", dflt.speculative), 1, 64)
    lse = _choice(src, "serving.return_lse", d.get("return_lse", dflt.return_lse), LSE_CHOICES)
    fold = _bool(src, "serving.decode_fold", d.get("decode_fold", dflt.decode_fold))
    split = _bool(src, "serving.split_kv", d.get("split_kv", dflt.split_kv))
    archs = None
    if "archs" in d:
        archs = _list(src, "serving.archs", d["archs"],
                      lambda f, x: _choice(src, f, x, tuple(ARCHS)))
    kv = _list(src, "serving.kv_cache_dtypes",
               d.get("kv_cache_dtypes", list(dflt.kv_cache_dtypes)),
               lambda f, x: _choice(src, f, x, KV_CACHE_DTYPES))
    return Serving(
        tp, layouts, phases, max_batch, max_context, pages, spec_len, lse, fold, split, archs,
        kv,
    )


def parse_spec(text: str, src: str = "<string>") -> Spec:
    """Parse and validate one spec. Raises SpecError naming the file, the field and the rule."""
    try:
        d = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{src}: invalid TOML: {e}") from None
    _check_keys(src, "", d, {"name", "model", "attention", "serving"})
    name = d.get("name")
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "-_." for c in name):
        raise _fail(src, "name", f"is required: letters, digits, '-', '_', '.'; got {name!r}")
    model = d.get("model", name)
    if not isinstance(model, str):
        raise _fail(src, "model", f"must be a string, got {model!r}")
    att = d.get("attention")
    if not isinstance(att, list) or not att:
        raise _fail(src, "attention", "at least one [[attention]] table is required")
    attention = tuple(_attention(src, i, a) for i, a in enumerate(att))
    names = [a.name for a in attention]
    if len(set(names)) != len(names):
        raise _fail(src, "attention", f"layer names must be distinct, got {names}")
    serving = _serving(src, d.get("serving", {}), attention)
    return Spec(name, model, attention, serving, src)


def load_spec(path: str | Path) -> Spec:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecError(f"{p}: cannot read spec: {e.strerror or e}") from None
    return parse_spec(text, str(p))


def default_spec_names() -> list[str]:
    return sorted(
        f.name[: -len(".toml")]
        for f in resources.files("fa4aot").joinpath("specs").iterdir()
        if f.name.endswith(".toml")
    )


def load_default(name: str) -> Spec:
    f = resources.files("fa4aot").joinpath("specs").joinpath(f"{name}.toml")
    if not f.is_file():
        raise SpecError(
            f"{name}: no such spec file or default spec; defaults: {', '.join(default_spec_names())}"
        )
    return parse_spec(f.read_text(), f"fa4aot/specs/{name}.toml")


def resolve_specs(names: list[str] | tuple[str, ...] | None) -> list[Spec]:
    """`--spec` values (names of default specs, or paths) -> specs; none given: all defaults."""
    if not names:
        return [load_default(n) for n in default_spec_names()]
    out = []
    for n in names:
        p = Path(n)
        out.append(load_spec(p) if (p.suffix == ".toml" or p.exists()) else load_default(n))
    return out
