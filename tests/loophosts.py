"""Loopback hosts the tests share beyond the fixtures (conftest.py imports these too)."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from provision.loopback import LoopbackHost


def readable_host() -> LoopbackHost:
    """A started loopback host whose authorized_keys any local user's session may read: a non-root user logs in
    with the same client key."""
    import os

    host = LoopbackHost().start()
    os.chmod(host.dir, 0o755)
    os.chmod(host.dir / "authorized_keys", 0o644)
    return host


def write_inventory(path: Path, t, roots: dict) -> Path:
    """An Ansible inventory at `path`: each host of `roots` reached as `t` (the session's loopback sshd) under its
    own provision_root."""
    path.write_text(f"all:\n  vars: {{ansible_host: {t.host}, ansible_port: {t.port}, ansible_user: {t.user}, "
                    f"ansible_ssh_private_key_file: {t.key_file}}}\n  hosts:\n"
                    + "".join(f"    {h}: {{provision_root: {root}}}\n" for h, root in roots.items()))
    return path


@contextlib.contextmanager
def sudo_account(sudoers_rule: str):
    """A login account of this machine, new and named for this process (never one that was there before), that
    logs in with a loopback host's client key and whose sudo rule is `sudoers_rule` (e.g. "ALL=(ALL) NOPASSWD:
    ALL"); it and its sudoers file are removed at the end, and nothing else is."""
    import secrets
    import subprocess

    while True:
        name = f"pv{os.getpid() % 100000}{secrets.token_hex(3)}"
        if subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name],
                          capture_output=True).returncode == 0:
            break
        if subprocess.run(["id", name], capture_output=True).returncode != 0:
            raise RuntimeError(f"useradd {name} failed")
    sudoers = Path("/etc/sudoers.d") / name
    try:
        subprocess.run(["usermod", "-p", "*", name], check=True)   # not locked: sshd without PAM refuses a locked one
        sudoers.write_text(f"{name} {sudoers_rule}\n")
        sudoers.chmod(0o440)
        yield name
    finally:
        sudoers.unlink(missing_ok=True)
        subprocess.run(["userdel", name], capture_output=True)
