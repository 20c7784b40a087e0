"""ansible-runner wrapper: a fresh private data dir per run, host-key-checked SSH, events → progress.

Inventory and variables reach Ansible as files whose every value is tagged !unsafe (data, never a
template); each host gets a remote temp dir of its own per run under its provision root.
`run_playbook` returns a RunResult whose `error` is one line (task, host, item, message) on failure;
the run directory is kept as the run's artifacts for post-mortems.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from .bundled import PLAYBOOKS
from .layout import Layout, root_of
from .transport import CONTROLLER_HOME, Target

RUNS = CONTROLLER_HOME / "runs"


@dataclass
class RunResult:
    status: str
    rc: int
    run_dir: str
    seconds: float
    error: str | None = None
    tasks: list[str] = field(default_factory=list)


class Unsafe(str):
    """A value Ansible must never render as a template (YAML tag !unsafe)."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(Unsafe, lambda d, v: d.represent_scalar("!unsafe", str(v)))


def unsafe(data):
    """`data` with every string value (not key) marked !unsafe, at any depth."""
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
    return Layout(root_of(t)).scratch(f"ansible-{run_id}")


def inventory(targets: list[Target], run_id: str, interpreters: dict[str, str] | None = None) -> dict:
    """Ansible inventory for targets (every value data, never a template); each host gets its own
    remote temp dir for this run under its provision root. `interpreters`: host name → a python the
    host's facts found (checked by the caller)."""
    hosts = {}
    for t in targets:
        py = (interpreters or {}).get(t.name) or t.vars.get("python") or "/usr/bin/python3"
        v = {"ansible_python_interpreter": py,
             "ansible_remote_tmp": remote_tmp(t, run_id)}
        if t.local:
            v["ansible_connection"] = "local"
        else:
            v.update(ansible_host=t.host, ansible_port=t.port)
            if t.user:
                v["ansible_user"] = t.user
            if t.key_file:
                v["ansible_ssh_private_key_file"] = t.key_file
            v.update(t.ssh_args)      # the inventory's own ssh options (a bastion, an ssh config) still apply
            # Host keys are verified against the known_hosts file provision manages (ssh takes an option's first value).
            v["ansible_ssh_common_args"] = (f"-o UserKnownHostsFile={t.known_hosts} -o StrictHostKeyChecking=yes "
                                            "-o BatchMode=yes " + t.ssh_args.get("ansible_ssh_common_args", "")).strip()
            if t.become:
                v.update(ansible_become=True, ansible_become_method="sudo", ansible_become_user=t.become)
        hosts[t.name] = v
    return {"all": {"hosts": hosts}}


def _env(run_dir: Path, sock_dir: str) -> dict:
    return {
        "ANSIBLE_HOME": str(run_dir / "ansible"),
        "ANSIBLE_LOCAL_TEMP": str(run_dir / "tmp"),
        "ANSIBLE_PIPELINING": "True",
        "ANSIBLE_HOST_KEY_CHECKING": "True",
        "ANSIBLE_SSH_ARGS": f"-o ControlMaster=auto -o ControlPersist=60s -o ControlPath={sock_dir}/%C",
        "ANSIBLE_RETRY_FILES_ENABLED": "False",
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_DEPRECATION_WARNINGS": "False",
        "ANSIBLE_LOCALHOST_WARNING": "False",
        "ANSIBLE_INVENTORY_UNPARSED_WARNING": "False",
        "ANSIBLE_PYTHON_INTERPRETER": "auto_silent",
        # ansible-playbook from the same environment as this tool, also when it is not activated
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
    }


def _failure(ev: dict) -> str:
    d = ev.get("event_data", {})
    res = d.get("res", {}) or {}
    if isinstance(res.get("results"), list):   # a loop: the first failed item says what went wrong
        bad = [r for r in res["results"] if r.get("failed") or r.get("unreachable")]
        res = bad[0] if bad else res
    msg = res.get("stderr") or res.get("msg") or res.get("module_stderr") or ""
    item = res.get("item")
    label = (item.get("name", "") + ("==" + item["version"] if "version" in item else "")) if isinstance(item, dict) else ""
    msg = " ".join(str(msg).split())[:400]
    return f"{d.get('task', 'task')}{' [' + label + ']' if label else ''}: {msg or ev.get('event')}"


def run_playbook(name: str, targets: list[Target], extravars: dict, *, label: str = "",
                 interpreters: dict[str, str] | None = None, on_event: Callable[[str, str, str], None] | None = None, check: bool = False) -> RunResult:
    import ansible_runner

    RUNS.mkdir(parents=True, exist_ok=True)
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    run_dir = RUNS / f"{run_id}-{name}-{label or 'run'}"
    (run_dir / "tmp").mkdir(parents=True)
    hosts = write_vars(run_dir / "inventory" / "hosts.yml", inventory(targets, run_id, interpreters))
    extra = write_vars(run_dir / "vars.yml", extravars)
    failures: list[str] = []
    tasks: list[str] = []

    def handler(ev: dict) -> bool:
        kind = ev.get("event", "")
        d = ev.get("event_data", {})
        if kind == "playbook_on_task_start":
            tasks.append(d.get("task", ""))
            if on_event:
                on_event("task", d.get("task", ""), "")
        elif kind in ("runner_on_failed", "runner_on_unreachable") and not d.get("ignore_errors"):
            failures.append(_failure(ev))
        elif kind == "runner_item_on_ok" and on_event:
            item = (d.get("res") or {}).get("item")
            if isinstance(item, dict) and "name" in item:
                on_event("item", d.get("task", ""), item["name"])
        return True

    t0 = time.perf_counter()
    sock_dir = tempfile.mkdtemp(prefix="pv-", dir="/tmp")   # ControlPath must stay under 108 bytes
    env = _env(run_dir, sock_dir)
    r = ansible_runner.run(private_data_dir=str(run_dir), playbook=str(PLAYBOOKS / f"{name}.yml"),
                           inventory=str(hosts), envvars=env,
                           suppress_env_files=True, quiet=True, event_handler=handler,
                           cmdline=shlex.join(["-e", f"@{extra}"] + (["--check", "--diff"] if check else [])),
                           settings={"suppress_ansible_output": True})
    stop_masters(Path(sock_dir))
    seconds = time.perf_counter() - t0
    error = None
    if r.rc != 0 or r.status != "successful":
        error = failures[0] if failures else f"ansible run {r.status} (rc {r.rc}); see {run_dir}"
    return RunResult(status=r.status, rc=r.rc, run_dir=str(run_dir), seconds=seconds, error=error, tasks=tasks)


def stop_masters(sock_dir: Path) -> None:
    """Stop the ControlPersist masters this run started (one socket per host), then drop the dir."""
    for sock in sock_dir.glob("*"):
        subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "dummy"],
                       capture_output=True, timeout=10, stdin=subprocess.DEVNULL)
    shutil.rmtree(sock_dir, ignore_errors=True)


