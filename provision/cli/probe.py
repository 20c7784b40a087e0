"""`provision probe`: run the verification probes in a generation; the probe table."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .common import (HOSTS, Hosts, JsonOpt, ProgressLines, console, edge, exit_for, host_options, over_hosts, plain,
                     print_rows, styled)

STYLE = {"pass": "green", "fail": "red", "skip": "dim", "warn": "yellow"}


def probe_table(report: dict):
    """One row per probe: status, name, reason (and whether a failure blocks the switch)."""
    from rich.table import Table

    title = f"probes in {report.get('generation', '?')}"
    if report.get("host"):
        title += f" on {report['host']}"
    s = report.get("summary") or {}
    caption = " · ".join(f"{v} {k}" for k, v in s.items() if v)
    table = Table(title=plain(title), title_justify="left", caption=plain(caption), caption_justify="left")
    for col in ("", "probe", "reason", "s"):
        table.add_column(col, overflow="fold")
    for r in report.get("results", []):
        st = r["status"]
        mark = styled((str(st), STYLE.get(st, "white")))
        name = r["name"] + ("" if r.get("required", True) else " (advisory)")
        secs = f"{r['seconds']:.1f}" if isinstance(r.get("seconds"), (int, float)) else ""
        table.add_row(mark, plain(name), plain(r.get("reason", "")), secs)
    return table


@edge
@host_options()
def probe(only: List[str] = typer.Option([], "--only", help="run only this probe (repeatable)"),
          generation: Optional[str] = typer.Option(None, "--generation", "-g",
                                                   help="generation number or id (default: current)"),
          lock: Optional[Path] = typer.Option(None, "--lock", "-l",
                                              help="expectations (default: the generation's own lock)"),
          json_out: bool = JsonOpt, hosts: Hosts = HOSTS):
    """Run the verification probes inside a generation; exit 1 if a required probe fails (playbooks/probe.yml
    through Ansible: each host's progress at least every few seconds)."""
    from .. import lock as lockmod
    from ..plays import Play
    from ..probes import check_names

    if lock:
        lockmod.load(lock)          # a lock refused here, before any host is contacted
    check_names(only, "--only")
    play = Play("probe", {"generation": generation, "lock": str(lock.resolve()) if lock else None, "only": only},
                on_progress=ProgressLines(json_out))
    rows = over_hosts(hosts.targets(), play, hosts.forks)

    def show(r):
        rep = r.value
        console.print(probe_table(rep))
        verdict = ("pass", "green") if rep["status"] == "pass" else ("fail", "red")
        failed = "" if rep["status"] == "pass" else f": {', '.join(rep['failed'])}"
        console.print(styled(f"{rep['generation']} on {r.host}: ", verdict, f"{failed} ({rep['seconds']:.1f}s)"))
    print_rows(rows, show, json_out)
    exit_for(rows, bad=lambda rep: rep["status"] != "pass")


def register(app: typer.Typer) -> None:
    app.command()(probe)
