"""The playbooks operators run themselves: `ansible-playbook -i INV <provision playbooks --path>/rollback.yml` on a
loopback fleet rolls each host back through the same agent as `provision rollback`, and `provision status` then
shows that state; status and history read it back; check mode switches nothing. Ansible reaches the hosts over
its own ssh connection, host keys checked against the known_hosts the tool manages."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from provision import apply as applymod, lock as lockmod
from provision.inventory import load_inventory
from provision.runner import stop_masters
from provision.transport import trust_host
from loophosts import readable_host
from test_core import cli
from wheelhouse import write_lock

HOSTS = ["p1", "p2", "p3"]


def playbook_dir() -> Path:
    return Path(cli("playbooks", "--path", check=0).stdout.strip())


def ansible_playbook(inv: Path, name: str, *args: str, known_hosts: Path | None = None) -> subprocess.CompletedProcess:
    """ansible-playbook as an operator runs it (from the tool's environment), host keys checked against
    `known_hosts` (-e provision_known_hosts, for every task; else provision's known_hosts); each result one JSON
    line (-v)."""
    bindir = os.path.dirname(sys.executable)
    cp = Path(tempfile.mkdtemp(prefix="pv-", dir="/tmp"))       # this run's ssh masters (ControlPersist), stopped after
    env = {**os.environ, "ANSIBLE_SSH_CONTROL_PATH_DIR": str(cp), "ANSIBLE_CALLBACK_RESULT_FORMAT": "json", "ANSIBLE_CALLBACK_FORMAT_PRETTY": "false",
           "ANSIBLE_NOCOLOR": "1", "ANSIBLE_HOME": str(inv.parent / "ansible-home"),
           "ANSIBLE_LOCAL_TEMP": str(inv.parent / "ansible-tmp"), "PATH": bindir + os.pathsep + os.environ["PATH"]}
    try:
        given = ["-e", f"provision_known_hosts={known_hosts}"] if known_hosts else []
        return subprocess.run([os.path.join(bindir, "ansible-playbook"), "-i", str(inv), str(playbook_dir() / name),
                               "-v", *given, *args], env=env, capture_output=True, text=True, timeout=300)
    finally:
        stop_masters(cp)


def results(p: subprocess.CompletedProcess, task: str) -> dict:
    """Each host's result of `task`, as the default callback printed it (`ok: [HOST] => {json}`)."""
    out, in_task = {}, False
    for line in p.stdout.splitlines():
        if line.startswith("TASK ["):
            in_task = line.startswith(f"TASK [{task}]")
        m = re.match(r"^(ok|changed|fatal|failed): \[([^\]]+)\](?: => | \(.*?\) => |: [A-Z]+! => )(\{.*\})$", line)
        if in_task and m:
            out[m.group(2)] = dict(json.loads(m.group(3)), _said=m.group(1))
    assert out, f"no result of task {task!r}: {p.stdout[-2000:]} {p.stderr[-2000:]}"
    return out


@pytest.fixture(scope="module")
def fleet(sshd, wheels, tmp_path_factory):
    """Three hosts on stack-b (0002), stack-a before it; the inventory as an operator writes it for ansible."""
    d = tmp_path_factory.mktemp("playbooks")
    t = sshd.target
    roots = {h: d / f"root-{h}" for h in HOSTS}
    inv = d / "inv.yml"
    inv.write_text(
        f"all:\n  vars:\n    ansible_host: {t.host}\n    ansible_port: {t.port}\n    ansible_user: {t.user}\n"
        f"    ansible_ssh_private_key_file: {t.key_file}\n    ansible_python_interpreter: /usr/bin/python3\n"
        "  hosts:\n" + "".join(f"    {h}: {{provision_root: {roots[h]}}}\n" for h in HOSTS))
    a = write_lock(d / "a.yaml", "stack-a", [wheels["alpha-1.0"]])
    b = write_lock(d / "b.yaml", "stack-b", [wheels["alpha-2.0"]])
    for lk in (a, b):
        run = applymod.apply_fleet(load_inventory(inv, t.known_hosts), lockmod.load(lk))
        assert {r.status for r in run.reports} == {"applied"}, [r.error for r in run.reports]
    return inv, roots, ["-i", str(inv), "--known-hosts", str(t.known_hosts)]


def current(roots, h) -> str:
    return os.readlink(roots[h] / "current").removeprefix("generations/")


def test_playbooks_ship_with_their_modules():
    d = playbook_dir()
    for name in ("status", "history", "rollback", "gc", "verify", "facts", "logs"):
        assert (d / f"{name}.yml").is_file() and (d / "library" / f"provision_{name}.py").is_file()
    assert (d / "module_utils" / "provision" / "agent" / "state.py").read_text() == \
        (d.parent / "agent" / "state.py").read_text()         # the very host code the CLI's agents run
    listing = cli("playbooks", check=0).stdout
    assert "rollback.yml" in listing and "status.yml" in listing


def test_ansible_playbook_rollback_then_provision_status_agrees(fleet):
    inv, roots, common = fleet
    p = ansible_playbook(inv, "status.yml", known_hosts=common[-1])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    st = results(p, "status")
    assert {h: (st[h]["current"], st[h]["lock"]) for h in HOSTS} == {h: ("0002-stack-b", "stack-b") for h in HOSTS}
    assert all(st[h]["changed"] is False and st[h]["probe"]["status"] == "pass" for h in HOSTS)

    p = ansible_playbook(inv, "rollback.yml", "--check", known_hosts=common[-1])   # the target; nothing switched
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    dry = results(p, "rollback")
    assert {h: (dry[h]["from"], dry[h]["to"], dry[h]["changed"]) for h in HOSTS} == \
        {h: ("0002-stack-b", "0001-stack-a", False) for h in HOSTS}
    assert [current(roots, h) for h in HOSTS] == ["0002-stack-b"] * 3

    p = ansible_playbook(inv, "rollback.yml", "--limit", "p1:p2", known_hosts=common[-1])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    done = results(p, "rollback")
    assert {h: (done[h]["to"], done[h]["changed"]) for h in done} == {"p1": ("0001-stack-a", True),
                                                                      "p2": ("0001-stack-a", True)}
    assert [current(roots, h) for h in HOSTS] == ["0001-stack-a", "0001-stack-a", "0002-stack-b"]

    rows = {r["host"]: r["result"] for r in json.loads(cli("status", *common, "--json", check=0).stdout)}
    assert {h: rows[h]["current"] for h in HOSTS} == {"p1": "0001-stack-a", "p2": "0001-stack-a",
                                                      "p3": "0002-stack-b"}
    hist = json.loads(cli("history", "p1", *common, "--json", check=0).stdout)
    events = hist[0]["result"]["events"] if isinstance(hist, list) else hist["events"]
    assert events[-1]["event"] == "rollback" and events[-1]["to"] == "0001-stack-a", events[-1]

    p = ansible_playbook(inv, "history.yml", "--limit", "p1", known_hosts=common[-1])
    assert p.returncode == 0 and results(p, "history")["p1"]["current"] == "0001-stack-a"

    p = ansible_playbook(inv, "rollback.yml", "-e", "to=2", "--limit", "p1", known_hosts=common[-1])   # forward
    assert p.returncode == 0 and results(p, "rollback")["p1"]["to"] == "0002-stack-b"
    assert current(roots, "p1") == "0002-stack-b"

    p = ansible_playbook(inv, "gc.yml", "-e", "keep=1", "--check", "--limit", "p1", known_hosts=common[-1])
    would = results(p, "gc")["p1"]                       # current and the rollback target are kept, whatever keep
    assert p.returncode == 0 and would["generations"] == [] and would["changed"] is False, would
    assert sorted(os.listdir(roots["p1"] / "generations")) == ["0001-stack-a", "0002-stack-b"]


def test_a_refused_rollback_is_a_failed_task_with_the_agents_line(fleet):
    inv, roots, common = fleet
    p = ansible_playbook(inv, "rollback.yml", "-e", "to=99", "--limit", "p3", known_hosts=common[-1])
    assert p.returncode == 2, p.stdout[-2000:]
    r = results(p, "rollback")["p3"]
    assert r["_said"] == "fatal" and "99" in r["msg"], r
    assert current(roots, "p3") == "0002-stack-b"


def test_a_sudo_user_rolls_back_with_become(sudo_user, wheels, tmp_path):
    """The same playbooks reach a host as a non-root user: its root is root's, so without `become` the user's
    module can read nothing there; with `--become` (sudo) the rollback goes through, and provision status (as
    root) agrees. The host is an sshd of its own whose key files the user may read."""
    host = readable_host()
    try:
        t = host.target
        trust_host(t)
        root = tmp_path / "root"
        inv = tmp_path / "inv.yml"
        inv.write_text(
            f"all:\n  vars:\n    ansible_host: {t.host}\n    ansible_port: {t.port}\n    ansible_user: {t.user}\n"
            f"    ansible_ssh_private_key_file: {t.key_file}\n    ansible_python_interpreter: /usr/bin/python3\n"
            f"  hosts:\n    gpu: {{provision_root: {root}}}\n")
        for name, wheel in (("stack-a", "alpha-1.0"), ("stack-b", "alpha-2.0")):   # as root, as before
            run = applymod.apply_fleet(load_inventory(inv, t.known_hosts),
                                       lockmod.load(write_lock(tmp_path / f"{name}.yaml", name, [wheels[wheel]])))
            assert {r.status for r in run.reports} == {"applied"}, [r.error for r in run.reports]
        as_user = tmp_path / "as-user.yml"
        as_user.write_text(inv.read_text().replace(f"    ansible_user: {t.user}\n",
                                                   f"    ansible_user: {sudo_user}\n"
                                                   f"    ansible_remote_tmp: /tmp/.ansible-{sudo_user}\n"))
        p = ansible_playbook(as_user, "rollback.yml", "--check", known_hosts=t.known_hosts)
        said = results(p, "rollback")["gpu"]
        assert p.returncode == 2 and said["_said"] == "fatal" and not said.get("unreachable"), p.stdout[-2000:]
        assert said["msg"] == f"cannot read the host root {root} (Permission denied): run as its owner (root: " \
            "Ansible's become, sudo)", said                           # in the module, on the root itself
        assert (root / "current").readlink() == Path("generations/0002-stack-b")

        p = ansible_playbook(as_user, "rollback.yml", "--become", known_hosts=t.known_hosts)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        done = results(p, "rollback")["gpu"]
        assert (done["from"], done["to"], done["changed"]) == ("0002-stack-b", "0001-stack-a", True)
        assert (root / "current").readlink() == Path("generations/0001-stack-a")
        rows = json.loads(cli("status", "-i", inv, "--known-hosts", t.known_hosts, "--json", check=0).stdout)
        assert rows[0]["result"]["current"] == "0001-stack-a"
    finally:
        host.cleanup()


def test_a_host_behind_a_jump_host_named_by_its_ssh_config_alias(tmp_path, wheels, behind_jump):
    """gpu-behind sits in a network namespace that only the jump host's namespace reaches. The operator's ssh config
    names it by an alias with ProxyJump; the inventory names the alias and that config. ansible-playbook reaches it
    through the jump host (its key checked against the managed known_hosts) and rolls it back; provision's own
    steps, over the same ssh connection, read it back."""
    behind, kh, cfg = behind_jump.behind, behind_jump.known_hosts, behind_jump.config
    with pytest.raises(OSError):                                   # no route from here: only through the jump
        socket.create_connection((behind.address, behind.port), timeout=2).close()
    root = tmp_path / "root"               # the namespaces share this machine's files: built with --local
    for name, wheel in (("stack-a", "alpha-1.0"), ("stack-b", "alpha-2.0")):
        cli("apply", "--local", "--root", root, "--lock",
            write_lock(tmp_path / f"{name}.yaml", name, [wheels[wheel]]), check=0)
    inv = tmp_path / "inv.yml"
    inv.write_text(f"all:\n  hosts:\n    gpu-behind:\n      provision_root: {root}\n"
                   f"      ansible_python_interpreter: /usr/bin/python3\n"
                   f"      ansible_ssh_common_args: -F {cfg}\n")

    p = ansible_playbook(inv, "rollback.yml", known_hosts=kh)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    done = results(p, "rollback")["gpu-behind"]
    assert (done["from"], done["to"], done["changed"]) == ("0002-stack-b", "0001-stack-a", True)
    assert (root / "current").readlink() == Path("generations/0001-stack-a")

    rows = json.loads(cli("status", "-i", inv, "--known-hosts", kh, "--json", check=0).stdout)
    assert rows[0]["result"]["current"] == "0001-stack-a", rows   # provision's own steps go the same way


def test_provisions_own_runs_leave_out_the_tasks_only_an_operators_run_needs(tmp_path):
    """The CLI's run of status.yml (and of every playbook) skips the host-keys task (the inventory it writes puts
    those options first already) and the report line (the CLI prints its own): one task, the step itself."""
    from provision.runner import run_playbook
    from provision.transport import Target

    res = run_playbook("status", [Target(host="local", root=str(tmp_path / "root"))], {})
    assert res.status == "successful" and res.tasks == ["status"], (res.tasks, res.error)
    text = (playbook_dir() / "status.yml").read_text() + (playbook_dir() / "tasks" / "host_keys.yml").read_text()
    assert "tags: provision_report" in text and "tags: [always, provision_host_keys]" in text
