"""Many hosts at once: one function run on each host in parallel (bounded by `forks`), one row per
host in inventory order. An unreachable host, or a host's error, is a row, never an abort."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from .errors import ProvisionError
from .transport import Target, Transport

# Hosts contacted at once, whatever the verb: each host does its own work (facts, builds, switches) while the
# controller waits on one SSH session per host, so the controller's cores are not what bounds it.
FORKS = 16


@dataclass
class Row:
    host: str
    value: Any = None
    error: ProvisionError | None = None
    stage: str = "done"            # "connect" (unreachable), "run" (the host's error), "skipped", "done"

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self, value_json: Callable[[Any], Any] = lambda v: v) -> dict:
        if self.error is not None:
            return {"host": self.host, "error": self.error.message, "where": self.error.where,
                    "stage": self.stage, "exit_code": self.error.exit_code}
        return {"host": self.host, "result": value_json(self.value)}


def each(targets: list[Target], fn: Callable[[Transport], Any], *, forks: int = FORKS,
         on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """fn(transport) on every target, `forks` at a time; `on_row` sees each row as it finishes."""
    from .transport import connect

    def one(t: Target) -> Row:
        try:
            tr = connect(t)
        except ProvisionError as e:
            row = Row(t.name, error=e, stage="connect")
        else:
            try:
                row = Row(t.name, value=fn(tr))
            except ProvisionError as e:
                row = Row(t.name, error=e, stage="run")
            finally:
                tr.close()
        if on_row:
            on_row(row)
        return row

    if len(targets) == 1:
        return [one(targets[0])]
    with ThreadPoolExecutor(max_workers=max(1, min(forks, len(targets)))) as pool:
        return list(pool.map(one, targets))


def batches(targets: list, serial: int) -> list[list]:
    """Consecutive batches of `serial` hosts (0: one batch of all)."""
    size = serial if serial > 0 else max(1, len(targets))
    return [targets[i:i + size] for i in range(0, len(targets), size)]


def rollout(targets: list[Target], fn: Callable[[Transport], Any], *, serial: int = 0, forks: int = FORKS,
            on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """`each` batch by batch (`serial` hosts per batch); after a batch with a failure the remaining
    hosts are rows with stage "skipped", untouched."""
    rows: list[Row] = []
    for batch in batches(targets, serial):
        if any(not r.ok for r in rows):
            rows += [Row(t.name, error=ProvisionError("not attempted: an earlier batch failed", where=t.name),
                         stage="skipped") for t in batch]
            continue
        rows += each(batch, fn, forks=forks, on_row=on_row)
    return rows
