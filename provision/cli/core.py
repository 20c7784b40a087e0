"""The operator's verbs: plan, apply, adopt, rollback, history, status, diff, demo (parse, call, render).

Library modules are imported inside each verb, so a verb loads only what it uses.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional

from enum import Enum

import typer

from ..errors import InputError
from .common import (HOSTS, Hosts, JsonOpt, alone, console, edge, err_console, exit_for, host_options, over_hosts,
                     plain, print_json, print_rows, row_error, styled, writable)

LockOpt = typer.Option(None, "--lock", "-l", help="lockfile (YAML)")
FullOpt = typer.Option(False, "--full", help="list every change (default: a summary with the headline changes)")
PythonOpt = typer.Option(None, "--python", help="the host's interpreter for the lock's Python (an absolute path; "
                                                "default: looked for on PATH, in /usr/bin, /usr/local/bin and "
                                                "uv's managed Pythons)")
SerialOpt = typer.Option("0", "--serial", metavar="N|N%[,...]",
                         help="fleet: hosts per batch, in inventory order, as Ansible's serial: a count or a "
                              "percentage of the fleet, or a list of them (1,25%,100%: one host, then a quarter of the "
                              "fleet, then the rest), the last entry repeating; a failed batch stops the rollout (0, "
                              "the default: all hosts in one batch)")
MaxFailOpt = typer.Option("0", "--max-fail", metavar="N|N%",
                          help="fleet: hosts of a batch (or percentage of it) that may fail; the batch fails when "
                               "more fail, as Ansible's max_fail_percentage (unreachable hosts count)")
RollbackOnFailOpt = typer.Option(False, "--rollback-on-fail",
                                 help="fleet: when a batch fails, its hosts that switched go back to the generation "
                                      "they were on (earlier batches stay; the summary prints how to roll them back)")


class Installer(str, Enum):
    uv = "uv"
    pip = "pip"


class WheelsFrom(str, Enum):
    host = "host"
    controller = "controller"


class StepPrinter:
    """Renders apply progress: one line per finished step with its time, and one per phase inside it (fetch,
    install); while a step runs, a spinner with its latest progress on a terminal. `verbose`: also every
    per-package line (`detail` events: uv's output, fetch counters at most every few seconds)."""

    EVERY = 5.0   # seconds between repeated progress lines of one kind when not on a terminal

    def __init__(self, quiet: bool, verbose: bool = False):
        self.quiet, self.verbose, self.status, self.t0, self.last = quiet, verbose, None, 0.0, {}
        self.tty = err_console.is_terminal

    def __call__(self, step: str, state: str, detail: str) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        if state == "wait":
            err_console.print(plain(detail))
        elif state == "start":
            self.t0, self.last = now, {}
            if self.tty:
                self.status = err_console.status(plain(f"{step} …"))
                self.status.start()
        elif state in ("info", "detail") and self.tty and self.status:
            self.status.update(plain(f"{step}: {detail[:110]}"))
            if state == "info" or (self.verbose and not detail.startswith("fetch ")):
                err_console.print(plain(f"    {step}: {detail}"))
        elif state == "info" or (state == "detail" and self.verbose and not self.tty):
            counter = detail.split(" ", 1)[0] if detail.startswith("fetch ") else None   # "fetch 37/118 · …"
            if counter is None or now - self.last.get(step, -self.EVERY) >= self.EVERY:
                if counter:
                    self.last[step] = now
                err_console.print(plain(f"    {step}: {detail}"))
        elif state in ("done", "fail"):
            if self.status:
                self.status.stop()
                self.status = None
            mark = ("✓", "green") if state == "done" else ("✗", "red")
            err_console.print(styled("  ", mark, f" {step:<10} {now - self.t0:6.1f}s  {detail}"))


class FleetPrinter:
    """Live progress of a fleet run: each batch as it starts; a line per host and step as it finishes; an
    unreachable host as it is found. While steps run: on a terminal, one live line per host with its latest
    progress (fetch, install); in logs, a host's progress lines at most every few seconds."""

    EVERY = 5.0

    def __init__(self, quiet: bool, hosts: list[str]):
        self.quiet, self.hosts, self.width, self.lock = quiet, hosts, max(map(len, hosts), default=4), threading.Lock()
        self.tty, self.live, self.running, self.last = err_console.is_terminal, None, {}, {}

    def _print(self, text: str) -> None:
        err_console.print(text, markup=False, soft_wrap=True, highlight=False)

    def _show(self) -> None:   # the live lines: one per host with a step running (the lock is held)
        from rich.console import Group

        lines = [plain(f"  {h:<{self.width}}  … {self.running[h]}") for h in self.hosts if h in self.running]
        if self.live is None and lines:
            from rich.live import Live

            self.live = Live(Group(*lines), console=err_console, transient=True, refresh_per_second=4)
            self.live.start()
        elif self.live is not None:
            self.live.update(Group(*lines), refresh=True)

    def for_host(self, host: str):
        def progress(step: str, state: str, detail: str) -> None:
            if self.quiet:
                return
            if state == "plan":            # the plan itself: a fleet's is `provision plan -i`'s to show
                return
            if state == "wait":            # "waiting for HOST: STEP (no progress for N s)"
                with self.lock:
                    self._print(detail)
                return
            now, line = time.monotonic(), None
            with self.lock:
                if state == "start":
                    self.running[host] = step
                elif state in ("info", "detail"):       # detail: a per-package line, live on a terminal only
                    if self.tty:
                        self.running[host] = f"{step}: {detail[:100]}"
                    elif state == "info" and now - self.last.get(host, -self.EVERY) >= self.EVERY:
                        self.last[host] = now
                        line = f"  {host:<{self.width}}  · {step:<10} {detail}"
                else:
                    self.running.pop(host, None)
                    line = f"  {host:<{self.width}}  {'✓' if state == 'done' else '✗'} {step:<10} {detail}"
                if self.tty:       # the live lines first: a line printed under them redraws them
                    self._show()
                if line:
                    self._print(line)
        return progress

    def batch(self, b) -> None:
        if not self.quiet and b.of > 1:
            size = f"{b.entry} of the fleet" if b.entry.endswith("%") else "the rest" if b.entry == "0" else b.entry
            with self.lock:
                self._print(f"batch {b.number}/{b.of}: {' '.join(b.hosts)} ({size})")

    def row(self, r) -> None:
        """A host's row as it is known: said here when no step line says it (unreachable, stopped)."""
        if self.quiet or r.stage not in ("connect", "halted"):
            return
        with self.lock:
            self.running.pop(r.host, None)
            if self.tty:
                self._show()
            what = "unreachable" if r.unreachable else "stopped"
            self._print(f"  {r.host:<{self.width}}  ✗ {what:<10} {r.error.message}")

    def close(self) -> None:
        with self.lock:
            if self.live is not None:
                self.live.stop()
                self.live = None


def _reprobed(rep) -> str:
    """How long a reused generation's probes took (they ran again before the switch, or refused it)."""
    step = next((s for s in rep.steps if s.name == "probe"), None)
    if not rep.plan or rep.plan.get("reuse") is None or rep.generation != rep.plan["reuse"] or step is None:
        return ""
    return f" (reuse probed in {step.seconds:.1f}s)"


def _print_fleet(fleet, apply_cmd: list[str], rollback_cmd: list[str]) -> None:
    """Each host's row, the counts, and when the rollout stopped: where each host is and the commands to go on."""
    import shlex

    reports = fleet.reports
    width = max(len(r.host) for r in reports)
    for r in reports:
        said = [r.generation, f"back on {r.rollback.to} in {r.rollback.seconds:.2f}s" if r.rollback else None,
                (r.error or "").removeprefix(f"{r.host}: ")]
        console.print(f"  {r.host:<{width}}  {r.status:<14} {' '.join(x for x in said if x)}{_reprobed(r)}")
        for w in r.warnings:
            err_console.print(f"warning: {r.host}: {w}", markup=False)
    counts = {s: sum(r.status == s for r in reports) for s in ("applied", "noop", "failed", "not-attempted")}
    counts.update({s: n for s in ("reused", "rolled-back", "stopped", "interrupted", "unreachable", "unknown")
                   if (n := sum(r.status == s for r in reports))})
    console.print("Fleet: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".")
    if not fleet.interrupted and not fleet.ended and fleet.failed_batch is None:
        return
    if fleet.failed_batch is not None:
        b = fleet.batches[fleet.failed_batch - 1]
        console.print(f"Stopped at batch {b.number}/{b.of}: {len(fleet.failed_hosts)} of {len(b.hosts)} hosts failed "
                      f"({' '.join(fleet.failed_hosts)}), more than --max-fail {fleet.max_fail} allows.")
    if fleet.interrupted:
        console.print("Interrupted (Ctrl-C): no host switched after it. Where each host is:")
    elif fleet.ended:
        console.print(f"The rollout ended early: {fleet.ended}; no host switched after it. Where each host is:")
    for state, hosts in fleet.by_state().items():
        console.print(f"  {state}: {' '.join(hosts)}")
    if fleet.resume:
        console.print("Resume with the hosts not switched:" if fleet.interrupted or fleet.ended else
                      "Resume with the hosts not attempted:")
        console.print("  " + shlex.join([*apply_cmd, "--limit", ",".join(fleet.resume)]))
    if fleet.still_switched:
        console.print("Roll back the hosts that switched:")
        console.print("  " + shlex.join([*rollback_cmd, "--limit", ",".join(fleet.still_switched)]))


def _switched(out, to: str | None) -> str:
    """A plain rollback (a replies.Rollback) rolls back, even to a newer generation (the one left by an apply that
    reused an older one); `--to` a newer generation switches forward."""
    return "Switched forward" if out.forward and to is not None else "Rolled back"


def _checked(check) -> str:
    """A rollback's check of its target (a replies.QuickCheck; None: not checked)."""
    if check is None:
        return " (not checked: --force)"
    how = "files' stat against the build's stamp" if check.how == "stamp" else "files against RECORD"
    return f" ({check.files} {how}, {check.hashed} hashed, {check.seconds:.2f}s)"


@edge
@host_options()
def plan(lock: Path = LockOpt, json_out: bool = JsonOpt,
         out: Optional[Path] = typer.Option(None, "--out", help="save the plan (a fleet's too) for `apply --plan`"),
         detailed_exitcode: bool = typer.Option(False, "--detailed-exitcode",
                                                help="exit 0 no changes, 2 changes, 1 error"),
         hosts: Hosts = HOSTS, full: bool = FullOpt, python: Optional[str] = PythonOpt):
    """Dry-run diff of host vs lock (read-only): playbooks/apply.yml in check mode through Ansible."""
    from .. import apply as applymod, lock as lockmod
    from ..errors import ProvisionError
    from ..facts import interpreter_arg
    from ..plan import render_plan, save_plans

    if lock is None:
        raise InputError("required: the lockfile to plan for (--lock FILE)", where="--lock")
    try:
        lk = lockmod.load(lock)
        python = interpreter_arg(python)
        if out:
            writable(out, "--out")
        rows = alone(applymod.plan_fleet(hosts.targets(), lk, interpreter=python, forks=hosts.forks))
    except ProvisionError as e:
        if detailed_exitcode:   # 2 means "changes" there; every error is 1
            e.exit_code = 1
        raise
    plans = [r.value for r in rows if r.ok]
    if out and plans:
        save_plans(out, plans, fleet=len(rows) > 1)
    print_rows(rows, lambda r: console.print(render_plan(r.value, full=full), markup=False), json_out,
               to_json=lambda p: p.to_json())
    if out and plans and not json_out:
        what = "the plan" if len(plans) == 1 else f"the plans of {len(plans)} hosts"
        console.print(f"Saved {what} to {out}; apply exactly with `provision apply --plan {out}`"
                      + (" -i INVENTORY" if len(rows) > 1 else " HOST") + ".", markup=False)
    exit_for(rows, bad=lambda p: p.errors)      # apply would refuse: an error in a plan is exit 1, always
    if detailed_exitcode and any(not p.noop for p in plans):
        raise typer.Exit(2)


@edge
@host_options(steps=True)
def apply(lock: Optional[Path] = LockOpt,
          plan_file: Optional[Path] = typer.Option(None, "--plan", help="apply a saved plan exactly"),
          adopt: Optional[str] = typer.Option(None, "--adopt",
                                              help="first contact: capture this existing env as generation 0"),
          skip_probe: List[str] = typer.Option([], "--skip-probe", help="emergency: skip a probe (recorded)"),
          installer: Optional[Installer] = typer.Option(None, "--installer",
                                                       help="uv (default; the tool brings its own if the host lacks "
                                                            "one) or pip"),
          wheels_from: WheelsFrom = typer.Option(WheelsFrom.host, "--wheels-from",
                                                 help="host: each host fetches what its store lacks; controller: "
                                                      "fetched once here (sha256-verified) and pushed to each "
                                                      "host by hash, so hosts build offline"),
          serial: str = SerialOpt, max_fail: str = MaxFailOpt, rollback_on_fail: bool = RollbackOnFailOpt,
          json_out: bool = JsonOpt, hosts: Hosts = HOSTS, full: bool = FullOpt, python: Optional[str] = PythonOpt,
          verbose: bool = typer.Option(False, "--verbose", "-v", help="every per-package progress line")):
    """One-command upgrade: build a new generation, patch, probe, switch `current`; a fleet in batches, through
    playbooks/apply.yml (every host of a batch passes its probes before any switches). Ctrl-C stops before the
    switch (a switch under way completes) and says where each host is (exit 130)."""
    from .. import apply as applymod, lock as lockmod
    from ..facts import interpreter_arg
    from ..fleet import parse_max_fail, parse_serial
    from ..plan import load_plans, lock_of_plan, plans_for

    batches, tolerance = parse_serial(serial), parse_max_fail(max_fail)

    saved = load_plans(plan_file) if plan_file else None
    if saved is None and lock is None:
        raise InputError("required: the lockfile to apply (--lock FILE), or a saved plan (--plan FILE)",
                         where="--lock")
    lk = lock_of_plan(saved[0]) if saved else lockmod.load(lock)
    python = interpreter_arg(python)
    ts = hosts.targets()
    by_host = plans_for(saved, ts, str(plan_file)) if saved else None
    kw = dict(adopt_path=adopt, skip_probes=skip_probe, installer=installer.value if installer else None,
              wheels_from=wheels_from.value, saved_plans=by_host, interpreter=python)
    if hosts.inventory is None:         # HOST or --local: its steps as they finish, its report
        _apply_one(ts[0], lk, json_out, verbose, full, kw)
        return
    printer = FleetPrinter(False, [t.name for t in ts])    # progress goes to stderr, --json or not
    err_console.print(f"apply {lk.name} → {len(ts)} hosts", markup=False)
    try:
        fleet = applymod.apply_fleet(ts, lk, serial=batches, max_fail=tolerance, rollback_on_fail=rollback_on_fail,
                                     forks=hosts.forks, progress_for=printer.for_host, on_row=printer.row,
                                     on_batch=printer.batch, **kw)
    finally:
        printer.close()
    if json_out:
        print_json(fleet.to_json())
    else:
        again = [*(["--plan", plan_file] if plan_file else ["--lock", lock]),
                 *(["--adopt", adopt] if adopt else []), *(a for p in skip_probe for a in ("--skip-probe", p)),
                 *(["--installer", installer.value] if installer else []),
                 *(["--wheels-from", wheels_from.value] if wheels_from != WheelsFrom.host else []),
                 "--serial", serial, "--max-fail", max_fail,
                 *(["--rollback-on-fail"] if rollback_on_fail else [])]
        _print_fleet(fleet, hosts.command("apply", *again), hosts.command("rollback"))
    if fleet.interrupted:
        raise typer.Exit(130)
    if not fleet.ok:
        raise typer.Exit(1)


def _apply_one(t, lk, json_out: bool, verbose: bool, full: bool, kw: dict) -> None:
    """apply on one host named without an inventory (HOST, or --local: `connection: local`), through the same play:
    the plan before anything changes, each step as it finishes, then the probes and the outcome; a failure is the
    command's error (its kind's exit code), the report with it."""
    from .. import apply as applymod
    from ..plan import Plan, render_plan

    err_console.print(f"apply {lk.name} → {t.name}", markup=False)    # progress goes to stderr, --json or not
    printer = StepPrinter(False, verbose)

    def said(step: str, state: str, detail: str) -> None:
        if state != "plan":
            printer(step, state, detail)
        else:
            err_console.print(render_plan(Plan.from_json(json.loads(detail)), full=full), markup=False)
    fleet = applymod.apply_fleet([t], lk, forks=1, progress_for=lambda host: said, **kw)
    rep = fleet.reports[0]
    e = _apply_error(fleet, rep, t.name)
    if e is not None:
        if not json_out:
            _print_probes(rep.probes)
            for w in rep.warnings:
                err_console.print(f"warning: {t.name}: {w}", markup=False)
        raise e
    if json_out:
        print_json(rep.to_json())
    elif rep.status == "noop":
        console.print(f"No changes: {t.name} already runs {lk.name} (generation {rep.generation}).")
    else:
        _print_probes(rep.probes)
        for w in rep.warnings:
            err_console.print(f"warning: {t.name}: {w}", markup=False)
        verb = "Switched to the existing" if rep.status == "reused" else "Applied"
        console.print(f"{verb} {lk.name} on {t.name}: current {rep.previous or '(none)'} → {rep.generation} "
                      f"in {rep.seconds:.1f}s{_reprobed(rep)}.")


def _apply_error(fleet, rep, host: str):
    """One host's apply that did not end well as the command's error (None when it did): Ctrl-C says where it left
    the host (exit 130); a failure is the error its step raised, of its kind (its exit code), the report with it."""
    from .. import apply as applymod, errors

    if fleet.interrupted:
        return applymod.interrupted(rep)
    if rep.status in ("applied", "reused", "noop"):
        return None
    kind = getattr(errors, str(rep.error_type), None)
    kind = kind if isinstance(kind, type) and issubclass(kind, errors.ProvisionError) else errors.ProvisionError
    e = kind(rep.error or f"{host}: {rep.status}")
    e.report = rep
    return e


@edge
@host_options(after="json_out")
def adopt(hosts: Hosts,
          path: Optional[str] = typer.Argument(None, help="prefix (or bin/python) of the existing environment"),
          json_out: bool = JsonOpt):
    """Capture an existing, unmanaged environment (the same PATH on each host) as generation 0
    (playbooks/adopt.yml through Ansible)."""
    from ..plays import Play

    ts, (path,) = hosts.targets_and_args((path,))
    if path is None:
        raise InputError("required: the environment to adopt (its prefix or bin/python)", where="PATH")
    rows = over_hosts(ts, Play("adopt", {"path": path}), hosts.forks)

    def show(r):
        v = r.value
        console.print(f"Adopted {path} on {r.host} as generation {v['id']}." if v.get("id")
                      else f"{r.host}: {v.get('detail', 'nothing adopted')}", markup=False)
    print_rows(rows, show, json_out)
    exit_for(rows)


@edge
@host_options()
def rollback(to: Optional[str] = typer.Option(None, "--to", help="generation number or id (may be newer)"),
             dry_run: bool = typer.Option(False, "--dry-run", help="say where each host would switch; change nothing"),
             force: bool = typer.Option(False, "--force", help="switch even to a generation that fails verification"),
             no_restart: bool = typer.Option(False, "--no-restart", help="leave the lock's service alone (default: "
                                             "restart its unit on the generation switched to, and check its health)"),
             serial: str = SerialOpt, json_out: bool = JsonOpt, hosts: Hosts = HOSTS):
    """Switch `current` back to the generation current before the last switch, as history records it (atomic,
    offline, nothing reinstalled); fleets in batches. playbooks/rollback.yml through Ansible (--dry-run: its
    --check): each host goes back on its own, an unreachable one named."""
    from .. import generations, replies
    from ..fleet import parse_serial

    batches = parse_serial(serial)
    ts = hosts.targets()
    live = not json_out and len(ts) > 1      # each host's row as it finishes, a slow host's last

    def show(r):
        out = r.value
        if out.noop:
            console.print(f"{r.host} is already on {out.to}.", markup=False)
        elif out.dry_run:
            verb = "switch forward" if out.forward and to is not None else "roll back"
            console.print(f"Would {verb} {r.host}: current {out.from_ or '(none)'} → {out.to} "
                          "(dry run: nothing changed).",
                          markup=False)
        else:
            console.print(f"{_switched(out, to)} {r.host}: current {out.from_ or '(none)'} → {out.to} "
                          f"in {out.seconds:.2f}s{_checked(out.check)}.", markup=False)
        s = out.service
        if s is not None and s.healthy:
            console.print(f"  restarted {s.unit}: healthy {s.seconds:.1f}s after its stop ({s.health}); serving "
                          f"{', '.join(s.generations) or '(no file of a generation mapped)'}", markup=False)
        elif s is not None:
            err_console.print(f"error: {r.host}: switched to {out.to}, but {s.error}", markup=False)
        for w in out.warnings:
            err_console.print(f"warning: {r.host}: {w}", markup=False)

    def told(r) -> None:
        print_rows([r], show, False)
    rows = alone(generations.rollback_play(ts, to, dry_run=dry_run, force=force, restart=not no_restart,
                                           serial=batches, forks=hosts.forks, on_row=told if live else None))
    if not live:
        print_rows(rows, show, json_out, to_json=replies.to_json)
    exit_for(rows, bad=generations.server_down)


@edge
@host_options()
def history(json_out: bool = JsonOpt, hosts: Hosts = HOSTS,
            events: bool = typer.Option(False, "--events", help="also list history.jsonl events")):
    """Generations with lock, time, status and probe summary (playbooks/history.yml through Ansible)."""
    from .. import replies
    from ..plays import Play, typed

    rows = over_hosts(hosts.targets(), Play("history", read=typed(replies.History)), hosts.forks)

    def show(r):
        console.print(history_table(r.value, r.host))
        for w in r.value.warnings:
            err_console.print(f"warning: {r.host}: {w}", markup=False)
        if events:
            for e in r.value.events:
                console.print(json.dumps(e, sort_keys=True), markup=False)
    print_rows(rows, show, json_out, to_json=replies.to_json)
    exit_for(rows)


@edge
@host_options()
def status(json_out: bool = JsonOpt, hosts: Hosts = HOSTS):
    """One table for the fleet: current generation, lock, since when, its last probe, the last probe of a generation
    that did not become current (a failed or stopped attempt), generations, disk (playbooks/status.yml through
    Ansible)."""
    from .. import replies
    from ..plays import Play, typed

    ts = hosts.targets()
    live = not json_out and len(ts) > 1
    answered: list[str] = []

    def told(r) -> None:      # each host as it finishes, on stderr: a slow host holds back only the table
        answered.append(r.host)
        what = f"current {r.value.current or '(none)'}" if r.ok else \
            "unreachable" if r.unreachable else "error (under the table)"
        err_console.print(f"{r.host}: {what} ({len(answered)}/{len(ts)} hosts)", markup=False, soft_wrap=True)
    # one host's error is a row too: the table shows it
    rows = Play("status", read=typed(replies.Status)).rows(ts, hosts.forks, on_row=told if live else None)
    if json_out:
        print_json([r.to_json(replies.to_json) for r in rows])
    else:
        console.print(status_table(rows))
        for r in rows:
            if not r.ok:
                err_console.print(row_error(r), markup=False, soft_wrap=True)
    exit_for(rows)


@edge
@host_options(forks=False, after="json_out")
def diff(hosts: Hosts,
         a: Optional[str] = typer.Argument(None, help="from this generation (number or id)", show_default=False),
         b: Optional[str] = typer.Argument(None, help="to this generation (default: current)"),
         json_out: bool = JsonOpt):
    """Stack changes between two generations of HOST, rendered like plan (playbooks/diff.yml through Ansible)."""
    from ..inventory import only
    from ..plan import render
    from ..plays import Play, diff_of

    ts, (a, b) = hosts.targets_and_args((a, b))
    if a is None:
        raise InputError("required: the generation to diff from (number or id)", where="A")
    d = over_hosts([only(ts)], Play("diff", {"a": a, "b": b}, read=diff_of))[0].value
    if json_out:
        print_json(dict(d, changes=[asdict(c) for c in d["changes"]]))
    else:
        console.print(render(d["changes"], header=f"Diff on {d['host']}: {d['from']} → {d['to']}",
                             summary=d["summary"], verb="Diff"), markup=False)


@edge
@host_options()
def gc(keep: int = typer.Option(3, "--keep", min=1, help="runnable generations to keep (at least 1; current and "
                                                         "the rollback target are always kept)"),
       dry_run: bool = typer.Option(False, "--dry-run", help="list what would be removed"),
       json_out: bool = JsonOpt, hosts: Hosts = HOSTS):
    """Remove old/failed generations, unused cache entries, their run dirs (never current or rollback's); report
    the bytes freed (playbooks/gc.yml through Ansible; --dry-run: its --check). Each host's progress goes to stderr
    as it collects, never silent for more than a few seconds."""
    from .. import generations, replies

    def said(host: str, ev: dict) -> None:
        err_console.print(f"{host}: {ev.get('step', 'gc')} {ev.get('detail', '')}", markup=False, soft_wrap=True)
    rows = alone(generations.gc_play(hosts.targets(), keep=keep, dry_run=dry_run, forks=hosts.forks,
                                     on_progress=said))   # stderr: --json's stdout stays the JSON
    print_rows(rows, lambda r: console.print(gc_text(r.host, r.value), markup=False), json_out,
               to_json=replies.to_json)
    exit_for(rows, bad=lambda v: v.errors)    # a removal that failed (what was done is reported)


@edge
@host_options(forks=False, after="json_out")
def logs(hosts: Hosts, generation: Optional[str] = typer.Argument(None, help="number or id"),
         json_out: bool = JsonOpt):
    """A generation's build and probe logs (default: the newest generation; playbooks/logs.yml through Ansible)."""
    from .. import replies
    from ..plays import Play, typed

    t, generation = hosts.one(generation)
    out = over_hosts([t], Play("logs", {"generation": generation}, read=typed(replies.Logs)))[0].value
    if json_out:
        print_json(replies.to_json(out))
        return
    console.print(f"{out.id}: {out.status}" + (f" ({out.reason})" if out.reason else ""))
    for r in out.probes:
        console.print(f"  probe {r.name:<12} {r.status:<5} {r.reason or ''}")
    for name, log in out.logs.items():
        console.print(f"--- {out.dir}/{name} ({log.bytes} bytes)")
        console.print(log.text, end="")
    if out.run_dir:
        console.print(f"--- controller run dir: {out.run_dir}")


@edge
def demo(keep: bool = typer.Option(False, "--keep", help="leave the sandbox for inspection"),
         torch_wheel: Optional[Path] = typer.Option(
             None, "--torch-wheel", exists=True, dir_okay=False,
             help="the CPU torch wheel lock B pins (default: found by `pip download`, through pip's find-links)"),
         json_out: bool = typer.Option(False, "--json", help="print only the measured figures, as JSON")):
    """Throwaway loopback host: plan → apply A → plan → apply B (the included engine probed) → plan →
    rollback → history."""
    from ..demo import run_demo

    if json_out:
        print_json(run_demo(say=lambda text: None, progress=None, show_history=lambda h, name: None,
                            show_probes=lambda p: None, keep=keep, torch_wheel=torch_wheel))
        return
    run_demo(say=lambda text: console.print(text), progress=StepPrinter(False),
             show_history=lambda h, name: console.print(history_table(h, name)),
             show_probes=_print_probes, keep=keep, torch_wheel=torch_wheel)


def playbooks(path: bool = typer.Option(False, "--path", help="print only the directory")) -> None:
    """The playbooks operators run with their own ansible-playbook, inventory, become and bastion: the same host
    steps as the CLI's verbs (`ansible-playbook -i INV DIR/rollback.yml`); their modules and module_utils beside.
    Every task checks host keys against the known_hosts `provision hosts trust` writes."""
    from .. import bundled
    from ..transport import DEFAULT_KNOWN_HOSTS, known_hosts_path

    typer.echo(str(bundled.PLAYBOOKS) if path else "\n".join(
        [f"{bundled.PLAYBOOKS}:", *(f"  {name:<14} {what}" for name, what in bundled.playbooks()),
         f"Every task checks host keys against {known_hosts_path(DEFAULT_KNOWN_HOSTS)} (what `provision hosts trust` "
         "records); -e provision_known_hosts=FILE names another."]))


def register(app: typer.Typer) -> None:
    for verb in (plan, apply, adopt, rollback, history, status, diff, gc, logs, demo, playbooks):
        app.command()(verb)


def gc_text(host: str, out) -> str:
    """gc's report (a replies.Gc) under its host's line of totals and what was kept: each generation with what
    removing it frees (and what stays, linked from elsewhere)."""
    from ..units import human_size

    verb, freed = ("would remove", "would free") if out.dry_run else ("removed", "freed")
    lines = []
    for g in out.generations:
        shared = f" (+{human_size(g.shared_bytes)} still linked elsewhere)" if g.shared_bytes else ""
        left = "" if out.dry_run or g.removed is not False else "  NOT REMOVED"
        lines.append(f"  - {g.id:<32} {g.status or '?':<10} {human_size(g.bytes):>10}{shared}{left}")
    took = f" in {out.seconds:.1f}s" if out.seconds is not None else ""
    lines.insert(0, f"{host}: {verb} {len(out.generations)} generations, {len(out.cache)} cached wheels, "
                 f"{len(out.uv_cache)} unpacked wheels of uv's cache, {len(out.run_dirs)} run dirs; "
                 f"{freed} {human_size(out.bytes)}{took}"
                 + (f" ({human_size(out.shared_bytes)} stays: linked from what is kept)"
                    if out.shared_bytes else "")
                 + f"; kept current {out.current or '(none)'} and rollback target "
                   f"{out.rollback_target or '(none)'}.")
    lines += [f"error: {host}: {e}" for e in out.errors]
    lines += [f"warning: {host}: {w}" for w in out.warnings]
    return "\n".join(lines)


def history_table(h, host: str):
    """A host's generations (a replies.History), the current one marked."""
    from rich.table import Table

    table = Table(title=plain(f"generations on {host}"), title_justify="left")
    for col in ("", "generation", "lock", "created", "status", "probes", "verified"):
        table.add_column(col, no_wrap=True)
    for g in h.generations:
        v = g.verify
        ptxt = " ".join(f"{k}={n}" for k, n in (g.probes_summary or {}).items() if n)
        status = "?" if g.status is None else g.status
        if g.skipped_probes:
            status += f" (skipped: {','.join(g.skipped_probes)})"
        table.add_row(*(plain(c) for c in ("→" if g.id == h.current else "", g.id, g.lock_name or "",
                                           g.created or "", status, ptxt or "-",
                                           f"{v.verdict} ({v.time})" if v else "-")))
    return table


def status_table(rows):
    from rich.table import Table

    from ..units import ago, human_size

    table = Table(title_justify="left")
    served = any(r.ok and r.value.serving for r in rows)      # the column only where a lock names a service
    cols = ("host", "current", "lock", "since", "last probe", "last attempt", "verified", "generations", "disk")
    for col in cols[:2] + (("serving",) if served else ()) + cols[2:]:
        table.add_column(col, no_wrap=True)
    for r in rows:
        if not r.ok:      # why is printed under the table, one line per host
            table.add_row(*(plain(c) for c in (r.host, "unreachable" if r.unreachable else "error",
                                               *["-"] * (len(cols) - 2 + served))))
            continue
        s = r.value           # a replies.Status
        p, a = s.probe, s.last_attempt
        probe = f"{p.status} ({p.time})" if p else "broken" if s.broken else "-"
        attempt = f"{a.generation}: probe {a.status} ({a.time})" if a else "-"
        v = s.verify
        verified = f"{v.verdict} ({ago(v.time)}{', at build' if v.how == 'build' else ''})" if v else \
            "broken" if s.broken else "-"
        cur = (s.current or "(none)") + (f" (broken: {s.broken})" if s.broken else "")
        runs = s.serving.generations if s.serving else []
        if runs and s.current not in runs:      # the server runs another generation than `current` names
            cur += f", serving {', '.join(runs)}"
        serving = [serving_text(s.serving)] if served else []
        table.add_row(*(plain(c) for c in (r.host, cur, *serving, s.lock or "-", s.since or "-", probe, attempt,
                                           verified, f"{s.generations} ({s.ready} runnable)",
                                           human_size(s.disk_bytes))))
    return table


def serving_text(v) -> str:
    """A Serving reply as status shows it: the generations the unit's processes run, the unit and its state."""
    if v is None:
        return "-"
    if v.error:
        return f"unknown ({v.unit}: {v.error})"
    state = v.active if v.sub in (None, v.active) else f"{v.active} ({v.sub})"
    if v.load == "not-found":
        state = "not found"
    well = "" if v.healthy is None else ", healthy" if v.healthy else f", unhealthy: {v.health}"
    return f"{', '.join(v.generations) or '-'} ({v.unit} {state}{well})"


def _print_probes(probes: dict | None) -> None:
    if not probes or not probes.get("results"):
        if probes and probes.get("detail"):
            err_console.print(f"  probes: {probes['detail']}", markup=False)
        return
    from .probe import probe_table

    console.print(probe_table(probes))
