"""`provision lock …`: check, resolve, diff, capture (parse, call, render)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .common import HOSTS, Hosts, console, edge, err_console, host_options, over_hosts, print_json

JsonOpt = typer.Option(False, "--json", help="machine-readable output")


@edge
def check(locks: List[Path] = typer.Argument(..., help="lockfiles"), json_out: bool = JsonOpt,
          offline: bool = typer.Option(False, "--offline", help="read wheel METADATA from the cache only")):
    """Prove each lock consistent: Requires-Dist closure, CUDA tags, driver, flashinfer, hashes."""
    from .. import lock as lockmod, lockcheck

    reports = [lockcheck.check(lockmod.load(p), offline=offline) for p in locks]
    if json_out:
        print_json([r.to_json() for r in reports])
    else:
        console.print("\n".join(lockcheck.render_report(r) for r in reports), markup=False, soft_wrap=True)
    if any(not r.ok for r in reports):
        raise typer.Exit(1)


@edge
def resolve(lock: Path = typer.Argument(..., help="lockfile whose `requires` to resolve"),
            out: Optional[Path] = typer.Option(None, "-o", "--out", help="write here (default: update LOCK)"),
            check: bool = typer.Option(False, "--check", help="write nothing; exit 1 if LOCK's resolution is stale"),
            json_out: bool = JsonOpt):
    """Resolve `requires` into the hashed closure; only `packages` and `unresolved` are (re)written."""
    from .. import lock as lockmod, resolve as resolvemod

    lk = lockmod.load(lock)
    with err_console.status(f"resolving {lk.name} …"):
        res = resolvemod.resolve(lk)
    for k, why in res.indexes_down.items():
        err_console.print(f"index {k} ({lk.indexes[k]}): {why}", soft_wrap=True, markup=False)
    for u in res.unresolved:
        err_console.print(f"unresolved {u['requirement']}: {u['reason']}", soft_wrap=True, markup=False)
    if check:
        stale = resolvemod.staleness(lk, res)
        if json_out:
            print_json({"lock": str(lock), "stale": bool(stale), "differences": stale})
        else:
            for line in stale:
                console.print(f"  {line}", markup=False, soft_wrap=True)
            console.print(f"{lock}: {'stale, run `provision lock resolve`' if stale else 'up to date'}.",
                          markup=False, soft_wrap=True)
        if stale:
            raise typer.Exit(1)
        return
    dest = out or lock
    lockmod.write(dest, resolvemod.rewrite_resolved(Path(lock).read_text(), res))
    if json_out:
        print_json({"lock": str(dest), "packages": len(res.packages), "unresolved": len(res.unresolved)})
    else:
        console.print(f"Wrote {dest}: {len(res.packages)} packages, {len(res.unresolved)} unresolved "
                      "(only `packages` and `unresolved` rewritten).", soft_wrap=True, markup=False)


@edge
def diff(old: Path = typer.Argument(..., help="from this lock"), new: Path = typer.Argument(..., help="to this lock"),
         json_out: bool = JsonOpt):
    """Stack changes between two lockfiles, rendered like `plan` (no host involved)."""
    from .. import lock as lockmod, lockcheck

    d = lockcheck.diff(lockmod.load(old), lockmod.load(new))
    if json_out:
        print_json(d.to_json())
    else:
        console.print(d.render(), markup=False, soft_wrap=True)


@edge
@host_options(forks=False, root=False)
def capture(out: Path = typer.Option(..., "-o", "--out", help="write the captured lock here"),
            python: str = typer.Option("python3", "--python", help="interpreter or environment prefix to capture"),
            name: str = typer.Option("adopted", "--name", help="name of the captured lock"),
            hosts: Hosts = HOSTS, json_out: bool = JsonOpt):
    """A lock from a live host's environment (what `apply` adopts as generation 0; playbooks/capture.yml through
    Ansible)."""
    from .. import lock as lockmod
    from ..plays import Play

    t, = hosts.one()
    data = over_hosts([t], Play("capture", {"python": python, "name": name}))[0].value["lock"]
    lk = lockmod.write(out, lockmod.dump(data))
    if json_out:
        print_json({"lock": str(out), "name": lk.name, "packages": len(lk.packages)})
        return
    console.print(f"Wrote {out}: lock {lk.name}, {len(lk.packages)} packages (versions only, no hashes).",
                  soft_wrap=True)


def register(app: typer.Typer) -> None:
    lock_app = typer.Typer(no_args_is_help=True, help="Lockfiles: check, resolve, diff, capture.")
    app.add_typer(lock_app, name="lock")
    for verb in (check, resolve, diff, capture):
        lock_app.command(verb.__name__)(verb)
