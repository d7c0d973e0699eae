"""The `fa4aot` click group: typed errors mapped to one-line messages and exit codes."""

from __future__ import annotations

import json

import click

from fa4aot import settings
from . import output
from fa4aot.errors import Fa4aotError, SettingError


def _debug() -> bool:
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

