"""Shared CLI plumbing: error edge (one line + exit code), host options, JSON and text output.

Output is text, never markup: values (hosts, packages, errors) print literally; styling goes through `styled`.
"""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.text import Text

from ..errors import InputError, InventoryError, ProvisionError
from ..transport import DEFAULT_KNOWN_HOSTS, Target, check_root

# markup and emoji off: `[six==1.17.0]`, `[/x]` and `host:abc:` are printed as they are; a message is
# one line however long (soft wrap), so a fingerprint or a path is never split. Piped output is never
# wrapped or truncated at 80 columns: a pipe gets tables as wide as they are.
_WIDE = 100_000
console = Console(highlight=False, markup=False, emoji=False, soft_wrap=True,
                  width=None if sys.stdout.isatty() else _WIDE)
err_console = Console(stderr=True, highlight=False, markup=False, emoji=False, soft_wrap=True,
                      width=None if sys.stderr.isatty() else _WIDE)


def styled(*parts) -> Text:
    """Text from plain strings and (string, style) pairs; no string is ever read as markup."""
    return Text.assemble(*parts)


def plain(text: str) -> Text:
    """A value as text for renderables that would read a str as markup (spinners, table cells, titles)."""
    return Text(str(text))


# Modules of optional features → the extra that brings them (pyproject's optional-dependencies).
OPTIONAL = {"torch": "engine", "safetensors": "engine", "tokenizers": "engine", "gguf": "engine"}


def edge(fn):
    """Turn a user-caused ProvisionError into one line on stderr and its exit code."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except ProvisionError as e:
            if kw.get("json_out"):       # --json: the error is JSON too (with the run's report, when it has one)
                report = getattr(e, "report", None)
                data = report.to_json() if report is not None else {"error": e.message}
                print_json(dict(data, where=e.where, exit_code=e.exit_code))
            err_console.print(styled(("error:", "red"), " ", str(e)), soft_wrap=True)
            raise typer.Exit(e.exit_code)
        except typer.BadParameter as e:
            if not kw.get("json_out"):
                raise
            print_json({"error": e.format_message(), "where": None, "exit_code": 2})
            raise typer.Exit(2)
        except ModuleNotFoundError as e:
            extra = OPTIONAL.get((e.name or "").split(".")[0])
            if extra is None:
                raise
            msg = f"this needs the optional `{extra}` dependencies (no module {e.name}): install provision[{extra}]"
            if kw.get("json_out"):
                print_json({"error": msg, "where": None, "exit_code": 1})
            err_console.print(f"error: {msg}", markup=False, soft_wrap=True)
            raise typer.Exit(1)
        except OSError as e:      # a file named on the command line that cannot be read or written
            where = f"{e.filename}: " if e.filename else ""
            code = 2 if isinstance(e, (FileNotFoundError, IsADirectoryError, NotADirectoryError,
                                       PermissionError)) else 1
            if kw.get("json_out"):
                print_json({"error": e.strerror or str(e), "where": e.filename, "exit_code": code})
            err_console.print(styled(("error:", "red"), f" {where}{e.strerror or e}"), soft_wrap=True)
            raise typer.Exit(code)
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130)

    return wrapper


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


# Host options shared by every command that talks to a host.
HostArg = typer.Argument(None, help="[user@]host[:port], or omit with --local / -i", show_default=False)
LocalOpt = typer.Option(False, "--local", help="act on this machine (no SSH)")
InventoryOpt = typer.Option(None, "-i", "--inventory", help="Ansible inventory (file or directory, YAML or INI)")
LimitOpt = typer.Option(None, "--limit", help="Ansible host pattern: only the matching inventory hosts")
ForksOpt = typer.Option(16, "--forks", help="hosts contacted at once")
KeyOpt = typer.Option(None, "--key", help="SSH private key file")
KnownHostsOpt = typer.Option(DEFAULT_KNOWN_HOSTS, "--known-hosts", help="managed known_hosts file")
RootOpt = typer.Option(None, "--root", help="host root (default /opt/provision, or the inventory's provision_root)")
JsonOpt = typer.Option(False, "--json", help="machine-readable output (errors too)")


def targets(host: Optional[str], local: bool, inventory: Optional[Path], key: Optional[Path],
            known_hosts: Path, root: Optional[str] = None, limit: Optional[str] = None) -> list[Target]:
    """The hosts a command acts on, from HOST, --local or -i (narrowed by --limit)."""
    if limit and not inventory:
        raise InventoryError("--limit narrows an inventory: give -i INVENTORY", where="--limit")
    if local:
        ts = [Target(host="local", known_hosts=known_hosts)]
    elif inventory:
        from ..inventory import load_inventory

        ts = load_inventory(inventory, known_hosts=known_hosts, limit=limit)
    elif host:
        ts = [Target.parse(host, known_hosts=known_hosts)]
    else:
        raise InputError("name a host, or use --local or -i INVENTORY", where="HOST")
    for t in ts:
        if key:
            t.key_file = str(key)
        if root:
            t.vars["provision_root"] = root
        if "provision_root" in t.vars:
            check_root(t.vars["provision_root"], "--root" if root else f"{inventory}: host {t.name}: provision_root")
    return ts


def writable(path: Path, option: str) -> None:
    """Refuse an output file that cannot be written (one line, exit 2) before any host is contacted."""
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror or e}", where=option) from None
    if not existed:
        path.unlink()


def one_target(*a, **kw) -> Target:
    ts = targets(*a, **kw)
    if len(ts) != 1:
        raise InputError(f"this command acts on one host; {len(ts)} match (narrow with --limit)", where="-i")
    return ts[0]


def over_hosts(ts: list[Target], fn, forks: int = 16, on_row=None) -> list:
    """fn(transport) on each host in parallel: one fleet.Row per host. With one host, its error is
    the command's error (one line, its exit code); with several, an error is that host's row."""
    from ..fleet import each

    rows = each(ts, fn, forks=forks, on_row=on_row)
    if len(rows) == 1 and not rows[0].ok:
        raise rows[0].error
    return rows


def each_host(ts: list[Target], fn) -> list:
    """fn(transport) for each target (in parallel); the results in order, or the first error raised."""
    rows = over_hosts(ts, fn)
    for r in rows:
        if not r.ok:
            raise r.error
    return [r.value for r in rows]


def row_error(row) -> str:
    """A failed host's row as one line: HOST: message."""
    e = row.error
    return f"{row.host}: {e.message if e.where in (None, row.host) else e}"


def print_rows(rows, render_ok, json_out: bool, to_json=lambda v: v) -> None:
    """Each host's result (render_ok) or error line; one host's JSON is its result alone."""
    if json_out:
        print_json(to_json(rows[0].value) if len(rows) == 1 else [r.to_json(to_json) for r in rows])
        return
    for r in rows:
        if r.ok:
            render_ok(r)
        else:
            err_console.print(row_error(r), markup=False, soft_wrap=True)


def exit_for(rows) -> None:
    """Exit 1 when any host failed (its row already says why)."""
    if any(not r.ok for r in rows):
        raise typer.Exit(1)
