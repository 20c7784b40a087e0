"""Hosts one row each, in order: a verb's hosts go through its playbook, Ansible working on `forks` of them at
once, and an unreachable host, or a host's error, is a row (`Row`). Rollouts are Ansible's (playbooks/apply.yml):
here their words, `--serial` batches and the `--max-fail` tolerance, as the CLI takes and reports them."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from .errors import InputError, ProvisionError

# Ansible's --forks by default, whatever the verb: the inventory hosts a play works on at once. Each host does its own
# work (facts, builds, switches) while the controller waits on one SSH session per host, so the controller's cores
# are not what bounds it.
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



def values(rows: list[Row]) -> list:
    """Each host's value, in order, or the first host's error raised."""
    for r in rows:
        if not r.ok:
            raise r.error
    return [r.value for r in rows]


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
