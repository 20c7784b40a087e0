"""Host-side agents (stdlib only), shipped as one bundle with their shared helpers (`host.py`, `../layout.py`).

An agent is a module here with `OPS = {op: function(payload) -> dict}`; a payload names its operation under `op`.
The controller runs it as `PYTHON -I -c host.BOOT` and writes one JSON line to its stdin: {bundle, agent, input,
env}; an agent that starts workers of its own (one per GPU, a JIT compile) starts them the same way.
"""
from __future__ import annotations

import getpass
import json
import os
import socket
from functools import lru_cache
from pathlib import Path

from .host import BOOT, bundle_of

PKG = Path(__file__).resolve().parent.parent        # the local `provision` package
SHARED = ("__init__.py", "layout.py")               # what agents import from outside agent/


@lru_cache(maxsize=None)
def bundle() -> str:
    """provision/__init__.py, the host layout (provision/layout.py, which agents import as Ansible modules import
    their module_utils), the steps' declarations (provision/steps/*.py) and provision/agent/*.py (this file
    excepted), by path, as zlib-compressed base64 JSON."""
    files = {f"provision/{name}": (PKG / name).read_text() for name in SHARED}
    for p in sorted((PKG / "steps").glob("*.py")):
        files[f"provision/steps/{p.name}"] = p.read_text()
    for p in sorted((PKG / "agent").glob("*.py")):
        files[f"provision/agent/{p.name}"] = p.read_text()
    files["provision/agent/__init__.py"] = '"""Host-side agents (this file\'s controller part stays behind)."""\n'

    return bundle_of(files)


def command(python: str = "python3", site: bool = True) -> list[str]:
    """The command line of every agent run: an interpreter and the constant loader, nothing else.
    `site=False` (the host's own interpreter, which runs only stdlib agents) skips its site-packages'
    start-up work (`-S`); a generation's interpreter keeps them."""
    return [python, "-I", *([] if site else ["-S"]), "-c", BOOT]


def message(name: str, payload: dict, env: dict | None = None, heartbeat: float | None = None) -> bytes:
    """The one stdin line that tells the loader which agent to run on what. `heartbeat`: the agent ends its work
    when no byte comes on its stdin for this many seconds (the controller sends one every few: see transport).
    `controller` names who started it (recorded with the host lock it takes)."""
    msg = {"bundle": bundle(), "agent": name, "input": payload, "controller": controller()}
    if env:
        msg["env"] = {str(k): str(v) for k, v in env.items()}
    if heartbeat:
        msg["heartbeat"] = heartbeat
    return (json.dumps(msg) + "\n").encode()


@lru_cache(maxsize=None)
def controller() -> str:
    """This controller process, as a host lock records its holder's controller: `user@machine pid N`."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()} pid {os.getpid()}"
