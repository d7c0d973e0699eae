"""`fa4aot` command line, one module per command group on plain click (after the `hf` CLI).

Commands build rows and hand them to one output sink (`output.Output`: a table or `--json`);
progress goes to stderr, for humans. Exit codes: 0 ok, 1 failure (a variant failed, something
missing or corrupt, an invalid setting), 2 usage, 130 interrupted. Under `--json` errors are
JSON too (`{"error": ..., "exit": N}`). FA4AOT_DEBUG=1 shows tracebacks.

    build.py    build, specs               store.py  ls, inspect, verify, prune
    ship.py     pack, unpack, wheel, merge check.py  coverage, doctor
    explain.py  explain                    hook.py   hook
"""

from __future__ import annotations

import json

import click

from ..errors import Fa4aotError, SettingError
from . import output


def _debug() -> bool:
    from .. import settings

    try:
        return settings.debug()
    except SettingError:
        return False


class _Cli(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except Fa4aotError as e:
            if _debug():
                raise
            self._fail(ctx, str(e), 1)
        except click.ClickException as e:
            if not self._json(ctx):
                raise
            self._fail(ctx, e.format_message(), e.exit_code)
        except KeyboardInterrupt:
            self._fail(ctx, "interrupted", 130)

    @staticmethod
    def _json(ctx) -> bool:
        out = output.current(ctx)
        return out.as_json if out is not None else "--json" in ctx.args

    def _fail(self, ctx, msg: str, code: int):
        out = output.current(ctx)
        if out is None:
            out = output.Output(self._json(ctx))
        if out.as_json:
            click.echo(json.dumps({"error": msg, "exit": code}, sort_keys=True))
        else:
            click.echo(f"error: {msg}", err=True)
        ctx.exit(code)


@click.group(cls=_Cli)
@click.version_option(package_name="fa4aot")
def main():
    """Ahead-of-time compiled FlashAttention-4 kernels: build on a CPU, serve with no compiler."""


from . import build, check, explain, hook, ship, store  # noqa: E402,F401 - register commands

# tests and tools reach the helpers through fa4aot.cli as before the split
from .common import matching_stores  # noqa: E402,F401
