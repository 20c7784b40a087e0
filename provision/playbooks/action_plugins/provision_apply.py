"""Controller side of provision_apply: `provision.apply.apply` of this host, reached as the inventory names it, halted
by its gate just before the switch (the new generation kept, probed and runnable); the play's next task switches.
Run by the CLI, each step event goes to its progress file and its cancel file stops the host before its switch."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path

from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

if importlib.util.find_spec("provision") is None:   # an ansible-playbook from another environment: the package
    sys.path.append(str(Path(__file__).resolve().parents[3]))   # these playbooks ship in, beside this directory

# Imported as the play loads this plugin (ansible-playbook's own process), so that each host's worker, forked from
# it, starts with them.
from provision import apply as applymod, lock as lockmod  # noqa: E402
from provision.action import (ControllerGone, append_event, connect_task, host_name, spec_of,  # noqa: E402
                              target_of)
from provision.apply import CANCELLED  # noqa: E402
from provision.errors import Halted, InputError, ProvisionError, Staged  # noqa: E402
from provision.facts import interpreter_arg  # noqa: E402
from provision.plan import load_plans, lock_of_plan as plan_lock, plan_host  # noqa: E402

display = Display()
CAUGHT_UP = 10.0     # seconds the gate waits for the controller to have read this host's progress


class ActionModule(ActionBase):
    _supports_check_mode = True
    _supports_async = False
    TRANSFERS_FILES = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        task_vars = task_vars or {}
        result["batch"] = list(task_vars.get("ansible_play_batch") or [])     # the play's tolerance counts on it
        _, args = self.validate_argument_spec(argument_spec=spec_of("provision_apply"), required_one_of=[["lock", "plan_file"]])
        host = host_name(task_vars)
        ctl = _Controller(args["progress_file"], args["cancel_file"], task_vars)
        if ctl.cancelled():
            return dict(result, failed=True, status="not-attempted", msg="interrupted (Ctrl-C) before this host started")
        try:
            saved = _saved_plan(args["plan_file"], host) if args["plan_file"] else None
            lock = plan_lock(saved) if saved is not None else lockmod.load(args["lock"])
            python = interpreter_arg(args["python"])
            t = target_of(self, task_vars, args["known_hosts"], args["root"])
            if args["step_deadline"]:
                t.deadline = float(args["step_deadline"])
            if args["wait_notice"]:
                t.notice = float(args["wait_notice"])
        except InputError as e:
            return dict(result, failed=True, msg=str(e).replace("--python: ", "python: "))

        def staged() -> None:           # the gate, under the host lock just before `current` would move
            if ctl.lost is not None:
                raise Halted(f"{ctl.lost}: the controller does not hear this host: stopped before its switch",
                             where=host)
            if not ctl.caught_up(CAUGHT_UP):
                raise Halted("the controller stopped reading this run's progress: stopped before its switch",
                             where=host)
            if ctl.cancelled():
                raise Halted(CANCELLED, where=host)
            raise Staged(where=host)
        try:
            tr = connect_task(self, t)
        except ProvisionError as e:     # not reached (as provision's fleets count it): Ansible's unreachable
            return dict(result, unreachable=True, msg=str(e))
        cancel = ctl.watch()
        try:
            if self._task.check_mode:    # the plan; its fatal findings fail the task, as apply would refuse
                plan = plan_host(tr, lock, interpreter=python)
                out = dict(result, changed=not plan.noop, status="noop" if plan.noop else "planned",
                           generation=plan.base if plan.noop else plan.reuse, previous=plan.base,
                           plan=_plan_of(plan.to_json()), report=plan.to_json())
                if plan.errors and not plan.noop:
                    more = f" (+{len(plan.errors) - 1} more)" if len(plan.errors) > 1 else ""
                    out.update(failed=True, msg=f"{host}: {plan.errors[0]}{more}")
                return out
            rep = applymod.apply(tr, lock, saved_plan=saved, adopt_path=args["adopt"],
                                 skip_probes=args["skip_probes"], installer=args["installer"],
                                 wheels_from=args["wheels_from"], interpreter=python, gate=staged,
                                 progress=ctl.progress(host), on_plan=ctl.plan(host), cancel=cancel)
            failed = None
        except ProvisionError as e:     # stopped at the gate (the one way it ends well), or failed
            rep, failed, kind = getattr(e, "report", None), str(e), {"error_type": type(e).__name__}
            if rep is None:
                return dict(result, failed=True, msg=failed, **kind)
            if rep.status == "stopped" and rep.staged:
                failed = None
        finally:
            ctl.stop()
            tr.close()
        for w in rep.warnings:
            display.warning(f"{host}: {w}")
        if failed:
            return dict(result, **_result_of(rep), failed=True, msg=failed, **kind)
        return dict(result, **_result_of(rep),
                    changed=rep.status == "stopped" and (rep.plan or {}).get("action") == "build")


def _plan_of(plan: dict | None) -> dict | None:
    """What the task says of the plan: its action and summary line, the base, the generation reused, findings."""
    if plan is None:
        return None
    return {k: plan.get(k) for k in ("action", "summary", "base", "reuse", "warnings", "errors")}


def _result_of(rep) -> dict:
    """The task's result from an ApplyReport."""
    probes = rep.probes or {}
    return {"status": rep.status, "generation": rep.generation, "previous": rep.previous,
            "plan": _plan_of(rep.plan), "failed_step": rep.failed_step, "run_dir": rep.run_dir,
            "probes": {k: probes.get(k) for k in ("status", "summary", "failed")} if probes else None,
            "steps": [{"name": s.name, "status": s.status, "seconds": round(s.seconds, 3), "detail": s.detail}
                      for s in rep.steps],
            "seconds": round(rep.seconds, 3), "warned": list(rep.warnings), "report": rep.to_json()}


def _saved_plan(path: str, host: str):
    """This host's entry of a saved plan file (`provision plan --out`), as `provision apply --plan` reads it."""
    plans = {p.host: p for p in load_plans(path)}
    if host not in plans:
        raise InputError(f"the saved plan has no entry for {host} (planned: {', '.join(plans)}); plan that host first",
                         where=path)
    return plans[host]


class _Controller:
    """What the CLI that runs the play hears and says: each step event is one `append_event` line appended to its
    progress file (this host's, and its offset kept); the CLI writes how far it has read to PROGRESS.read and creates
    its cancel file on Ctrl-C; the CLI gone (killed) is a cancel too. Without the files (ansible-playbook run
    directly), each step is an Ansible display line."""

    def __init__(self, progress_file: str | None, cancel_file: str | None, task_vars: dict):
        self.file, self.cancel_file, self.said_up_to = progress_file, cancel_file, 0
        self.lost = None        # the progress file could not be written (the controller's disk full): why
        self.flag, self.done = threading.Event(), threading.Event()
        self.gone = ControllerGone(task_vars, self.flag)

    def cancelled(self) -> bool:
        return bool(self.cancel_file) and os.path.exists(self.cancel_file)

    def progress(self, host: str):
        """The apply's progress callback for this host."""
        t0 = time.monotonic()

        def said(step: str, state: str, detail: str) -> None:
            if not self.file:
                if state == "wait":
                    display.v(detail, host=host)
                elif state in ("done", "fail"):
                    display.vv(f"{step} {state}{': ' + detail if detail else ''}", host=host)
                return
            self._append(host, step, state, detail, time.monotonic() - t0)
        return said

    def _append(self, *line) -> None:
        """One progress line; one that cannot be written (the controller's disk full) is the run's `lost`, and the
        host stops at its gate: the controller would not hear a Ctrl-C said after it."""
        if self.lost is not None:
            return
        try:
            self.said_up_to = append_event(self.file, *line)
        except OSError as e:
            from provision.errors import controller_failure

            self.lost = controller_failure(e, self.file)

    def plan(self, host: str):
        """The apply's on_plan for this host: the plan, before anything changes, as one progress line (state "plan",
        its JSON the detail) for the CLI to render; nothing without a progress file."""
        def said(plan) -> None:
            if self.file:
                self._append(host, "plan", "plan", json.dumps(plan.to_json()), 0.0)
        return said

    def caught_up(self, within: float) -> bool:
        """Whether the controller has read this host's progress up to its last line (waiting up to `within` s): a
        Ctrl-C said while it read them is known before the host passes its gate. True without a progress file."""
        if not self.file:
            return True
        end = time.monotonic() + within
        while time.monotonic() < end:
            try:
                if int(Path(self.file + ".read").read_text() or 0) >= self.said_up_to:
                    return True
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        return False

    def watch(self) -> threading.Event | None:
        """The apply's cancel flag, set once the cancel file appears (polled in a thread until `stop`) or the CLI is
        gone."""
        if not self.cancel_file:
            return self.flag if self.gone.watched else None

        def poll() -> None:
            while not self.done.wait(0.2):
                if self.cancelled():
                    self.flag.set()
                    return
        threading.Thread(target=poll, name="cancel file", daemon=True).start()
        return self.flag

    def stop(self) -> None:
        self.done.set()
        self.gone.stop()
