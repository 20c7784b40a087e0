"""Which known_hosts a host's key is checked against: a relative `--known-hosts FILE` is the caller's (taken from
the working directory) for every part that reads it — `hosts trust`, ssh through Ansible's run directory,
provision's own steps, the hint an unknown key prints — and the shipped playbooks, run with plain
`ansible-playbook`, check every task's host key against the file `provision hosts trust` writes."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from provision.loopback import LoopbackHost
from provision.runner import stop_masters

ROOT = Path(__file__).resolve().parent.parent


def environ(env: dict | None) -> dict:
    """This process's environment with `env` over it (a None value drops the variable); PYTHONPATH made absolute,
    so that this checkout's package is the one imported whatever the working directory."""
    out = {**os.environ, **(env or {})}
    out["PYTHONPATH"] = os.pathsep.join(str(Path(p).absolute()) for p in out.get("PYTHONPATH", "").split(os.pathsep)
                                        if p)
    return {k: v for k, v in out.items() if v is not None}


def run(cwd: Path, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI as an operator runs it, in `cwd`."""
    p = subprocess.run([sys.executable, "-m", "provision.cli", *map(str, args)], cwd=cwd, capture_output=True,
                       text=True, env=environ(dict(env or {}, COLUMNS="200")))
    assert "Traceback" not in p.stderr, p.stderr
    return p


def playbook(cwd: Path, inv: Path, name: str, *args, env: dict) -> subprocess.CompletedProcess:
    """`ansible-playbook -i INV $(provision playbooks --path)/NAME` in `cwd`, as the README says to run it (the
    ansible-playbook of provision's environment); its ssh masters stopped after."""
    bindir = os.path.dirname(sys.executable)
    book = Path(run(cwd, "playbooks", "--path", env=env).stdout.strip()) / name
    cp = Path(tempfile.mkdtemp(prefix="pv-", dir="/tmp"))
    try:
        return subprocess.run([os.path.join(bindir, "ansible-playbook"), "-i", str(inv), str(book), *map(str, args)],
                              cwd=cwd, capture_output=True, text=True, timeout=300,
                              env=environ(dict(env, ANSIBLE_SSH_CONTROL_PATH_DIR=str(cp), ANSIBLE_NOCOLOR="1",
                                               PATH=bindir + os.pathsep + os.environ["PATH"])))
    finally:
        stop_masters(cp)


def reached(p: subprocess.CompletedProcess, task: str, host: str) -> bool:
    """Whether the play ran and `task` came back ok on `host` (Ansible's own words for it)."""
    said = re.search(rf"^TASK \[{task}\] \**\n(ok|changed): \[{host}\]", p.stdout, re.M)
    return p.returncode == 0 and said is not None


def inventory(path: Path, h: LoopbackHost, name: str = "gpu-1", more: str = "") -> Path:
    t = h.target
    path.write_text(f"all:\n  hosts:\n    {name}:\n      ansible_host: {t.host}\n      ansible_port: {t.port}\n"
                    f"      ansible_user: {t.user}\n      ansible_ssh_private_key_file: {t.key_file}\n"
                    f"      ansible_python_interpreter: /usr/bin/python3\n      provision_root: {h.root}\n{more}")
    return path


def test_a_relative_known_hosts_is_the_working_directorys_file_for_every_part(tmp_path):
    """`--known-hosts kh` in ops/: the unknown key's hint names ops/kh, so following it from another directory
    trusts the key in the very file ssh checks; then status over Ansible's ssh (its run directory elsewhere), a
    fleet's status and gc (a step over provision's own ssh, from Ansible's worker) all reach the host."""
    ops, elsewhere = tmp_path / "ops", tmp_path / "elsewhere"
    ops.mkdir()
    elsewhere.mkdir()
    kh = ops / "kh"
    with LoopbackHost() as h:
        own = [h.spec, "--key", h.target.key_file, "--known-hosts", "kh", "--root", h.root]
        p = run(ops, "status", *own)
        assert p.returncode == 1 and "Host key verification failed" in p.stderr, p.stderr
        hint = re.search(r"`(provision hosts trust [^`]*)`", p.stderr)
        assert hint and f"--known-hosts {kh}" in hint.group(1), p.stderr
        assert not kh.exists()

        said = run(elsewhere, *shlex.split(hint.group(1))[1:], "--yes")     # the hint, as printed, run elsewhere
        assert said.returncode == 0 and "Recorded ssh-ed25519 SHA256:" in said.stdout, said.stdout + said.stderr
        assert f" in {kh}." in said.stdout and kh.is_file() and not (elsewhere / "kh").exists()

        p = run(ops, "status", *own, "--json")
        assert p.returncode == 0, p.stdout + p.stderr
        assert json.loads(p.stdout)[0]["result"]["current"] is None, p.stdout

        inv = inventory(ops / "inv.yml", h)
        p = run(ops, "status", "-i", "inv.yml", "--known-hosts", "kh", "--json")
        assert p.returncode == 0 and json.loads(p.stdout)[0]["host"] == "gpu-1", p.stdout + p.stderr
        p = run(ops, "gc", "-i", inv.name, "--known-hosts", "kh", "--dry-run")
        assert p.returncode == 0 and "would remove 0 generations" in p.stdout, p.stdout + p.stderr

        again = run(ops, "hosts", "trust", h.spec, "--known-hosts", "kh", "--yes")
        assert f"Already trusted in {kh}; nothing changed." in again.stdout, again.stdout + again.stderr


def test_the_playbooks_check_host_keys_against_the_file_hosts_trust_writes(tmp_path):
    """The README's way: `provision hosts trust HOST`, then `ansible-playbook -i INV $P/status.yml`. HOME is a fresh
    directory, so ~/.ssh/known_hosts knows no host: status.yml's module task (Ansible's own ssh) and gc.yml's step
    (provision's) both check the key against ~/.provision/known_hosts. A relative `-e provision_known_hosts=FILE`
    is the working directory's file, for both kinds of task."""
    home, ops = tmp_path / "home", tmp_path / "ops"
    home.mkdir()
    ops.mkdir()
    env = {"HOME": str(home), "PROVISION_HOME": None}
    with LoopbackHost() as h:
        inv = inventory(ops / "inv.yml", h)
        p = run(ops, "hosts", "trust", h.spec, "--yes", env=env)
        assert p.returncode == 0 and (home / ".provision" / "known_hosts").is_file(), p.stdout + p.stderr

        p = playbook(ops, inv, "status.yml", env=env)
        assert reached(p, "status", "gpu-1"), p.stdout[-3000:] + p.stderr[-3000:]
        assert not (home / ".ssh" / "known_hosts").exists()
        listing = run(ops, "playbooks", env=env).stdout               # what `provision playbooks` tells the operator
        assert f"checks host keys against {home / '.provision' / 'known_hosts'} " in listing, listing
        p = playbook(ops, inv, "gc.yml", "--check", env=env)
        assert reached(p, "gc", "gpu-1"), p.stdout[-3000:] + p.stderr[-3000:]

        (home / ".provision" / "known_hosts").rename(ops / "kh")          # now only ops/kh knows the key
        p = playbook(ops, inv, "status.yml", env=env)
        assert p.returncode != 0 and "Host key verification failed" in p.stdout, p.stdout[-3000:]
        for book in ("status.yml", "gc.yml"):
            p = playbook(ops, inv, book, "-e", "provision_known_hosts=kh", *(["--check"] if book == "gc.yml" else []),
                         env=env)
            assert reached(p, book.removesuffix(".yml"), "gpu-1"), p.stdout[-3000:] + p.stderr[-3000:]


def test_the_playbooks_keep_the_inventorys_ssh_options(tmp_path, behind_jump):
    """The inventory's ansible_ssh_common_args still apply under the playbooks' host-key options: gpu-behind is
    reached only through the jump host its ssh config names (-F), whose own key that config's known_hosts holds;
    the target's key is in the file `provision hosts trust` wrote (scanned through the jump), not in that one."""
    b = behind_jump
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "PROVISION_HOME": None}
    jump_only = tmp_path / "jump_known_hosts"
    jump_only.write_text(next(ln for ln in b.known_hosts.read_text().splitlines(True)
                              if ln.startswith(b.jump.address + " ")))
    cfg = tmp_path / "ssh_config"
    cfg.write_text(b.config.read_text().replace(str(b.known_hosts), str(jump_only)))
    inv = tmp_path / "inv.yml"
    inv.write_text(f"all:\n  hosts:\n    gpu-behind:\n      provision_root: {tmp_path / 'root'}\n"
                   f"      ansible_python_interpreter: /usr/bin/python3\n"
                   f"      ansible_ssh_common_args: -F {cfg}\n")
    p = run(tmp_path, "hosts", "trust", "-i", inv, "--yes", env=env)
    assert p.returncode == 0 and "Recorded" in p.stdout, p.stdout + p.stderr
    p = playbook(tmp_path, inv, "status.yml", env=env)
    assert reached(p, "status", "gpu-behind"), p.stdout[-3000:] + p.stderr[-3000:]
