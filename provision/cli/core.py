"""The operator's verbs: plan, apply, adopt, rollback, history, demo (parse, call, render)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from .. import apply as applymod
from .. import lock as lockmod
from ..errors import ProvisionError
from ..plan import render_plan
from ..transport import connect
from .common import (HostArg, each_host, InventoryOpt, KeyOpt, KnownHostsOpt, LocalOpt, RootOpt, console, edge,
                     err_console, one_target, plain, print_json, styled, targets)

LockOpt = typer.Option(None, "--lock", "-l", help="lockfile (YAML)")
JsonOpt = typer.Option(False, "--json", help="machine-readable output")


class StepPrinter:
    """Renders apply progress: one line per finished step, a spinner while a step runs."""

    def __init__(self, quiet: bool):
        self.quiet, self.status = quiet, None

    def __call__(self, step: str, state: str, detail: str) -> None:
        if self.quiet:
            return
        if state == "start":
            self.status = err_console.status(plain(f"{step} …"))
            self.status.start()
        elif state == "info" and self.status:
            self.status.update(plain(f"{step}: {detail[:90]}"))
        elif state in ("done", "fail"):
            if self.status:
                self.status.stop()
                self.status = None
            mark = ("✓", "green") if state == "done" else ("✗", "red")
            err_console.print(styled("  ", mark, f" {step:<10} {detail}"))


def register(app: typer.Typer) -> None:
    @app.command()
    @edge
    def plan(host: Optional[str] = HostArg, lock: Path = LockOpt, json_out: bool = JsonOpt,
             out: Optional[Path] = typer.Option(None, "--out", help="save the plan for `apply --plan`"),
             detailed_exitcode: bool = typer.Option(False, "--detailed-exitcode",
                                                    help="exit 0 no changes, 2 changes, 1 error"),
             local: bool = LocalOpt, inventory: Optional[Path] = InventoryOpt, key: Optional[Path] = KeyOpt,
             known_hosts: Path = KnownHostsOpt, root: Optional[str] = RootOpt):
        """Dry-run diff of host vs lock (read-only)."""
        if lock is None:
            raise typer.BadParameter("--lock is required")
        try:
            lk = lockmod.load(lock)
            plans = each_host(targets(host, local, inventory, key, known_hosts, root),
                              lambda tr: applymod.plan(tr, lk))
        except ProvisionError as e:
            if detailed_exitcode:   # 2 means "changes" there; every error is 1
                e.exit_code = 1
            raise
        if out:
            data = plans[0].to_json() if len(plans) == 1 else [p.to_json() for p in plans]
            out.write_text(json.dumps(data, indent=2))
        if json_out:
            print_json(plans[0].to_json() if len(plans) == 1 else [p.to_json() for p in plans])
        else:
            for p in plans:
                console.print(render_plan(p), markup=False)
            if out:
                console.print(f"Saved plan to {out}; apply it exactly with `provision apply HOST --plan {out}`.")
        if detailed_exitcode and any(not p.noop for p in plans):
            raise typer.Exit(2)

    @app.command()
    @edge
    def apply(host: Optional[str] = HostArg, lock: Optional[Path] = LockOpt,
              plan_file: Optional[Path] = typer.Option(None, "--plan", help="apply a saved plan exactly"),
              adopt: Optional[str] = typer.Option(None, "--adopt",
                                                  help="first contact: capture this existing env as generation 0"),
              skip_probe: List[str] = typer.Option([], "--skip-probe", help="emergency: skip a probe (recorded)"),
              installer: Optional[str] = typer.Option(None, "--installer", help="uv or pip (default: uv if on host)"),
              serial: int = typer.Option(0, "--serial", help="fleet: hosts per batch; a failed batch stops the rollout"),
              forks: int = typer.Option(5, "--forks", help="fleet: hosts applied at once within a batch"),
              json_out: bool = JsonOpt, local: bool = LocalOpt, inventory: Optional[Path] = InventoryOpt,
              key: Optional[Path] = KeyOpt, known_hosts: Path = KnownHostsOpt, root: Optional[str] = RootOpt):
        """One-command upgrade: build a new generation, patch, probe, switch `current`."""
        saved = applymod.load_plan(plan_file) if plan_file else None
        if saved is None and lock is None:
            raise typer.BadParameter("give --lock or --plan")
        lk = applymod.lock_of_plan(saved) if saved else lockmod.load(lock)
        ts = targets(host, local, inventory, key, known_hosts, root)
        if len(ts) > 1:
            if saved:
                raise typer.BadParameter("a saved plan is for one host")
            reports = applymod.apply_fleet(ts, lk, serial=serial, forks=forks, adopt_path=adopt,
                                           skip_probes=skip_probe, installer=installer)
            if json_out:
                print_json([r.to_json() for r in reports])
            else:
                for r in reports:
                    console.print(f"  {r.host:<28} {r.status:<14} {r.generation or ''} {r.error or ''}", markup=False)
                counts = {s: sum(r.status == s for r in reports) for s in ("applied", "noop", "failed", "not-attempted")}
                console.print("Fleet: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".")
            if any(r.status in ("failed", "not-attempted") for r in reports):
                raise typer.Exit(1)
            return
        t = ts[0]
        tr = connect(t)
        try:
            if not json_out:
                err_console.print(f"apply {lk.name} → {t.name}")
            rep = applymod.apply(tr, lk, saved_plan=saved, adopt_path=adopt, skip_probes=skip_probe,
                                 installer=installer, progress=StepPrinter(json_out),
                                 on_plan=None if json_out else lambda p: err_console.print(render_plan(p), markup=False))
        except ProvisionError as e:
            if json_out and getattr(e, "report", None) is not None:
                print_json(e.report.to_json())   # the report survives a failure
            elif getattr(e, "report", None) is not None:
                _print_probes(e.report.probes)
                for w in e.report.warnings:
                    err_console.print(f"warning: {w}", markup=False)
            raise
        finally:
            tr.close()
        if json_out:
            print_json(rep.to_json())
        elif rep.status == "noop":
            console.print(f"No changes: {t.name} already runs {lk.name} (generation {rep.generation}).")
        else:
            _print_probes(rep.probes)
            for w in rep.warnings:
                err_console.print(f"warning: {w}", markup=False)
            verb = "Switched to the existing" if rep.status == "reused" else "Applied"
            console.print(f"{verb} {lk.name} on {t.name}: current {rep.previous or '(none)'} → {rep.generation} "
                          f"in {rep.seconds:.1f}s.")

    @app.command()
    @edge
    def adopt(host: Optional[str] = HostArg,
              path: Optional[str] = typer.Argument(None, help="prefix (or bin/python) of the existing environment"),
              json_out: bool = JsonOpt, local: bool = LocalOpt, inventory: Optional[Path] = InventoryOpt,
              key: Optional[Path] = KeyOpt, known_hosts: Path = KnownHostsOpt, root: Optional[str] = RootOpt):
        """Capture an existing, unmanaged environment as generation 0 (recorded, never moved)."""
        if path is None and local and host:   # `provision adopt --local PATH`
            host, path = None, host
        if path is None:
            raise typer.BadParameter("name the environment to adopt (PATH)")
        t = one_target(host, local, inventory, key, known_hosts, root)
        out = each_host([t], lambda tr: applymod.adopt_host(tr, path))[0]
        if json_out:
            print_json(out)
        elif out.get("id"):
            console.print(f"Adopted {path} on {t.name} as generation {out['id']}.")
        else:
            console.print(out.get("detail", "nothing adopted"))

    @app.command()
    @edge
    def rollback(host: Optional[str] = HostArg,
                 to: Optional[str] = typer.Option(None, "--to", help="generation number or id"),
                 json_out: bool = JsonOpt, local: bool = LocalOpt, inventory: Optional[Path] = InventoryOpt,
                 key: Optional[Path] = KeyOpt, known_hosts: Path = KnownHostsOpt, root: Optional[str] = RootOpt):
        """Switch `current` back to the prior generation (atomic, offline, nothing reinstalled)."""
        t = one_target(host, local, inventory, key, known_hosts, root)
        out = each_host([t], lambda tr: applymod.rollback(tr, to))[0]
        if json_out:
            print_json(out)
        elif out.get("noop"):
            console.print(f"{t.name} is already on {out['to']}.")
        else:
            console.print(f"Rolled back {t.name}: current {out['from']} → {out['to']} in {out['seconds']:.2f}s.")

    @app.command()
    @edge
    def history(host: Optional[str] = HostArg, json_out: bool = JsonOpt, local: bool = LocalOpt,
                inventory: Optional[Path] = InventoryOpt, key: Optional[Path] = KeyOpt,
                known_hosts: Path = KnownHostsOpt, root: Optional[str] = RootOpt,
                events: bool = typer.Option(False, "--events", help="also list history.jsonl events")):
        """Generations with lock, time, status and probe summary."""
        t = one_target(host, local, inventory, key, known_hosts, root)
        h = each_host([t], applymod.history)[0]
        if json_out:
            print_json(h)
            return
        console.print(history_table(h, t.name))
        if events:
            for e in h["events"]:
                console.print(json.dumps(e, sort_keys=True), markup=False)

    @app.command()
    @edge
    def gc(host: Optional[str] = HostArg, keep: int = typer.Option(3, "--keep", help="runnable generations to keep"),
           dry_run: bool = typer.Option(False, "--dry-run", help="list what would be removed"),
           json_out: bool = JsonOpt, local: bool = LocalOpt, inventory: Optional[Path] = InventoryOpt,
           key: Optional[Path] = KeyOpt, known_hosts: Path = KnownHostsOpt, root: Optional[str] = RootOpt):
        """Remove old/failed generations, unused cache entries, their run dirs (never current or rollback's)."""
        t = one_target(host, local, inventory, key, known_hosts, root)
        out = each_host([t], lambda tr: applymod.gc(tr, keep=keep, dry_run=dry_run))[0]
        if json_out:
            print_json(out)
            return
        verb = "would remove" if dry_run else "removed"
        for g in out["generations"]:
            console.print(f"  - {g['id']:<32} {g['status']:<10} {g['bytes'] / 2**20:9.1f} MiB", markup=False)
        console.print(f"{t.name}: {verb} {len(out['generations'])} generations, {len(out['cache'])} cache entries, "
                      f"{len(out['run_dirs'])} run dirs, {out['bytes'] / 2**20:.1f} MiB; kept current "
                      f"{out['current'] or '(none)'} and rollback target {out['rollback_target'] or '(none)'}.",
                      markup=False)

    @app.command()
    @edge
    def logs(host: Optional[str] = HostArg, generation: Optional[str] = typer.Argument(None, help="number or id"),
             json_out: bool = JsonOpt, local: bool = LocalOpt, inventory: Optional[Path] = InventoryOpt,
             key: Optional[Path] = KeyOpt, known_hosts: Path = KnownHostsOpt, root: Optional[str] = RootOpt):
        """A generation's build and probe logs (default: the newest generation)."""
        t = one_target(host, local, inventory, key, known_hosts, root)
        out = each_host([t], lambda tr: applymod.logs(tr, generation))[0]
        if json_out:
            print_json(out)
            return
        console.print(f"{out['id']}: {out['status']}" + (f" ({out['reason']})" if out.get("reason") else ""),
                      markup=False)
        for r in out["probes"]:
            console.print(f"  probe {r['name']:<12} {r['status']:<5} {r.get('reason') or ''}", markup=False)
        for name, log in out["logs"].items():
            console.print(f"--- {out['dir']}/{name} ({log['bytes']} bytes)", markup=False)
            console.print(log["text"], markup=False, end="")
        if out.get("run_dir"):
            console.print(f"--- controller run dir: {out['run_dir']}", markup=False)

    @app.command()
    @edge
    def demo(keep: bool = typer.Option(False, "--keep", help="leave the sandbox for inspection")):
        """Throwaway loopback host: plan → apply A → plan → apply B → plan → rollback → history."""
        from ..demo import run_demo

        run_demo(say=lambda text: console.print(text, markup=False), progress=StepPrinter(False),
                 show_history=lambda h, name: console.print(history_table(h, name)),
                 show_probes=_print_probes, keep=keep)


def history_table(h: dict, host: str) -> Table:
    table = Table(title=plain(f"generations on {host}"), title_justify="left")
    for col in ("", "generation", "lock", "created", "status", "probes"):
        table.add_column(col)
    for g in h["generations"]:
        probes = g.get("probes_summary") or {}
        ptxt = " ".join(f"{k}={v}" for k, v in probes.items() if v) if isinstance(probes, dict) else str(probes)
        status = g.get("status", "?")
        if g.get("skipped_probes"):
            status += f" (skipped: {','.join(g['skipped_probes'])})"
        table.add_row(*(plain(c) for c in ("→" if g["id"] == h["current"] else "", g["id"], g.get("lock_name", ""),
                                           g.get("created", ""), status, ptxt or "-")))
    return table


def _print_probes(probes: dict | None) -> None:
    if not probes or not probes.get("results"):
        if probes and probes.get("detail"):
            err_console.print(f"  probes: {probes['detail']}")
        return
    from .probe import probe_table

    console.print(probe_table(probes))
