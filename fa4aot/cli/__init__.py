"""`fa4aot` command line, one module per command group on plain click (after the `hf` CLI).

Commands build rows and hand them to one output sink (`output.Output`: a table or `--json`);
progress goes to stderr, for humans. Exit codes: 0 ok, 1 failure (a variant failed, something
missing or corrupt, an invalid setting), 2 usage, 130 interrupted. Under `--json` errors are
JSON too (`{"error": ..., "exit": N}`). FA4AOT_DEBUG=1 shows tracebacks.

    build.py    build, specs               store.py  ls, inspect, verify, prune
    ship.py     pack, unpack, wheel, merge check.py  coverage, doctor
    explain.py  explain                    hook.py   hook
"""

# relative: docs/gen_cli.py imports a private copy of this package, whose modules must find
# one another (and register their commands on its own `main`)
from . import build, check, explain, hook, ship, store  # noqa: F401 - register commands
from .app import main

__all__ = ["main"]
