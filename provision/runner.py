"""ansible-runner wrapper: a fresh private data dir per run, host-key-checked SSH, events → progress.

Inventory and variables reach Ansible as files in which no value can be templated (data, never a template:
each string Ansible could render is tagged !unsafe, every other one quoted, so it stays that string); each host
gets a remote temp dir of its own per run under its provision root.
`run_playbook` returns a RunResult whose `error` is one line (task, host, item, message) on failure;
the run directory is kept as the run's artifacts for post-mortems. `play_rows` is a fleet verb as a playbook: one
fleet.Row per host, as the verbs over provision's own connection give them.
"""
from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from .bundled import PLAYBOOKS
from .errors import HostError, HostKeyError, ProvisionError, controller_failure
from .layout import Layout
from .transport import CONTROLLER_HOME, KEEPALIVE_COUNT, TIMEOUT, Target, host_key_options

RUNS = CONTROLLER_HOME / "runs"


@dataclass
class RunResult:
    status: str
    rc: int
    run_dir: str
    seconds: float
    error: str | None = None
    tasks: list[str] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)     # hosts Ansible could not reach, in the order it said
    results: dict[str, dict[str, dict]] = field(default_factory=dict)   # task → host → its result (ok, failed or
    #                                                                      unreachable), as the module returned it
    durations: dict[str, dict[str, float]] = field(default_factory=dict)   # task → host → its seconds, as Ansible
    #                                                                        timed it (task start to result)
    stopped: str | None = None     # why the controller stopped the play before its end (its disk full), in one line


class Unsafe(str):
    """A value Ansible must never render as a template (YAML tag !unsafe)."""


class _Dumper(yaml.SafeDumper):
    pass


def _represent_unsafe(dumper, value):
    """A string Ansible could render (it holds `{`, which every Jinja delimiter starts with) is tagged !unsafe; any
    other is a double-quoted YAML string, which no Ansible renders. Not every string is tagged: ansible-core 2.19
    resolves a tagged scalar's type as if it were unquoted, so `!unsafe "0013"` reads as the int 11 (YAML 1.1
    octal) and `!unsafe "1.10"` as the float 1.1."""
    if "{" in value:
        return dumper.represent_scalar("!unsafe", str(value))
    return dumper.represent_scalar("tag:yaml.org,2002:str", str(value), style='"')


_Dumper.add_representer(Unsafe, _represent_unsafe)


def unsafe(data):
    """`data` with every string value (not key) marked as data (`Unsafe`), at any depth."""
    if isinstance(data, dict):
        return {str(k): unsafe(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [unsafe(v) for v in data]
    return Unsafe(data) if isinstance(data, str) else data


def write_vars(path: Path, data: dict) -> Path:
    """A YAML vars file in which no value can be templated: what reaches Ansible stays data."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.dump(unsafe(data), Dumper=_Dumper, sort_keys=True))
    return path


def remote_tmp(t: Target, run_id: str) -> str:
    """This run's own temp dir on the host, under its provision root."""
    return Layout(t.root).scratch(f"ansible-{run_id}")


SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,254}\Z")   # a host name Ansible keeps as it is written


def ansible_names(targets: list[Target]) -> dict[str, str]:
    """Each target's name → its name in a run's inventory: the same, unless Ansible would read it otherwise (a
    `host:port` named on the command line is a host and a port to Ansible); then one it keeps, the target's own
    name beside it as provision_name (what the run's events and steps name the host by)."""
    out: dict[str, str] = {}
    for t in targets:
        name = t.name if SAFE_NAME.match(t.name) else re.sub(r"[^A-Za-z0-9._@-]", "_", t.name).lstrip("._@-") or "host"
        base, n = name, 1
        while name in out.values():
            n += 1
            name = f"{base}-{n}"
        out[t.name] = name
    return out


def inventory(targets: list[Target], run_id: str, interpreters: dict[str, str] | None = None,
              ssh_args: str = "") -> dict:
    """Ansible inventory for targets (every value data, never a template): each host's provision_root, and a
    remote temp dir of its own for this run under it. `interpreters`: host name → a python the
    host's facts found (checked by the caller). `ssh_args`: the run's own ssh options (its masters, keepalives),
    each host's ssh_args after its host-key options and before the inventory's own ssh_args; the operator's
    ssh_common_args and ssh_extra_args (the inventory's, else Ansible's settings) stay as they are."""
    hosts, names = {}, ansible_names(targets)
    for t in targets:
        py = (interpreters or {}).get(t.name) or t.python    # as the agents find it
        v = {"ansible_python_interpreter": py, "provision_root": t.root,
             "ansible_remote_tmp": remote_tmp(t, run_id),
             **({"provision_nvidia_smi": t.nvidia_smi} if t.nvidia_smi else {})}     # what a step reads of them
        if t.local:
            v["ansible_connection"] = "local"
        else:
            v.update(ansible_host=t.host, ansible_port=t.port)
            if t.user:
                v["ansible_user"] = t.user
            if t.key_file:
                v["ansible_ssh_private_key_file"] = t.key_file
            v.update(t.ssh_args)      # the inventory's own ssh options (a bastion, an ssh config) still apply
            # Host keys are verified against the known_hosts file provision manages: ssh takes an option's first
            # value, and ssh_args come first on Ansible's ssh command line.
            v["ansible_ssh_args"] = " ".join(filter(None, (
                shlex.join([*host_key_options(t.known_hosts), "-o", "BatchMode=yes"]), ssh_args,
                t.ssh_args.get("ansible_ssh_args", ""))))
            if t.become:
                v.update(ansible_become=True, ansible_become_method="sudo", ansible_become_user=t.become)
        if names[t.name] != t.name:
            v["provision_name"] = t.name
        hosts[names[t.name]] = v
    return {"all": {"hosts": hosts}}


def ansible_playbook() -> str:
    """ansible-playbook from the same environment as this tool, also when it is not activated (the PATH a play's
    `python3` is looked up on stays the operator's), else the PATH's."""
    beside = os.path.join(os.path.dirname(sys.executable), "ansible-playbook")
    return beside if os.access(beside, os.X_OK) else "ansible-playbook"


def run_ssh_args(sock_dir: str, env: dict) -> str:
    """The run's own ssh options: one master per host under `sock_dir` (ControlPersist, shared by the play's
    module tasks and its steps), and keepalives every ANSIBLE_TIMEOUT seconds (KEEPALIVE_COUNT unanswered drop the
    host, as the transport drops it)."""
    return (f"-o ControlMaster=auto -o ControlPersist=60s -o ControlPath={sock_dir}/%C "
            f"-o ServerAliveInterval={env['ANSIBLE_TIMEOUT']} -o ServerAliveCountMax={KEEPALIVE_COUNT}")


def _env(run_dir: Path, timeout: float = TIMEOUT) -> dict:
    """Ansible's settings for one run. `timeout` (seconds, the transport's: TCP connect, SSH banner and handshake)
    is Ansible's connect timeout and the SSH keepalive period (`run_ssh_args`)."""
    period = str(max(1, math.ceil(timeout)))
    return {
        "ANSIBLE_HOME": str(run_dir / "ansible"),
        "ANSIBLE_LOCAL_TEMP": str(run_dir / "tmp"),
        "ANSIBLE_PIPELINING": "True",
        "ANSIBLE_HOST_KEY_CHECKING": "True",
        "ANSIBLE_TIMEOUT": period,
        "ANSIBLE_RETRY_FILES_ENABLED": "False",
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_DEPRECATION_WARNINGS": "False",
        "ANSIBLE_LOCALHOST_WARNING": "False",
        "ANSIBLE_INVENTORY_UNPARSED_WARNING": "False",
        "ANSIBLE_PYTHON_INTERPRETER": "auto_silent",
    }


def _failure(ev: dict) -> str:
    """One line for a failed or unreachable task: `task: message`, or `HOST unreachable (task): message`."""
    d = ev.get("event_data", {})
    res = d.get("res", {}) or {}
    if isinstance(res.get("results"), list):   # a loop: the first failed item says what went wrong
        bad = [r for r in res["results"] if r.get("failed") or r.get("unreachable")]
        res = bad[0] if bad else res
    msg = res.get("stderr") or res.get("msg") or res.get("module_stderr") or ""
    item = res.get("item")
    label = (item.get("name", "") + ("==" + item["version"] if "version" in item else "")) if isinstance(item, dict) else ""
    msg = " ".join(str(msg).split())[:400]
    if ev.get("event") == "runner_on_unreachable":
        return f"{d.get('host', 'host')} unreachable ({d.get('task', 'task')}): {msg or 'no answer'}"
    return f"{d.get('task', 'task')}{' [' + label + ']' if label else ''}: {msg or ev.get('event')}"


# The tasks a play runs only for an operator's own ansible-playbook: the host-key options (the inventory written
# here already gives them, first) and the report lines (the CLI prints its own from the results).
SKIP_TAGS = "provision_host_keys,provision_report"


def run_playbook(name: str, targets: list[Target], extravars: dict, *, label: str = "",
                 interpreters: dict[str, str] | None = None, on_event: Callable[[str, str, str], None] | None = None,
                 check: bool = False, forks: int | None = None, on_raw: Callable[[dict], None] | None = None,
                 cancel: Callable[[], bool] | None = None,
                 on_result: Callable[[str, str, dict, float | None], None] | None = None) -> RunResult:
    """playbooks/NAME.yml through ansible-runner on the targets. `on_event` hears each task start and loop item;
    `on_raw` every runner event as it comes (in this thread); `on_result(task, host, result, seconds)` each host's
    result of a task as it comes, as `results` and `durations` keep it; `cancel` is polled while the play runs, and once it
    returns True the play is killed (Ctrl-C is then the caller's). Without `cancel`, a Ctrl-C (or SIGTERM) kills
    the play and is then raised here as the process would have had it (`_signals_stop`)."""
    import ansible_runner

    _close_promptly()
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    run_dir = RUNS / f"{run_id}-{name}-{label or 'run'}"
    try:        # the run's files: a full disk is one line naming the file, before anything starts
        RUNS.mkdir(parents=True, exist_ok=True)
        (run_dir / "tmp").mkdir(parents=True)
        env = _env(run_dir, max((t.timeout for t in targets), default=TIMEOUT))
        sock_dir = tempfile.mkdtemp(prefix="pv-", dir="/tmp")   # ControlPath must stay under 108 bytes
        hosts = write_vars(run_dir / "inventory" / "hosts.yml",
                           inventory(targets, run_id, interpreters, ssh_args=run_ssh_args(sock_dir, env)))
        stop_file = run_dir / "stop"        # a Ctrl-C here: each step's host command stops (action.ControllerGone)
        extra = write_vars(run_dir / "vars.yml", dict(extravars, provision_controller=controller_id(),
                                                      provision_stop=str(stop_file)))
    except OSError as e:
        raise controller_failure(e, run_dir) from None
    failures: list[str] = []
    tasks: list[str] = []
    unreachable: list[str] = []
    results: dict[str, dict[str, dict]] = {}
    durations: dict[str, dict[str, float]] = {}

    ours = {a: name for name, a in ansible_names(targets).items() if a != name}

    def handler(ev: dict) -> bool:
        kind = ev.get("event", "")
        d = ev.get("event_data", {})
        if d.get("host") in ours:            # the host as the run's targets name it
            d["host"] = ours[d["host"]]
        if kind in ("runner_on_ok", "runner_on_failed", "runner_on_unreachable") and d.get("host"):
            results.setdefault(d.get("task", ""), {})[d["host"]] = dict(
                d.get("res") or {}, unreachable=kind == "runner_on_unreachable",
                **({"failed": True} if kind == "runner_on_failed" else {}))   # the event says so; `res` may not
            if isinstance(d.get("duration"), (int, float)):
                durations.setdefault(d.get("task", ""), {})[d["host"]] = float(d["duration"])
            if on_result:
                on_result(d.get("task", ""), d["host"], results[d.get("task", "")][d["host"]],
                          durations.get(d.get("task", ""), {}).get(d["host"]))
        if kind == "playbook_on_task_start":
            tasks.append(d.get("task", ""))
            if on_event:
                on_event("task", d.get("task", ""), "")
        elif kind in ("runner_on_failed", "runner_on_unreachable") and not d.get("ignore_errors"):
            failures.append(_failure(ev))
            if kind == "runner_on_unreachable":
                unreachable.append(d.get("host", ""))
        elif kind == "runner_item_on_ok" and on_event:
            item = (d.get("res") or {}).get("item")
            if isinstance(item, dict) and "name" in item:
                on_event("item", d.get("task", ""), item["name"])
        if on_raw:
            on_raw(ev)
        return True

    t0 = time.perf_counter()
    stopped = None
    with _signals_stop(cancel, stop_file) as stop:
        try:
            r = ansible_runner.run(private_data_dir=str(run_dir), playbook=str(PLAYBOOKS / f"{name}.yml"),
                                   binary=ansible_playbook(),
                                   inventory=str(hosts), envvars=env,
                                   suppress_env_files=True, quiet=True, event_handler=handler,
                                   **({"forks": forks} if forks else {}), cancel_callback=stop,
                                   cmdline=shlex.join(["-e", f"@{extra}", "--skip-tags", SKIP_TAGS]
                                                      + (["--check", "--diff"] if check else [])
                                                      + [str(PLAYBOOKS / f"{name}.yml")]),   # `binary` takes it here
                                   settings={"suppress_ansible_output": True})
            status, rc = r.status, r.rc
        except OSError as e:    # ansible-runner could not write the play's output (a full disk): the play goes
            _kill_play(str(extra))
            stopped = f"{controller_failure(e, run_dir / 'artifacts')}: the play was stopped"
            status, rc = "failed", None
        stop_masters(Path(sock_dir))
    seconds = time.perf_counter() - t0
    error = None
    if stopped or rc != 0 or status != "successful":
        error = stopped or (failures[0] if failures else f"ansible run {status} (rc {rc}); see {run_dir}")
    return RunResult(status=status, rc=rc, run_dir=str(run_dir), seconds=seconds, error=error, tasks=tasks,
                     unreachable=unreachable, results=results, durations=durations, stopped=stopped)


def _close_promptly() -> None:
    """ansible-runner closes the play's pty once it has read its end; ptyprocess then sleeps a fixed 0.1 s before it
    looks whether the play has exited. Here close() waits for the exit itself (a few ms), then closes as before: a play
    still running after 5 s is terminated as ptyprocess would. One subclass of pexpect.spawn, installed once."""
    import pexpect

    if getattr(pexpect.spawn, "closes_promptly", False):
        return

    class Spawn(pexpect.spawn):
        closes_promptly = True

        def close(self, force=True):
            if not self.closed:
                until = time.monotonic() + 5.0
                while self.ptyproc.isalive() and time.monotonic() < until:
                    time.sleep(0.002)
                self.ptyproc.delayafterclose = 0.0
            super().close(force=force)

    pexpect.spawn = Spawn


def _kill_play(marker: str) -> None:
    """End the play this process started whose command line names `marker` (its vars file), with its workers (the
    process group pexpect gave it), and wait until it is gone: nothing of it goes on once its run has failed."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent != os.getpid() or f"@{marker}".encode() not in argv:
            continue
        try:
            if os.getpgid(int(pid)) == int(pid):
                os.killpg(int(pid), signal.SIGKILL)
            else:
                os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            continue
        try:
            os.waitpid(int(pid), 0)
        except ChildProcessError:
            pass


def controller_id(pid: int | None = None) -> str:
    """This process as a play's steps watch it (`action.controller_alive`): "PID:START", START its start time in
    clock ticks since boot where /proc tells it (a reused pid is then another process), else "PID"."""
    pid = os.getpid() if pid is None else pid
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f"{pid}:{f.read().rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        return str(pid)


STOP_GRACE = 15.0      # seconds a play has, after a Ctrl-C, to stop its steps' host commands before it is killed


@contextmanager
def _signals_stop(cancel: Callable[[], bool] | None, stop_file: Path):
    """The play's cancel_callback. Given `cancel`, it alone (the signals stay the caller's). Otherwise, in the main
    thread, SIGINT and SIGTERM stop the play while it runs: the first creates `stop_file`, on which each step stops
    its host command (the host lock, and what the step started there, go with it) and the play ends; a second
    signal, or STOP_GRACE seconds, kill the play (ansible-runner's own handlers would stay installed after it, and
    swallow the signal). Afterwards the handlers before it are back and the signal that came is delivered to them:
    a Ctrl-C is KeyboardInterrupt, as anywhere else in the process."""
    if cancel is not None or threading.current_thread() is not threading.main_thread():
        yield cancel or (lambda: False)
        return
    came: list[tuple[int, float]] = []

    def heard(signum, frame) -> None:
        came.append((signum, time.monotonic()))
        stop_file.touch()
    kept = {s: signal.signal(s, heard) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield lambda: len(came) > 1 or bool(came) and time.monotonic() - came[0][1] > STOP_GRACE
    finally:
        for s, h in kept.items():
            signal.signal(s, h)
    for s in dict.fromkeys(signum for signum, _ in came):
        if s == signal.SIGINT and kept[s] in (signal.default_int_handler, signal.SIG_DFL):
            raise KeyboardInterrupt
        signal.raise_signal(s)


def stop_masters(sock_dir: Path) -> None:
    """Stop the ControlPersist masters this run started (one socket per host), then drop the dir."""
    for sock in sock_dir.glob("*"):
        subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "dummy"],
                       capture_output=True, timeout=10, stdin=subprocess.DEVNULL)
    shutil.rmtree(sock_dir, ignore_errors=True)


ANSIBLE_KEYS = {"changed", "failed", "msg", "invocation", "skipped", "unreachable", "warnings", "deprecations",
                "agent_warnings"}      # what a task's result holds besides the module's own reply


def reply_of(result: dict) -> dict:
    """A provision module's result as its agent replied: Ansible's keys left out, the agent's warnings (the module's
    own, `agent_warnings`) under `warnings` again."""
    out = {k: v for k, v in result.items() if k not in ANSIBLE_KEYS and not k.startswith("_ansible")}
    if "agent_warnings" in result:
        out["warnings"] = result["agent_warnings"]
    return out


def said(result: dict) -> str:
    """What a failed or unreachable task's result says, as one line (without Ansible's "Task failed: ")."""
    return " ".join(str(result.get("msg") or result.get("module_stderr") or "failed").split()).removeprefix(
        "Task failed: ")


def answer(t: Target, result: dict, seconds: float | None = None) -> dict:
    """A reached host's result: the module's reply (`reply_of`), or a failed task's message as a HostError."""
    if result.get("failed"):
        raise HostError(said(result), where=t.name)
    return reply_of(result)


def play_rows(name: str, targets: list[Target], extravars: dict, *, task: str | None = None, check: bool = False,
              forks: int | None = None, read: Callable[[Target, dict, float | None], object] = answer,
              on_row: Callable | None = None) -> list:
    """A fleet verb as a playbook: playbooks/NAME.yml through Ansible on every target (`check`: its --check), one
    fleet.Row per target, in the targets' order. Each host goes on its own, as Ansible runs a play: a host it could
    not reach is that host's row (stage "connect", see `unreachable`), never a reason to stop the others. A reached
    host's row is `read(target, result, seconds)` of its result of task `task` (default: NAME) and Ansible's time for
    it; a ProvisionError `read` raises is that host's error (stage "run"). The default `read`: a failed task is a
    `answer`. `on_row(row)` hears each host's row as its result comes (the hosts with none, once the play is done)."""
    from .fleet import Row

    by_name, rows = {t.name: t for t in targets}, {}

    def row_of(t, r, seconds) -> Row:
        if r.get("unreachable"):
            return Row(t.name, error=unreachable(t, said(r)), stage="connect")
        if r.get("failed") and become_refused(t, said(r)):       # reached, but not as the user it must run as
            return Row(t.name, error=become_refused(t, said(r)), stage="connect")
        try:
            return Row(t.name, value=read(t, r, seconds))
        except ProvisionError as e:
            return Row(t.name, error=e, stage="run")

    def came(task_name: str, host: str, r: dict, seconds: float | None) -> None:
        if task_name == (task or name) and host in by_name:
            rows[host] = row_of(by_name[host], r, seconds)
            if on_row:
                on_row(rows[host])

    res = run_playbook(name, targets, extravars, label=name, check=check, forks=forks, on_result=came)
    out = []
    for t in targets:
        if t.name not in rows:
            rows[t.name] = Row(t.name, error=HostError(res.error or f"no result (see {res.run_dir})", where=t.name),
                               stage="run")
            if on_row:
                on_row(rows[t.name])
        out.append(rows[t.name])
    return out


def unreachable(t: Target, msg: str) -> HostError:
    """Ansible's word on a host it could not reach, as one line; a key the known_hosts lacks (or that changed) is a
    HostKeyError that says how to trust it, as provision's own connection says."""
    from .transport import ssh_error, trust_command

    msg = " ".join(msg.split()).removeprefix(f"{t.name}: ")      # the row names its host
    if "Host key verification failed" in msg:
        return HostKeyError(f"{msg} (known_hosts {t.known_hosts}); verify the host's key, then "
                            f"`{trust_command(t)}`", where=t.name)
    known = ssh_error(t, msg, 255)      # ssh's own words where Ansible passed them on: as provision says them
    return known if not known.message.startswith("ssh: ") else HostError(msg, where=t.name)


BECOME_REFUSED = ("Missing sudo password", "Incorrect sudo password", "is not in the sudoers file")


def become_refused(t: Target, msg: str) -> HostError | None:
    """Ansible's word that sudo would not run a task as the become user, as provision's own connection says it
    (None for any other failure)."""
    if not t.become or not any(w in msg for w in BECOME_REFUSED):
        return None
    why = "a password is required" if "password" in msg else "the login user may not use sudo"
    return HostError(f"sudo refused to run as {t.become} ({why}): become needs passwordless sudo (NOPASSWD) for "
                     "the login user", where=t.name)
