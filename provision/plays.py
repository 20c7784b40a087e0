"""An inventory's verb as its playbook, from the CLI's side: one Ansible run, a fleet.Row per host (`Play`); a
provision action plugin's result read back as its step's value (`value_of`, the inverse of `carried`); the progress
its steps append to a file, tailed while the play runs (`tail`)."""
from __future__ import annotations

import json
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import errors
from .errors import HostError, ProvisionError

# The step's keys Ansible gives a meaning of its own travel as `step_KEY` (its warnings as `agent_warnings`, as the
# modules' do); `value_of` puts them back.
APART = ("changed", "failed", "msg", "skipped", "unreachable", "invocation", "deprecations")
DONE = "step_done"          # in a result: the step ran to its end (its value is there, a failed verdict too)


def carried(value: dict) -> dict:
    """A step's value as a task's result: its keys Ansible reads apart (APART, warnings)."""
    out = {}
    for k, v in value.items():
        out["agent_warnings" if k == "warnings" else f"step_{k}" if k in APART else k] = v
    return out


def value_of(t, result: dict, seconds: float | None = None) -> dict:
    """A HostStep task's result read back as the step's value (play_rows' `read`): the step's error raised as it was
    raised (its type, where and message), or a failed task's line as the host's HostError."""
    from .runner import reply_of, said

    if result.get("error_type"):
        kind = getattr(errors, str(result["error_type"]), ProvisionError)
        kind = kind if isinstance(kind, type) and issubclass(kind, ProvisionError) else ProvisionError
        raise kind(str(result.get("msg") or "failed"), where=result.get("error_where"))
    if not result.get(DONE):
        raise HostError(said(result), where=t.name)
    out = {}
    for k, v in reply_of(result).items():
        if k == DONE:
            continue
        out[k[5:] if k.startswith("step_") and k[5:] in APART else k] = v
    return out


def typed(cls) -> Callable[..., Any]:
    """A play_rows `read` for a module's result: the reply as reply dataclass `cls` (replies.py) reads it, checked
    field by field (a reply of the wrong shape is the host's ReplyError, one line); `replies.to_json` gives it back
    as JSON."""
    from .runner import answer

    def read(t, result: dict, seconds: float | None = None):
        return cls.of(answer(t, result), t.name)
    return read


def facts_of(t, result: dict, seconds: float | None = None):
    """facts.yml's result read back as `facts.gather` returns it: the host's Facts, checked field by field."""
    from .facts import Facts
    from .runner import answer

    return Facts.from_reply(answer(t, result).get("facts"), t.name)


def unlock_of(t, result: dict, seconds: float | None = None) -> dict:
    """unlock.yml's result read back as `transport.unlock` returns it."""
    from .layout import Layout
    from .runner import answer
    from .transport import unlocked

    return unlocked(answer(t, result), Layout(t.root).lock_file, t.name)


def diff_of(t, result: dict, seconds: float | None = None) -> dict:
    """diff.yml's result read back as `generations.diff` returns it (each change a plan.Change again)."""
    from .plan import Change

    d = value_of(t, result, seconds)
    return dict(d, changes=[Change(**c) for c in d["changes"]])


def pack_of(t, result: dict, seconds: float | None = None) -> dict:
    """pack.yml's result read back as `pack.pack` returns it (its lock's check a lockcheck.Report again)."""
    from .lockcheck import Finding, Report

    rep = value_of(t, result, seconds)
    c = rep["check"]
    return dict(rep, check=Report(c["lock"], c["path"], c["packages"], [Finding(**f) for f in c["findings"]],
                                  c["overrides_used"], c["launch"]))


@dataclass
class Play:
    """A verb as its playbook (playbooks/NAME.yml): the extra vars it is given, how a host's result is read back
    (`read`, default `value_of`), `on_progress(host, event)` for the progress its steps append (a file made
    for the run, given to the play as `progress`), and whether it runs in check mode."""

    name: str
    extravars: dict = field(default_factory=dict)
    read: Callable[..., Any] = value_of
    on_progress: Callable[[str, dict], None] | None = None
    check: bool = False             # the play's --check (a dry run)

    def rows(self, targets: list, forks: int | None = None, on_row: Callable | None = None) -> list:
        """One fleet.Row per target, in order, from one Ansible run; the hosts' keys checked against the known_hosts
        the targets name; `on_row` hears each host's row as it comes. A Ctrl-C stops the run and is
        KeyboardInterrupt here (runner.run_playbook)."""
        from .runner import RUNS

        given = {k: v for k, v in self.extravars.items() if v is not None}
        given.setdefault("provision_known_hosts", str(targets[0].known_hosts))
        if self.on_progress is None:
            return self._run(targets, given, forks, on_row)
        RUNS.mkdir(parents=True, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix=f"progress-{self.name}-", suffix=".jsonl", dir=RUNS)
        os.close(fd)
        with tail(Path(path), self.on_progress):          # the file goes when the tail ends
            return self._run(targets, dict(given, progress=path), forks, on_row)

    def _run(self, targets: list, given: dict, forks: int | None, on_row: Callable | None = None) -> list:
        from .runner import play_rows

        return play_rows(self.name, targets, given, forks=forks, read=self.read, check=self.check, on_row=on_row)


class tail:
    """While the block runs, each JSON line appended to `path` goes to `on_event(host, event)` (read every `every`
    seconds, and once more at the end), then `after(offset)` with how far the file has been read; the file is
    removed afterwards."""

    def __init__(self, path: Path, on_event: Callable[[str, dict], None], every: float = 0.25,
                 after: Callable[[int], None] | None = None):
        self.path, self.on_event, self.stop, self.at = path, on_event, threading.Event(), 0
        self.every, self.after = every, after

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.at)
                data = f.read()
        except OSError:
            return
        whole = data[:data.rfind(b"\n") + 1]
        self.at += len(whole)
        for line in whole.splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict):
                self.on_event(str(ev.get("host", "")), ev)
        if self.after:
            self.after(self.at)

    def _loop(self) -> None:
        while not self.stop.wait(self.every):
            self._read()

    def __enter__(self):
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self._read()
        self.path.unlink(missing_ok=True)
