"""The `provision` command: parses arguments, calls the library, renders results; no logic."""
from __future__ import annotations

import importlib

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  pretty_exceptions_enable=False, help="Lockfile-driven upgrades of GPU inference hosts.")

# Each sub-module registers its commands on `app` (top-level verbs) or adds a sub-app.
for _mod in ("core", "lock", "hosts", "patches", "engine", "probe"):
    try:
        importlib.import_module(f"{__name__}.{_mod}").register(app)
    except ModuleNotFoundError as e:  # a module not written yet
        if e.name != f"{__name__}.{_mod}":
            raise


def main() -> None:
    app()
