"""Activate `fa4aot.install()` from the environment, for servers that cannot add a line.

`fa4aot hook --enable` writes `fa4aot-autoinstall.pth` into site-packages. Python executes its
one line at every interpreter start; with FA4AOT_INSTALL unset that line is a dictionary lookup
(about a microsecond). With FA4AOT_INSTALL=error|warn|jit it puts a finder on sys.meta_path
that waits for `flash_attn.cute.interface` to be imported and installs fa4aot right after it
executes: nothing heavy is imported early, and processes that never import FA4 pay nothing.
(Alternatively add the same two calls to a `sitecustomize.py`.)
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from fa4aot.errors import Fa4aotError

TARGET = "flash_attn.cute.interface"
PTH_NAME = "fa4aot-autoinstall.pth"
# The .pth line reads the variable itself: importing fa4aot at every interpreter start would cost
# milliseconds in every Python process of the host; the check costs a dictionary lookup.
PTH_LINE = "import os; os.environ.get('FA4AOT_INSTALL') and __import__('fa4aot._autoinstall')._autoinstall.activate()\n"


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, mode: str):
        self.mode = mode

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # once; and let the normal finders locate the module
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module
        mode = self.mode

        def exec_module(module):
            run(module)
            from fa4aot.fa4.dropin import install

            install(on_miss=mode)

        spec.loader.exec_module = exec_module
        return spec


def activate() -> None:
    """Install now if FA4 is imported, else when it is. An invalid FA4AOT_INSTALL must not stop
    the interpreter it runs in: it is ignored with one warning per process, however often the
    hook runs (a `.pth` line and an explicit call, or a re-executed site)."""
    from fa4aot import settings

    try:
        mode = settings.install_mode()
    except Fa4aotError as e:
        settings.warn_once(f"fa4aot: ignored: {e}")
        return
    if mode is None:
        return
    if TARGET in sys.modules:
        from fa4aot.fa4.dropin import install

        install(on_miss=mode)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(mode))
