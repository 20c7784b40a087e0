"""The `provision` command: parses arguments, calls the library, renders results; no logic."""
from __future__ import annotations

import importlib
import sys

import typer

from .. import __version__
from . import params
from .common import Group

params.install()     # plain str/int/Path values skip typer's per-parameter pydantic validators


def _version(value: bool) -> None:
    if value:
        typer.echo(f"provision {__version__}")
        raise typer.Exit()


# Help text is plain text: `[user@]host` is printed as written, never read as markup.
app = typer.Typer(cls=Group, no_args_is_help=True, rich_markup_mode=None, pretty_exceptions_enable=False,
                  help="Lockfile-driven upgrades of GPU inference hosts.")


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print the version and exit")) -> None:
    """Lockfile-driven upgrades of GPU inference hosts."""


# Each sub-module registers its commands on `app` (top-level verbs) or adds a sub-app; each imports
# the library only inside its commands, so starting the tool stays cheap.
for _mod in ("core", "lock", "hosts", "patches", "engine", "probe", "verify", "pack"):
    importlib.import_module(f"{__name__}.{_mod}").register(app)


def main() -> None:
    # paramiko imports the `invoke` package only for ssh_config `Match exec`, which provision never reads;
    # the command skips it (a tenth of a second off every verb that talks to a host).
    sys.modules.setdefault("invoke", None)
    app()
