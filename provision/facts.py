"""Host facts, gathered in one round trip by the stdlib agent; capture of an environment as a lock.

`gather` returns the agent's JSON; `capture_lock` turns a live environment into lock data
(used by `apply --adopt` and `lock capture`).
"""
from __future__ import annotations

from .layout import DEFAULT_ROOT, root_of  # noqa: F401  (re-exported: the root is named in layout)
from .transport import Transport


def gather(transport: Transport, *, python: str | None = None, adopt: str | None = None) -> dict:
    """The host's facts; `python` ("3.12", a lock's) narrows the interpreters looked for to that version."""
    payload = {"root": root_of(transport), "python": python, "adopt": adopt,
               "nvidia_smi": transport.target.vars.get("provision_nvidia_smi")}
    facts = transport.run_agent("facts", payload)
    facts["host"] = transport.target.name
    return facts


def env_paths(path: str) -> tuple[str, str]:
    """(prefix, interpreter) of an environment named by either (`/opt/env` or `/opt/env/bin/python3`)."""
    path = path.rstrip("/")
    if path.rsplit("/", 1)[-1].startswith("python"):
        return path.rsplit("/", 2)[0], path
    return path, path + "/bin/python"


def capture_lock(transport: Transport, python: str, name: str = "adopted") -> dict:
    """Lock data describing the environment of `python` (an interpreter or a prefix) as it is.

    Captured packages carry name and version only (no wheel hashes exist for what is already
    installed); the lock is a record to roll back to, not something `apply` can rebuild.
    """
    from .errors import HostError

    facts = gather(transport, adopt=env_paths(python)[1])
    env = facts["adopt"]
    if env.get("error"):
        raise HostError(f"cannot read environment {python}: {env['error']}", where=transport.target.name)
    major_minor = ".".join(env["python"].split(".")[:2])
    data = {
        "lock": 1, "name": name,
        "description": f"captured from {env['prefix']} on {facts['host']}",
        "platform": {"python": major_minor, "os": f"{facts['os'].get('id')}-{facts['os'].get('version_id')}",
                     "arch": facts["os"].get("arch") or "x86_64"},
        "requires": [], "packages": [{"name": n, "version": v} for n, v in sorted(env["dists"].items())],
        "patches": [], "engine": {}, "probes": {},
    }
    if facts.get("gpus"):
        data["platform"]["gpus"] = {"compute_capability": sorted({g["compute_cap"] for g in facts["gpus"]})}
    return data
