"""`provision probe`: run the verification probes in a generation; the probe table."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from .common import (HostArg, InventoryOpt, KeyOpt, KnownHostsOpt, LocalOpt, RootOpt, console, edge, one_target,
                     plain, print_json, styled)

STYLE = {"pass": "green", "fail": "red", "skip": "dim", "warn": "yellow"}


def probe_table(report: dict) -> Table:
    """One row per probe: status, name, reason (and whether a failure blocks the switch)."""
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


def register(app: typer.Typer) -> None:
    @app.command()
    @edge
    def probe(host: Optional[str] = HostArg,
              only: List[str] = typer.Option([], "--only", help="run only this probe (repeatable)"),
              generation: Optional[str] = typer.Option(None, "--generation", "-g",
                                                       help="generation number or id (default: current)"),
              lock: Optional[Path] = typer.Option(None, "--lock", "-l",
                                                  help="expectations (default: the generation's own lock)"),
              json_out: bool = typer.Option(False, "--json", help="machine-readable report"),
              local: bool = LocalOpt, inventory: Optional[Path] = InventoryOpt, key: Optional[Path] = KeyOpt,
              known_hosts: Path = KnownHostsOpt, root: Optional[str] = RootOpt):
        """Run the verification probes inside a generation; exit 1 if a required probe fails."""
        from .. import lock as lockmod
        from ..probes import run_probes
        from ..transport import connect

        lk = lockmod.load(lock) if lock else None
        t = one_target(host, local, inventory, key, known_hosts, root)
        tr = connect(t)
        try:
            rep = run_probes(tr, lk, generation=generation, only=only or None)
        finally:
            tr.close()
        if json_out:
            print_json(rep)
        else:
            console.print(probe_table(rep))
            verdict = ("pass", "green") if rep["status"] == "pass" else ("fail", "red")
            failed = "" if rep["status"] == "pass" else f": {', '.join(rep['failed'])}"
            console.print(styled(f"{rep['generation']} on {rep['host']}: ", verdict, f"{failed} ({rep['seconds']:.1f}s)"))
        if rep["status"] != "pass":
            raise typer.Exit(1)
