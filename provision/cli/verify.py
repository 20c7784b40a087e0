"""`provision verify`: a generation's files and distributions against its lock, by distribution (parse, call,
render)."""
from __future__ import annotations

from typing import Optional

import typer

from .common import (Hosts, JsonOpt, ProgressLines, alone, console, edge, err_console, exit_for, host_options, print_rows,
                     styled)


def figures(v: dict) -> str:
    """bytes hashed, seconds, rate; and a first read of the same bytes from disk when measured, else that the
    time includes reading them."""
    from ..units import human_size

    text = f"{v['files']} files, {human_size(v['bytes'])} read and hashed in {v['seconds']:.2f}s"
    if v.get("rate_gbs"):
        text += f" ({human_size(v['bytes'] / v['seconds'])}/s, {v['jobs']} threads)"
    if v.get("bytecode_checked"):
        text += f"; {v['bytecode_checked']} cached bytecode files against their source"
    if v.get("read_seconds") is None:
        text += "; --baseline times a first read of the same bytes from disk to compare"
    elif v.get("ratio"):
        text += (f"; a first read of the same bytes without hashing took {v['read_seconds']:.2f}s "
                 f"({human_size(v['read_bytes'] / v['read_seconds'])}/s), {v.get('cache')}: hashing takes "
                 f"{v['ratio']:.1f}x a first read")
    return text


@edge
@host_options(after="json_out")
def verify(hosts: Hosts,
           generation: Optional[str] = typer.Argument(None, help="generation number or id (default: current)"),
           baseline: bool = typer.Option(False, "--baseline",
                                         help="hash from disk (each file's page cache dropped first) and time a "
                                              "first read of the same bytes from disk (hashing's yardstick: the "
                                              "ratio)"),
           jobs: Optional[int] = typer.Option(None, "--jobs", min=1, max=256,
                                              help="hashing threads on the host (default: 2 per core, at most 32)"),
           json_out: bool = JsonOpt):
    """Every file of a generation against its RECORD hash (patched files against their series' hashes) and its
    distributions against its lock; exit 1 on drift, one line per distribution (playbooks/verify.yml through
    Ansible; each host's progress on stderr at least every few seconds)."""
    from .. import verify as verifymod

    ts, (generation,) = hosts.targets_and_args((generation,))
    rows = alone(verifymod.verify_play(ts, generation, baseline=baseline, jobs=jobs, forks=hosts.forks,
                                       on_progress=ProgressLines(json_out)))

    def show(r):
        v = r.value
        for text in v["lines"]:
            console.print(f"  {text}", markup=False)
        mark = ("clean", "green") if v["verdict"] == "clean" else ("drift", "red")
        what = "" if v["verdict"] == "clean" else f" in {len(v['rows'])} distribution(s)"
        console.print(styled(f"{v['generation']} on {r.host}: ", mark, f"{what} — {figures(v)}"), soft_wrap=True)
        for w in v.get("warnings") or []:
            err_console.print(f"warning: {r.host}: {w}", markup=False)
    print_rows(rows, show, json_out)
    exit_for(rows, bad=lambda v: v["verdict"] != "clean")


def register(app: typer.Typer) -> None:
    app.command()(verify)
