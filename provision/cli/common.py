"""Shared CLI plumbing: the error edge (one line + exit code), option groups (Hosts), JSON and text output.

Output is text, never markup: values (hosts, packages, errors) print literally; styling goes through `styled`.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import json
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperGroup
from rich.console import Console
from rich.text import Text

try:                 # newer typer carries its own copy of click
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover
    from click import exceptions as click_errors
from ..errors import InputError, ProvisionError, controller_failure
from ..fleet import FORKS, values
from ..layout import DEFAULT_ROOT
from ..transport import DEADLINE, DEFAULT_KNOWN_HOSTS, NOTICE, TIMEOUT, Target, known_hosts_path

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
            why = controller_failure(e, "").message if e.errno == errno.ENOSPC else e.strerror or str(e)
            if kw.get("json_out"):
                print_json({"error": why, "where": e.filename, "exit_code": code})
            err_console.print(styled(("error:", "red"), f" {where}{why}"), soft_wrap=True)
            raise typer.Exit(code)
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130)

    return wrapper


class Group(TyperGroup):
    """The root command: a usage error (an unknown option, a missing or bad value) is one line on stderr and exit 2,
    and with --json one JSON object `{"error", "where", "exit_code"}` on stdout, like every other error."""

    def make_context(self, info_name, args, parent=None, **extra):
        argv = list(args)
        with _usage_errors(argv):
            ctx = super().make_context(info_name, args, parent=parent, **extra)
        ctx.meta["provision.argv"] = argv
        return ctx

    def invoke(self, ctx):
        with _usage_errors(ctx.meta.get("provision.argv", [])):
            return super().invoke(ctx)


@contextlib.contextmanager
def _usage_errors(argv: list):
    try:
        yield
    except getattr(click_errors, "NoArgsIsHelpError", ()):     # a group named alone: its help
        raise
    except click_errors.UsageError as e:
        param = getattr(e, "param", None)
        where = (max(param.opts, key=len) if param.opts else param.human_readable_name) if param is not None \
            else getattr(e, "option_name", None)
        if "--json" in (argv[:argv.index("--")] if "--" in argv else argv):
            print_json({"error": e.format_message(), "where": where, "exit_code": 2})
        hint = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
        err_console.print(styled(("error:", "red"), f" {e.format_message()}{hint}"), soft_wrap=True)
        raise typer.Exit(2) from None


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def options(name: str, build, params: dict, after: Optional[str] = None):
    """A decorator for a verb whose parameter `name` stands for an option group: on the command line the group's
    `params` (parameter name → (type, typer Argument or Option)) take its place, in order (its options after the
    verb's parameter `after`, when given, as the help lists them); the verb is called with `name=build(**values)`."""

    def wrap(fn):
        hints = typing.get_type_hints(fn)
        own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in inspect.signature(fn).parameters.values()]
        group = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=info, annotation=kind)
                 for n, (kind, info) in params.items()]
        args = [p for p in group if isinstance(p.default, typer.models.ArgumentInfo)]
        opts = [p for p in group if p not in args]
        signature = []
        for p in own:
            signature += (args if after else args + opts) if p.name == name else [p]
            signature += opts if p.name == after else []

        @functools.wraps(fn)
        def verb(**kw):
            kw[name] = build(**{n: kw.pop(n) for n in params})
            return fn(**kw)

        verb.__signature__ = inspect.Signature(signature)
        verb.__annotations__ = {p.name: p.annotation for p in signature}
        return verb

    return wrap


HOST_HELP = "[user@]host[:port]; with -i, an inventory host, group or pattern (narrows like --limit)"

# Every option that names hosts and how to reach them: parameter name → (type, typer parameter).
HOST_PARAMS = {
    "host": (Optional[str], typer.Argument(None, help=f"{HOST_HELP}; omit with --local", show_default=False)),
    "local": (bool, typer.Option(False, "--local", help="act on this machine (no SSH)")),
    "inventory": (Optional[Path], typer.Option(None, "-i", "--inventory",
                                               help="Ansible inventory (file or directory, YAML or INI)")),
    "limit": (Optional[str], typer.Option(None, "--limit", help="Ansible host pattern: only the matching inventory "
                                                                "hosts")),
    "forks": (int, typer.Option(FORKS, "--forks", min=1,
                                help="inventory hosts Ansible works on at once (its --forks), the same for every "
                                     "verb: the hosts do the work while the controller waits on each (--serial "
                                     "bounds how many hosts an apply changes before it stops)")),
    "key": (Optional[Path], typer.Option(None, "--key", help="SSH private key file")),
    "known_hosts": (Path, typer.Option(DEFAULT_KNOWN_HOSTS, "--known-hosts",
                                       help="managed known_hosts file (a relative path: from the working directory)")),
    "timeout": (float, typer.Option(TIMEOUT, "--timeout", min=0.1, metavar="SECONDS",
                                    help="SSH: the most the connection and the SSH banner may take (ssh's "
                                         "ConnectTimeout, whole seconds); also the keepalive period (a host that "
                                         "answers none of 3 in a row is disconnected)")),
    "step_deadline": (float, typer.Option(DEADLINE, "--step-deadline", min=1, metavar="SECONDS",
                                          help="a step (fetch, install, probes, switch) that shows no progress for "
                                               "this long is stopped, its host work ended, and the host left on its "
                                               "current generation; progress is bytes fetched, installer output, "
                                               "files written, not the step's length")),
    "wait_notice": (float, typer.Option(NOTICE, "--wait-notice", min=0.1, metavar="SECONDS",
                                        help="after this long without progress, say what the run waits for, and "
                                             "again every SECONDS while it waits")),
    "become": (bool, typer.Option(False, "--become",
                                  help="run host commands as root through sudo (non-interactive: the login user needs "
                                       "passwordless sudo); the inventory's ansible_become and ansible_become_user do "
                                       "the same per host")),
    "root": (Optional[str], typer.Option(None, "--root", help=f"host root (default {DEFAULT_ROOT}, or the inventory's "
                                                              "provision_root)")),
}


@dataclass
class Hosts:
    """The host options as given: which hosts (HOST, --local, -i and --limit) and how to reach them."""

    host: Optional[str] = None
    local: bool = False
    inventory: Optional[Path] = None
    limit: Optional[str] = None
    forks: int = FORKS
    key: Optional[Path] = None
    known_hosts: Path = DEFAULT_KNOWN_HOSTS
    timeout: float = TIMEOUT
    step_deadline: float = DEADLINE
    wait_notice: float = NOTICE
    become: bool = False
    root: Optional[str] = None

    def __post_init__(self):     # one file for every consumer, whichever directory it runs in
        self.known_hosts = known_hosts_path(self.known_hosts)

    def targets(self, local_by_default: bool = False) -> list[Target]:
        """The hosts the verb acts on (`local_by_default`: no HOST and no -i is this machine)."""
        return self.targets_and_args((), local_by_default)[0]

    def targets_and_args(self, args: tuple, local_by_default: bool = False) -> tuple:
        """(hosts, args): the hosts and the verb's positionals after HOST, as meant (see inventory.select)."""
        from ..inventory import select

        return select(self.host, args, local=self.local, inventory=self.inventory, limit=self.limit,
                      known_hosts=self.known_hosts, key=self.key, root=self.root, timeout=self.timeout,
                      deadline=self.step_deadline, notice=self.wait_notice, local_by_default=local_by_default,
                      become=self.become)

    def one(self, *args) -> tuple:
        """(host, *args): the one host of a verb that acts on one host, and its positionals after HOST."""
        from ..inventory import only

        ts, args = self.targets_and_args(args)
        return (only(ts), *args)

    def command(self, verb: str, *more) -> list[str]:
        """This command's host options for an inventory as given (those left at their defaults left out), for the
        commands a summary prints."""
        return ["provision", verb, "-i", str(self.inventory),
                *(["--known-hosts", str(self.known_hosts)] if Path(self.known_hosts) != Path(DEFAULT_KNOWN_HOSTS)
                  else []),
                *(["--key", str(self.key)] if self.key else []), *(["--root", self.root] if self.root else []),
                *(["--become"] if self.become else []),
                *(["--timeout", f"{self.timeout:g}"] if self.timeout != TIMEOUT else []),
                *(["--forks", str(self.forks)] if self.forks != FORKS else []), *map(str, more)]


HOSTS = Hosts()     # the default of a `hosts` parameter that follows others with defaults (host_options replaces it)


def host_options(*, forks: bool = True, steps: bool = False, local: bool = True, key: bool = True, root: bool = True,
                 become: bool = True, after: Optional[str] = None):
    """The host options on a verb whose parameter `hosts: Hosts` stands for them: HOST where `hosts` stands, then
    --local, -i, --limit, --forks, --key, --known-hosts, --timeout, (--step-deadline, --wait-notice,) --become, --root
    (after the verb's parameter `after`, when given); a verb leaves out those it has no use for (--forks when it acts on
    one host, ...)."""
    left_out = {n for n, kept in (("forks", forks), ("step_deadline", steps), ("wait_notice", steps), ("local", local),
                                  ("key", key), ("root", root), ("become", become)) if not kept}
    params = {n: p for n, p in HOST_PARAMS.items() if n not in left_out}
    if not local:       # HOST's help says nothing of --local
        params["host"] = (Optional[str], typer.Argument(None, help=HOST_HELP, show_default=False))
    return options("hosts", Hosts, params, after)


JsonOpt = typer.Option(False, "--json", help="machine-readable output (errors too)")


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


def over_hosts(ts: list[Target], play, forks: int = FORKS) -> list:
    """The verb on its hosts as its playbook (`play`, a plays.Play): one Ansible run, `forks` hosts at once, one
    fleet.Row each, in order. With one host, its error is the command's error (one line, its exit code); with
    several, an error is that host's row."""
    return alone(play.rows(ts, forks))


def alone(rows: list) -> list:
    """The rows of a verb over hosts; with one host, its error is the command's error, raised."""
    if len(rows) == 1 and not rows[0].ok:
        raise rows[0].error
    return rows


def each_host(ts: list[Target], play, forks: int = FORKS) -> list:
    """The verb's result on each host (see over_hosts), in order, or the first error raised."""
    return values(over_hosts(ts, play, forks))


class ProgressLines:
    """A long step's progress on an inventory's hosts, on stderr: each host's latest line, at most every EVERY
    seconds a host (its steps report at least every few seconds, so a host is never silent for longer)."""

    EVERY = 4.0

    def __init__(self, quiet: bool = False):
        import threading
        import time

        self.quiet, self.last, self.lock, self.clock = quiet, {}, threading.Lock(), time.monotonic

    def __call__(self, host: str, ev: dict) -> None:
        if self.quiet:
            return
        now = self.clock()
        with self.lock:
            if now - self.last.get(host, -self.EVERY) < self.EVERY:
                return
            self.last[host] = now
        err_console.print(f"  {host}  · {ev.get('step', '')} {ev.get('detail', '')}", markup=False,
                          soft_wrap=True, highlight=False)


def row_error(row) -> str:
    """A failed host's row as one line: HOST: message (HOST: unreachable: message when it was never reached, as
    every verb and the fleet summary name it)."""
    e = row.error
    said = "unreachable: " if getattr(row, "unreachable", False) else ""
    return f"{row.host}: {said}{e.message if e.where in (None, row.host) else e}"


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


def exit_for(rows, bad=None) -> None:
    """Exit 1 when any host failed (its row already says why), or when `bad(value)` holds for a host's result
    (a failed verdict the row has shown)."""
    if any(not r.ok for r in rows) or (bad is not None and any(bad(r.value) for r in rows)):
        raise typer.Exit(1)
