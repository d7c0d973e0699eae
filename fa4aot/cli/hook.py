"""`fa4aot hook`: the site-packages hook behind FA4AOT_INSTALL."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import click

from fa4aot._autoinstall import PTH_LINE, PTH_NAME
from .app import main
from fa4aot.store.files import atomic_write


@main.command()
@click.option(
    "--enable", "action", flag_value="enable", help="Write the .pth hook into site-packages."
)
@click.option("--disable", "action", flag_value="disable", help="Remove it.")
@click.option(
    "--status", "action", flag_value="status", default=True, help="Show where it is (default)."
)
def hook(action):
    """Manage the site-packages hook that runs fa4aot.install() when FA4AOT_INSTALL is set."""


    path = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    if action == "enable":
        atomic_write(path, PTH_LINE.encode())
        click.echo(
            f"enabled: {path} (set FA4AOT_INSTALL=error|warn|jit in the server's environment)"
        )
    elif action == "disable":
        existed = path.exists()
        path.unlink(missing_ok=True)
        click.echo(f"{'removed' if existed else 'not present'}: {path}")
    else:
        click.echo(f"{'enabled' if path.exists() else 'disabled'}: {path}")
