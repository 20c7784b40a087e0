"""Control-side handle on a host's generations store (the `state` agent): prepare, mark, switch,
roll back, adopt, history, recover, gc, logs. Every call is one round trip; the agent does the atomic work, and
its reply is read through its declared shape (replies.py): status, history, logs, switch, rollback and gc give that
dataclass itself."""
from __future__ import annotations

import time

from . import replies
from .layout import pick_generation
from .errors import HostError
from .transport import Transport


def call(transport: Transport, op: str, **args) -> dict:
    return transport.run_agent("state", dict(args, op=op, root=transport.target.root))


def ask(transport: Transport, reply: type, op: str, **args):
    """The state agent's reply to `op`, read as the dataclass `reply` (ReplyError naming the host and the field)."""
    return reply.of(call(transport, op, **args), transport.target.name)


def prepare(t: Transport, lock_name: str, lock_text: str, manifest: dict, packages: list[dict]) -> dict:
    """New generation dir with lock.yaml, requirements.txt (hashes) and a 'building' manifest."""
    pkgs = [{"name": p["name"], "sha256": p["sha256"], "filename": p["filename"]} for p in packages]
    return ask(t, replies.Prepared, "prepare", lock_name=lock_name, lock_text=lock_text, manifest=manifest,
               packages=pkgs).to_json()


def mark(t: Transport, gen_id: str, event: dict | None = None, remove_venv: bool = False, **fields) -> dict:
    return ask(t, replies.Marked, "mark", id=gen_id, fields=fields, event=event, remove_venv=remove_venv).to_json()


def switch(t: Transport, gen_id: str, kind: str = "switch", event: dict | None = None,
           take_lock: bool = False) -> replies.Switched:
    """Commit `gen_id` as current (rename of `current`); `bookkeeping_failed` names what failed after it.
    `take_lock`: under the host lock (a caller that does not hold it already)."""
    return ask(t, replies.Switched, "switch", id=gen_id, kind=kind, event=event or {},
               **({"take_lock": True} if take_lock else {}))


def recover(t: Transport) -> dict:
    """Settle what an interrupted run left (the caller holds the host lock): abandoned, repaired, freed."""
    return ask(t, replies.Recovered, "recover").to_json()


def logs(t: Transport, generation: str | None = None, tail: int = 65536) -> replies.Logs:
    """A generation's logs (tail of each), probe results with reasons, failure reason and run dir; `generation`
    is its id or number (default: the newest)."""
    return ask(t, replies.Logs, "logs", generation=generation, tail=tail)


def gc(t: Transport, keep: int = 3, dry_run: bool = False, on_event=None) -> replies.Gc:
    """Collect old and failed generations and unreferenced cache entries on the host (under its lock),
    then the controller's run directories of the generations removed. `bytes` is what the host freed (each
    inode once, and only when no link to it is left); `shared_bytes` what stays linked from elsewhere;
    `on_event` hears gc's progress (a phase begins, and at least every 2 s within one)."""
    out = t.run_agent("state", {"op": "gc", "root": t.target.root, "keep": keep, "dry_run": dry_run,
                                "take_lock": True}, on_event=on_event)
    return collected(replies.Gc.of(out, t.target.name), dry_run)


def collected(reply: replies.Gc, dry_run: bool) -> replies.Gc:
    """The host's gc reply, then the controller's part: the run directories of the generations it removed (or would
    remove), under `run_dirs`, removed here unless `dry_run`."""
    import shutil
    from pathlib import Path

    from .runner import RUNS

    run_dirs = []
    for g in reply.generations:
        rd = g.run_dir
        if rd and (dry_run or g.removed) and Path(rd).resolve().parent == RUNS.resolve() and Path(rd).is_dir():
            run_dirs.append(rd)
            if not dry_run:
                shutil.rmtree(rd, ignore_errors=True)
    return replies.given(reply, run_dirs=run_dirs)


def rollback(t: Transport, to: str | None = None, dry_run: bool = False, force: bool = False) -> replies.Rollback:
    """Switch back (or, with `to`, possibly forward: `forward` says so); `dry_run` only names the target. The
    target is checked first (every file's stat against its build's stamp, hashing what changed; `check` holds
    the figures): one that drifted is refused, naming its files, unless `force`. The rename of `current` is the
    commit: a failure after it is a warning (`warnings`), the switch stands and the next run records it."""
    t0 = time.perf_counter()
    out = ask(t, replies.Rollback, "rollback", to=to, take_lock=not dry_run, dry_run=dry_run, force=force)
    return rolled_back(out, time.perf_counter() - t0)


def rolled_back(reply: replies.Rollback, seconds: float | None) -> replies.Rollback:
    """The host's rollback reply as `rollback` returns it: `seconds` the step took as the controller saw it, and a
    warning for each record that failed after the switch."""
    return replies.given(reply, seconds=seconds or 0.0, warnings=reply.warnings + [
        f"switched to {reply.to}; recording it failed ({what}); the next run repairs it"
        for what in reply.bookkeeping_failed])


def server_down(reply: replies.Rollback) -> bool:
    """Whether a rollback restarted the service and it did not come back healthy (the switch itself stands)."""
    return reply.service is not None and not reply.service.healthy


def status(t: Transport) -> replies.Status:
    """Current generation, its lock, since when, last probe verdict, generations kept, disk used."""
    return ask(t, replies.Status, "status")


def adopt(t: Transport, prefix: str, lock_name: str, lock_text: str, manifest: dict) -> dict:
    return ask(t, replies.Adopted, "adopt", prefix=prefix, lock_name=lock_name, lock_text=lock_text,
               manifest=manifest).to_json()


def history(t: Transport, limit: int = 200) -> replies.History:
    return ask(t, replies.History, "history", limit=limit)


def resolve(t: Transport, generation: str | None, default: str = "current") -> str:
    """A generation's id from its id or number; None means `current` (or the newest, default="newest")."""
    from .errors import ProvisionError

    h = ask(t, replies.History, "history", limit=200)
    try:
        return pick_generation([(g.number, g.id) for g in h.generations], h.current, generation, default)
    except LookupError as e:
        why = {"none": f"no generations under {t.target.root}: adopt or apply first",
               "no current": "no current generation; name one with --generation"}.get(str(e), str(e))
        raise ProvisionError(why, where=t.target.name) from None


def read(t: Transport, gen_id: str) -> dict:
    """A generation's manifest and lock text, as the host sent them (`read_generation`'s reply)."""
    return read_generation(t, gen_id).to_json()


def read_generation(t: Transport, gen_id: str) -> replies.GenerationRead:
    return ask(t, replies.GenerationRead, "read", id=gen_id)


def lock_of(t: Transport, gen_id: str):
    """(the Lock generation `gen_id` was built from, its manifest); HostError when it has no lock.yaml."""
    from .lock import loads

    info = read_generation(t, gen_id)
    if not info.lock_text:
        raise HostError(f"generation {gen_id} has no lock.yaml", where=t.target.name)
    return loads(info.lock_text, f"{t.target.name}:{gen_id}/lock.yaml"), info.manifest


def diff(t: Transport, a: str, b: str | None = None) -> dict:
    """Stack changes from generation `a` to `b` (default: current), each read from its own lock."""
    from .plan import diff_stacks, stack_of_lock, summarize

    ids = [resolve(t, a), resolve(t, b)]
    changes = diff_stacks(*(stack_of_lock(lock_of(t, gen_id)[0]) for gen_id in ids))
    return {"host": t.target.name, "from": ids[0], "to": ids[1], "changes": changes, "summary": summarize(changes)}


# ---------------------------------------------------------------- the verbs' playbooks, through Ansible

def rollback_play(targets: list, to: str | None = None, *, dry_run: bool = False, force: bool = False,
                  restart: bool = True, serial: str | list[str] = "0", forks: int | None = None,
                  on_row=None) -> list:
    """`rollback` on the hosts as playbooks/rollback.yml (`dry_run`: its --check), one Ansible run per batch of
    `serial` (Ansible would end a play at a batch whose every host failed; here each host goes back on its own, a
    dead one named in its row). One fleet.Row per host, values as `rollback` returns them (replies.Rollback);
    `on_row` hears each host's row as it comes."""
    from .fleet import batches
    from .runner import answer, play_rows

    given = {"to": to, "force": force, "restart": restart}
    rows = []
    for number, group in enumerate(batches(targets, serial), 1):
        def told(row, number=number) -> None:
            row.batch = number
            if on_row:
                on_row(row)
        rows += play_rows("rollback", group, {k: v for k, v in given.items() if v is not None}, check=dry_run,
                          forks=forks, read=lambda t, r, seconds: rolled_back(
                              replies.Rollback.of(answer(t, r), t.name), seconds), on_row=told)
    return rows


def gc_play(targets: list, keep: int = 3, dry_run: bool = False, forks: int | None = None,
            on_progress=None) -> list:
    """`gc` as playbooks/gc.yml (`dry_run`: its --check) over the hosts, each host's run directories of what it
    removed too; one fleet.Row per host, values as `gc` returns them (replies.Gc). `on_progress(host, event)` hears
    each host's phases as it collects."""
    from .plays import Play

    return Play("gc", {"keep": keep}, read=gc_of, check=dry_run, on_progress=on_progress).rows(targets, forks)


def gc_of(t, result: dict, seconds: float | None = None) -> replies.Gc:
    """gc.yml's result read back as `gc` returns it: the plugin's value (its run_dirs as it set them), a Gc again."""
    from .plays import value_of

    return replies.Gc.of(value_of(t, result, seconds), t.name)


def gc_progress(ev: dict) -> str:
    """One line of gc's progress (after the host's name and "gc"): its phase, how far, since when."""
    far = f" {ev['directories']}/{ev['of']} directories" if ev.get("of") else \
        f" {ev['items']} items" + (f", {ev['store_entries']} store entries" if ev.get("store_entries") else "") \
        if ev.get("items") is not None else ""
    return f"{ev.get('phase', '')}{far} ({ev.get('seconds', 0):.1f}s)"
