"""Every FA4AOT_* environment variable, read here and nowhere else.

In the manner of Triton's `knobs.py`: each setting is a typed descriptor on `Settings`, read
lazily from the environment at each access (a server that sets a variable after import still
gets it), with one policy for a bad value: `SettingError`, naming the variable, the value and
the values allowed. An empty variable counts as unset. Tests override settings through
`scope(...)`, never by editing `os.environ`:

    from fa4aot import settings
    with settings.scope(padding="deny", split_kv="4"):
        ...                                  # strings are parsed as the environment's would be

`report()` lists every setting with its value and where it came from (`fa4aot doctor`).
The accessors below (`on_miss()`, `padding()`, `split_kv()`...) are what other modules call.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fa4aot.errors import SettingError

PREFIX = "FA4AOT_"


class _Setting:
    """One FA4AOT_* variable: `parse(raw) -> value` raises ValueError on a bad value."""

    def __init__(self, default: Any, parse: Callable[[str], Any], allowed: str, doc: str):
        self.default, self.parse, self.allowed, self.doc = default, parse, allowed, doc

    def __set_name__(self, owner, attr: str) -> None:
        self.attr = attr
        self.env = PREFIX + attr.upper()

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return obj.value(self.attr)


def _choice(*values: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in values:
            raise ValueError(raw)
        return raw

    return parse


def _flag(raw: str) -> bool:
    # 0/1 only: "yes", "true" and "on" read differently in every tool; one spelling, no doubt
    if raw not in ("0", "1"):
        raise ValueError(raw)
    return raw == "1"


def _number(kind: type, low: float) -> Callable[[str], Any]:
    def parse(raw: str):
        v = kind(raw)
        if not v >= low:  # also refuses nan
            raise ValueError(raw)
        return v

    return parse


def _path(raw: str) -> Path:
    return Path(raw).expanduser()


def _layers(raw: str) -> list[Path]:
    # "::" or ":" would silently mean "no store at all": a typo, never an intent
    layers = [Path(p).expanduser() for p in raw.split(os.pathsep) if p.strip()]
    if not layers:
        raise ValueError(raw)
    return layers


def _split_kv(raw: str) -> str | int:
    if raw == "auto":
        return raw
    if not raw.isdigit():
        raise ValueError(raw)
    return int(raw)  # 0: never split


FAULT_POINTS = (
    "export",
    "link",
    "stage",
    "publish",
    "published",
    "unpack-staged",
    "unpack-imported-one",
    "unpack-indexes",
)


# What a call no artifact serves does (FA4AOT_ON_MISS, Runtime(on_miss=), fa4aot.install(on_miss=))
ON_MISS = ("error", "warn", "jit")


class Settings:
    """The settings, as typed attributes (`settings.padding` -> "allow")."""

    on_miss = _Setting(
        "error", _choice(*ON_MISS), "error, warn or jit",
        "runtime policy for a call no artifact serves",
    )
    padding = _Setting(
        "allow", _choice("allow", "deny"), "allow or deny",
        "serve calls from a larger cached variant by padding",
    )
    decode_fold = _Setting(
        True, _flag, "0 or 1", "serve one-row decode steps by folding query heads into rows"
    )
    split_kv = _Setting(
        "auto", _split_kv, "auto, 0 or a positive integer",
        "KV splits of a decode step (auto: the runtime's choice; 0: never split)",
    )
    cache_dir = _Setting(
        None, _layers, "':'-separated directories",
        "store layers, in lookup order (default: the user cache directory)",
    )
    cache_wheels = _Setting(True, _flag, "0 or 1", "add installed cache wheels' stores as layers")
    kernel_source = _Setting(
        "auto", _choice("auto", "upstream", "vllm", "sglang"), "auto, upstream, vllm or sglang",
        "the FA4 source whose stores the runtime serves (auto: upstream where flash-attn-4 is "
        "installed, else any)",
    )
    allow_unsafe_dirs = _Setting(
        False, _flag, "0 or 1", "load native code from directories others can write"
    )
    miss_log = _Setting(None, _path, "a file path", "append each distinct miss (JSON lines)")
    miss_log_max = _Setting(
        1000, _number(int, 0), "an integer >= 0", "most lines the miss log may hold"
    )
    install = _Setting(
        None, _choice("error", "warn", "jit"), "error, warn or jit",
        "with `fa4aot hook --enable`: run fa4aot.install(on_miss=...) when FA4 is imported",
    )
    runtime_lib = _Setting(None, _path, "a file path", "libcute_dsl_runtime.so to load")
    engine_plugin = _Setting(
        True, _flag, "0 or 1", "0: the vLLM / SGLang plugins (fa4aot.engines) patch nothing"
    )
    lock = _Setting(
        "auto", _choice("auto", "flock", "marker"), "auto, flock or marker",
        "build lock kind (auto: flock on local filesystems, marker files elsewhere)",
    )
    lock_lease_s = _Setting(
        60.0, _number(float, 1.0), "seconds >= 1",
        "when another machine's marker lock counts as abandoned",
    )
    progress = _Setting(
        "auto", _choice("auto", "0", "1"), "auto, 0 or 1",
        "build progress on stderr (auto: unless --json; off a terminal one line per variant)",
    )
    debug = _Setting(False, _flag, "0 or 1", "the CLI prints tracebacks")
    stub_compiler = _Setting(False, _flag, "0 or 1", "tests: build fake, never loadable artifacts")
    stub_delay = _Setting(
        0.05, _number(float, 0.0), "seconds >= 0", "tests: duration of a fake compile"
    )
    fault = _Setting(
        None, _choice(*FAULT_POINTS), ", ".join(FAULT_POINTS),
        "crash tests (stub stores only): SIGKILL the build or unpack at that point",
    )

    def __init__(self) -> None:
        self._overrides: dict[str, Any] = {}
        self._lock = threading.Lock()

    @classmethod
    def all(cls) -> list[_Setting]:
        return [v for v in vars(cls).values() if isinstance(v, _Setting)]

    def _setting(self, attr: str) -> _Setting:
        s = vars(type(self)).get(attr)
        if not isinstance(s, _Setting):
            raise AttributeError(f"no setting {attr!r}")
        return s

    def raw(self, attr: str) -> str | None:
        """The text the value is parsed from (a scope's, else the environment's); None: unset."""
        s = self._setting(attr)
        if attr in self._overrides:
            v = self._overrides[attr]
            return v if isinstance(v, str) or v is None else str(v)
        return os.environ.get(s.env) or None

    def source(self, attr: str) -> str:
        """scope | env | default."""
        s = self._setting(attr)
        if attr in self._overrides:
            return "scope"
        return "env" if os.environ.get(s.env) else "default"

    def value(self, attr: str) -> Any:
        s = self._setting(attr)
        if attr in self._overrides:
            v = self._overrides[attr]
            if not isinstance(v, str):
                return s.default if v is None else v
            raw = v or None
        else:
            raw = os.environ.get(s.env) or None
        if raw is None:
            return s.default
        try:
            return s.parse(raw)
        except (ValueError, TypeError, OverflowError):
            raise SettingError(f"{s.env}={raw!r} is invalid: expected {s.allowed}") from None

    @contextlib.contextmanager
    def scope(self, **values: Any) -> Iterator[Settings]:
        """Override settings inside a `with` block: a string is parsed as the environment's
        would be (so a scope can hold an invalid value, to test the error); None means unset;
        another value is used as is. Restored on exit, whatever happens."""
        for attr in values:
            self._setting(attr)
        with self._lock:
            saved = {a: self._overrides[a] for a in values if a in self._overrides}
            self._overrides.update(values)
        try:
            yield self
        finally:
            with self._lock:
                for a in values:
                    self._overrides.pop(a, None)
                self._overrides.update(saved)

    def overrides(self) -> dict[str, Any]:
        """The scope's overrides, to hand to worker processes (build's spawn pool)."""
        return dict(self._overrides)

    def apply(self, overrides: dict[str, Any]) -> None:
        """Adopt a parent process's overrides for good (worker initializers only)."""
        self._overrides.update(overrides)

    def report(self) -> list[dict[str, Any]]:
        """Every setting: its variable, value (or error), source, allowed values, what it does."""
        rows = []
        for s in self.all():
            row = {
                "variable": s.env,
                "source": self.source(s.attr),
                "raw": self.raw(s.attr),
                "allowed": s.allowed,
                "doc": s.doc,
            }
            try:
                v = self.value(s.attr)
                row["value"] = [str(p) for p in v] if isinstance(v, list) else (
                    str(v) if isinstance(v, Path) else v
                )
            except SettingError as e:
                row["value"], row["error"] = None, str(e)
            rows.append(row)
        return rows

    def errors(self) -> list[str]:
        """What is wrong with the settings, one line each (empty: all valid)."""
        return [r["error"] for r in self.report() if "error" in r]


settings = Settings()
scope = settings.scope


def check() -> None:
    """Raise SettingError for the first invalid setting (commands that judge a host call it)."""
    for s in Settings.all():
        settings.value(s.attr)


# Accessors: what the other modules call.
def on_miss() -> str:
    return settings.on_miss


def padding() -> str:
    return settings.padding


def allow_padding() -> bool:
    return settings.padding == "allow"


def decode_fold() -> bool:
    return settings.decode_fold


def split_kv() -> str | int:
    """"auto", or a number of KV splits (0: never split)."""
    return settings.split_kv


def cache_dir() -> list[Path] | None:
    return settings.cache_dir


def fa4_source() -> str:
    return settings.kernel_source


def cache_wheels() -> bool:
    return settings.cache_wheels


def allow_unsafe_dirs() -> bool:
    return settings.allow_unsafe_dirs


def miss_log() -> Path | None:
    return settings.miss_log


def miss_log_max() -> int:
    return settings.miss_log_max


def install_mode() -> str | None:
    return settings.install


def runtime_lib() -> Path | None:
    return settings.runtime_lib


def lock_kind() -> str:
    return settings.lock


def lock_lease_s() -> float:
    return settings.lock_lease_s


def progress() -> str:
    return settings.progress


def debug() -> bool:
    return settings.debug


def stub_compiler() -> bool:
    return settings.stub_compiler


def stub_delay() -> float:
    return settings.stub_delay


def fault() -> str | None:
    return settings.fault


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Print `message` to stderr once per process (settings that must not raise where they are
    read: the site-packages hook at interpreter start, the miss log on a serving path)."""

    with settings._lock:
        if message in _warned:
            return
        _warned.add(message)
    print(message, file=sys.stderr)
