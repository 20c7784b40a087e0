"""Loopback hosts the tests share beyond the fixtures (conftest.py imports these too)."""
from __future__ import annotations

from provision.loopback import LoopbackHost


def readable_host() -> LoopbackHost:
    """A started loopback host whose authorized_keys any local user's session may read: a non-root user logs in
    with the same client key."""
    import os

    host = LoopbackHost().start()
    os.chmod(host.dir, 0o755)
    os.chmod(host.dir / "authorized_keys", 0o644)
    return host
