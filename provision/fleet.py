"""Many hosts at once: one function run on each host in parallel (bounded by `forks`), one row per host in
inventory order; rollouts batch by batch (Ansible's `serial` and `max_fail_percentage`), with a gate before each
host's commit point and an undo for a batch that fails. An unreachable host, or a host's error, is a row."""
from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import Halted, InputError, ProvisionError
from .transport import Target, Transport

# Hosts contacted at once, whatever the verb: each host does its own work (facts, builds, switches) while the
# controller waits on one SSH session per host, so the controller's cores are not what bounds it.
FORKS = 16


@dataclass
class Row:
    """One host's outcome. `stage`: "connect" (unreachable), "run" (the host's error), "halted" (stopped before
    its commit point), "skipped" (not attempted) or "done"."""
    host: str
    value: Any = None
    error: ProvisionError | None = None
    stage: str = "done"
    batch: int = 0                 # 1-based batch of a rollout (0 outside one)
    undo: Any = None               # what undoing this host's change returned (its batch failed)
    undo_error: ProvisionError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def unreachable(self) -> bool:
        return self.stage == "connect"

    def to_json(self, value_json: Callable[[Any], Any] = lambda v: v) -> dict:
        if self.error is not None:
            return {"host": self.host, "error": self.error.message, "where": self.error.where,
                    "stage": self.stage, "exit_code": self.error.exit_code}
        return {"host": self.host, "result": value_json(self.value)}


def _run(t: Target, fn: Callable[[Transport], Any]) -> Row:
    """fn(transport) on one target: its row (a ProvisionError's `.report`, if any, is the row's value)."""
    from .transport import connect

    try:
        tr = connect(t)
    except ProvisionError as e:
        return Row(t.name, error=e, stage="connect")
    try:
        return Row(t.name, value=fn(tr))
    except Halted as e:
        return Row(t.name, value=getattr(e, "report", None), error=e, stage="halted")
    except ProvisionError as e:
        return Row(t.name, value=getattr(e, "report", None), error=e, stage="run")
    finally:
        tr.close()


def each(targets: list[Target], fn: Callable[[Transport], Any], *,
         on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """fn(transport) on each target in turn, one row each (`on_row` sees each as it is known): a host reached
    directly. An inventory's hosts go through its verb's playbook, Ansible running them side by side."""
    rows = []
    for t in targets:
        rows.append(_run(t, fn))
        if on_row:
            on_row(rows[-1])
    return rows


# ---------------------------------------------------------------- batches and tolerance (Ansible's words)

_COUNT = re.compile(r"(0|[1-9][0-9]{0,8})\Z")
_PERCENT = re.compile(r"(0|[1-9][0-9]{0,2})%\Z")


def parse_serial(text: str | int | None) -> list[str]:
    """`--serial`: a count or a percentage of the fleet, or a list of them (`1,25%,100%`); the last entry repeats
    until the fleet is done; 0 is the rest of the fleet in one batch. InputError naming --serial otherwise."""
    entries = [e.strip() for e in str("0" if text is None else text).split(",")]
    for e in entries:
        if not (_COUNT.match(e) or (_PERCENT.match(e) and 1 <= int(e[:-1]) <= 100)):
            raise InputError(f"{e!r} is neither a host count (0 or more) nor a percentage (1% to 100%); "
                             "give e.g. 1,25%,100%", where="--serial")
    return entries


def parse_max_fail(text: str | int | None) -> str:
    """`--max-fail N|N%`: how many hosts of a batch (or what percentage of it) may fail; more fail the batch."""
    e = str(0 if text is None else text).strip()
    if not (_COUNT.match(e) or (_PERCENT.match(e) and int(e[:-1]) <= 100)):
        raise InputError(f"{e!r} is neither a host count (0 or more) nor a percentage (0% to 100%)",
                         where="--max-fail")
    return e


def batch_sizes(serial: list[str], n: int) -> list[int]:
    """Ansible's batching: each entry in turn (a percentage of the whole fleet, rounded down, at least one
    host; 0 the rest), the last one repeating until all n hosts are in a batch."""
    sizes, left, i = [], n, 0
    while left > 0:
        e = serial[min(i, len(serial) - 1)]
        size = max(1, n * int(e[:-1]) // 100) if e.endswith("%") else int(e)
        size = left if size <= 0 else min(size, left)
        sizes.append(size)
        left -= size
        i += 1
    return sizes


def batches(targets: list, serial: list[str] | str | int) -> list[list]:
    """Consecutive batches of the targets, in inventory order."""
    spec = serial if isinstance(serial, list) else parse_serial(serial)
    out, at = [], 0
    for size in batch_sizes(spec, len(targets)):
        out.append(targets[at:at + size])
        at += size
    return out


def allowed_failures(max_fail: str, batch_size: int) -> int:
    """The most hosts of a batch that may fail before the batch fails (Ansible: it fails when MORE fail)."""
    if max_fail.endswith("%"):
        return batch_size * int(max_fail[:-1]) // 100
    return int(max_fail)


@dataclass
class Batch:
    number: int
    of: int
    hosts: list[str]
    entry: str                     # the --serial entry it came from ("1", "25%", "0")


@dataclass
class Rollout:
    rows: list[Row]
    batches: list[Batch]
    max_fail: str = "0"
    failed_batch: int | None = None    # the batch that failed beyond the tolerance; those after it not attempted
    failed_hosts: list[str] = field(default_factory=list)   # that batch's failures


def rollout(targets: list[Target], fn: Callable[[Transport, Callable[[], None]], Any], *,
            serial: str | list[str] = "0", max_fail: str = "0", forks: int = FORKS,
            on_row: Callable[[Row], None] | None = None, on_batch: Callable[[Batch], None] | None = None,
            changed: Callable[[Row], bool] | None = None,
            undo: Callable[[Transport, Row], Any] | None = None) -> Rollout:
    """fn(transport, gate) batch by batch, up to `forks` hosts at once within a batch. A host's failure (an error
    row; unreachable ones too) counts against its batch's tolerance; once a batch has more failures than
    `max_fail` allows it has failed. `gate()`, which fn calls just before its commit point, is the batch's barrier:
    it returns once every host of the batch has reached its gate or ended, and raises Halted (that host is a
    "halted" row) when the batch has failed; its hosts not yet started are not attempted, and once its hosts have
    finished `undo(transport, row)` runs on each whose row `changed` says it changed something; the batches after
    it are not attempted. `on_row` sees each row as it is known (an unreachable host at once), `on_batch` each batch
    as it starts."""
    spec = serial if isinstance(serial, list) else parse_serial(serial)
    groups = batches(targets, spec)
    entries = [spec[min(i, len(spec) - 1)] for i in range(len(groups))]
    plan = [Batch(i + 1, len(groups), [t.name for t in g], entries[i]) for i, g in enumerate(groups)]
    out = Rollout(rows=[], batches=plan, max_fail=max_fail)
    for batch, group in zip(plan, groups):
        if out.failed_batch is not None:
            out.rows += [Row(t.name, error=ProvisionError(f"not attempted: batch {out.failed_batch}/{batch.of} "
                                                          "failed", where=t.name), stage="skipped",
                             batch=batch.number) for t in group]
            continue
        if on_batch:
            on_batch(batch)
        allowed = allowed_failures(max_fail, len(group))
        rows = _batch(group, fn, batch, allowed, forks, on_row)
        out.rows += rows
        failures = [r for r in rows if r.stage in ("run", "connect")]
        if len(failures) > allowed:
            out.failed_batch, out.failed_hosts = batch.number, [r.host for r in failures]
            if undo is not None:
                _undo([(t, r) for t, r in zip(group, rows) if changed is not None and changed(r)], undo, forks)
    return out


def _batch(group: list[Target], fn, batch: Batch, allowed: int, forks: int, on_row) -> list[Row]:
    """One batch, as Ansible's linear strategy runs a play's tasks: every host of the batch reaches its commit
    point (its `gate`) or ends before any host passes it, so a failure anywhere in the batch is known before any
    partner switches. Up to `forks` hosts work at once; a host waiting at the gate gives its place to another."""
    failed: list[str] = []
    pending = {t.name for t in group}          # hosts neither at the gate nor ended
    settled = threading.Condition()
    places = threading.Semaphore(max(1, forks))

    def gate(name: str) -> None:
        with settled:
            pending.discard(name)
            settled.notify_all()
        places.release()
        try:
            with settled:
                settled.wait_for(lambda: not pending)
        finally:
            places.acquire()
        with settled:
            if len(failed) > allowed:
                raise Halted(f"batch {batch.number}/{batch.of} had failed ({', '.join(failed)}): stopped before "
                             "its switch")

    def one(t: Target) -> Row:
        with places:
            with settled:
                late = len(failed) > allowed
            if late:
                row = Row(t.name, error=ProvisionError(f"not attempted: batch {batch.number}/{batch.of} failed "
                                                       "before this host started", where=t.name), stage="skipped")
            else:
                row = _run(t, lambda tr: fn(tr, lambda: gate(t.name)))
        row.batch = batch.number
        with settled:
            if row.stage in ("run", "connect"):
                failed.append(t.name)
            pending.discard(t.name)
            settled.notify_all()
        if on_row:
            on_row(row)
        return row

    with ThreadPoolExecutor(max_workers=len(group)) as pool:
        return list(pool.map(one, group))


def _undo(pairs: list[tuple[Target, Row]], undo, forks: int) -> None:
    def one(pair) -> None:
        t, row = pair
        done = _run(t, lambda tr: undo(tr, row))
        row.undo, row.undo_error = done.value, done.error

    if pairs:
        with ThreadPoolExecutor(max_workers=max(1, min(forks, len(pairs)))) as pool:
            list(pool.map(one, pairs))
