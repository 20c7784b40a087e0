"""Hosts as operators reach them, through the ssh connection Ansible uses: a host behind a jump host named by an
ssh_config alias (ProxyJump), and a non-root login user who becomes root through sudo (--become, or the
inventory's ansible_become). A sudo that wants a password is one line."""
from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from loophosts import readable_host, sudo_account, write_inventory
from provision.transport import trust_host
from test_core import cli
from wheelhouse import write_lock


def test_apply_and_status_through_a_jump_host_by_ssh_config_alias(tmp_path, wheels, behind_jump, monkeypatch):
    """The inventory names the host by its ssh_config alias (ansible_host) and that config (-F): apply builds and
    switches a generation there, and status reads it back, through the jump host: nothing here routes to it. A bare
    alias on the command line goes the same way, the ssh config named in Ansible's own settings."""
    b = behind_jump
    with pytest.raises(OSError):
        socket.create_connection((b.behind.address, b.behind.port), timeout=2).close()
    root = tmp_path / "root"          # the namespaces share this machine's files
    inv = tmp_path / "inv.yml"
    inv.write_text(f"all:\n  hosts:\n    gpu:\n      ansible_host: {b.alias}\n      provision_root: {root}\n"
                   f"      ansible_python_interpreter: /usr/bin/python3\n"
                   f"      ansible_ssh_common_args: -F {b.config}\n")
    lk = write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]])
    p = cli("apply", "-i", inv, "--known-hosts", b.known_hosts, "--lock", lk, check=0)
    assert (root / "current").readlink() == Path("generations/0001-stack-a"), p.stdout + p.stderr
    rows = json.loads(cli("status", "-i", inv, "--known-hosts", b.known_hosts, "--json", check=0).stdout)
    assert rows[0]["host"] == "gpu" and rows[0]["result"]["current"] == "0001-stack-a", rows
    monkeypatch.setenv("ANSIBLE_SSH_COMMON_ARGS", f"-F {b.config}")
    said = json.loads(cli("status", b.alias, "--known-hosts", b.known_hosts, "--root", root, "--json", check=0).stdout)
    assert said[0]["host"] == b.alias and said[0]["result"]["current"] == "0001-stack-a", said


def test_hosts_trust_through_a_jump_host_records_the_key_ssh_checks(tmp_path, behind_jump):
    """`hosts trust` scans the key over the host's own connection (through the jump host: nothing here routes to
    it) and records it under the name ssh checks it by (the alias's HostName); the host's steps then go through."""
    b = behind_jump
    managed = tmp_path / "managed_known_hosts"          # the jump host's key stays the ssh config's business
    inv = tmp_path / "inv.yml"
    inv.write_text(f"all:\n  hosts:\n    gpu:\n      ansible_host: {b.alias}\n"
                   f"      provision_root: {tmp_path / 'root'}\n"
                   f"      ansible_ssh_common_args: -F {b.config}\n")
    p = cli("status", "-i", inv, "--known-hosts", managed, check=1)
    assert p.stderr.startswith("gpu: unreachable: ") and "Host key verification failed" in p.stderr and \
        p.stderr.endswith(f"`provision hosts trust -i {inv} --limit gpu --known-hosts {managed}`\n"), p.stderr
    shown = (b.behind.dir / "host_ed25519.pub").read_text().split()
    cli("hosts", "trust", "-i", inv, "--known-hosts", managed, "--yes", check=0)
    assert managed.read_text().split() == [b.behind.address, *shown[:2]]
    rows = json.loads(cli("status", "-i", inv, "--known-hosts", managed, "--json", check=0).stdout)
    assert rows[0]["result"]["current"] is None, rows


@pytest.fixture(scope="module")
def sudo_host():
    host = readable_host()
    trust_host(host.target)
    yield host
    host.cleanup()


def test_apply_with_become_as_a_sudo_user_makes_a_root_owned_generation(sudo_host, sudo_user, wheels, tmp_path):
    t = sudo_host.target
    root = tmp_path / "root"
    spec = f"{sudo_user}@{t.host}:{t.port}"
    common = ["--key", t.key_file, "--known-hosts", t.known_hosts, "--root", root]
    lk = write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]])
    p = cli("apply", spec, *common, "--lock", lk, check=1)           # as the user alone: root's dirs are not its
    assert p.stderr.splitlines()[-1].startswith(f"error: {spec}: cannot take host lock ") \
        and "Permission denied" in p.stderr, p.stderr
    cli("apply", spec, *common, "--lock", lk, "--become", check=0)
    gen = root / "generations" / "0001-stack-a"
    assert (root / "current").readlink() == Path("generations/0001-stack-a")
    assert os.stat(gen).st_uid == 0 and os.stat(gen / "venv").st_uid == 0

    inv = tmp_path / "inv.ini"       # the inventory's become does the same
    inv.write_text(f"gpu ansible_host={t.host} ansible_port={t.port} ansible_user={sudo_user} "
                   f"ansible_ssh_private_key_file={t.key_file} provision_root={root} ansible_become=true\n")
    rows = json.loads(cli("status", "-i", inv, "--known-hosts", t.known_hosts, "--json", check=0).stdout)
    assert rows[0]["result"]["current"] == "0001-stack-a", rows


@pytest.fixture
def password_sudo_user():
    """A user whose sudo asks for a password (new for this test, removed at the end)."""
    with sudo_account("ALL=(ALL) ALL") as name:
        yield name


def test_become_without_passwordless_sudo_is_one_line(sudo_host, password_sudo_user, tmp_path):
    t = sudo_host.target
    spec = f"{password_sudo_user}@{t.host}:{t.port}"
    p = cli("status", spec, "--key", t.key_file, "--known-hosts", t.known_hosts, "--root", tmp_path / "root",
            "--become", check=1)
    assert p.stderr == (f"{spec}: unreachable: sudo refused to run as root (a password is required): become needs "
                        "passwordless sudo (NOPASSWD) for the login user\n"), p.stderr


def test_the_playbooks_the_cli_runs_keep_the_hosts_ssh_options_and_become(tmp_path):
    """A host's playbook run (the toolkit task) goes the way its steps go: through its ssh options, as its become
    user, host keys still checked against the managed known_hosts."""
    from provision import runner
    from provision.inventory import load_inventory

    inv = tmp_path / "inv.ini"
    inv.write_text("gpu ansible_host=gpu-behind ansible_user=ops ansible_become=yes "
                   "ansible_ssh_common_args='-F /etc/ops/ssh_config'\n")
    kh = tmp_path / "kh"
    v = runner.inventory(load_inventory(inv, kh), "run", ssh_args="-o ControlPath=/tmp/x/%C")["all"]["hosts"]["gpu"]
    assert v["ansible_ssh_args"] == (f"-o StrictHostKeyChecking=yes -o UserKnownHostsFile={kh} "
                                     "-o GlobalKnownHostsFile=/dev/null -o BatchMode=yes "
                                     "-o ControlPath=/tmp/x/%C")      # first on the line: ssh takes the first value
    assert v["ansible_ssh_common_args"] == "-F /etc/ops/ssh_config"     # the operator's, as given
    assert (v["ansible_host"], v["ansible_become"], v["ansible_become_user"]) == ("gpu-behind", True, "root")


def test_ansibles_default_ssh_args_give_way_to_ours_an_operators_stay(monkeypatch):
    """Ansible's built-in ssh_args (-C and its own master) are replaced by provision's master options: compression
    would halve the speed of pushing wheels, which are compressed already. An operator's ssh_args are kept."""
    from provision.transport import Target, ssh_command

    t = Target(host="127.0.0.1", port=2222, user="root", known_hosts=Path("/nonexistent/kh"))
    monkeypatch.delenv("ANSIBLE_SSH_ARGS", raising=False)
    argv = ssh_command(t, control=None)
    assert "-C" not in argv and "ControlPersist=60s" not in argv and argv[-1] == "127.0.0.1"
    monkeypatch.setenv("ANSIBLE_SSH_ARGS", "-C -o Compression=yes")
    argv = ssh_command(t, control=None)
    assert "-C" in argv and "Compression=yes" in argv


def test_a_plays_host_steps_share_the_tasks_own_ssh_connection(target, wheels, tmp_path, monkeypatch):
    """Every ssh command of `apply -i` (provision's stage step, then the switch, each an agent run over its task's
    connection) is the ssh executable Ansible's settings name, and they all go through one master connection to the
    host, the one Ansible keeps for it: provision's steps run over the task's own connection, not a second one."""
    log = tmp_path / "ssh.log"
    wrapper = tmp_path / "ssh-logged"
    wrapper.write_text(f"#!/bin/sh\n{{ printf '%s\\037' \"$@\"; printf '\\036'; }} >> {log}\nexec ssh \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("ANSIBLE_SSH_EXECUTABLE", str(wrapper))
    root = tmp_path / "h1"
    inv = write_inventory(tmp_path / "inv.yml", target, {"h1": root})
    lk = write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]])
    cli("apply", "-i", inv, "--known-hosts", target.known_hosts, "--lock", lk, check=0)
    assert (root / "current").readlink() == Path("generations/0001-stack-a")
    runs = [r.split("\x1f")[:-1] for r in log.read_text().split("\x1e")[:-1]]
    paths = [[a.split("=", 1)[1].strip('"') for a in argv if a.startswith("ControlPath=")][:1] for argv in runs]
    assert all(paths) and len({p[0] for p in paths}) == 1, runs    # ssh takes an option's first value
    assert sum("-I -S -c" in argv[-1] for argv in runs) >= 2, runs       # provision's agents: the stage's, the switch's
    assert not any("&& sleep 0" in argv[-1] for argv in runs), runs      # and no module of Ansible's sent to the host
