"""Apply a lock to a host, one named step at a time (`_apply`; each step a `with steps.step(NAME)` around one
visible call):

    recover (generations.recover) → facts (facts.gather) [→ adopt] → plan (plan.make_plan), then
      noop:  nothing to do
      reuse: check (verify.check) → probe (probes.run_probes) → switch (generations.switch)
      build: build (build.build: fetch, install) → patch (patches.apply_series) → seal (verify.seal)
             → probe (probes.run_probes) → switch (generations.switch)

The rename of `current` is the one commit point: a failure before it leaves `current` untouched and the
new generation failed (venv removed at once); after it, apply reports the switch and names the failed
bookkeeping. Also: adoption of an unmanaged environment as generation 0, and a fleet's rollout in batches.
A plan alone is `plan.plan_host`; rollback, history, gc and logs are the generations store's (`generations`).
"""
from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable


from . import build as buildmod, generations, layout, lock as lockmod, toolkit, verify as verifymod
from .errors import HostError, Interrupted, PlanError, ProbesFailed, ProvisionError, SwitchUnknown
from .facts import Facts, capture_lock, env_paths, gather
from .fleet import FORKS
from .lock import Lock
from .plan import Plan, facts_digest, make_plan, stack_of_lock
from .transport import Cancelled, StepStalled, Transport, Watch

Progress = Callable[[str, str, str], None]   # (step, state: start|done|fail|info, detail)


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
    seconds: float = 0.0
    batch: int = 0                     # a fleet rollout's batch (1-based; 0 outside one)
    rollback: dict | None = None       # a fleet rollout's rollback of this host (its batch failed)

    def to_json(self) -> dict:
        return asdict(self)


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
            raise _interrupted(report) from None
    except ProvisionError as e:
        if isinstance(e, (Cancelled, Interrupted)) and report.status not in ("applied", "reused", "unknown"):
            report.status = "interrupted"
        elif report.status not in ("unknown", "stopped", "applied", "reused"):
            report.status = "failed"
        if isinstance(e, (StepStalled, Cancelled)) and report.status != "unknown":
            e.message += f"; current left at {report.current or '(none)'}"
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
        facts = gather(transport, python=lock.platform.python, interpreter=interpreter)
    if adopt_path and not facts.generations:
        with steps.step("adopt") as step:
            step.said(adopt(transport, adopt_path, facts))
        facts = gather(transport, python=lock.platform.python, interpreter=interpreter)
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
    from .fleet import Halted

    if gate is None:
        return
    try:
        gate()
    except Halted as e:
        report.status, report.current = "stopped", report.previous
        kept = ""
        if built is not None:
            try:
                generations.mark(transport, built, status="ready", stopped=e.message,
                                 event={"event": "apply-stopped", "generation": built, "lock": report.lock_name,
                                        "reason": e.message})
                kept = f"; {built} kept (probed, a later apply reuses it)"
            except ProvisionError as me:
                report.warnings.append(f"could not record {built} as kept ({me}); the next apply settles it")
        raise Halted(f"{e.message}; current left at {report.previous or '(none)'}{kept}",
                     where=transport.target.name) from None


def _interrupted(report: ApplyReport) -> Interrupted:
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
def _ctrl_c_sets(cancel: threading.Event):
    """In a fleet run, Ctrl-C sets `cancel` (every host then stops before its switch and the rollout reports);
    a second Ctrl-C interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_int(signum, frame):
        if cancel.is_set():
            raise KeyboardInterrupt
        cancel.set()
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
        with steps.step("switch") as step:
            sw = step.said(generations.switch(transport, gen_id, "apply", event))
    except HostError as e:
        try:
            now = generations.history(transport, limit=1)["current"]
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
    report.current = sw["to"]
    for what in sw.get("bookkeeping_failed") or []:
        report.warnings.append(f"switched to {gen_id}; recording it failed ({what}); the next run repairs it")


# A host's state in a fleet rollout's summary, by its report's status.
STATES = {"applied": "switched", "reused": "switched", "noop": "unchanged", "rolled-back": "rolled back",
          "failed": "failed", "unknown": "unknown", "stopped": "stopped before its switch",
          "interrupted": "interrupted (Ctrl-C), not switched",
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
        """The hosts a resumed rollout acts on: those not attempted."""
        return [r.host for r in self.reports if r.status == "not-attempted"]

    @property
    def still_switched(self) -> list[str]:
        """When the rollout stopped: the hosts that switched and stay so (the earlier batches', and the failed
        batch's when it was not rolled back), which the summary's rollback command acts on."""
        if self.failed_batch is None:
            return []
        return [r.host for r in self.reports if r.status in ("applied", "reused")]

    def to_json(self) -> dict:
        return {"reports": [r.to_json() for r in self.reports],
                "batches": [{"number": b.number, "hosts": b.hosts, "serial": b.entry} for b in self.batches],
                "max_fail": self.max_fail, "failed_batch": self.failed_batch, "failed_hosts": self.failed_hosts,
                "states": self.by_state(), "resume": self.resume, "roll_back": self.still_switched}


def apply_fleet(targets: list, lock: Lock, *, serial: str | list[str] = "0", max_fail: str = "0",
                rollback_on_fail: bool = False, forks: int = FORKS,
                progress_for: Callable[[str], Progress | None] | None = None,
                on_row: Callable | None = None, on_batch: Callable | None = None,
                saved_plans: dict | None = None, cancel: threading.Event | None = None, **kw) -> FleetReport:
    """Apply to many hosts in batches (fleet.rollout: `serial` as Ansible's, `max_fail` failures allowed per
    batch), up to `forks` at a time within a batch. A batch with more failures than allowed stops the rollout:
    its hosts not yet switched stop before their switch, later batches are not attempted, and with
    `rollback_on_fail` each host of that batch that switched goes back to the generation it was on.
    `saved_plans` maps host name → its saved Plan, each applied exactly. `on_row` and `on_batch` are
    fleet.rollout's; `progress_for(host)` also sees a rollback as the step "rollback". Ctrl-C (or setting
    `cancel`) stops every host in flight before its switch and those not started; the report says so."""
    from .fleet import Halted, rollout

    cancel = cancel or threading.Event()

    def one(tr: Transport, gate) -> ApplyReport:
        name = tr.target.name
        if cancel.is_set():
            raise Halted("interrupted (Ctrl-C) before this host started", where=name)

        def gated() -> None:     # the fleet's gate, and Ctrl-C's: nothing switches once the run is cancelled
            def stop_if_cancelled() -> None:
                if cancel.is_set():
                    raise Halted("interrupted (Ctrl-C): stopped before its switch", where=name)
            stop_if_cancelled()
            if gate is not None:
                gate()               # the batch's barrier: returns once every partner has reached it or ended
                stop_if_cancelled()
        args = dict(kw, saved_plan=saved_plans[name]) if saved_plans is not None else kw
        try:
            return apply(tr, lock, progress=progress_for(name) if progress_for else None, gate=gated,
                         cancel=cancel, **args)
        except Cancelled as e:   # cut mid-step by the cancel: a stop, not a failure that counts against its batch
            halted = Halted(e.message, where=e.where)
            halted.report = getattr(e, "report", None)
            raise halted from None

    def back(tr: Transport, row) -> dict:
        say = (progress_for(row.host) if progress_for else None) or (lambda *a: None)
        rep = row.value
        say("rollback", "start", "")
        try:
            if not rep.previous:
                raise HostError(f"no generation was current before {rep.generation}: nothing to go back to",
                                where=row.host)
            out = generations.rollback(tr, to=rep.previous)
        except ProvisionError as e:
            say("rollback", "fail", e.message)
            raise
        say("rollback", "done", f"{out['from']} → {out['to']} in {out['seconds']:.2f}s")
        return out

    with _ctrl_c_sets(cancel):
        run = rollout(targets, one, serial=serial, max_fail=max_fail, forks=forks, on_row=on_row,
                      on_batch=on_batch, changed=lambda r: r.ok and r.value.status in ("applied", "reused"),
                      undo=back if rollback_on_fail else None)
    reports = []
    for row in run.rows:
        rep = row.value if isinstance(row.value, ApplyReport) else ApplyReport(
            host=row.host, lock_name=lock.name, status={"connect": "unreachable", "skipped": "not-attempted", "halted": "not-attempted"}.get(
                row.stage, "failed"), error=str(row.error) if row.error else None)
        rep.batch = row.batch
        if row.undo is not None:
            rep.status, rep.current, rep.rollback = "rolled-back", row.undo["to"], row.undo
            rep.warnings += row.undo.get("warnings") or []
        elif row.undo_error is not None:
            rep.warnings.append(f"rolling back failed: {row.undo_error.message}")
        reports.append(rep)
    return FleetReport(reports, run.batches, run.max_fail, run.failed_batch, run.failed_hosts, cancel.is_set())
