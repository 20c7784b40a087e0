"""What provision's action plugins share: the task's host as a Target reached over provision's transport, a step
run there with its value as the task's result (`HostStep`), and its progress as JSON lines appended to a file.
The CLI's side of such a play (its rows, the value read back, the progress tailed) is plays.py."""
from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
from pathlib import Path

from ansible.plugins.action import ActionBase

from .agent import bundle
from .bundled import PLAYBOOKS
from .errors import HostKeyError, InputError, ProvisionError
from .plays import DONE, carried
from .replies import to_json

bundle()    # the agents' bundle, built once here in ansible-playbook's process (which loads the action plugins),
#             not once per host: each host's worker is forked from it

HEARTBEAT = 2.0             # seconds between "still running" lines of a step that says nothing itself


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def spec_of(module: str) -> dict:
    """A module's declared arguments: those every step shares (module_utils/provision/spec.py's STEP) and its own
    (playbooks/library/MODULE.py's ARGUMENT_SPEC), as the module itself declares them to Ansible."""
    shared = _load("provision_module_spec", PLAYBOOKS / "module_utils" / "provision" / "spec.py").STEP
    return dict(shared, **_load(f"{module}_module", PLAYBOOKS / "library" / f"{module}.py").ARGUMENT_SPEC)


class TaskVars:
    """The task's variables as the inventory names the host, each rendered by Ansible when read (what
    `inventory._target` reads of them), with what the command line set (`-c local`, `-u`, `--private-key`,
    `--become`) where they say nothing."""

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


def host_name(task_vars: dict) -> str:
    """The task's host as provision names it: the name the CLI gave it (provision_name, where Ansible's differs),
    else its inventory name."""
    return str(task_vars.get("provision_name") or task_vars.get("inventory_hostname", "host"))


def target_of(action: ActionBase, task_vars: dict, known_hosts: str | None, root: str | None):
    """The task's host as provision reaches it: the inventory's name, address, user, key, ssh options and become;
    `root` (the task's) over the inventory's provision_root; Ansible's connect timeout. InputError on a value
    provision refuses (a template, a connection it does not run over, a root that is no absolute path)."""
    from .inventory import _target
    from .transport import DEFAULT_KNOWN_HOSTS, check_root

    host = host_name(task_vars)
    where = str(task_vars.get("inventory_file") or "inventory")
    t = _target(host, TaskVars(action._templar, task_vars, action._play_context),
                Path(known_hosts or DEFAULT_KNOWN_HOSTS), where)
    if root:
        check_root(root, f"{where}: host {host}: root")
        t.root = root
    if action._play_context.timeout:
        t.timeout = float(action._play_context.timeout)
    return t


def connect_task(action: ActionBase, target):
    """The target's transport over the task's own connection: Ansible's ssh connection plugin as Ansible set it
    up for this host (its options, its master), or the controller itself for `connection: local`."""
    from .transport import connect

    conn = action._connection
    return connect(target, conn if getattr(conn, "transport", None) == "ssh" else None)


def controller_alive(spec) -> bool:
    """Whether the process `runner.controller_id` named is still running (the CLI that runs this play)."""
    from .runner import controller_id

    pid = str(spec).split(":", 1)[0]
    if not pid.isdigit():
        return True             # not a controller's id: nothing to watch
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    return ":" not in str(spec) or controller_id(int(pid)) == str(spec)


class ControllerGone:
    """Set `flag` once the CLI that runs this play (task var provision_controller) is gone or asks the play to stop
    (its Ctrl-C: the file task var provision_stop names exists), polled every `every` seconds in a thread until
    `stop`: the step then stops its host command. Nothing to watch for a play an operator runs with
    ansible-playbook."""

    def __init__(self, task_vars: dict, flag: threading.Event, every: float = 0.25):
        self.spec, self.flag, self.done = task_vars.get("provision_controller"), flag, threading.Event()
        self.stop_file = task_vars.get("provision_stop")
        if self.watched:
            threading.Thread(target=self._poll, args=(every,), name="controller watch", daemon=True).start()

    @property
    def watched(self) -> bool:
        return self.spec is not None or self.stop_file is not None

    def _poll(self, every: float) -> None:
        while not self.done.wait(every):
            if (self.spec is not None and not controller_alive(self.spec)) or \
                    (self.stop_file is not None and os.path.exists(str(self.stop_file))):
                self.flag.set()
                return

    def stop(self) -> None:
        self.done.set()


def append_event(path: str, host: str, step: str, state: str, detail: str, seconds: float) -> int:
    """One progress line appended to `path`, the one shape every step's progress has:
    {"host", "step", "state" (start|done|fail|info|wait), "detail", "seconds" (since the host's step began)}.
    Returns the file's length after it (how far a reader must have read to have read it)."""
    line = json.dumps({"host": host, "step": step, "state": state, "detail": detail,
                       "seconds": round(seconds, 1)}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())      # one write of a short line: whole, whoever else appends
        return os.lseek(fd, 0, os.SEEK_CUR)
    finally:
        os.close(fd)


class Progress:
    """A step's progress as `append_event` lines appended to `path` (none: dropped), its state "info"; while the
    step says nothing, a line every HEARTBEAT seconds says it runs, and what the host last said it does
    (`doing()`, e.g. the probe that runs) where it said so."""

    def __init__(self, path: str | None, host: str, step: str, doing=None):
        self.path, self.host, self.step, self.t0 = path, host, step, time.monotonic()
        self.last, self.stop, self.doing = self.t0, threading.Event(), doing

    def __call__(self, detail: str) -> None:
        self.last = time.monotonic()
        if not self.path:
            return
        append_event(self.path, self.host, self.step, "info", detail, self.last - self.t0)

    def __enter__(self):
        def beat():
            while not self.stop.wait(0.5):
                if time.monotonic() - self.last >= HEARTBEAT:
                    what = self.doing() if self.doing else None      # what the host last said it does
                    self(f"{what or 'running'} ({time.monotonic() - self.t0:.0f}s)")
        if self.path:
            threading.Thread(target=beat, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()


class HostStep(ActionBase):
    """An action plugin whose work is `step(transport, args, progress)` on the task's host, reached as the inventory
    names it: MODULE (playbooks/library/MODULE.py) declares its arguments, among them `known_hosts`, `root` and
    `progress` (a controller file for `Progress`). The step's value (a dict, or a reply dataclass: its JSON,
    `replies.to_json`) is the task's result (`value_of` reads it back); `changed` and `verdict` see it as the step
    returned it. A ProvisionError it raises fails the task with its one line, its type and where; a host provision's
    connection cannot reach is unreachable, as Ansible counts it. `verdict(value)`: a line that fails the task with
    the value kept (a failed probe), or None. STOPPABLE false: the controller gone or stopping never cuts the step's
    host command (a switch is one commit)."""

    MODULE = ""
    STEP = ""
    STOPPABLE = True
    _supports_check_mode = False
    _supports_async = False
    TRANSFERS_FILES = False

    def step(self, transport, args: dict, progress: Progress) -> dict:
        raise NotImplementedError

    def verdict(self, value: dict) -> str | None:
        return None

    def changed(self, value: dict) -> bool:
        return False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        task_vars = task_vars or {}
        _, args = self.validate_argument_spec(argument_spec=spec_of(self.MODULE))
        host = host_name(task_vars)
        try:
            t = target_of(self, task_vars, args.get("known_hosts"), args.get("root"))
        except InputError as e:
            return dict(result, failed=True, msg=str(e))
        try:
            tr = connect_task(self, t)
        except HostKeyError as e:       # in ssh's words, which the CLI turns into how to trust the key it names
            return dict(result, unreachable=True, msg=f"Host key verification failed ({e.message.split(';')[0]})")
        except ProvisionError as e:     # not reached (as provision's fleets count it): Ansible's unreachable
            return dict(result, unreachable=True, msg=e.message)
        from .transport import Watch

        gone = ControllerGone(task_vars, threading.Event())   # the controller killed or stopping: the step's host
        tr.watch = Watch(self.STEP or self.MODULE, None,      # command stops
                         gone.flag if gone.watched and self.STOPPABLE else None)
        said = tr.watch
        try:
            with Progress(args.get("progress"), host, self.STEP or self.MODULE,
                          doing=lambda: said.doing) as progress:
                value = self.step(tr, args, progress)
        except ProvisionError as e:
            return dict(result, failed=True, msg=e.message, error_type=type(e).__name__, error_where=e.where)
        finally:
            gone.stop()
            tr.close()
        out = dict(result, **carried(to_json(value)), changed=self.changed(value))
        out[DONE] = True
        why = self.verdict(value)
        if why:
            out.update(failed=True, msg=why)
        return out
