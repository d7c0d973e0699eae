"""The CLI's one output sink (after the `hf` CLI's `Output`): tables or one JSON document on
stdout, notes and warnings on stderr, errors as one line (or, under --json, as JSON), and the
store layers each command read. Commands build rows and hand them here; nothing else echoes."""

from __future__ import annotations

import functools
import json
import sys
from typing import Any, NoReturn

import click

from fa4aot.store.layers import Layer

META_KEY = "fa4aot.output"


class Output:
    def __init__(self, as_json: bool = False):
        self.as_json = as_json
        self.layers: list[dict[str, str]] = []
        self.warnings: list[str] = []
        self._note: str | None = None  # the layers line, shown with the first output

    # -- documents --------------------------------------------------------------------------
    def table(self, rows: list[dict], columns: list[str], **extra: Any) -> None:
        """Rows as a table (humans) or `{"rows": [...], **extra}` (--json)."""
        if self.as_json:
            self.document({"rows": rows, **extra})
            return
        self.flush()
        if not rows:
            click.echo("(nothing)")
            return
        click.echo(format_table(rows, columns))

    def document(self, doc: dict) -> None:
        """One JSON document (--json only), with the layers read and the warnings given."""
        if self.layers and "layers" not in doc:  # doctor reports layers in more detail
            doc = {**doc, "layers": self.layers}
        if self.warnings:
            doc = {**doc, "warnings": self.warnings}
        click.echo(json.dumps(doc, indent=2, sort_keys=True, default=str))

    def text(self, line: str = "") -> None:
        """A line of the human report (stdout); nothing under --json."""
        if not self.as_json:
            self.flush()
            click.echo(line)

    # -- side channels (stderr) -------------------------------------------------------------
    def note(self, line: str) -> None:
        """Context for humans (what was read, where it went): stderr, so stdout stays data."""
        if not self.as_json:
            click.echo(line, err=True)

    def warning(self, msg: str) -> None:
        self.flush()
        self.warnings.append(msg)
        click.echo(f"warning: {msg}", err=True)

    def read_layers(self, layers: list[Layer], verb: str = "read") -> None:
        """Name the store layers this command read (or wrote): every command says which."""
        self.layers = [
            {"root": str(layer.root), "source": layer.source, "use": verb} for layer in layers
        ]
        if layers:  # shown with the report, so that an error stays one line
            self._note = f"{verb}: " + ", ".join(layer.describe() for layer in layers)

    def flush(self) -> None:
        """Show the layers line now (before progress output, say)."""
        if self._note is not None:
            note, self._note = self._note, None
            self.note(note)

    def error(self, msg: str, code: int = 1) -> NoReturn:
        """One line on stderr (`error: ...`), or `{"error": ..., "exit": N}` on stdout under
        --json; then exit `code`."""
        if self.as_json:
            click.echo(json.dumps({"error": msg, "exit": code}, sort_keys=True))
        else:
            click.echo(f"error: {msg}", err=True)
        sys.exit(code)


def format_table(rows: list[dict], columns: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in columns).rstrip()]
    lines += ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns).rstrip() for r in rows]
    return "\n".join(lines)


def current(ctx: click.Context | None = None) -> Output | None:
    """The Output of the command running in `ctx` (None before one started)."""
    ctx = ctx or click.get_current_context(silent=True)
    while ctx is not None:
        if META_KEY in ctx.meta:
            return ctx.meta[META_KEY]
        ctx = ctx.parent
    return None


def with_output(f):
    """Add `--json` and hand the command an `out: Output` in place of the flag."""

    @click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout, errors too.")
    @functools.wraps(f)
    def wrapper(*args, as_json: bool, **kwargs):
        out = Output(as_json)
        click.get_current_context().meta[META_KEY] = out
        return f(*args, out=out, **kwargs)

    return wrapper
