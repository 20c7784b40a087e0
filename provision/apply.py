"""Apply a lock to a host, one named step at a time (`_apply`; each step a `with steps.step(NAME)` around one
visible call):

    recover (generations.recover) → facts (facts.gather) [→ adopt] → plan (plan.make_plan), then
      noop:  nothing to do
      reuse: check (verify.check) → probe (probes.run_probes) → switch (generations.switch)
      build: build (build.build: fetch, install) → patch (patches.apply_series) → seal (verify.seal)
             → probe (probes.run_probes) → switch (generations.switch)

The rename of `current` is the one commit point: a failure before it leaves `current` untouched and the
new generation failed (venv removed at once); after it, apply reports the switch and names the failed
bookkeeping. Also: adoption of an unmanaged environment as generation 0, and a fleet's apply and plan through
playbooks/apply.yml (its action plugin runs `apply` per host, stopped at its gate; the play switches).
A plan alone is `plan.plan_host`; rollback, history, gc and logs are the generations store's (`generations`).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable


from . import build as buildmod, generations, layout, lock as lockmod, replies, toolkit, verify as verifymod
from .errors import ConnectionLost, HostError, Interrupted, PlanError, ProbesFailed, ProvisionError, SwitchUnknown
from .facts import Facts, capture_lock, env_paths, gather, gather_for
from .fleet import FORKS
from .lock import Lock
from .plan import Plan, facts_digest, make_plan, stack_of_lock
from .plays import tail
from .transport import Cancelled, StepStalled, Transport, Watch

Progress = Callable[[str, str, str], None]   # (step, state: start|done|fail|info, detail)
CANCELLED = "interrupted (Ctrl-C): stopped before its switch"


@dataclass
class Step:
    name: str
    status: str = "pending"
    seconds: float = 0.0
    detail: str = ""

    def said(self, out: dict) -> dict:
        """What the step's call returned: its `detail` becomes the step's, and a verdict of "fail" (the
        probes') fails the step. Returns `out`."""
        if out.get("detail"):
            self.detail = out["detail"]
        if out.get("status") == "fail":
            self.status = "failed"
        return out


@dataclass
class ApplyReport:
    host: str
    lock_name: str
    status: str = "pending"            # applied | reused | noop | failed | unknown | stopped | interrupted; in a fleet also
    #                                    rolled-back | not-attempted | unreachable
    generation: str | None = None
    previous: str | None = None
    current: str | None = None         # what `current` names on the host when apply returned
    failed_step: str | None = None
    steps: list[Step] = field(default_factory=list)
    plan: dict | None = None
    recovered: dict | None = None      # what an interrupted earlier run left, settled under the host lock
    warnings: list[str] = field(default_factory=list)
    probes: dict | None = None
    patches: dict | None = None
    run_dir: str | None = None
    build: dict | None = None          # the build's figures: fetched, cached, pushed, seconds per phase, isolation
    verify: dict | None = None         # the seal's full check of the new generation (manifest `verify`)
    error: str | None = None
    error_type: str | None = None      # the error's kind (errors.py) where the host's step raised one
    seconds: float = 0.0
    batch: int = 0                     # a fleet rollout's batch (1-based; 0 outside one)
    rollback: replies.Rollback | None = None    # a fleet rollout's rollback of this host (its batch failed)
    staged: bool = False               # stopped at its gate as the play asks (errors.Staged): its switch is next
    generation_kept: str | None = None  # the probed generation a stop before the switch kept ready

    def to_json(self) -> dict:
        return dict(asdict(self), rollback=replies.to_json(self.rollback))


def patch(transport: Transport, lock: Lock, gen: dict) -> dict:
    """The lock's patch series applied inside generation `gen` (its new venv); a JSON-able summary."""
    if not lock.patches:
        return {"status": "none", "detail": "the lock names no patch series"}
    from . import patches

    series = [patches.load_series(lock.resolve_path(p)) for p in lock.patches]
    report = patches.apply_series(transport, series, python=layout.Generation(gen["dir"]).python)
    counts: dict[str, int] = {}
    for s in report["series"]:
        for p in s["patches"]:
            counts[p["status"]] = counts.get(p["status"], 0) + 1
    detail = ", ".join(f"{n} {k}" for k, n in counts.items()) + f"; {len(report.get('files', {}))} files recorded"
    return {"status": "applied", "detail": detail, **report}


def probe(transport: Transport, lock: Lock, gen_id: str, skip: list[str], facts: Facts,
          manifest: dict | None) -> dict:
    """The probes inside generation `gen_id` (a new build's manifest in hand, or None: the generation's own,
    read from the host, for a reused one)."""
    from .probes import run_probes

    report = run_probes(transport, lock, generation=gen_id, skip=skip, during_apply=True, facts=facts,
                        manifest=manifest)
    report.setdefault("detail", " · ".join(f"{n} {k}" for k, n in (report.get("summary") or {}).items() if n))
    return report


def probe_failure(gen_id: str, probes: dict, current: str | None) -> str:
    """One line: each required probe that failed, and why."""
    why = {r["name"]: r.get("reason") or "no reason given" for r in probes.get("results", [])}
    failed = "; ".join(f"{n} ({why.get(n, '?')})" for n in probes.get("failed", [])) or "?"
    return f"probes failed in {gen_id}: {failed}; current left at {current or '(none)'}"


class _Steps:
    """Times each step, reports it to the progress callback, and keeps it in the report. The host commands of a
    step run under its Watch: a silence is said ("waiting for HOST: STEP ...") and the cancel flag stops them;
    once the flag is set no further step starts."""

    def __init__(self, report: ApplyReport, progress: Progress | None, transport: Transport | None = None,
                 cancel: threading.Event | None = None):
        self.report, self.progress = report, progress or (lambda *a: None)
        self.transport, self.cancel = transport, cancel

    def waiting(self, what: str, seconds: float) -> None:
        self.progress(what, "wait", f"waiting for {self.report.host}: {what} (no progress for {seconds:g} s)")

    @contextmanager
    def step(self, name: str):
        """`with steps.step(NAME) as step:` runs the body as step NAME (its Step yielded: `step.said(out)`
        takes the detail and verdict of what the body's call returned)."""
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled(f"stopped before {name}: the run was cancelled", where=self.report.host)
        step = Step(name, "running")
        self.report.steps.append(step)
        self.progress(name, "start", "")
        t0 = time.perf_counter()
        if self.transport is not None:     # a switch under way is one commit: the cancel flag never cuts it
            self.transport.watch = Watch(name, self.waiting, None if name == "switch" else self.cancel)
        try:
            yield step
        except BaseException as e:
            why = str(e) or ("interrupted" if isinstance(e, KeyboardInterrupt) else type(e).__name__)
            step.status, step.seconds, step.detail = "failed", time.perf_counter() - t0, why
            self.progress(name, "fail", why)
            raise
        finally:
            if self.transport is not None:
                self.transport.watch = None
        step.status, step.seconds = "failed" if step.status == "failed" else "done", time.perf_counter() - t0
        self.progress(name, "fail" if step.status == "failed" else "done", step.detail)


def adopt(transport: Transport, prefix: str, facts: Facts | None = None) -> dict:
    """Capture an unmanaged environment as generation 0000 (recorded as a lock; not moved)."""
    facts = facts or gather(transport)
    if facts.generations:
        return {"id": None, "detail": "host is already managed; --adopt ignored"}
    data = capture_lock(transport, prefix, name="adopted")
    text = lockmod.dump(data)
    lk = lockmod.from_data(data, "adopted")
    manifest = {"lock_name": lk.name, "lock_digest": lk.digest, "stack": asdict(stack_of_lock(lk)),
                "installer": "adopted"}
    return generations.adopt(transport, env_paths(prefix)[0], lk.name, text, manifest)


def adopt_host(transport: Transport, prefix: str) -> dict:
    """`provision adopt`: adoption on its own, under the host lock like any mutating run."""
    with transport.hold():
        return adopt(transport, prefix)


def apply(transport: Transport, lock: Lock, *, saved_plan: Plan | None = None, adopt_path: str | None = None,
          skip_probes: list[str] | None = None, installer: str | None = None, wheels_from: str | None = None,
          progress: Progress | None = None, on_plan: Callable[[Plan], None] | None = None,
          gate: Callable[[], None] | None = None, interpreter: str | None = None,
          cancel: threading.Event | None = None) -> ApplyReport:
    """One-command upgrade: exactly what `make_plan` says (noop, reuse or build). `on_plan` receives the plan
    before anything is changed; `gate` is called under the host lock just before `current` moves, and a
    fleet.Halted it raises stops the apply there (status "stopped"; a new generation is kept, probed and
    runnable, for a later apply to reuse); `interpreter` (--python PATH) is the host's Python a build uses.
    Raises ProvisionError on failure, with the full report as `.report`. Setting `cancel` stops the run before
    its next step (a running host command is stopped), never mid-switch. Ctrl-C raises Interrupted (exit 130)
    that says where the host is; a switch under way completes first."""
    t_start = time.perf_counter()
    report = ApplyReport(host=transport.target.name, lock_name=lock.name)
    try:
        try:
            with transport.hold():
                _apply(transport, lock, report, _Steps(report, progress, transport, cancel), saved_plan=saved_plan,
                       adopt_path=adopt_path, skip=list(skip_probes or []), installer=installer,
                       wheels_from=wheels_from, on_plan=on_plan, progress=progress, gate=gate,
                       interpreter=interpreter)
        except KeyboardInterrupt:
            raise interrupted(report) from None
    except ProvisionError as e:
        if isinstance(e, (Cancelled, Interrupted)) and report.status not in ("applied", "reused", "unknown"):
            report.status = "interrupted"
        elif report.status not in ("unknown", "stopped", "applied", "reused"):
            report.status = "failed"
        if isinstance(e, (StepStalled, Cancelled, ConnectionLost)) and report.status != "unknown":
            facts = any(s.name == "facts" and s.status == "done" for s in report.steps)
            e.message += f"; current left at {report.current or '(none)'}" if facts else "; current not changed"
            report.error = str(e)
        report.error = report.error or str(e)
        report.failed_step = report.failed_step or next((s.name for s in report.steps if s.status == "failed"), None)
        report.seconds = time.perf_counter() - t_start
        e.report = report
        raise
    report.seconds = time.perf_counter() - t_start
    return report


def _apply(transport: Transport, lock: Lock, report: ApplyReport, steps: _Steps, *, saved_plan, adopt_path,
           skip: list[str], installer, wheels_from, on_plan, progress, gate, interpreter) -> None:
    """The pipeline, one step at a time: recover → facts (→ adopt) → plan, then noop, reuse (`_reuse`) or
    build (`_build`), then the gate and the switch."""
    with steps.step("recover") as step:
        report.recovered = step.said(_recover(transport))
    with steps.step("facts"):
        facts = gather_for(transport, lock, interpreter)
    if adopt_path and not facts.generations:
        with steps.step("adopt") as step:
            step.said(adopt(transport, adopt_path, facts))
        facts = gather_for(transport, lock, interpreter)
    if saved_plan is not None:
        if saved_plan.host != facts.host or saved_plan.facts_digest != facts_digest(facts):
            raise PlanError("the host changed since this plan was made; plan again", where=facts.host)
    report.previous = report.current = facts.current
    with steps.step("plan"):
        plan = _planned(facts, lock, report, on_plan)
    if plan.noop:
        report.status, report.generation = "noop", facts.current
        return
    if plan.action == "reuse" and _reuse(transport, lock, report, steps, plan.reuse, facts, skip, gate):
        return
    gen_id = _build(transport, lock, report, steps, facts, skip, installer, wheels_from, progress)
    _halt_at(gate, transport, report, gen_id)
    _switch(transport, report, steps, gen_id, {"lock": lock.name, "skipped_probes": skip})
    report.status = "applied"


def _planned(facts: Facts, lock: Lock, report: ApplyReport, on_plan: Callable[[Plan], None] | None) -> Plan:
    """The plan, shown before anything changes; its fatal findings stop the apply here."""
    plan = make_plan(facts, lock)
    report.plan = plan.to_json()
    if on_plan:
        on_plan(plan)
    if plan.errors and not plan.noop:
        raise HostError(plan.errors[0] + (f" (+{len(plan.errors) - 1} more)" if len(plan.errors) > 1 else ""),
                        where=facts.host)
    return plan


def _reuse(transport: Transport, lock: Lock, report: ApplyReport, steps: _Steps, gen_id: str, facts: Facts,
           skip: list[str], gate: Callable[[], None] | None) -> bool:
    """Switch to `gen_id`, a complete generation of this lock, once it checks clean and its probes pass again;
    False (and a warning) when it fails verification: a new generation is built instead."""
    with steps.step("check") as step:
        check = step.said(verifymod.check(transport, gen_id))
    if check["verdict"] != "clean":
        report.warnings.append(f"{gen_id} holds this lock but fails verification ({check['named']}): "
                               "built a new generation instead")
        return False
    report.generation = gen_id
    with steps.step("probe") as step:
        report.probes = step.said(probe(transport, lock, gen_id, skip, facts, None))
    if report.probes.get("status") == "fail":     # the host changed since it was proven: stay
        report.failed_step = "probe"
        raise ProbesFailed(probe_failure(gen_id, report.probes, facts.current), where=facts.host)
    _halt_at(gate, transport, report, None)
    _switch(transport, report, steps, gen_id, {"lock": lock.name, "reuse": True, "skipped_probes": skip})
    report.status = "reused"
    return True


def _build(transport: Transport, lock: Lock, report: ApplyReport, steps: _Steps, facts: Facts, skip: list[str],
           installer: str | None, wheels_from: str | None, progress: Progress | None) -> str:
    """A new generation: prepared, built (fetch and install), patched, sealed and probed; returns its id,
    verified and ready to switch to. Any failure marks it failed (its venv removed), `current` untouched."""
    lay = layout.of(transport)
    manifest = {"lock_name": lock.name, "lock_digest": lock.digest, "stack": asdict(stack_of_lock(lock)),
                "python": lock.platform.python, "cuda": asdict(lock.platform.cuda)}
    packages, _ = buildmod.packages_of(lock)
    gen = generations.prepare(transport, lock.name, lockmod.dump(lock), manifest, packages)
    report.generation = gen["id"]
    try:
        with steps.step("build") as step:
            report.build = buildmod.build(transport, lock, facts, gen, installer, progress, wheels_from)
            report.run_dir = report.build.get("run_dir")
            step.detail = buildmod.summary(report.build, len(lock.packages))
        manifest.update(cuda_home=toolkit.home(lock, lay.gen(gen["id"]).venv),
                        installer=report.build["installer"], run_dir=report.run_dir)
        generations.mark(transport, gen["id"], status="built", cuda_home=manifest["cuda_home"],
                         installer=manifest["installer"], run_dir=report.run_dir, build=report.build,
                         isolation=report.build.get("isolation"))
        with steps.step("patch") as step:
            report.patches = step.said(patch(transport, lock, gen))
        if report.patches.get("files"):   # recorded before probes and the seal: both check these sha256
            manifest["patches"] = report.patches
            generations.mark(transport, gen["id"], patches=report.patches)
        with steps.step("seal") as step:
            report.verify = step.said(verifymod.seal(transport, lock, gen["id"], manifest["installer"]))["record"]
        with steps.step("probe") as step:
            report.probes = step.said(probe(transport, lock, gen["id"], skip, facts, manifest))
        if report.probes.get("status") == "fail":
            report.failed_step = "probe"
            raise ProbesFailed(probe_failure(gen["id"], report.probes, facts.current), where=facts.host)
        generations.mark(transport, gen["id"], status="verified", probes_summary=report.probes.get("summary"),
                         patches=report.patches, skipped_probes=skip, verify=report.verify)
    except BaseException as e:
        reason = str(e) or type(e).__name__
        report.error = reason
        # Ctrl-C (or the cancel flag) cut the build or its probes short: the generation is unproven, not failed
        status = "abandoned" if isinstance(e, (Cancelled, Interrupted, KeyboardInterrupt)) else "failed"
        if isinstance(e, ConnectionLost):     # another session would wait its connect timeout on a host gone
            report.warnings.append(f"{gen['id']} not marked failed: the connection is lost; the next apply settles it")
            raise
        try:   # space first (the venv goes), then the record; the logs stay in the generation dir
            _marked_failed(report, gen["id"], generations.mark(
                transport, gen["id"], status=status, reason=reason, remove_venv=True,
                event={"event": "apply-failed" if status == "failed" else "apply-interrupted", "lock": lock.name,
                       "reason": reason}))
        except ProvisionError as me:   # the host may be gone: the next run marks it abandoned
            report.warnings.append(f"could not mark {gen['id']} failed ({me}); the next apply settles it")
        raise
    return gen["id"]


def _halt_at(gate: Callable[[], None] | None, transport: Transport, report: ApplyReport, built: str | None) -> None:
    """The fleet's gate before the commit point. A halted apply leaves `current` as it was; the generation it
    built is complete and probed, so it is kept runnable (never current yet) for a later apply to reuse."""
    from .errors import Halted, Staged

    if gate is None:
        return
    try:
        gate()
    except Halted as e:
        report.status, report.current, report.staged = "stopped", report.previous, isinstance(e, Staged)
        if built is not None:      # the play's stage (its switch is the next task) or a stop before the switch
            try:
                out = generations.mark(transport, built, status="ready", stopped=e.message,
                                       event={"event": "staged" if report.staged else "apply-stopped",
                                              "generation": built, "lock": report.lock_name, "reason": e.message})
                report.generation_kept = built
                report.warnings += [f"kept {built}; recording it failed ({what}); the next run repairs it"
                                    for what in out.get("bookkeeping_failed") or []]
            except ProvisionError as me:
                report.warnings.append(f"could not record {built} as kept ({me}); the next apply settles it")
        raise type(e)(halted_line(e.message, report), where=transport.target.name) from None


def halted_line(why: str, report: ApplyReport) -> str:
    """What a host stopped before its switch says: why, where `current` stayed, the generation kept."""
    kept = f"; {report.generation_kept} kept (probed, a later apply reuses it)" if report.generation_kept else ""
    return f"{why}; current left at {report.previous or '(none)'}{kept}"


def interrupted(report: ApplyReport) -> Interrupted:
    """Where a Ctrl-C left the host, in one line (the report is the truth: a switch under way completed)."""
    step = next((s.name for s in reversed(report.steps) if s.status == "failed"), None)
    if report.generation and report.current == report.generation and report.previous != report.generation:
        report.status = report.status if report.status in ("applied", "reused") else (
            "reused" if report.plan and report.plan.get("reuse") == report.generation else "applied")
        msg = f"interrupted after the switch: current is {report.generation} (was {report.previous or '(none)'})"
    else:
        report.status = "interrupted"
        facts = any(s.name == "facts" and s.status == "done" for s in report.steps)
        msg = f"interrupted{f' during {step}' if step else ''}: " + (
            f"current left at {report.current or '(none)'}" if facts else "current not changed")
    e = Interrupted(msg, where=report.host)
    e.report, report.error = report, str(e)
    return e


@contextmanager
def _switch_completes():
    """A Ctrl-C during the switch waits for it (milliseconds): the switch is one atomic commit, and what the
    run then says must be the host's state. Raised as KeyboardInterrupt once the switch is done."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if got:
        raise KeyboardInterrupt


@contextmanager
def _ctrl_c_sets(cancel: threading.Event, hard: threading.Event):
    """In a fleet run, Ctrl-C sets `cancel` (every host then stops before its switch and the rollout reports);
    a second Ctrl-C sets `hard`: the play is killed at once (each host's agent ends when its heartbeat stops)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_int(signum, frame):
        (hard if cancel.is_set() else cancel).set()
    old = signal.signal(signal.SIGINT, on_int)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _marked_failed(report: ApplyReport, gen_id: str, out: dict) -> None:
    for what in out.get("bookkeeping_failed") or []:
        report.warnings.append(f"marked {gen_id} failed; recording it failed ({what}); the next run repairs it")


def _recover(transport: Transport) -> dict:
    out = generations.recover(transport)
    parts = [f"{len(out[k])} {k}" for k in ("abandoned", "repaired", "settled", "freed", "removed_tmp", "unreadable")
             if out.get(k)]
    out["detail"] = ", ".join(parts) if parts else "nothing to settle"
    return out


def _switch(transport: Transport, report: ApplyReport, steps: _Steps, gen_id: str, event: dict) -> None:
    """The commit. What the host says after it is the truth: a lost connection is reported as unknown,
    a failure after the rename as switched with the failed bookkeeping named. A Ctrl-C waits until it is done."""
    with _switch_completes():
        _switch_now(transport, report, steps, gen_id, event)


def _switch_now(transport: Transport, report: ApplyReport, steps: _Steps, gen_id: str, event: dict) -> None:
    try:
        with steps.step("switch"):
            sw = generations.switch(transport, gen_id, "apply", event)
    except HostError as e:
        try:
            now = generations.history(transport, limit=1).current
        except ProvisionError:
            report.status, report.failed_step = "unknown", "switch"
            raise SwitchUnknown(f"connection lost while switching to {gen_id} ({e.message}); `current` is either "
                                f"{report.previous or '(none)'} or {gen_id}: the next apply settles and records it",
                                where=e.where) from None
        report.current = now
        if now != gen_id:
            report.failed_step = "switch"
            if event.get("reuse") is None:
                try:
                    _marked_failed(report, gen_id, generations.mark(
                        transport, gen_id, status="failed", reason=str(e), remove_venv=True,
                        event={"event": "apply-failed", "lock": report.lock_name, "reason": str(e)}))
                except ProvisionError as me:
                    report.warnings.append(f"could not mark {gen_id} failed ({me})")
            raise
        report.warnings.append(f"switched to {gen_id}, but the switch reported: {e.message}")
        return
    report.current = sw.to
    report.warnings += [unrecorded(gen_id, what) for what in sw.bookkeeping_failed]


def unrecorded(gen_id: str, what: str) -> str:
    """The warning for a record that failed after the switch committed: the switch stands, and what to run."""
    return (f"switched to {gen_id}, but recording it failed ({what}): history lacks the switch until the next apply "
            "or rollback on this host records it (the same apply again is a no-op that does)")


# A host's state in a fleet rollout's summary, by its report's status.
STATES = {"applied": "switched", "reused": "switched", "noop": "unchanged", "rolled-back": "rolled back",
          "failed": "failed", "unknown": "unknown", "stopped": "stopped before its switch",
          "interrupted": "interrupted, not switched",
          "not-attempted": "not attempted", "unreachable": "unreachable"}


@dataclass
class FleetReport:
    """A fleet apply: each host's report (inventory order, `batch` set) and how the rollout went."""
    reports: list[ApplyReport]
    batches: list                      # fleet.Batch, in order
    max_fail: str = "0"
    failed_batch: int | None = None    # the batch that failed beyond --max-fail (the rollout stopped there)
    failed_hosts: list[str] = field(default_factory=list)
    interrupted: bool = False          # Ctrl-C (or the cancel flag) stopped it: each host stopped before its switch
    ended: str | None = None           # why the play ended before its end (ansible-playbook killed), None if it did not

    @property
    def ok(self) -> bool:
        return all(r.status in ("applied", "reused", "noop") for r in self.reports)

    def by_state(self) -> dict[str, list[str]]:
        """Hosts by their state (switched, rolled back, failed, ...), states in the order of STATES."""
        out: dict[str, list[str]] = {}
        for state in dict.fromkeys(STATES.values()):
            hosts = [r.host for r in self.reports if STATES.get(r.status) == state]
            if hosts:
                out[state] = hosts
        return out

    @property
    def resume(self) -> list[str]:
        """The hosts a resumed rollout acts on: those not attempted; after Ctrl-C also those it stopped before their
        switch (interrupted, or staged and stopped at the barrier)."""
        left = ("not-attempted", "interrupted", "stopped") if self.interrupted or self.ended else ("not-attempted",)
        return [r.host for r in self.reports if r.status in left]

    @property
    def still_switched(self) -> list[str]:
        """When the rollout stopped (a failed batch, or Ctrl-C): the hosts that switched and stay so (the earlier
        batches', and the failed batch's when it was not rolled back), which the summary's rollback command acts
        on."""
        if self.failed_batch is None and not self.interrupted and not self.ended:
            return []
        return [r.host for r in self.reports if r.status in ("applied", "reused")]

    def to_json(self) -> dict:
        return {"reports": [r.to_json() for r in self.reports],
                "batches": [{"number": b.number, "hosts": b.hosts, "serial": b.entry} for b in self.batches],
                "max_fail": self.max_fail, "failed_batch": self.failed_batch, "failed_hosts": self.failed_hosts,
                "ended": self.ended,
                "states": self.by_state(), "resume": self.resume, "roll_back": self.still_switched}


def apply_fleet(targets: list, lock: Lock, *, serial: str | list[str] = "0", max_fail: str = "0",
                rollback_on_fail: bool = False, forks: int = FORKS,
                progress_for: Callable[[str], Progress | None] | None = None,
                on_row: Callable | None = None, on_batch: Callable | None = None,
                saved_plans: dict | None = None, cancel: threading.Event | None = None, **kw) -> FleetReport:
    """Apply to many hosts through playbooks/apply.yml (Ansible's play: `serial` batches, the linear strategy's
    barrier, `max_fail` failures allowed per batch), up to `forks` hosts at once. Every host of a batch stages
    (builds, patches, seals and probes, stopping before its switch) before any switches; a batch with more failures
    than allowed switches no host and ends the play, later batches not attempted; with `rollback_on_fail` each host
    of that batch that switched goes back to the generation it was on (playbooks/rollback.yml). `saved_plans` maps
    host name → its saved Plan, each applied exactly. `progress_for(host)` hears each step as the host takes it
    (also the switch and a rollback); `on_batch` each batch as it starts; `on_row` a host unreachable as it is
    found, and a host stopped before its switch. `kw`: apply's adopt_path, skip_probes, installer, wheels_from,
    interpreter. Ctrl-C (or setting `cancel`) stops every host in flight before its switch and those not started;
    the report says so."""
    import tempfile
    from pathlib import Path

    from .fleet import Batch, batches as batches_of, parse_serial
    from .runner import run_playbook

    spec = serial if isinstance(serial, list) else parse_serial(serial)
    groups = batches_of(targets, spec)
    plan = [Batch(i + 1, len(groups), [t.name for t in g], spec[min(i, len(spec) - 1)]) for i, g in enumerate(groups)]
    cancel, hard = cancel or threading.Event(), threading.Event()
    # a killed play's workers may still write here as it is removed: what they leave is not the run's error
    with tempfile.TemporaryDirectory(prefix="provision-apply-", ignore_cleanup_errors=True) as tmp:
        feed = _Feed(Path(tmp), plan, progress_for, on_batch, cancel, lock.name)
        given = _play_vars(lock, saved_plans, Path(tmp), targets, kw)
        given.update(max_fail=max_fail, progress_file=str(feed.file), cancel_file=str(feed.cancel_file))
        results: dict[str, dict[str, dict]] = {}
        ended: str | None = None
        feed.start()
        try:
            with _ctrl_c_sets(cancel, hard):
                start = 0
                while start < len(groups):    # again after a batch that failed within the tolerance: Ansible
                    rest = groups[start:]      # ends a play at a batch whose every host failed
                    feed.first, feed.stages, feed.finished = start, 0, False
                    res = run_playbook("apply", [t for g in rest for t in g],
                                     dict(given, serial=[str(len(g)) for g in rest]), label="fleet", forks=forks,
                                     on_raw=lambda ev: feed.event(ev, on_row), cancel=hard.is_set)
                    for task, by_host in res.results.items():
                        results.setdefault(task, {}).update(by_host)
                    if res.stopped:         # the controller stopped it (its disk full)
                        ended = res.stopped
                    elif not feed.finished:   # killed (or never started): what it did not run is not run again
                        how = "was killed" if res.rc is None else f"ended (rc {res.rc})"
                        ended = f"ansible-playbook {how} before the play's end (its run: {res.run_dir})"
                    fleet = _fleet_report(groups, plan, results, lock, max_fail, cancel.is_set(), feed.heard, ended)
                    tried = [i for i in range(start, len(groups))
                             if any(t.name in results.get("stage", {}) for t in groups[i])]
                    if cancel.is_set() or ended or fleet.failed_batch is not None or not tried:
                        break
                    start = tried[-1] + 1
        finally:
            feed.stop()
        # what the hosts said up to the end (the feed's last read), for those whose apply never returned
        ended = ended or (str(feed.unwritten) if feed.unwritten else None)
        fleet = _fleet_report(groups, plan, results, lock, max_fail, cancel.is_set(), feed.heard, ended)
    if feed.error is not None:
        raise feed.error
    if rollback_on_fail and fleet.failed_batch is not None:
        _roll_back(fleet, groups[fleet.failed_batch - 1], progress_for, forks)
    for r in fleet.reports:
        if on_row and r.status == "stopped":
            from .fleet import Row

            on_row(Row(r.host, value=r, error=ProvisionError((r.error or "").removeprefix(f"{r.host}: "),
                                                             where=r.host), stage="halted", batch=r.batch))
    return fleet


def plan_fleet(targets: list, lock: Lock, *, interpreter: str | None = None, forks: int | None = None) -> list:
    """`plan` of many hosts: playbooks/apply.yml in check mode (each host's facts against the lock, nothing changed),
    one fleet.Row per host in the targets' order, its value the host's Plan (also one that apply would refuse); a
    host not reached is its row."""
    import tempfile
    from pathlib import Path

    from .plan import Plan
    from .runner import play_rows, said

    def read(t, result: dict, seconds) -> Plan:
        if isinstance(result.get("report"), dict):
            return Plan.from_json(result["report"], where=t.name)
        raise HostError(said(result).removeprefix(f"{t.name}: "), where=t.name)
    with tempfile.TemporaryDirectory(prefix="provision-plan-") as tmp:
        given = _play_vars(lock, None, Path(tmp), targets, {"interpreter": interpreter})
        return play_rows("apply", targets, dict(given, max_fail="100%"), task="stage", check=True, forks=forks,
                         read=read)


def _play_vars(lock: Lock, saved_plans: dict | None, tmp, targets: list, kw: dict) -> dict:
    """apply.yml's variables for a fleet apply: the lock (or the saved plans, as a file) and apply's options."""
    from pathlib import Path

    from .plan import save_plans

    out: dict = {}
    if saved_plans is not None:
        out["plan_file"] = str(tmp / "plans.json")
        save_plans(Path(out["plan_file"]), list(saved_plans.values()), fleet=True)
    elif Path(lock.path).is_file():
        out["lock"] = str(Path(lock.path).resolve())
    else:
        out["lock"] = str(tmp / "lock.yaml")
        Path(out["lock"]).write_text(lockmod.dump(lock))
    t = targets[0]
    out.update(python=kw.pop("interpreter", None), adopt=kw.pop("adopt_path", None),
               installer=kw.pop("installer", None), wheels_from=kw.pop("wheels_from", None),
               skip_probes=list(kw.pop("skip_probes", None) or []), provision_known_hosts=str(t.known_hosts),
               step_deadline=t.deadline, wait_notice=t.notice)
    if kw:
        raise TypeError(f"apply_fleet: unexpected {', '.join(kw)}")
    return {k: v for k, v in out.items() if v is not None}


class _Feed:
    """The controller's end of a fleet apply's progress: the action plugin's step events (`action.append_event`
    lines in `file`, tailed by `plays.tail`) said to `progress_for(host)`, each batch said to `on_batch` as the play starts it
    (before its hosts' steps), how far it has read written to FILE.read (a host passes its gate once its lines are
    read), and the cancel flag turned into the cancel file the hosts watch. The switch, as the play's events say it."""

    def __init__(self, tmp, plan: list, progress_for, on_batch, cancel: threading.Event, lock_name: str):
        self.file, self.cancel_file = tmp / "progress.jsonl", tmp / "cancel"
        self.plan, self.progress_for, self.on_batch, self.cancel = plan, progress_for, on_batch, cancel
        self.batch_of = {h: b.number for b in plan for h in b.hosts}
        self.announced, self.first, self.stages, self.offset = 0, 0, 0, 0
        self.lock_name, self.finished, self.unwritten = lock_name, False, None
        self.heard: dict[str, ApplyReport] = {}     # each host's apply as its steps said it (its plan, its steps)
        self.said = threading.Condition()
        self.error: BaseException | None = None
        self.tail = tail(self.file, self._line, every=0.05, after=self._read_to)

    def start(self) -> None:
        self.file.touch()
        self.tail.__enter__()

    def stop(self) -> None:
        self.tail.__exit__(None, None, None)

    def announce(self, number: int) -> None:
        """Batches up to `number` as started, each said once and in order."""
        with self.said:
            while self.announced < number:
                self.announced += 1
                if self.on_batch:
                    self._call(self.on_batch, self.plan[self.announced - 1])
            self.said.notify_all()

    def tell(self, host: str, step: str, state: str, detail: str, seconds: float = 0.0) -> None:
        self._heard(host, step, state, detail, seconds)
        say = self.progress_for(host) if self.progress_for else None
        if say:
            self._call(say, step, state, detail)

    def _heard(self, host: str, step: str, state: str, detail: str, seconds) -> None:
        """The host's report as its events tell it: where it is when its apply never returns (the play killed)."""
        rep = self.heard.setdefault(host, ApplyReport(host=host, lock_name=self.lock_name))
        if state == "plan":
            try:
                rep.plan = json.loads(detail)
                rep.previous = rep.current = rep.plan.get("base")
            except (ValueError, AttributeError):
                pass
        elif state == "start":
            rep.steps.append(Step(step, "running"))
        elif state in ("done", "fail"):
            running = next((s for s in reversed(rep.steps) if s.name == step and s.status == "running"), None)
            if running is None:
                running = Step(step)
                rep.steps.append(running)
            running.status, running.detail = "done" if state == "done" else "failed", detail
            running.seconds = float(seconds) if isinstance(seconds, (int, float)) else 0.0

    def _call(self, fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as e:     # a listener's error is the run's, once the play is done
            self.error = self.error or e

    def event(self, ev: dict, on_row) -> None:
        """An event of the play (ansible-runner's, in its thread): a batch starts (its stage task), a host is not
        reached, a host switches."""
        d = ev.get("event_data") or {}
        kind, task, host = ev.get("event"), d.get("task"), d.get("host")
        if kind == "playbook_on_stats":
            self.finished = True
        elif kind == "playbook_on_task_start" and task == "stage":
            self.stages += 1
            self.announce(self.first + self.stages)
        elif kind == "runner_on_unreachable" and task == "stage" and host and on_row:
            from .fleet import Row
            from .runner import said

            msg = said(d.get("res") or {}).removeprefix(f"{host}: ")
            self._call(on_row, Row(host, error=HostError(msg, where=host), stage="connect",
                                   batch=self.batch_of.get(host, 0)))
        elif task == "switch" and host:
            res = d.get("res") or {}
            if kind == "runner_on_start":
                self.tell(host, "switch", "start", "")
            elif kind == "runner_on_ok":
                sw = switched_of(host, res)
                self.tell(host, "switch", "done", f"{sw.from_ or '(none)'} → {sw.to}")
            elif kind in ("runner_on_failed", "runner_on_unreachable"):
                from .runner import said

                self.tell(host, "switch", "fail", said(res))

    def _line(self, host: str, ev: dict) -> None:
        """A host's step event (`action.append_event`'s line), said after its batch's start."""
        try:
            host, step, state, detail = ev["host"], ev["step"], ev["state"], ev["detail"]
        except KeyError:
            return
        number = self.batch_of.get(host, 0)
        with self.said:     # a batch's steps come after its start (the play says it first)
            self.said.wait_for(lambda: self.announced >= number, timeout=5)
        self.announce(number)
        self.tell(host, step, state, detail, ev.get("seconds"))

    def _read_to(self, offset: int) -> None:
        """After each read: the cancel file made once cancelled, how far the file is read written to FILE.read. One
        that cannot be written (the disk full) is the run's `unwritten`: the hosts then stop at their gates."""
        read = self.file.with_name(self.file.name + ".read")
        part = read.with_name(read.name + ".part")
        try:
            if self.cancel.is_set() and not self.cancel_file.exists():
                self.cancel_file.touch()
            if offset != self.offset and self.unwritten is None:
                part.write_text(str(offset))
                os.replace(part, read)
                self.offset = offset
        except OSError as e:
            from .errors import controller_failure

            self.unwritten = self.unwritten or controller_failure(e, part)


def _fleet_report(groups: list, plan: list, results: dict, lock: Lock, max_fail: str, cancelled: bool,
                  heard: dict[str, ApplyReport], ended: str | None = None) -> FleetReport:
    """Each host's report from the play's results (its stage's apply report, its switch), in inventory order, and
    the first batch whose failures went beyond the tolerance. A host whose apply never returned (Ctrl-C, or the play
    `ended` before its end: killed) is told as its steps said it (`heard`): interrupted at the step it was in."""
    from .fleet import allowed_failures
    from .runner import said, unreachable

    stage, switch = results.get("stage", {}), results.get("switch", {})
    cut = "interrupted (Ctrl-C)" if cancelled else f"interrupted: {ended}" if ended else None
    reports, failed_batch, failed_hosts = [], None, []
    for b, group in zip(plan, groups):
        for t in group:
            r, sw = stage.get(t.name), switch.get(t.name)
            if r is None and cut and t.name in heard:
                rep = _cut_short(heard[t.name], None if cancelled else ended)
            elif r is None:
                rep = ApplyReport(host=t.name, lock_name=lock.name, status="not-attempted")
            elif r.get("unreachable"):
                rep = ApplyReport(host=t.name, lock_name=lock.name, status="unreachable",
                                  error=str(unreachable(t, said(r).removeprefix(f"{t.name}: "))))
            elif isinstance(r.get("report"), dict):
                rep = _report_of(r["report"])
                rep.error_type = r.get("error_type") if r.get("failed") else None
            else:
                rep = ApplyReport(host=t.name, lock_name=lock.name, error=f"{t.name}: {said(r)}",
                                  error_type=r.get("error_type"),
                                  status="not-attempted" if r.get("status") == "not-attempted" else "failed")
            rep.batch = b.number
            if sw is not None and not sw.get("failed") and not sw.get("unreachable"):
                done = switched_of(t.name, sw)
                rep.status = "reused" if (rep.plan or {}).get("reuse") == rep.generation else "applied"
                rep.current, rep.error = done.to, None
                rep.steps.append(Step("switch", "done", float(done.switch_seconds or 0.0)))
                rep.warnings += [unrecorded(done.to, what) for what in done.bookkeeping_failed]
            elif sw is not None:
                rep.status, rep.failed_step, rep.error = "failed", "switch", f"{t.name}: {said(sw)}"
                rep.steps.append(Step("switch", "failed", 0.0, said(sw)))
            elif ended and rep.generation and any(s.name == "switch" and s.status == "running"
                                                  for s in heard.get(t.name, ApplyReport(t.name, "")).steps):
                rep.status, rep.failed_step = "unknown", "switch"
                rep.error = (f"{t.name}: the play ended during its switch to {rep.generation} ({ended}): `current` is "
                             f"either {rep.previous or '(none)'} or {rep.generation}: the next apply settles it")
            reports.append(rep)
        fails = [r.host for r in reports[-len(group):] if r.status in ("failed", "unknown", "unreachable")]
        if failed_batch is None and len(fails) > allowed_failures(max_fail, len(group)):
            failed_batch, failed_hosts = b.number, fails
    for rep in reports:
        why = cut or (f"batch {failed_batch}/{len(plan)} had failed ({', '.join(failed_hosts)})" if failed_batch
                      else None)
        if rep.status == "stopped" and rep.staged and why:
            rep.error = f"{rep.host}: {halted_line(f'{why}: stopped before its switch', rep)}"
        elif rep.status == "not-attempted" and rep.error is None and why:
            rep.error = f"{rep.host}: not attempted: {cut or f'batch {failed_batch}/{len(plan)} failed'}"
    return FleetReport(reports, plan, max_fail, failed_batch, failed_hosts, cancelled, ended)


def switched_of(host: str, result: dict) -> replies.Switched:
    """The switch task's result (provision_switch's: `generations.switch` as its JSON) read back as the Switched it
    was."""
    from .runner import reply_of

    return replies.Switched.of(reply_of(result), host)


def _cut_short(heard: ApplyReport, ended: str | None) -> ApplyReport:
    """The report of a host whose apply never returned (Ctrl-C, or the play `ended` early), from what its steps
    said: interrupted at the step it was in, `current` where its plan found it (it never switched: the switch is the
    play's later task)."""
    rep = _report_of(heard.to_json())
    running = next((s for s in reversed(rep.steps) if s.status == "running"), None)
    if running is not None:
        running.status, running.detail = "failed", ended or "interrupted (Ctrl-C)"
    elif rep.steps and rep.steps[-1].status == "failed":   # its step saw the run end first (its controller gone)
        running = rep.steps[-1]
    rep.status, rep.failed_step = "interrupted", running.name if running is not None else None
    during = f" during {rep.failed_step}" if rep.failed_step else ""
    where = f"current left at {rep.current or '(none)'}" if rep.plan is not None else "current not changed"
    rep.error = (f"{rep.host}: interrupted{during}: {ended}; {where}" if ended else
                 f"{rep.host}: interrupted (Ctrl-C){during}: {where}")
    return rep


def _report_of(data: dict) -> ApplyReport:
    """An ApplyReport from its JSON (the stage task's `report`), its own copy."""
    import copy

    data = copy.deepcopy(data)
    known = {f for f in ApplyReport.__dataclass_fields__}
    rep = ApplyReport(**{k: v for k, v in data.items() if k in known and k != "steps"})
    rep.steps = [Step(**{k: v for k, v in s.items() if k in Step.__dataclass_fields__}) for s in data.get("steps") or []]
    return rep


def _roll_back(fleet: FleetReport, group: list, progress_for, forks: int) -> None:
    """The failed batch's hosts that switched, back to the generation each was on (playbooks/rollback.yml)."""
    by = {r.host: r for r in fleet.reports}
    switched = [t for t in group if by[t.name].status in ("applied", "reused")]
    for previous in dict.fromkeys(by[t.name].previous for t in switched):
        ts = [t for t in switched if by[t.name].previous == previous]
        for t in ts:
            say = progress_for(t.name) if progress_for else None
            if say:
                say("rollback", "start", "")
        if previous is None:
            rows = [None] * len(ts)
        else:
            rows = generations.rollback_play(ts, previous, forks=forks)
        for t, row in zip(ts, rows):
            rep, say = by[t.name], (progress_for(t.name) if progress_for else None) or (lambda *a: None)
            if row is None or not row.ok:
                why = row.error.message if row is not None else \
                    f"no generation was current before {rep.generation}: nothing to go back to"
                say("rollback", "fail", why)
                rep.warnings.append(f"rolling back failed: {why}")
                continue
            out = row.value
            say("rollback", "done", f"{out.from_} → {out.to} in {out.seconds:.2f}s")
            rep.status, rep.current, rep.rollback = "rolled-back", out.to, out
            rep.warnings += out.warnings
