"""Loopback hosts the tests share beyond the fixtures (conftest.py imports these too)."""
from __future__ import annotations

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

