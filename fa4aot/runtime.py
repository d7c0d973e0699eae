"""The compiler-free runtime: FA4's forward calling convention, served from the store.

Never imports `cutlass` or `flash_attn` (unless FA4AOT_ON_MISS=jit and a call misses). Per
call: derive the call's variant (`variants.features`, FA4's own selection logic), find its
artifact in the store layers, check the call against the kernel's contract, allocate outputs,
run helper kernels when the variant needs them, call the kernel through tvm-ffi.

The per-call path is kept short (target: under 15 us of host time): everything that depends
only on a call's static features is resolved once and cached in `_plans`.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from . import constraints as C
from .errors import (
    ArtifactMissing,
    ContractViolation,
    Fa4aotError,
    UnsupportedVariant,
)
from . import settings
from . import split as S
from .select import fold_from_env
from .store import Artifact, Store, default_roots, find_serving_store, runtime_expectation
from .variants import Variant, features, split_kernel_variant

log = logging.getLogger("fa4aot")

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_SINK_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
ON_MISS = ("error", "warn", "jit")
_NO_AUX = (None, None)  # FA4's AuxData(tensors=None, scalars=None): a compile-time value
# The decode/prefill choice depends on the query length only up to the largest tile_m (192):
# plan-cache keys clamp it there, so prefill calls of every length share one entry.
_Q_KEY_CAP = 193
_BIN_BATCH = C.BIN_BATCH_SEARCH_THRESH  # batch above which varlen calls take the cu_total path
_SPLIT_ROWS = S.MAX_ROWS
_SPLIT_MIN = S.NEVER_SPLIT_KEYS


@dataclass
class _SplitKernel:
    """A loaded split-KV chunk kernel (variants.Variant.split_kernel) and its combine."""

    fwd: Any
    combine: Any
    max_slots: int
    artifact: Artifact


@dataclass
class _Plan:
    """Everything a call with these static features needs, resolved once."""

    variant: Variant
    fwd: Any
    tile_cumsum: Any  # helper kernel (varlen batch > 256) or None
    helper_cu: bool  # the helper was compiled to read cu_seqlens_q
    helper_seqused: bool  # ... and/or seqused_q
    artifact: Artifact
    window_left: int | None = None  # FA4's resolved window, passed to the kernel
    window_right: int | None = None
    pad: Any = None  # select.Choice when the call is served by padding (or a decode fold)
    # a sequence of at most one query row is one m-block for the helper: with max_seqlen_q == 1
    # its output equals cu_seqlens_q (see flash_attn_varlen_func)
    decode_blocks: bool = False
    # calls with these static features may be split-KV decode steps (split.split_refusal's
    # static part: no window, few query rows); the entry points check the rest per call
    may_split: bool = True


def _arch_of(device: torch.device) -> tuple[str, int]:
    major, minor = torch.cuda.get_device_capability(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return f"sm{major}{minor}", sms


class Runtime:
    """Serves calls from a layered store. Thread-safe; loads each artifact once per process."""

    def __init__(
        self,
        roots: list[Path] | None = None,
        on_miss: str | None = None,
        allow_unsafe_dirs: bool | None = None,
    ):
        self.roots = [Path(r) for r in roots] if roots else default_roots()
        # one snapshot of the settings (fa4aot.settings: a bad value raises SettingError,
        # naming the variable, here, when the runtime is built)
        self.on_miss = on_miss or settings.on_miss()
        if self.on_miss not in ON_MISS:
            raise ValueError(f"on_miss must be one of {ON_MISS}, got {self.on_miss!r}")
        if allow_unsafe_dirs is None:
            allow_unsafe_dirs = settings.allow_unsafe_dirs()
        self.allow_unsafe_dirs = allow_unsafe_dirs
        self.padding = settings.allow_padding()
        self.fold = fold_from_env()  # serve s_q == 1 decode by folding heads into rows
        split = settings.split_kv()
        self.split = -1 if split == "auto" else split  # -1: the cost model chooses
        self._lock = threading.Lock()
        self._devices: dict[int, tuple[str, int]] = {}
        self._lib_checked: set[Path] = set()
        self._split_kernels: dict[tuple, _SplitKernel | None] = {}
        self._split_n: dict[tuple, S.Split | None] = {}
        self._split_consts: dict[tuple, Any] = {}
        self._split_runs: dict[tuple, Any] = {}
        self._stores: dict[tuple[str, int], list[Store]] = {}
        self._modules: dict[str, tuple[Any, Any, Artifact]] = {}
        self._plans: dict[tuple, _Plan] = {}

    # -- store and artifact resolution (once per variant) -------------------------------------
    def stores_for(self, arch: str, num_sms: int) -> list[Store]:
        key = (arch, num_sms)
        if key not in self._stores:
            self._stores[key] = find_serving_store(self.roots, runtime_expectation(arch, num_sms))
        return self._stores[key]

    def find(self, variant: Variant, num_sms: int) -> Artifact | None:
        for store in self.stores_for(variant.arch, num_sms):
            art = store.get(variant.id, verify=False)
            if art is not None:
                return art
        return None

    def available(self, arch: str, num_sms: int) -> list[Variant]:
        """Every variant the serving stores hold (read on misses only: one JSON per artifact)."""
        out = []
        for store in self.stores_for(arch, num_sms):
            for _, a in store.iter_artifacts():
                if isinstance(a, Exception) or a.record.get("stub"):
                    continue
                try:
                    out.append(Variant.from_dict(a.record["variant"]))
                except (ValueError, TypeError):
                    continue
        return out

    def _load(self, art: Artifact, *names: str) -> list[Any]:
        """The named parts of `art` (None for a part it lacks), after one check of the whole
        artifact: every part's sha256 is hashed once per load, not once per part."""
        art.check_loadable(self.allow_unsafe_dirs)  # stub, unsafe dirs, sha256: before any dlopen
        from . import runtime_lib

        self._check_runtime_lib(art)
        runtime_lib.load_runtime_lib()
        import tvm_ffi

        parts = art.record["parts"]
        return [
            tvm_ffi.load_module(str(art.part_path(n)))[f"fa4aot_{n}"] if n in parts else None
            for n in names
        ]

    def _check_runtime_lib(self, art: Artifact) -> None:
        """RuntimeLibraryMismatch unless the store holding `art` was built against the runtime
        library this process loads (once per store directory)."""
        from . import runtime_lib
        from .store import read_toolchain

        d = art.dir.parent.parent  # <fingerprint dir>/artifacts/<id>
        if d not in self._lib_checked:
            runtime_lib.check_matches(read_toolchain(d).get("runtime_lib"))
            self._lib_checked.add(d)

    def device(self, index: int) -> tuple[str, int]:
        """(arch, SM count) of CUDA device `index`, queried once."""
        got = self._devices.get(index)
        if got is None:
            got = self._devices[index] = _arch_of(torch.device("cuda", index))
        return got

    def split_kernel(
        self, dev: int, dtype, head_dim: int, head_dim_v: int, page_size: int | None
    ) -> _SplitKernel | None:
        """The split-KV chunk kernel (packed K when page_size is None) with its combine, or
        None when the stores lack it (the call then runs unsplit)."""
        key = (dev, dtype, head_dim, head_dim_v, page_size)
        if key in self._split_kernels:
            return self._split_kernels[key]
        arch, sms = self.device(dev)
        got = None
        if not C.runtime_unsupported_reason(arch) and not C.unsupported_reason(
            arch, _DTYPES[dtype], head_dim, head_dim_v
        ):
            v = split_kernel_variant(arch, _DTYPES[dtype], head_dim, head_dim_v, page_size)
            with self._lock:
                art = self.find(v, sms)
                comb = art.record["parts"].get("combine", {}) if art is not None else {}
                if comb.get("partial_dtype") == _DTYPES[dtype] and comb.get("tile_m"):
                    if art.id in self._modules:  # the decode fold loaded it
                        (combine,) = self._load(art, "combine")
                    else:
                        fwd, helper, combine = self._load(art, "fwd", "tile_cumsum", "combine")
                        self._modules[art.id] = (fwd, helper, art)
                    got = _SplitKernel(
                        self._modules[art.id][0],
                        combine,
                        int(comb.get("max_splits", S.MAX_SLOTS)),
                        art,
                    )
        self._split_kernels[key] = got
        return got

    def split_for(
        self, dev: int, dtype, ctas: int, seqlen_k: int, d: int, dv: int,
        page_size: int | None, sink: bool,
    ) -> S.Split | None:
        """The split plan of a decode step with `ctas` (sequence, row, KV head) triples over
        at most seqlen_k keys, or None (run it unsplit: the cost model says splitting loses,
        FA4AOT_SPLIT_KV=0, or the store lacks the split kernel). Planned for seqlen_k rounded
        up to 256 keys and cached, so a decode loop whose KV grows a key a step replans (and
        reallocates nothing) once per 256 steps."""
        bucket = S.plan_bucket(seqlen_k)
        key = (dev, dtype, ctas, bucket, d, dv, page_size, sink, self.split)
        try:
            return self._split_n[key]
        except KeyError:
            pass
        sp = None
        kern = self.split_kernel(dev, dtype, d, dv, page_size) if self.split else None
        if kern is not None:
            sp = S.plan_split(
                ctas=ctas, seqlen_k=bucket, bytes_per_key=(d + dv) * dtype.itemsize,
                page_size=page_size, sink=sink, num_sms=self.device(dev)[1],
                setting=self.split, max_slots=kern.max_slots,
            )
        if len(self._split_n) > 4096:
            self._split_n.clear()
        self._split_n[key] = sp
        return sp

    def plan(self, variant: Variant, num_sms: int) -> _Plan | None:
        """Load the artifact serving `variant` (or None if the store has none)."""
        with self._lock:
            art = self.find(variant, num_sms)
            if art is None:
                return None
            if art.id not in self._modules:
                fwd, helper = self._load(art, "fwd", "tile_cumsum")
                self._modules[art.id] = (fwd, helper, art)
            fwd, helper, art = self._modules[art.id]
            hp = art.record["parts"].get("tile_cumsum", {})
            return _Plan(
                variant,
                fwd,
                helper,
                bool(hp.get("cu_seqlens")),
                bool(hp.get("seqused")),
                art,
                decode_blocks=variant.qhead_per_kvhead <= variant.tile.m,
            )

    def miss(self, variant: Variant, num_sms: int, allow_padding: bool) -> None:
        from .missing import record_miss
        from .select import nearest

        record_miss(variant)
        near = nearest(variant, self.available(variant.arch, num_sms))
        near_s = "; ".join(f"{v.describe()} ({v.id})" for v in near) or "none (empty store?)"
        pad = "" if allow_padding else " (padding is denied: FA4AOT_PADDING=deny or padding=False)"
        raise ArtifactMissing(
            f"no artifact serves {variant.describe()} (variant id {variant.id}){pad}, not even by "
            f"padding. Nearest cached: {near_s}. Add it with: fa4aot build --arch {variant.arch} "
            f"--spec <a spec whose envelope covers this call>, or record misses with "
            f"FA4AOT_MISS_LOG=FILE and run fa4aot build --from-misses FILE"
        )


_DEFAULT: Runtime | None = None
_DEFAULT_LOCK = threading.Lock()


def default_runtime() -> Runtime:
    global _DEFAULT
    if _DEFAULT is None:
        with _DEFAULT_LOCK:
            if _DEFAULT is None:
                _DEFAULT = Runtime()
    return _DEFAULT


def reset(roots: list[Path] | None = None, on_miss: str | None = None) -> Runtime:
    """Replace the process-wide runtime (tests; a server reconfiguring its store)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        _DEFAULT = Runtime(roots, on_miss)
    return _DEFAULT


def _launch(
    fwd,
    q,
    k,
    v,
    out,
    lse,
    scale: float,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    seqused_q=None,
    seqused_k=None,
    page_table=None,
    window_left=None,
    window_right=None,
    learnable_sink=None,
    cu_total_m_blocks=None,
):
    """The one place that spells FA4's sm90 forward ABI (4.0.0b36, tvm-ffi; the stream is
    torch's current one): q, k, v, out, lse, scale, cu_seqlens_q/k, seqused_q/k, page_table,
    window left/right, learnable_sink, block sparsity (unused), aux data (FA4 passes a
    compile-time empty pair), cu_total_m_blocks, cu_total_splits_m_blocks (unused on sm90)."""
    fwd(
        q,
        k,
        v,
        out,
        lse,
        scale,
        cu_seqlens_q,
        cu_seqlens_k,
        seqused_q,
        seqused_k,
        page_table,
        window_left,
        window_right,
        learnable_sink,
        None,
        _NO_AUX,
        cu_total_m_blocks,
        None,
    )


# -- contract checks --------------------------------------------------------------------------


def _fail(msg: str) -> ContractViolation:
    return ContractViolation(msg)


def _aligned(t: torch.Tensor) -> bool:
    """FA4's kernels assume a 16-byte aligned base, unit last stride, 16-byte aligned strides."""
    if t.data_ptr() % 16:
        return False
    if t.is_contiguous():  # head_dim is a multiple of 8 elements (checked at selection)
        return True
    st = t.stride()
    if st[-1] != 1 and t.shape[-1] != 1:
        return False
    e = 16 // t.element_size()
    for s, n in zip(st[:-1], t.shape[:-1]):
        if s == 0 or (s % e and n != 1):
            return False
    return True


def _prep(t: torch.Tensor, name: str, contiguous_ok: bool) -> torch.Tensor:
    if _aligned(t):
        return t
    if contiguous_ok:
        # FA4's maybe_contiguous does the same; the copy is the price of a strided input.
        return t.clone(memory_format=torch.contiguous_format)
    raise _fail(
        f"{name} must have a 16-byte aligned base, a contiguous last dim and 16-byte "
        f"aligned strides (got strides {tuple(t.stride())}); pass .contiguous()"
    )


def _int_like(x: Any) -> bool:
    """An int subclass other than bool (e.g. an IntEnum); the hot path tests `type(x) is int`."""
    return isinstance(x, int) and not isinstance(x, bool)


def _vec_ok(t: Any, n: int, device: int) -> bool:
    """Hot-path test for an int32 (n,) vector on `device`, contiguous (False: `_int_vec` then
    names what is wrong)."""
    return (
        type(t) is torch.Tensor
        and t.dtype is torch.int32
        and t.shape == (n,)
        and t.get_device() == device
        and (t.stride(0) == 1 or n < 2)
    )


def _int_vec(t: Any, name: str, n: int | None, device: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise _fail(f"{name} must be int32, got {t.dtype}")
    if t.dim() != 1 or (n is not None and t.shape[0] != n):
        raise _fail(f"{name} must have shape ({n},), got {tuple(t.shape)}")
    if t.get_device() != device:
        raise _fail(f"{name} is on {t.device}, q is on device {device}")
    if t.stride(0) != 1 and t.shape[0] > 1:
        raise _fail(f"{name} must be contiguous")
    return t


def _check_page_table(page_table: Any, batch: int, dev: int) -> None:
    """Names what is wrong with a page table that failed the hot-path test (or returns: a
    non-contiguous table whose rows do not overlap is accepted)."""
    if not isinstance(page_table, torch.Tensor) or page_table.dtype != torch.int32:
        raise _fail(
            f"page_table must be an int32 tensor, got {getattr(page_table, 'dtype', type(page_table).__name__)}"
        )
    if page_table.dim() != 2 or page_table.shape[0] != batch:
        raise _fail(
            f"page_table must have shape ({batch}, max_pages), got {tuple(page_table.shape)}"
        )
    if page_table.get_device() != dev:
        raise _fail(f"page_table is on {page_table.device}, q is on device {dev}")
    if page_table.stride(-1) != 1 and page_table.shape[-1] > 1:
        raise _fail("page_table must be contiguous in its last dimension")
    if page_table.data_ptr() % 4 or (
        page_table.shape[0] > 1 and page_table.stride(0) < page_table.shape[1]
    ):
        raise _fail("page_table rows must not overlap; pass page_table.contiguous()")


def _check_qkv(q, k, v) -> tuple[int, Any, Any, Any]:
    """Checks shared by both entry points; -> q's device index (-1: not CUDA, refused later,
    after every other check, so that input checks are testable on a CPU) and the three shapes.
    On the hot path every attribute is read once."""
    if not (
        isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    ):
        bad = next(n for n, t in (("q", q), ("k", k), ("v", v)) if not isinstance(t, torch.Tensor))
        raise _fail(f"{bad} must be a torch.Tensor, got {type(locals()[bad]).__name__}")
    dq = q.get_device()
    if k.get_device() != dq or v.get_device() != dq:
        raise _fail(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    dt = q.dtype
    if dt not in _DTYPES or k.dtype is not dt or v.dtype is not dt:
        # an FP8 KV cache beside a bf16 q was refused as a plain dtype mismatch, naming no way
        # out; upstream FA4 has no FP8 forward on sm90 (the only arch this runtime serves)
        fp8 = [(n, t.dtype) for n, t in (("q", q), ("k", k), ("v", v)) if t.dtype in _FP8]
        if fp8:
            which = "/".join(n for n, _ in fp8)
            raise UnsupportedVariant(
                C.fp8_reason("sm90", str(fp8[0][1]).removeprefix("torch."), which)
            )
        if dt not in _DTYPES:
            raise _fail(f"q dtype must be bfloat16 or float16, got {dt}")
        raise _fail(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    qs, ks, vs = q.shape, k.shape, v.shape
    if len(qs) < 3 or len(ks) < 3 or len(vs) < 3:  # found by fuzzing: 0-d/1-d inputs hit IndexError
        raise _fail(
            f"q, k, v must be (..., heads, head_dim), got shapes {tuple(qs)}, "
            f"{tuple(ks)}, {tuple(vs)}"
        )
    if qs[-1] != ks[-1]:
        raise _fail(f"q and k head_dim differ: {qs[-1]} vs {ks[-1]}")
    hq, hk = qs[-2], ks[-2]
    if vs[-2] != hk:
        raise _fail(f"k and v must have the same number of heads, got {hk} and {vs[-2]}")
    if hk == 0 or hq % hk:
        raise _fail(f"num q heads ({hq}) must be a multiple of num kv heads ({hk})")
    return dq, qs, ks, vs


def _check_buffer(name: str, t, shape: tuple, dtype, dtype_name: str, dq: int) -> None:
    if (
        not isinstance(t, torch.Tensor)
        or tuple(t.shape) != tuple(shape)
        or t.dtype is not dtype
        or t.get_device() != dq
    ):
        raise _fail(
            f"{name} must be a {dtype_name} tensor of shape {tuple(shape)} on q's device, "
            f"got {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}"
        )


def _check_outputs(q, out, lse, out_shape: tuple, lse_shape: tuple, dq: int) -> None:
    """Caller-owned output buffers are written in place, never copied: check them fully."""
    if out is not None:
        _check_buffer("out", out, out_shape, q.dtype, str(q.dtype), dq)
        if not _aligned(out):
            raise _fail(
                "out must have a 16-byte aligned base, a contiguous last dim and 16-byte "
                f"aligned strides (got strides {tuple(out.stride())})"
            )
    if lse is not None:
        _check_buffer("lse", lse, lse_shape, torch.float32, "float32", dq)
        if not lse.is_contiguous() or lse.data_ptr() % 4:
            raise _fail("lse must be contiguous")


def _require_cuda(dq: int, q) -> None:
    if dq < 0:
        raise _fail(f"q, k, v must be CUDA tensors, got device {q.device}")


def _window(window_size) -> tuple[int | None, int | None]:
    try:
        wl, wr = window_size
    except (TypeError, ValueError):
        raise _fail(f"window_size must be a pair (left, right), got {window_size!r}") from None
    for w in (wl, wr):
        if w is not None and (isinstance(w, bool) or not isinstance(w, int)):
            raise _fail(f"window_size entries must be int or None, got {window_size!r}")
    return wl, wr


def _softcap(softcap) -> float | None:
    """FA4's softcap: 0 means none; the value is baked into the kernel (Variant.softcap)."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap < 0:
        raise _fail(f"softcap must be a number >= 0 (0: none), got {softcap!r}")
    return float(softcap) if softcap else None


def _sink(learnable_sink, hq: int, device: int) -> str | None:
    if learnable_sink is None:
        return None
    if not isinstance(learnable_sink, torch.Tensor) or learnable_sink.dtype not in _SINK_DTYPES:
        raise _fail("learnable_sink must be a float32/bfloat16/float16 tensor")
    if tuple(learnable_sink.shape) != (hq,) or learnable_sink.get_device() != device:
        raise _fail(
            f"learnable_sink must have shape ({hq},) on device {device}, got "
            f"{tuple(learnable_sink.shape)} on {learnable_sink.device}"
        )
    return _SINK_DTYPES[learnable_sink.dtype]


# -- entry points ------------------------------------------------------------------------------


def _resolve(rt: Runtime, fkey: tuple, feat_kwargs: dict, device, allow_padding: bool) -> _Plan:
    plan = rt._plans.get(fkey)
    if plan is not None:
        return plan
    arch, sms = _arch_of(device)
    why = C.runtime_unsupported_reason(arch)
    if why:
        raise UnsupportedVariant(why)
    variant = features(arch=arch, **feat_kwargs)
    why = C.unsupported_reason(
        arch, feat_kwargs["dtype"], feat_kwargs["head_dim"], feat_kwargs["head_dim_v"]
    )
    plan = None if why else rt.plan(variant, sms)
    if plan is None and allow_padding:
        from .select import choose

        choices = choose(arch, feat_kwargs, rt.available(arch, sms), allow_fold=rt.fold)
        if choices:
            inner = rt.plan(choices[0].variant, sms)
            if inner is not None:
                plan = replace(inner, pad=choices[0])
                log.debug(
                    "fa4aot: %s served by %s", variant.describe(), choices[0].describe(variant)
                )
    if plan is None and why:
        raise UnsupportedVariant(f"{variant.describe()}: {why}")
    if plan is None:
        return None  # caller decides (miss policy)
    _, local, plan.window_left, plan.window_right = C.resolve_window(
        feat_kwargs["causal"], feat_kwargs["window_left"], feat_kwargs["window_right"]
    )
    rows = feat_kwargs["seqlen_q"] or feat_kwargs["max_seqlen_q"]
    plan.may_split = not local and rows is not None and rows <= _SPLIT_ROWS
    rt._plans[fkey] = plan
    return plan


def _on_miss(
    rt: Runtime, fkey, feat_kwargs, device, jit_fn, args, kwargs, allow_padding, out=None, lse=None
):
    arch, sms = _arch_of(device)
    variant = features(arch=arch, **feat_kwargs)
    if rt.on_miss == "error":
        rt.miss(variant, sms, allow_padding)
    from .missing import record_miss

    record_miss(variant)
    if rt.on_miss == "warn":
        log.warning("fa4aot: no artifact for %s; compiling with FA4 (JIT)", variant.describe())
    from . import compiler

    o, lse_ = getattr(compiler, jit_fn)(*args, **kwargs)
    if out is not None:  # FA4's public functions take no output buffers: honour the caller's
        out.copy_(o)
        o = out
    if lse is not None and lse_ is not None:
        lse.copy_(lse_)
        lse_ = lse
    return o, lse_


# -- split-KV (split.py) ----------------------------------------------------------------------


def _try_split(
    rt: Runtime,
    dev: int,
    q4: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kind: str,
    kv_args: tuple,
    seqlen_k: int,
    page_size: int | None,
    causal: bool,
    sink,
    softmax_scale,
    out,
    lse,
    return_lse: bool,
    varlen_q: bool,
    sp: S.Split,
):
    """Serve a decode step by the split-KV plan `sp` (Runtime.split_for), or return None (the
    caller runs it unsplit).

    q4: the caller's q as (batch, rows, hq, d); kind: dense | varlen | paged K; kv_args:
    (cu_seqlens_k, seqused_k, page_table); seqlen_k: a host bound on every KV length; out /
    lse: the caller's buffers or None (lse laid out as the entry point returns it)."""
    b, rows, hq, d = q4.shape
    hk, dv = k.shape[-2], v.shape[-1]
    if rows > 1 and kind != "paged":
        return None  # split.split_refusal: only pages can give unrolled rows the same keys
    if kind == "dense":
        try:
            kk, vv = k.view(b * seqlen_k, hk, d), v.view(b * seqlen_k, hk, dv)
        except RuntimeError:
            return None  # K/V strided across batch and sequence: no packed view
    else:
        kk, vv = k, v
    if out is not None:
        try:  # the combine writes the caller's out in place, as (decode rows, 1, hq, dv)
            out_c = out.view(b * rows, 1, hq, dv)
        except RuntimeError:
            if rows > 1 or varlen_q:
                return None  # a caller's out whose rows do not merge
            out_c = out  # (b, 1, hq, dv), any strides
    cuda = q4.device.type == "cuda"  # (CPU tensors: the tests' stand-in kernels)
    capturing = cuda and torch._C._cuda_isCurrentStreamCapturing()
    stream = torch._C._cuda_getCurrentRawStream(dev) if cuda else 0
    # (a dense K's chunk bounds depend on its exact length, not only on the plan's bucket)
    key = (dev, stream, kind, q4.dtype, b, rows, hq, hk, d, dv, sp, page_size, causal,
           seqlen_k if kind == "dense" else 0)
    run = None if capturing else rt._split_runs.get(key)
    if run is None:
        run = _SplitRun(rt, dev, q4, hk, dv, kind, sp, page_size, causal, seqlen_k)
        if not capturing:
            if len(rt._split_runs) > 16:  # scratch per batch size: bound what it holds
                rt._split_runs.clear()
            rt._split_runs[key] = run
    r = hq // hk
    if b * rows == 1:
        # one decode row: every chunk reads the same q through a stride-0 batch mode, no copy
        # (the kernel took it and matched the copied q bit for bit on the H200, 2026-11-30)
        sh = q4.stride(2)
        kq = torch.as_strided(q4, (sp.slots, r, hk, d), (0, sh, r * sh, 1), q4.storage_offset())
    else:
        run.q_dst.copy_(q4.view(b, rows, 1, hk, r, d).expand(run.q_dst.shape))
        kq = run.kq
    cu_k, used_k, pt = kv_args
    if kind == "dense":
        cu_k = run.cu_k
    elif kind == "varlen":
        cu_k = S.varlen_cu_seqlens_k(torch, cu_k, run.offsets)
    else:
        used_k = S.chunk_lengths(used_k, run.offsets, sp.chunk)
        pt = S.chunk_page_table(torch, pt, sp, page_size, rows)
    _launch(
        run.kern.fwd,
        kq,
        kk,
        vv,
        run.ko,
        run.kl,
        float(1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale),
        None,
        cu_k,
        None,
        used_k,
        pt,
    )
    if sink is not None:  # the empty last slot carries the sink: counted once, as FA4 does
        run.lp_sink.copy_(sink[None, :].expand(run.lp_sink.shape))
    if out is None:
        out = q4.new_empty((b * rows, hq, dv) if varlen_q else (b, rows, hq, dv))
        out_c = out.view(b * rows, 1, hq, dv)
    if return_lse and lse is None:
        lse = torch.empty(
            (hq, b * rows) if varlen_q else (b, hq, rows), dtype=torch.float32, device=q4.device
        )
    if lse is not None and rows == 1:
        st = (1, 1, b) if varlen_q else (hq, 1, 1)
        lse_c = torch.as_strided(lse, (b, 1, hq), st, lse.storage_offset())
    else:
        lse_c = run.lse_scratch
    run.kern.combine(run.op_c, run.lp_c, out_c, lse_c, None, None, None, None, None)
    if lse is not None and rows > 1:
        bb = b * rows
        lse.copy_(lse_c.view(bb, hq).t() if varlen_q else lse_c.view(b, rows, hq).transpose(1, 2))
    return out, lse


class _SplitRun:
    """What a split decode step of one shape needs besides its inputs: the kernels, scratch
    buffers and the kernel-facing views of them, made once per (device, stream, shape) and
    reused by later steps: steps on one stream are ordered, so a step never overwrites
    scratch an earlier one still reads. While a CUDA graph is captured nothing is reused or
    kept: the graph gets scratch of its own, from its pool (constants made eagerly before,
    e.g. by the warm-up call, are shared: nothing writes them)."""

    def __init__(self, rt, dev, q4, hk, dv, kind, sp, page_size, causal, seqlen_k):
        b, rows, hq, d = q4.shape
        r, slots = hq // hk, sp.slots
        bb, nv = b * rows, b * rows * slots  # decode rows; virtual sequences (chunk fastest)
        dvc = q4.device
        self.kern = rt.split_kernel(dev, q4.dtype, d, dv, page_size)
        qr = q4.new_empty((b, rows, slots, hk, r, d))
        self.q_dst = qr
        self.kq = qr.view(nv, hk, r, d).transpose(1, 2)  # GQA folded: r rows of a 1:1 kernel
        op = q4.new_empty((bb, slots, hq, dv))
        self.ko = op.view(nv, hk, r, dv).transpose(1, 2)
        lp = torch.empty((bb, slots, hq), dtype=torch.float32, device=dvc)
        self.kl = lp.view(nv, hk, r)
        self.lp_sink = lp[:, sp.n] if slots > sp.n else None
        # the combine's modes are (chunk, row, 1, hq, dv) for partial outputs and (chunk, row,
        # 1, hq) for partial LSE with the seqlen mode contiguous: views of the kernel's
        self.op_c = op.permute(1, 0, 2, 3).unsqueeze(2)
        self.lp_c = torch.as_strided(lp, (slots, bb, 1, hq), (hq, slots * hq, 1, 1))
        self.lse_scratch = torch.empty((bb, 1, hq), dtype=torch.float32, device=dvc)

        def const(key, make):  # (while capturing: the eager warm-up's, or made in the graph)
            return _const(rt, key, dvc, make)

        if kind == "dense":
            self.cu_k = const(
                ("dense_cu", dev, b, seqlen_k, sp.chunk, slots),
                lambda: S.dense_cu_seqlens_k(torch, b, seqlen_k, sp, dvc),
            )
        else:
            offs = lambda: torch.arange(  # noqa: E731
                0, slots * sp.chunk, sp.chunk, dtype=torch.int32, device=dvc
            )
            self.offsets = const(("offsets", dev, slots, sp.chunk), offs)
            if rows > 1:
                # unrolled row t of a causal step sees len - rows + 1 + t keys; a
                # non-causal one all of them: per (row, chunk) offsets
                back = torch.arange(rows - 1, -1, -1, dtype=torch.int32, device=dvc)
                self.offsets = ((back[:, None] if causal else back[:, None] * 0)
                                + self.offsets).flatten()


def _const(rt: Runtime, key: tuple, device, make):
    """A device tensor that depends only on host-known sizes (chunk offsets, a dense K's
    cu_seqlens_k): made once and cached, except while a CUDA graph is captured (a tensor made
    then holds nothing until the graph replays)."""
    t = rt._split_consts.get(key)
    if t is None:
        t = make()
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            if len(rt._split_consts) > 256:
                rt._split_consts.clear()
            rt._split_consts[key] = t
    return t


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    learnable_sink: torch.Tensor | None = None,
    return_lse: bool = False,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    padding: bool | None = None,
    softcap: float = 0.0,
    pack_gqa: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dense forward with FA4's calling convention: q (b, sq, hq, d), k/v (b, sk, hk, d[v]).

    Returns (out, lse): out (b, sq, hq, dv) in q's dtype, lse (b, hq, sq) float32 or None.
    out / lse: caller-owned buffers to write into (as FA4's internal `_flash_attn_fwd` takes
    them; e.g. for CUDA graphs); `lse` given implies return_lse.
    padding: allow serving the call from a padded variant (and copying inputs whose layout the
    kernel cannot take); None: FA4AOT_PADDING (default allow).
    """
    dq, qs, ks, vs = _check_qkv(q, k, v)
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        raise _fail(
            f"flash_attn_func takes 4-D q/k/v (batch, seqlen, heads, head_dim), got "
            f"{q.dim()}-D/{k.dim()}-D/{v.dim()}-D; use flash_attn_varlen_func for packed inputs"
        )
    b, sq, hq, d = qs
    _, sk, hk, dv = vs
    if ks[0] != b or ks[1] != sk or vs[0] != b:
        raise _fail(f"k/v shapes {tuple(ks)}/{tuple(vs)} do not match q {tuple(qs)}")
    if window_size == (None, None):
        wl = wr = None
    else:
        wl, wr = _window(window_size)
    sink_dt = None if learnable_sink is None else _sink(learnable_sink, hq, dq)
    cap = _softcap(softcap)
    if pack_gqa is not None and type(pack_gqa) is not bool:
        raise _fail(f"pack_gqa must be True, False or None, got {pack_gqa!r}")
    return_lse = bool(return_lse) or lse is not None
    if out is not None or lse is not None:
        _check_outputs(q, out, lse, (b, sq, hq, dv), (b, hq, sq), dq)
    rt = _DEFAULT or default_runtime()
    pad_ok = rt.padding if padding is None else bool(padding)
    if not (_aligned(q) and _aligned(k) and _aligned(v)):
        q, k, v = _prep(q, "q", pad_ok), _prep(k, "k", pad_ok), _prep(v, "v", pad_ok)
    fkey = (
        "dense",
        q.dtype,
        d,
        dv,
        hq // hk,
        bool(causal),
        wl,
        wr,
        return_lse,
        sink_dt,
        min(sq, _Q_KEY_CAP),
        dq,
        pad_ok,
        cap,
        pack_gqa,
    )
    # the split's chunk kernels carry no softcap (split.py): a capped call runs unsplit
    if (
        sq == 1 and rt.split and wl is None and wr is None and cap is None and sk > _SPLIT_MIN
        and b and dq >= 0
    ):
        sp = rt.split_for(dq, q.dtype, b * hk, sk, d, dv, None, learnable_sink is not None)
        if sp is not None:
            got = _try_split(
                rt, dq, q, k, v, "dense", (None, None, None), sk, None, causal, learnable_sink,
                softmax_scale, out, lse, return_lse, False, sp,
            )
            if got is not None:
                return got
    plan = rt._plans.get(fkey)
    if plan is None:
        _require_cuda(dq, q)
        dev = q.device
        feat = dict(
            dtype=_DTYPES[q.dtype],
            head_dim=d,
            head_dim_v=dv,
            num_heads=hq,
            num_heads_kv=hk,
            causal=bool(causal),
            window_left=wl,
            window_right=wr,
            return_lse=return_lse,
            sink_dtype=sink_dt,
            batch=b,
            seqlen_q=sq,
            total_q=b * sq,
            max_seqlen_q=None,
            softcap=cap,
            pack_gqa=pack_gqa,
        )
        plan = _resolve(rt, fkey, feat, dev, pad_ok)
        if plan is None:
            return _on_miss(
                rt,
                fkey,
                feat,
                dev,
                "jit_flash_attn_func",
                (q, k, v),
                dict(
                    softmax_scale=softmax_scale,
                    causal=causal,
                    window_size=window_size,
                    learnable_sink=learnable_sink,
                    return_lse=return_lse,
                    softcap=softcap,
                    pack_gqa=pack_gqa,
                ),
                pad_ok,
                out,
                lse,
            )
    if plan.pad is not None:
        if plan.pad.fold > 1:
            return _folded(
                plan, q, k, v, out, lse, softmax_scale, return_lse, False, sk, (None, None, None)
            )
        return _padded(
            flash_attn_func,
            plan.pad,
            q,
            k,
            v,
            hk,
            learnable_sink,
            softmax_scale,
            dict(
                causal=causal,
                window_size=window_size,
                return_lse=return_lse,
                softcap=softcap,
                pack_gqa=pack_gqa,
            ),
            varlen=False,
            out=out,
            lse=lse,
        )
    if out is None:
        # empty_like skips shape parsing (~1 us); for a contiguous q it is contiguous too
        out = torch.empty_like(q) if dv == d and q.is_contiguous() else q.new_empty((b, sq, hq, dv))
    if lse is None and return_lse:
        lse = q.new_empty((b, hq, sq), dtype=torch.float32)
    if sq == 0 or sk == 0 or b == 0:
        return _empty(out, lse, learnable_sink, varlen=False)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    if learnable_sink is not None and learnable_sink.stride(0) != 1:
        learnable_sink = learnable_sink.contiguous()
    _launch(
        plan.fwd, q, k, v, out, lse, float(softmax_scale), None, None, None, None, None,
        plan.window_left, plan.window_right, learnable_sink,
    )
    return out, lse


def _pad_last2(x: torch.Tensor, hk: int, r: int, r2: int, d2: int) -> torch.Tensor:
    """(..., hk*r, d) -> (..., hk*r2, d2): r2 - r query heads appended to each KV group, d2 - d
    columns to the head dim. The extra columns are zeros (they enter every dot product); the
    extra heads' rows are left uninitialized: attention rows are independent (softmax, LSE and
    P@V are per row) and those rows are cropped from O and LSE, so one copy kernel suffices."""
    d = x.shape[-1]
    if r2 == r and d2 == d:
        return x
    lead = x.shape[:-2]
    y = x.new_empty((*lead, hk, r2, d2))
    if d2 > d:
        y[..., d:].zero_()
    _copy_wide(y[..., :r, :d], x.reshape(*lead, hk, r, d))
    return y.view(*lead, hk * r2, d2)


def _copy_wide(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for same-dtype strided views, moved as 8-byte words where both views allow
    it (contiguous rows of a multiple of 8 bytes, 8-byte aligned): torch's strided copy kernel
    is per element, so 2-byte elements cost it 4x the index math. Bit-for-bit the same copy."""
    if dst.dtype == src.dtype and dst.element_size() < 8:
        try:
            dst, src = dst.view(torch.int64), src.view(torch.int64)
        except RuntimeError:
            pass  # a row not a whole number of aligned words: copy element by element
    dst.copy_(src)


def _folded(plan, q, k, v, out, lse, softmax_scale, return_lse, varlen, seqlen_k, kv_args):
    """A decode step (one query row per sequence) run on the non-causal kernel of ratio
    `plan.pad.ratio` that `plan.fwd` is: the call's r query heads per KV group as r / ratio query
    rows (select.py). q, O and a dense call's LSE are strided views; a varlen call's LSE (heads,
    tokens) is the transpose of the kernel's (batch, heads, rows) and takes one copy.
    kv_args: (cu_seqlens_k, seqused_k, page_table), passed through."""
    b, hq, d, dv = q.shape[0], q.shape[-2], q.shape[-1], v.shape[-1]
    m = plan.pad.fold
    h2 = hq // m
    if out is None:
        out = q.new_empty((*q.shape[:-1], dv))
    lf = None
    if return_lse:
        if varlen:
            if lse is None:
                lse = q.new_empty((hq, b), dtype=torch.float32)
            lf = q.new_empty((b, h2, m), dtype=torch.float32)
        else:
            if lse is None:
                lse = q.new_empty((b, hq, 1), dtype=torch.float32)
            lf = lse.view(b, h2, m)
    if b == 0 or seqlen_k == 0:
        return _empty(out, lse, None, varlen)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    cu_seqlens_k, seqused_k, page_table = kv_args
    _launch(
        plan.fwd,
        q.view(b, h2, m, d).transpose(1, 2),
        k,
        v,
        out.view(b, h2, m, dv).transpose(1, 2),
        lf,
        float(softmax_scale),
        None,
        cu_seqlens_k,
        None,
        seqused_k,
        page_table,
    )
    if varlen and return_lse:
        lse.copy_(lf.view(b, hq).t())
    return out, lse


def _padded(entry, choice, q, k, v, hk, sink, softmax_scale, kw, varlen, out=None, lse=None):
    """Run `entry` on padded inputs with the exact padded variant, crop O and LSE back (into
    the caller's buffers when given)."""
    hq, d, dv = q.shape[-2], q.shape[-1], v.shape[-1]
    r, r2 = hq // hk, choice.ratio
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)  # the caller's head_dim, not the padded one
    qp = _pad_last2(q, hk, r, r2, choice.head_dim)
    kp = _pad_last2(k, hk, 1, 1, choice.head_dim)
    vp = _pad_last2(v, hk, 1, 1, choice.head_dim_v)
    sinkp = None
    if sink is not None:
        # padded heads' sinks: any finite value (their rows are cropped); 0 keeps them tame
        sinkp = torch.nn.functional.pad(sink.reshape(hk, r), (0, r2 - r)).reshape(hk * r2)
    po, pl = entry(
        qp, kp, vp, softmax_scale=softmax_scale, learnable_sink=sinkp, padding=False, **kw
    )
    # crop straight into the caller's buffers (or fresh ones): one copy each, none when nothing
    # was padded
    lead, dv2 = po.shape[:-2], choice.head_dim_v
    if out is None and r2 == r and dv2 == dv:
        out = po
    else:
        if out is None:
            out = po.new_empty((*lead, hq, dv))
        _copy_wide(out.view(*lead, hk, r, dv), po.view(*lead, hk, r2, dv2)[..., :r, :dv])
    if pl is not None:
        if lse is None and r2 == r:
            lse = pl
        else:
            if lse is None:
                lse = pl.new_empty((hq, pl.shape[1]) if varlen else (pl.shape[0], hq, pl.shape[2]))
            if varlen:  # (hq2, total_q)
                n = pl.shape[1]
                lse.view(hk, r, n).copy_(pl.view(hk, r2, n)[:, :r])
            else:  # (b, hq2, sq)
                b, n = pl.shape[0], pl.shape[2]
                lse.view(b, hk, r, n).copy_(pl.view(b, hk, r2, n)[:, :, :r])
    return out, lse


def _empty(out, lse, sink, varlen):
    out.zero_()
    if lse is not None:
        if sink is None:
            lse.fill_(float("-inf"))
        else:
            lse.copy_(
                sink[:, None].expand_as(lse) if varlen else sink[None, :, None].expand_as(lse)
            )
    return out, lse


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    learnable_sink: torch.Tensor | None = None,
    return_lse: bool = False,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    padding: bool | None = None,
    softcap: float = 0.0,
    pack_gqa: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Varlen / paged forward with FA4's calling convention.

    q: (total_q, hq, d) with cu_seqlens_q (batch+1,) int32 [or (b, sq, hq, d) without it].
    k/v: (total_k, hk, d) with cu_seqlens_k; or paged (num_pages, page_size, hk, d) with
    page_table (batch, max_pages) int32 and seqused_k (batch,) int32.
    Caller's contract (not checked: it would need a device sync): cu_seqlens start at 0, are
    non-decreasing and end at the packed length; max_seqlen_q, when given, bounds every
    sequence's query length; max_seqlen_k, when given, bounds every sequence's KV length (a
    split-KV decode step reads no key beyond it); page_table entries index the KV pool and
    cover ceil(seqused_k / page_size) pages per sequence; seqused_k <= pages * page_size.
    Returns (out, lse): out like q with head_dim_v; lse (hq, total_q) float32 or None.
    out / lse: caller-owned buffers, as in flash_attn_func.
    """
    dev, qs, ks, vs = _check_qkv(q, k, v)
    varlen_q = cu_seqlens_q is not None
    if varlen_q:
        if len(qs) != 3:
            raise _fail(
                f"with cu_seqlens_q, q must be (total_q, heads, head_dim), got {tuple(q.shape)}"
            )
        if not isinstance(cu_seqlens_q, torch.Tensor):
            raise _fail("cu_seqlens_q must be an int32 tensor")
        batch = cu_seqlens_q.shape[0] - 1 if cu_seqlens_q.dim() == 1 else -1
        if batch < 0:
            raise _fail(f"cu_seqlens_q must have shape (batch+1,), got {tuple(cu_seqlens_q.shape)}")
        if not _vec_ok(cu_seqlens_q, batch + 1, dev):
            _int_vec(cu_seqlens_q, "cu_seqlens_q", batch + 1, dev)
        total_q, hq, d = qs
        sq_dense = None
    else:
        if len(qs) != 4:
            raise _fail(
                f"without cu_seqlens_q, q must be (batch, seqlen, heads, head_dim), got {tuple(q.shape)}"
            )
        batch, sq_dense, hq, d = qs
        total_q = batch * sq_dense
    if max_seqlen_q is not None and (
        (type(max_seqlen_q) is not int and not _int_like(max_seqlen_q)) or max_seqlen_q < 0
    ):
        raise _fail(f"max_seqlen_q must be a non-negative host int or None, got {max_seqlen_q!r}")
    if seqused_q is not None and not _vec_ok(seqused_q, batch, dev):
        _int_vec(seqused_q, "seqused_q", batch, dev)
    paged = page_table is not None
    if paged:
        if cu_seqlens_k is not None:
            raise _fail(
                "page_table and cu_seqlens_k cannot be combined: pass KV lengths as seqused_k"
            )
        if not (
            type(page_table) is torch.Tensor
            and page_table.dtype is torch.int32
            and page_table.dim() == 2
            and page_table.shape[0] == batch
            and page_table.get_device() == dev
            and page_table.is_contiguous()
        ):
            _check_page_table(page_table, batch, dev)
        if len(ks) != 4 or len(vs) != 4:
            raise _fail(
                f"paged k/v must be (num_pages, page_size, kv_heads, head_dim), got {tuple(ks)}"
            )
        num_pages, page_size, hk, _ = ks
        if vs[:3] != ks[:3]:
            raise _fail(f"k {tuple(k.shape)} and v {tuple(v.shape)} page layouts differ")
        if seqused_k is None:
            raise _fail("paged KV needs seqused_k (batch,) int32: the KV length of each sequence")
        seqlen_k = num_pages * page_size
    else:
        page_size = None
        if cu_seqlens_k is not None:
            if len(ks) != 3 or len(vs) != 3:
                raise _fail(
                    f"with cu_seqlens_k, k/v must be (total_k, kv_heads, head_dim), got {tuple(ks)}"
                )
            if not _vec_ok(cu_seqlens_k, batch + 1, dev):
                _int_vec(cu_seqlens_k, "cu_seqlens_k", batch + 1, dev)
        elif len(ks) != 4 or len(vs) != 4 or ks[0] != batch:
            raise _fail(
                f"without cu_seqlens_k or page_table, k/v must be (batch={batch}, seqlen, heads, dim), got {tuple(k.shape)}"
            )
        if ks[:-1] != vs[:-1]:
            raise _fail(f"k {tuple(ks)} and v {tuple(vs)} differ")
        hk = ks[-2]
        seqlen_k = ks[-3]
    if seqused_k is not None and not _vec_ok(seqused_k, batch, dev):
        _int_vec(seqused_k, "seqused_k", batch, dev)
    dv = vs[-1]
    if window_size == (None, None):
        wl = wr = None
    else:
        wl, wr = _window(window_size)
    sink_dt = None if learnable_sink is None else _sink(learnable_sink, hq, dev)
    cap = _softcap(softcap)
    if pack_gqa is not None and type(pack_gqa) is not bool:
        raise _fail(f"pack_gqa must be True, False or None, got {pack_gqa!r}")
    return_lse = bool(return_lse) or lse is not None
    if out is not None or lse is not None:
        _check_outputs(
            q,
            out,
            lse,
            (*qs[:-1], dv),
            (hq, total_q) if varlen_q else (batch, hq, sq_dense),
            dev,
        )
    eff_q = max_seqlen_q if max_seqlen_q is not None else (total_q if varlen_q else sq_dense)
    rt = _DEFAULT or default_runtime()
    pad_ok = rt.padding if padding is None else bool(padding)
    fkey = (
        "varlen",
        q.dtype,
        d,
        dv,
        hq // hk,
        bool(causal),
        wl,
        wr,
        return_lse,
        sink_dt,
        varlen_q,
        cu_seqlens_k is not None,
        seqused_q is not None,
        seqused_k is not None,
        page_size,
        batch > _BIN_BATCH,
        max_seqlen_q is None,
        min(eff_q, _Q_KEY_CAP),
        total_q == batch,  # with max_seqlen_q == 1: one row per sequence, the decode fold applies
        dev,
        pad_ok,
        cap,
        pack_gqa,
    )
    if not (_aligned(q) and _aligned(k) and _aligned(v)):
        q, k, v = _prep(q, "q", pad_ok), _prep(k, "k", pad_ok), _prep(v, "v", pad_ok)
    plan = rt._plans.get(fkey)
    if (
        (plan is None or plan.may_split)
        and rt.split
        and wl is None
        and wr is None
        and cap is None
        and seqused_q is None
        and batch
        and dev >= 0
        and (page_table is not None or cu_seqlens_k is not None)
        # a packed K with seqused_k too: the chunks' bounds would ignore seqused_k (found in
        # review once FA4's cu_seqlens_k + seqused_k layout became buildable)
        and (paged or seqused_k is None)
    ):
        rows = sq_dense if not varlen_q else max_seqlen_q
        if rows is not None and 0 < rows <= _SPLIT_ROWS and total_q == batch * rows:
            if type(max_seqlen_k) is int and max_seqlen_k >= 0:
                bound = max_seqlen_k  # the caller's contract: it bounds every KV length
            else:
                bound = page_table.shape[1] * page_size if paged else ks[0]
            sp = None
            if bound > _SPLIT_MIN and (paged or rows == 1):
                sp = rt.split_for(dev, q.dtype, batch * rows * hk, bound, d, dv, page_size,
                                  learnable_sink is not None)
            if sp is not None:
                got = _try_split(
                    rt, dev, q.view(batch, rows, hq, d), k, v, "paged" if paged else "varlen",
                    (cu_seqlens_k, seqused_k, page_table), bound, page_size, causal,
                    learnable_sink, softmax_scale, out, lse, return_lse, varlen_q, sp,
                )
                if got is not None:
                    return got
    if plan is None:
        _require_cuda(dev, q)
        dev = q.device
        feat = dict(
            dtype=_DTYPES[q.dtype],
            head_dim=d,
            head_dim_v=dv,
            num_heads=hq,
            num_heads_kv=hk,
            causal=bool(causal),
            window_left=wl,
            window_right=wr,
            return_lse=return_lse,
            sink_dtype=sink_dt,
            batch=batch,
            seqlen_q=sq_dense,
            total_q=total_q,
            max_seqlen_q=max_seqlen_q,
            cu_seqlens_q=varlen_q,
            cu_seqlens_k=cu_seqlens_k is not None,
            seqused_q=seqused_q is not None,
            seqused_k=seqused_k is not None,
            page_size=page_size,
            softcap=cap,
            pack_gqa=pack_gqa,
        )
        plan = _resolve(rt, fkey, feat, dev, pad_ok)
        if plan is None:
            return _on_miss(
                rt,
                fkey,
                feat,
                dev,
                "jit_flash_attn_varlen_func",
                (q, k, v),
                dict(
                    cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k=cu_seqlens_k,
                    max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k,
                    seqused_q=seqused_q,
                    seqused_k=seqused_k,
                    page_table=page_table,
                    softmax_scale=softmax_scale,
                    causal=causal,
                    window_size=window_size,
                    learnable_sink=learnable_sink,
                    return_lse=return_lse,
                    softcap=softcap,
                    pack_gqa=pack_gqa,
                ),
                pad_ok,
                out,
                lse,
            )
    if plan.pad is not None:
        if plan.pad.fold > 1:  # q (batch, hq, d), one row per sequence (see the fkey)
            return _folded(
                plan,
                q,
                k,
                v,
                out,
                lse,
                softmax_scale,
                return_lse,
                varlen_q,
                seqlen_k,
                (cu_seqlens_k, seqused_k, page_table),
            )
        return _padded(
            flash_attn_varlen_func,
            plan.pad,
            q,
            k,
            v,
            hk,
            learnable_sink,
            softmax_scale,
            dict(
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k,
                seqused_q=seqused_q,
                seqused_k=seqused_k,
                page_table=page_table,
                causal=causal,
                window_size=window_size,
                return_lse=return_lse,
                softcap=softcap,
                pack_gqa=pack_gqa,
            ),
            varlen=varlen_q,
            out=out,
            lse=lse,
        )
    if out is None:
        out = (
            torch.empty_like(q)
            if dv == d and q.is_contiguous()
            else q.new_empty((*q.shape[:-1], dv))
        )
    if lse is None and return_lse:
        lse = q.new_empty((hq, total_q) if varlen_q else (batch, hq, sq_dense), dtype=torch.float32)
    if total_q == 0 or seqlen_k == 0:
        return _empty(out, lse, learnable_sink, varlen=varlen_q)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    if learnable_sink is not None and learnable_sink.stride(0) != 1:
        learnable_sink = learnable_sink.contiguous()
    cu_total = None
    if plan.tile_cumsum is None:
        pass
    elif max_seqlen_q == 1 and plan.helper_cu and not plan.helper_seqused and plan.decode_blocks:
        # Decode (every sequence has 0 or 1 query rows): the helper would compute, per sequence,
        # ceil(rows * qhead_per_kvhead / tile) = rows (qhead_per_kvhead <= tile_m), i.e.
        # cu_total == cu_seqlens_q. Passing it saves a kernel launch and an allocation.
        cu_total = cu_seqlens_q
    else:
        cu_total = cu_seqlens_q.new_empty(batch + 1) if varlen_q else seqused_q.new_empty(batch + 1)
        plan.tile_cumsum(
            cu_total,
            None,
            cu_seqlens_q if plan.helper_cu else None,
            seqused_q if plan.helper_seqused else None,
            None,
            None,
        )
    _launch(
        plan.fwd, q, k, v, out, lse, float(softmax_scale), cu_seqlens_q, cu_seqlens_k,
        seqused_q, seqused_k, page_table, plan.window_left, plan.window_right, learnable_sink,
        cu_total,
    )
    return out, lse


__all__ = [
    "Runtime",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "default_runtime",
    "reset",
    "Fa4aotError",
]
