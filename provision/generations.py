"""Control-side handle on a host's generations store (the `state` agent): prepare, mark, switch,
roll back, adopt, history. Every call is one round trip; the agent does the atomic work."""
from __future__ import annotations

import base64
import json

from . import agent
from .facts import root_of
from .transport import Transport


def call(transport: Transport, op: str, **args) -> dict:
    args["root"] = root_of(transport)
    payload = base64.b64encode(json.dumps(args).encode()).decode()
    return transport.run_agent(agent.source("state"), [op, payload])


def prepare(t: Transport, lock_name: str, lock_text: str, manifest: dict, packages: list[dict]) -> dict:
    """New generation dir with lock.yaml, requirements.txt (hashes) and a 'building' manifest."""
    pkgs = [{"name": p["name"], "sha256": p["sha256"], "filename": p["filename"]} for p in packages]
    return call(t, "prepare", lock_name=lock_name, lock_text=lock_text, manifest=manifest, packages=pkgs)


def mark(t: Transport, gen_id: str, event: dict | None = None, remove_venv: bool = False, **fields) -> dict:
    return call(t, "mark", id=gen_id, fields=fields, event=event, remove_venv=remove_venv)


def switch(t: Transport, gen_id: str, kind: str = "switch", ready: bool = True, event: dict | None = None) -> dict:
    return call(t, "switch", id=gen_id, kind=kind, ready=ready, event=event or {})


def rollback(t: Transport, to: str | None = None) -> dict:
    return call(t, "rollback", to=to, take_lock=True)


def adopt(t: Transport, prefix: str, lock_name: str, lock_text: str, manifest: dict) -> dict:
    return call(t, "adopt", prefix=prefix, lock_name=lock_name, lock_text=lock_text, manifest=manifest)


def history(t: Transport, limit: int = 200) -> dict:
    return call(t, "history", limit=limit)


def read(t: Transport, gen_id: str) -> dict:
    return call(t, "read", id=gen_id)
