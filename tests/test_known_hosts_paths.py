"""Which known_hosts a host's key is checked against: a relative `--known-hosts FILE` is the caller's (taken from
the working directory) for every part that reads it — `hosts trust`, ssh through Ansible's run directory,
provision's own steps, the hint an unknown key prints."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from provision.loopback import LoopbackHost

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
