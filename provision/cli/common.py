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

from ..errors import ProvisionError
from ..transport import DEFAULT_KNOWN_HOSTS, Target

# markup and emoji off: `[six==1.17.0]`, `[/x]` and `host:abc:` are printed as they are; a message is
# one line however long (soft wrap), so a fingerprint or a path is never split.
console = Console(highlight=False, markup=False, emoji=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, markup=False, emoji=False, soft_wrap=True)


def styled(*parts) -> Text:
    """Text from plain strings and (string, style) pairs; no string is ever read as markup."""
    return Text.assemble(*parts)


def plain(text: str) -> Text:
    """A value as text for renderables that would read a str as markup (spinners, table cells, titles)."""
    return Text(str(text))


def edge(fn):
    """Turn a user-caused ProvisionError into one line on stderr and its exit code."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except ProvisionError as e:
            err_console.print(styled(("error:", "red"), " ", str(e)), soft_wrap=True)
            raise typer.Exit(e.exit_code)
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130)

    return wrapper


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


# Host options shared by every command that talks to a host.
HostArg = typer.Argument(None, help="[user@]host[:port], or omit with --local / -i")
LocalOpt = typer.Option(False, "--local", help="act on this machine (no SSH)")
InventoryOpt = typer.Option(None, "-i", "--inventory", help="Ansible inventory file (YAML or INI)")
KeyOpt = typer.Option(None, "--key", help="SSH private key file")
KnownHostsOpt = typer.Option(DEFAULT_KNOWN_HOSTS, "--known-hosts", help="managed known_hosts file")
RootOpt = typer.Option(None, "--root", help="host root (default /opt/provision, or the inventory's provision_root)")


def targets(host: Optional[str], local: bool, inventory: Optional[Path], key: Optional[Path],
            known_hosts: Path, root: Optional[str] = None) -> list[Target]:
    """The hosts a command acts on, from HOST, --local or -i."""
    from ..inventory import load_inventory

    if local:
        ts = [Target(host="local", known_hosts=known_hosts)]
    elif inventory:
        ts = load_inventory(inventory, known_hosts=known_hosts)
    elif host:
        ts = [Target.parse(host, known_hosts=known_hosts)]
    else:
        raise ProvisionError("name a host, or use --local or -i INVENTORY")
    for t in ts:
        if key:
            t.key_file = str(key)
        if root:
            t.vars["provision_root"] = root
    return ts


def one_target(*a, **kw) -> Target:
    ts = targets(*a, **kw)
    if len(ts) != 1:
        raise ProvisionError(f"this command acts on one host; the inventory names {len(ts)}")
    return ts[0]


def each_host(ts: list[Target], fn) -> list:
    """fn(transport) for each target, connection closed afterwards; results in order."""
    from ..transport import connect

    out = []
    for t in ts:
        tr = connect(t)
        try:
            out.append(fn(tr))
        finally:
            tr.close()
    return out
