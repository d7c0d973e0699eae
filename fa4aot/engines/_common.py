"""What the engine plugins share: counters, the hand-back log, the serve-or-hand-back step, an
engine call turned into fa4aot's (`precheck`, `to_fa4aot`), and the plugin's life cycle (`Engine`:
patching a module attribute as soon as its module is imported, putting it back, the entry point).

A plugin wraps one function of an engine (its FA4 entry point). Each call is either served by
fa4aot's runtime (a hit) or handed back to the engine's own function, unchanged, with a reason:
an argument fa4aot does not serve exactly (a hand-back) or a typed refusal of fa4aot's runtime
before launch (a miss). Nothing is dropped: every hand-back is counted by reason and written once
per (engine, function, reason, call shape) to the miss log (FA4AOT_MISS_LOG) as a line
`{"handback": {...}}`, beside the variant lines fa4aot's runtime writes for its own misses.
"""

from __future__ import annotations

import collections
import importlib.abc
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass, field

from .. import errors

log = logging.getLogger("fa4aot.engines")

# fa4aot's runtime raises these on the host before anything runs: the caller's buffers are
# untouched, so the engine's own function can take the call over.
MISS_ERRORS = (errors.ArtifactMissing, errors.UnsupportedVariant, errors.ContractViolation)

# Set to "0" to keep a shipped plugin from patching anything when its engine loads it.
ENV_DISABLE = "FA4AOT_ENGINE_PLUGIN"

_lock = threading.Lock()
_logged: set[str] = set()


@dataclass
class Counters:
    """Per-plugin call counts. `handbacks` and `misses` map a reason to its count; a miss's
    reason is the fa4aot error's class name and the start of its message."""

    hits: int = 0
    misses: collections.Counter = field(default_factory=collections.Counter)
    handbacks: collections.Counter = field(default_factory=collections.Counter)
    # engine arguments fa4aot served by its own choice (e.g. its split count for num_splits)
    overridden: collections.Counter = field(default_factory=collections.Counter)

    @property
    def calls(self) -> int:
        return self.hits + sum(self.misses.values()) + sum(self.handbacks.values())

    def as_dict(self) -> dict:
        return {
            "calls": self.calls,
            "hits": self.hits,
            "misses": dict(self.misses),
            "handbacks": dict(self.handbacks),
            "overridden": dict(self.overridden),
        }

    def reset(self) -> None:
        self.hits = 0
        self.misses.clear()
        self.handbacks.clear()
        self.overridden.clear()


def describe(q, k, v, **flags) -> dict:
    """A JSON-able summary of a call's shape: enough to write the spec layer that serves it."""

    def t(x):
        if x is None:
            return None
        return {"dtype": str(x.dtype).replace("torch.", ""), "shape": list(x.shape)}

    out = {"q": t(q), "k": t(k), "v": t(v)}
    for name, val in flags.items():
        out[name] = t(val) if hasattr(val, "dtype") and hasattr(val, "shape") else val
    return out


def log_handback(engine: str, function: str, kind: str, reason: str, call: dict) -> bool:
    """Append one `{"handback": ...}` line to the miss log, once per distinct (engine, function,
    kind, reason, call); bounded by FA4AOT_MISS_LOG_MAX lines in the file. Never raises."""
    from .. import settings

    try:
        path = settings.miss_log()
        limit = settings.miss_log_max() if path else 0
    except errors.SettingError as e:
        settings.warn_once(f"fa4aot: miss log off: {e}")
        return False
    if not path:
        return False
    rec = {"engine": engine, "function": function, "kind": kind, "reason": reason, "call": call}
    key = json.dumps(rec, sort_keys=True, default=str)
    with _lock:
        if key in _logged:
            return False
        _logged.add(key)
        try:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                data = b""
            if data.count(b"\n") >= limit:
                return False
            line = json.dumps({"handback": rec}, sort_keys=True, default=str) + "\n"
            # a writer killed mid-line left no newline: ours must not be glued to its tail
            if data and not data.endswith(b"\n"):
                line = "\n" + line
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
            return True
        except OSError:
            return False


def read_handbacks(path) -> list[dict]:
    """The hand-back records of a miss log (the variant lines are fa4aot.missing's)."""
    out = []
    try:
        text = open(path).read()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("handback"), dict):
            out.append(rec["handback"])
    return out


class Plugin:
    """One wrapped engine function: counts, logs, and holds the original."""

    def __init__(self, engine: str, function: str):
        self.engine = engine
        self.function = function
        self.counters = Counters()
        self.original = None
        # call keys fa4aot refused once: handed back without asking again (a miss re-plans
        # and searches the store for the nearest variant, far costlier than a hit)
        self._refused: dict[tuple, str] = {}

    def handback(self, reason: str, call: dict, args, kwargs):
        self.counters.handbacks[reason] += 1
        if log_handback(self.engine, self.function, "handback", reason, call):
            log.info("fa4aot: %s %s handed back (%s)", self.engine, self.function, reason)
        return self.original(*args, **kwargs)

    def miss(self, err: Exception | str, key, call: dict, args, kwargs):
        reason = err if isinstance(err, str) else f"{type(err).__name__}: {str(err)[:160]}"
        if key is not None and not isinstance(err, str):
            self._refused[key] = reason
        self.counters.misses[reason] += 1
        if log_handback(self.engine, self.function, "miss", reason, call):
            log.info("fa4aot: %s %s miss, handed back (%s)", self.engine, self.function, reason)
        return self.original(*args, **kwargs)

    def refused(self, key) -> str | None:
        return self._refused.get(key)


def apply_when_imported(module: str, patch) -> None:
    """Run patch(mod) now if `module` is imported, else right after it is first imported (an
    import hook: patching must not import the engine's FA4 copy, which loads the CuTe DSL)."""
    mod = sys.modules.get(module)
    if mod is not None:
        patch(mod)
        return
    with _lock:
        for f in sys.meta_path:
            if isinstance(f, _PatchOnImport):
                f.pending.setdefault(module, []).append(patch)
                return
        finder = _PatchOnImport()
        finder.pending[module] = [patch]
        sys.meta_path.insert(0, finder)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a pending module it asks the other finders, then wraps the
    loader so the patches run once the module body has executed."""

    def __init__(self):
        self.pending: dict[str, list] = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        patches = self.pending.pop(fullname)
        exec_module = loader.exec_module

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, mod):
                exec_module(mod)
                for p in patches:
                    p(mod)

        spec.loader = _Loader()
        return spec


def disabled() -> bool:
    from .. import settings

    try:
        return not settings.settings.engine_plugin
    except errors.SettingError as e:  # a bad value must not break the engine's start-up
        settings.warn_once(f"fa4aot: engine plugin off: {e}")
        return True


# the arguments a miss's log line records beside q, k, v: what a spec layer needs
_SUMMARY = (
    "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table", "max_seqlen_q", "causal",
    "window_size", "learnable_sink", "softcap", "return_lse", "q_descale", "qv",
)


def _static(name: str, x):
    """What of one argument fa4aot's store lookup depends on (a refused-call cache key term)."""
    if x is None or isinstance(x, (bool, float, str)):
        return x
    if isinstance(x, int):
        if name == "max_seqlen_q":
            return min(x, 193)  # fa4aot's decode/prefill choice stops depending on it there
        return x.bit_length() if name == "max_seqlen_k" else x
    shape = getattr(x, "shape", None)
    if shape is None:
        return type(x).__name__
    dev = getattr(x, "device", None)
    if len(shape) >= 3:
        return (str(x.dtype), tuple(shape[1:]), str(dev))
    return (str(x.dtype), len(shape), len(shape) == 1 and shape[0] > 257)


def make_wrapper(plugin: Plugin, params: list[tuple[str, object]], must_default, convert, result):
    """A wrapper with the wrapped function's parameters (`params`, in order, with defaults).

    must_default: names whose non-default value fa4aot does not serve (hand back, reason = name).
    convert(a): the bound arguments -> (fa4aot function, kwargs) or a hand-back reason string.
    result(out, lse): fa4aot's (out, lse) -> the wrapped function's return value.
    The engine's function gets back exactly the (args, kwargs) the wrapper received."""
    names = [n for n, _ in params]
    defaults = dict(params)
    checks = [(n, defaults[n]) for n in must_default]

    def wrapper(*args, **kwargs):
        if len(args) > len(names):
            return plugin.handback("extra positional arguments", {}, args, kwargs)
        a = dict(defaults)
        a.update(zip(names, args))
        for n in kwargs:
            if n not in defaults:
                return plugin.handback(f"unknown argument {n}", {}, args, kwargs)
        a.update(kwargs)
        call = None
        for n, d in checks:
            val = a[n]
            if val is not d and not (d is not None and val == d):
                call = call or describe(a.get("q"), a.get("k"), a.get("v"))
                return plugin.handback(n, call, args, kwargs)
        got = convert(a)
        if isinstance(got, str):
            return plugin.handback(got, describe(a.get("q"), a.get("k"), a.get("v")), args, kwargs)
        fn, kw = got
        key = (fn.__name__, *((n, _static(n, v)) for n, v in kw.items()))
        why = plugin.refused(key)
        if why is not None:
            plugin.counters.misses[why] += 1
            return plugin.original(*args, **kwargs)
        try:
            out, lse = fn(**kw)
        except MISS_ERRORS as e:
            call = describe(kw["q"], kw["k"], kw["v"], **{n: kw.get(n) for n in _SUMMARY})
            cacheable = not isinstance(e, errors.ContractViolation)
            return plugin.miss(e, key if cacheable else None, call, args, kwargs)
        plugin.counters.hits += 1
        return result(out, lse)

    return wrapper


def window(left, right):
    """FA4's window pair as fa4aot takes it, or a hand-back reason. FA4 reads a pair summing
    below 0 as no window (interface.py `_resolve_causal_local_window`); a lone negative entry
    has no fa4aot meaning that is certainly FA4's, so it goes back."""
    if left is not None and right is not None and left + right < 0:
        return None, None
    if (left is not None and left < 0) or (right is not None and right < 0):
        return "window_size with a negative entry"
    return left, right


def grad_or_fake(*ts) -> str | None:
    """fa4aot serves inference on real CUDA tensors: autograd and tracing (fake or meta
    tensors, as torch.compile and the engines' compile-only warm-ups pass) go back."""
    for t in ts:
        if t is None:
            continue
        if getattr(t, "requires_grad", False):
            return "requires_grad"
        if type(t).__name__ in ("FakeTensor", "FunctionalTensor") or t.device.type == "meta":
            return "fake or meta tensor"
    return None


def patch(plugin: Plugin, mod, attr: str, build) -> bool:
    """Replace mod.attr by build(), wrapping the current function; idempotent. The wrapper takes
    the original's attributes (FA4's `_flash_attn_fwd.compile_cache` is looked up through the
    module global the wrapper replaces) and `__wrapped__`."""
    import functools

    orig = getattr(mod, attr, None)
    if orig is None:
        log.warning("fa4aot: %s.%s is not there (engine's FA4 unavailable?): not patched",
                    mod.__name__, attr)
        return False
    if getattr(orig, "__fa4aot_plugin__", None) is plugin:
        return True
    plugin.original = orig
    w = functools.update_wrapper(build(), orig)
    w.__fa4aot_plugin__ = plugin
    setattr(mod, attr, w)
    log.info("fa4aot: serving %s.%s from the fa4aot store", mod.__name__, attr)
    return True


def unpatch(plugin: Plugin, module: str, attr: str) -> None:
    """Put the engine's function back (a no-op when not patched)."""
    mod = sys.modules.get(module)
    cur = getattr(mod, attr, None) if mod is not None else None
    if getattr(cur, "__fa4aot_plugin__", None) is plugin:
        setattr(mod, attr, plugin.original)
    for f in sys.meta_path:
        if isinstance(f, _PatchOnImport):
            f.pending.pop(module, None)


# the K/V layout arguments both engines' FA4 entries take: any of them -> flash_attn_varlen_func
LAYOUT = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "page_table")


def precheck(a: dict) -> str | None:
    """A hand-back reason every plugin gives before converting a call, or None."""
    if a["q"] is None or a["k"] is None:
        return "q or k is None"
    return grad_or_fake(a["q"], a["k"], a["v"], a["qv"], a["learnable_sink"])


def to_fa4aot(plugin: Plugin, a: dict, win: tuple, **extra):
    """An engine call's bound FA4 arguments `a` (the names both copies share; `win`: the window
    as fa4aot takes it) -> (fa4aot function, kwargs): flash_attn_func without any layout
    argument, flash_attn_varlen_func with one. extra: more fa4aot keywords. `num_splits` is a
    scheduling hint fa4aot replaces with its own choice (counted in `overridden`)."""
    import fa4aot

    kw = dict(
        q=a["q"], k=a["k"], v=a["v"], softmax_scale=a["softmax_scale"], causal=a["causal"],
        window_size=win, learnable_sink=a["learnable_sink"], return_lse=a["return_lse"],
        out=a["out"], softcap=a["softcap"] or 0.0, pack_gqa=a["pack_gqa"], **extra,
    )
    for n in ("q_descale", "k_descale", "v_descale", "qv"):
        if a[n] is not None:
            kw[n] = a[n]
    if all(a[n] is None for n in LAYOUT):
        fn = fa4aot.flash_attn_func
    else:
        fn = fa4aot.flash_attn_varlen_func
        kw.update({n: a[n] for n in LAYOUT}, max_seqlen_q=a["max_seqlen_q"],
                  max_seqlen_k=a["max_seqlen_k"])
    if a["num_splits"] not in (0, 1):
        plugin.counters.overridden["num_splits"] += 1
    return fn, kw


class Engine:
    """One engine plugin's life cycle: it wraps `module.attr` (the engine's FA4 entry, whose
    parameters are `params`) with make_wrapper(plugin, params, hand_back, convert, result)."""

    def __init__(self, engine: str, label: str, module: str, attr: str,
                 params: list[tuple[str, object]], hand_back: tuple[str, ...], convert, result):
        self.label, self.module, self.attr = label, module, attr
        self.params, self.hand_back, self.convert, self.result = params, hand_back, convert, result
        self.plugin = Plugin(engine, f"{module}.{attr}")

    def _patch(self, mod) -> None:
        patch(self.plugin, mod, self.attr, lambda: make_wrapper(
            self.plugin, self.params, self.hand_back, self.convert, self.result))

    def install(self) -> Counters:
        """Wrap the engine's FA4 entry now, or when its module is first imported. Idempotent.
        Returns the counters."""
        apply_when_imported(self.module, self._patch)
        return self.plugin.counters

    def uninstall(self) -> None:
        unpatch(self.plugin, self.module, self.attr)

    def register(self) -> None:
        """The engine's plugin entry point: install() unless FA4AOT_ENGINE_PLUGIN=0."""
        if disabled():
            log.info("fa4aot: %s plugin off (%s=0)", self.label, ENV_DISABLE)
            return
        self.install()
