"""`provision pack`: a generation into a hashed wheelhouse another host rebuilds from offline (parse, call, render)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .common import Hosts, JsonOpt, ProgressLines, console, edge, err_console, host_options, over_hosts, print_json


@edge
@host_options(forks=False, after="json_out")
def pack(hosts: Hosts,
         generation: Optional[str] = typer.Argument(None, help="generation number or id (default: current)"),
         out: Path = typer.Option(..., "--out", "-o", help="the wheelhouse folder: wheels and lock.yaml go here"),
         allow_drift: bool = typer.Option(False, "--allow-drift",
                                          help="pack files that no longer match their RECORD as they are, and "
                                               "record them in the lock (`drift:` per package)"),
         base: Optional[Path] = typer.Option(None, "--base",
                                             help="take platform, requires, overrides, patches, engine, probes "
                                                  "from this lock (an adopted one's captured lock has none)"),
         with_: List[Path] = typer.Option([], "--with", help="add this wheel file (repeatable); it replaces a "
                                                             "packed distribution of the same name"),
         name: Optional[str] = typer.Option(None, "--name", help="the lock's name (default: the source's)"),
         jobs: Optional[int] = typer.Option(None, "--jobs", min=1, max=256,
                                            help="worker processes on the host, each reading, checking and "
                                                 "packing files (default: one per core)"),
         force: bool = typer.Option(False, "--force", help="pack into DIR even when it is not empty (its "
                                                          "lock.yaml and wheels of the same names are replaced)"),
         json_out: bool = JsonOpt):
    """Pack a generation (managed or adopted) into DIR: one wheel per distribution, rebuilt from its installed
    files, each checked against its RECORD as it is read (drift refuses the pack), and DIR/lock.yaml naming each
    by sha256. Members are stored as they are, so a generation packs to the same bytes on any host;
    PROVISION_PACK_LEVEL=1..9 deflates them (smaller wheels, several times the time on a small host), except
    where deflate would not shrink them. playbooks/pack.yml through Ansible (the wheelhouse is written here, on
    the controller), its progress on stderr at least every few seconds."""
    from ..plays import Play, pack_of

    t, generation = hosts.one(generation)
    given = {"out": str(out.resolve()), "generation": generation, "allow_drift": allow_drift,
             "base": str(base.resolve()) if base else None, "extra": [str(p.resolve()) for p in with_],
             "lock_name": name, "jobs": jobs, "force": force}
    rep = over_hosts([t], Play("pack", given, read=pack_of, on_progress=ProgressLines(json_out)))[0].value
    if json_out:
        print_json(dict(rep, check=rep["check"].to_json()))
    else:
        render(rep)
    if not rep["check"].ok:
        raise typer.Exit(1)


def progress_line(ev: dict) -> str:
    """A host agent's progress event in words: its phase, files and bytes done of their totals, seconds so far."""
    from ..units import human_size

    words = {"plan": "reading the RECORDs", "pack": "reading, checking and packing", "read": "timing a first read",
             "hash": "hashing against RECORD", "seal": "comparing with the seal",
             "extra": "looking for files no RECORD lists"}
    text = words.get(ev.get("phase"), str(ev.get("phase") or "working"))
    if ev.get("files_total"):
        text += f": {ev.get('files', 0)}/{ev['files_total']} files"
        if ev.get("bytes_total"):
            text += f", {human_size(ev.get('bytes', 0))} of {human_size(ev['bytes_total'])}"
    seconds = ev.get("seconds")
    return text + (f" ({seconds:.0f}s)" if isinstance(seconds, (int, float)) else "")


def level_words(rep: dict) -> str:
    how = "the default; PROVISION_PACK_LEVEL sets it" if rep.get("level_auto") else \
        "PROVISION_PACK_LEVEL"
    return f"deflate level {rep['level']}, {how}" if rep["level"] else f"level 0: nothing deflated, {how}"


def render(rep: dict) -> None:
    from ..lockcheck import render_report
    from ..units import human_size

    s, m = rep["seconds"], rep["members"]
    console.print(f"Packed {rep['host']}:{rep['generation']} ({rep['venv']}) into {rep['out']}: "
                  f"{rep['distributions']} distributions, {rep['files']} files, {human_size(rep['bytes'])} read, "
                  f"checked against RECORD and packed in {s['plan'] + s['pack']:.2f}s on {rep['jobs']} "
                  f"{rep['workers']} (reading the RECORDs {s['plan']:.2f}s of it); "
                  f"{human_size(rep['wheel_bytes'])} of wheels ({m['deflated']} members deflated, {m['stored']} "
                  f"stored as they are; {level_words(rep)}).", markup=False, soft_wrap=True)
    ratio = f"{rep['ratio']:.2f}×" if rep["ratio"] is not None else "n/a"
    console.print(f"  a first read of the same {human_size(rep['read_bytes'])} took {s['read']:.2f}s, {rep['cache']}: "
                  f"pack ÷ first read {ratio}"
                  + (f"; fetched over the connection {s['fetch']:.2f}s" if s.get("fetch", 0) > 0.01 else "")
                  + f"; total {s['total']:.2f}s.", markup=False, soft_wrap=True)
    for n, paths in sorted(rep["drift"].items()):
        console.print(f"  drift {n}: {', '.join(paths[:5])}" + (f" and {len(paths) - 5} more" if len(paths) > 5
                                                                else "") + " (packed as found; recorded in the lock)",
                      markup=False, soft_wrap=True)
    if rep["not_owned"]:
        err_console.print(f"warning: {rep['not_owned']} files under site-packages belong to no RECORD: not packed",
                          markup=False)
    for r in rep["replaced"]:
        console.print(f"  replaced {r} (--with)", markup=False)
    for x in rep["extra"]:
        console.print(f"  added {x}", markup=False)
    for rel in rep["missing_series"]:
        err_console.print(f"warning: patch series {rel} not found here; the lock finds it only among those "
                          f"shipped with provision", markup=False)
    console.print(render_report(rep["check"]), markup=False, soft_wrap=True)
    console.print(f"Wrote {rep['lock']}: apply it offline with `provision apply HOST --lock {rep['lock']}`.",
                  markup=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command()(pack)
