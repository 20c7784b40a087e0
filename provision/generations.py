"""Control-side handle on a host's generations store (the `state` agent): prepare, mark, switch,
roll back, adopt, history, recover, gc, logs. Every call is one round trip; the agent does the atomic work."""
from __future__ import annotations

import time

from .layout import pick_generation, root_of
from .errors import HostError
from .transport import Transport


def call(transport: Transport, op: str, **args) -> dict:
    return transport.run_agent("state", dict(args, op=op, root=root_of(transport.target)))


def prepare(t: Transport, lock_name: str, lock_text: str, manifest: dict, packages: list[dict]) -> dict:
    """New generation dir with lock.yaml, requirements.txt (hashes) and a 'building' manifest."""
    pkgs = [{"name": p["name"], "sha256": p["sha256"], "filename": p["filename"]} for p in packages]
    return call(t, "prepare", lock_name=lock_name, lock_text=lock_text, manifest=manifest, packages=pkgs)


def mark(t: Transport, gen_id: str, event: dict | None = None, remove_venv: bool = False, **fields) -> dict:
    return call(t, "mark", id=gen_id, fields=fields, event=event, remove_venv=remove_venv)


def switch(t: Transport, gen_id: str, kind: str = "switch", event: dict | None = None) -> dict:
    """Commit `gen_id` as current (rename of `current`); `bookkeeping_failed` names what failed after it."""
    return call(t, "switch", id=gen_id, kind=kind, event=event or {})


def recover(t: Transport) -> dict:
    """Settle what an interrupted run left (the caller holds the host lock): abandoned, repaired, freed."""
    return call(t, "recover")


def logs(t: Transport, generation: str | None = None, tail: int = 65536) -> dict:
    """A generation's logs (tail of each), probe results with reasons, failure reason and run dir; `generation`
    is its id or number (default: the newest)."""
    return call(t, "logs", id=resolve(t, generation, default="newest"), tail=tail)


def gc(t: Transport, keep: int = 3, dry_run: bool = False, on_event=None) -> dict:
    """Collect old and failed generations and unreferenced cache entries on the host (under its lock),
    then the controller's run directories of the generations removed. `bytes` is what the host freed (each
    inode once, and only when no link to it is left); `shared_bytes` what stays linked from elsewhere;
    `on_event` hears gc's progress (a phase begins, and at least every 2 s within one)."""
    out = t.run_agent("state", {"op": "gc", "root": root_of(t.target), "keep": keep, "dry_run": dry_run,
                                "take_lock": True}, on_event=on_event)
    return collected(out, dry_run)


def collected(out: dict, dry_run: bool) -> dict:
    """The host's gc reply, then the controller's part: the run directories of the generations it removed (or would
    remove), under `run_dirs`, removed here unless `dry_run`."""
    import shutil
    from pathlib import Path

    from .runner import RUNS

    out["run_dirs"] = []
    for g in out["generations"]:
        rd = g.get("run_dir")
        if rd and (dry_run or g.get("removed")) and Path(rd).resolve().parent == RUNS.resolve() and Path(rd).is_dir():
            out["run_dirs"].append(rd)
            if not dry_run:
                shutil.rmtree(rd, ignore_errors=True)
    return out


def rollback(t: Transport, to: str | None = None, dry_run: bool = False, force: bool = False) -> dict:
    """Switch back (or, with `to`, possibly forward: `forward` says so); `dry_run` only names the target. The
    target is checked first (every file's stat against its build's stamp, hashing what changed; `check` holds
    the figures): one that drifted is refused, naming its files, unless `force`. The rename of `current` is the
    commit: a failure after it is a warning (`warnings`), the switch stands and the next run records it."""
    t0 = time.perf_counter()
    out = call(t, "rollback", to=to, take_lock=not dry_run, dry_run=dry_run, force=force)
    return rolled_back(out, time.perf_counter() - t0)


def rolled_back(out: dict, seconds: float | None) -> dict:
    """The host's rollback reply as `rollback` returns it: `seconds` the step took as the controller saw it, and a
    warning for each record that failed after the switch."""
    out["seconds"] = seconds or 0.0
    out["warnings"] = list(out.get("warnings") or []) + [
        f"switched to {out['to']}; recording it failed ({what}); the next run repairs it"
        for what in out.get("bookkeeping_failed") or []]
    return out


def status(t: Transport) -> dict:
    """Current generation, its lock, since when, last probe verdict, generations kept, disk used."""
    return call(t, "status")


def adopt(t: Transport, prefix: str, lock_name: str, lock_text: str, manifest: dict) -> dict:
    return call(t, "adopt", prefix=prefix, lock_name=lock_name, lock_text=lock_text, manifest=manifest)


def history(t: Transport, limit: int = 200) -> dict:
    return call(t, "history", limit=limit)


def resolve(t: Transport, generation: str | None, default: str = "current") -> str:
    """A generation's id from its id or number; None means `current` (or the newest, default="newest")."""
    from .errors import ProvisionError

    h = history(t)
    gens = [(x["number"], x["id"]) for x in h.get("generations") or []]
    try:
        return pick_generation(gens, h.get("current"), generation, default)
    except LookupError as e:
        why = {"none": f"no generations under {root_of(t.target)}: adopt or apply first",
               "no current": "no current generation; name one with --generation"}.get(str(e), str(e))
        raise ProvisionError(why, where=t.target.name) from None


def read(t: Transport, gen_id: str) -> dict:
    return call(t, "read", id=gen_id)


def diff(t: Transport, a: str, b: str | None = None) -> dict:
    """Stack changes from generation `a` to `b` (default: current), each read from its own lock."""
    from .lock import loads
    from .plan import diff_stacks, stack_of_lock, summarize

    ids = [resolve(t, a), resolve(t, b)]
    stacks = []
    for gen_id in ids:
        text = read(t, gen_id).get("lock_text")
        if not text:
            raise HostError(f"generation {gen_id} has no lock.yaml", where=t.target.name)
        stacks.append(stack_of_lock(loads(text, f"{t.target.name}:{gen_id}/lock.yaml")))
    changes = diff_stacks(*stacks)
    return {"host": t.target.name, "from": ids[0], "to": ids[1], "changes": changes, "summary": summarize(changes)}


def rollback_hosts(targets: list, to: str | None = None, *, dry_run: bool = False, force: bool = False,
                   serial: str | list[str] = "0", forks: int | None = None) -> list:
    """rollback on hosts named without an inventory; one fleet.Row per host. One host goes back over provision's
    own connection (no play to start); several through playbooks/rollback.yml (`rollback_play`), batch by batch,
    each host on its own: a dead or hung host is its row, never a reason to keep the others where they are."""
    if len(targets) > 1:
        return rollback_play(targets, to, dry_run=dry_run, force=force, serial=serial, forks=forks)
    from .fleet import each

    rows = each(targets, lambda tr: rollback(tr, to, dry_run=dry_run, force=force))
    for row in rows:
        row.batch = 1
    return rows


# ---------------------------------------------------------------- an inventory's hosts: the playbooks, through Ansible

def rollback_play(targets: list, to: str | None = None, *, dry_run: bool = False, force: bool = False,
                  serial: str | list[str] = "0", forks: int | None = None) -> list:
    """`rollback_hosts` as playbooks/rollback.yml (`dry_run`: its --check), one Ansible run per batch of `serial`
    (Ansible would end a play at a batch whose every host failed; here each host goes back on its own, a dead one
    named in its row). One fleet.Row per host, values as `rollback` returns them."""
    from .fleet import batches
    from .runner import answer, play_rows

    given = {"to": to, "force": force}
    rows = []
    for number, group in enumerate(batches(targets, serial), 1):
        for row in play_rows("rollback", group, {k: v for k, v in given.items() if v is not None}, check=dry_run,
                             forks=forks, read=lambda t, r, seconds: rolled_back(answer(t, r), seconds)):
            row.batch = number
            rows.append(row)
    return rows


def gc_play(targets: list, keep: int = 3, dry_run: bool = False, forks: int | None = None) -> list:
    """`gc` as playbooks/gc.yml (`dry_run`: its --check) over the hosts, then the controller's run directories of
    what each removed; one fleet.Row per host. The module answers once: no progress while a host collects."""
    from .runner import answer, play_rows

    return play_rows("gc", targets, {"keep": keep}, check=dry_run, forks=forks,
                     read=lambda t, r, seconds: collected(answer(t, r), dry_run))
