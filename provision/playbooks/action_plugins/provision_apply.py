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

try:
    import provision  # noqa: F401 - the package these playbooks ship in
except ImportError:      # an ansible-playbook from another environment: the package beside this directory
    sys.path.append(str(Path(__file__).resolve().parents[3]))

# Imported as the play loads this plugin (ansible-playbook's own process), so that each host's worker, forked from
# it, starts with them.
from provision import apply as applymod, lock as lockmod  # noqa: E402
from provision.apply import CANCELLED, STAGED  # noqa: E402
from provision.errors import Halted, InputError, ProvisionError  # noqa: E402
from provision.facts import interpreter_arg  # noqa: E402
from provision.inventory import _target  # noqa: E402
from provision.plan import load_plans, lock_of_plan as plan_lock, plan_host  # noqa: E402
from provision.transport import DEFAULT_KNOWN_HOSTS, check_root, connect  # noqa: E402

display = Display()
CAUGHT_UP = 10.0     # seconds the gate waits for the controller to have read this host's progress


def _spec() -> dict:
    """The module's declared arguments (library/provision_apply.py), the one statement of them."""
    path = Path(__file__).resolve().parents[1] / "library" / "provision_apply.py"
    spec = importlib.util.spec_from_file_location("provision_apply_module", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ARGUMENT_SPEC


class _HostVars:
    """The task's variables as the inventory names the host, each rendered by Ansible when read (what `_target`
    reads of them), with what the command line set (`-c local`, `-u`, `--private-key`, `--become`) where they
    say nothing."""

    def __init__(self, templar, task_vars: dict, play_context):
        self.templar, self.vars, self.given = templar, task_vars, {}
        pc = play_context
        for key, value in (("ansible_connection", "local" if pc.connection == "local" else None),
                           ("ansible_user", pc.remote_user), ("ansible_ssh_private_key_file", pc.private_key_file),
                           ("ansible_become", True if pc.become else None),
                           ("ansible_become_user", pc.become_user if pc.become else None)):
            if value is not None:
                self.given[key] = value

    def get(self, key: str, default=None):
        if key in self.vars:
            return self.templar.template(self.vars[key])
        return self.given.get(key, default)



class ActionModule(ActionBase):
    _supports_check_mode = True
    _supports_async = False
    TRANSFERS_FILES = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        task_vars = task_vars or {}
        result["batch"] = list(task_vars.get("ansible_play_batch") or [])     # the play's tolerance counts on it
        _, args = self.validate_argument_spec(argument_spec=_spec(), required_one_of=[["lock", "plan_file"]])
        host = task_vars.get("inventory_hostname", "host")
        ctl = _Controller(args["progress_file"], args["cancel_file"])
        if ctl.cancelled():
            return dict(result, failed=True, status="not-attempted", msg="interrupted (Ctrl-C) before this host started")
        try:
            saved = _saved_plan(args["plan_file"], host) if args["plan_file"] else None
            lock = plan_lock(saved) if saved is not None else lockmod.load(args["lock"])
            python = interpreter_arg(args["python"])
            where = str(task_vars.get("inventory_file") or "inventory")
            t = _target(host, _HostVars(self._templar, task_vars, self._play_context),
                        Path(args["known_hosts"] or DEFAULT_KNOWN_HOSTS), where)
            if args["root"]:
                t.vars["provision_root"] = args["root"]
            if "provision_root" in t.vars:
                check_root(t.vars["provision_root"], f"{where}: host {host}: " + ("root" if args["root"] else
                                                                                 "provision_root"))
            if self._play_context.timeout:
                t.timeout = float(self._play_context.timeout)
            if args["step_deadline"]:
                t.deadline = float(args["step_deadline"])
            if args["wait_notice"]:
                t.notice = float(args["wait_notice"])
        except InputError as e:
            return dict(result, failed=True, msg=str(e).replace("--python: ", "python: "))

        def staged() -> None:           # the gate, under the host lock just before `current` would move
            if not ctl.caught_up(CAUGHT_UP):
                raise Halted("the controller stopped reading this run's progress: stopped before its switch",
                             where=host)
            raise Halted(CANCELLED if ctl.cancelled() else STAGED, where=host)
        try:
            tr = connect(t)
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
                                 progress=ctl.progress(host), cancel=cancel)
            failed = None
        except ProvisionError as e:     # stopped at the gate (the one way it ends well), or failed
            rep, failed = getattr(e, "report", None), str(e)
            if rep is None:
                return dict(result, failed=True, msg=failed)
            if rep.status == "stopped" and STAGED in failed:
                failed = None
        finally:
            ctl.stop()
            tr.close()
        for w in rep.warnings:
            display.warning(f"{host}: {w}")
        if failed:
            return dict(result, **_result_of(rep), failed=True, msg=failed)
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
    """What the CLI that runs the play hears and says: each step event is one JSON line appended to its progress file
    (this host's, and its offset kept); the CLI writes how far it has read to PROGRESS.read and creates its cancel
    file on Ctrl-C. Without the files (ansible-playbook run directly), each step is an Ansible display line."""

    def __init__(self, progress_file: str | None, cancel_file: str | None):
        self.file, self.cancel_file, self.said_up_to = progress_file, cancel_file, 0
        self.flag, self.done = threading.Event(), threading.Event()

    def cancelled(self) -> bool:
        return bool(self.cancel_file) and os.path.exists(self.cancel_file)

    def progress(self, host: str):
        """The apply's progress callback for this host."""
        def said(step: str, state: str, detail: str) -> None:
            if not self.file:
                if state == "wait":
                    display.v(detail, host=host)
                elif state in ("done", "fail"):
                    display.vv(f"{step} {state}{': ' + detail if detail else ''}", host=host)
                return
            line = json.dumps({"host": host, "step": step, "state": state, "detail": detail}) + "\n"
            fd = os.open(self.file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:       # one write of one line: lines of hosts writing at once never interleave
                os.write(fd, line.encode())
                self.said_up_to = os.lseek(fd, 0, os.SEEK_CUR)
            finally:
                os.close(fd)
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
        """The apply's cancel flag, set once the cancel file appears (polled in a thread until `stop`)."""
        if not self.cancel_file:
            return None

        def poll() -> None:
            while not self.done.wait(0.2):
                if self.cancelled():
                    self.flag.set()
                    return
        threading.Thread(target=poll, name="cancel file", daemon=True).start()
        return self.flag

    def stop(self) -> None:
        self.done.set()
