"""Host facts, gathered in one round trip by the stdlib agent; capture of an environment as a lock.

`gather` returns the agent's JSON; `capture_lock` turns a live environment into lock data
(used by `apply --adopt` and `lock capture`).
"""
from __future__ import annotations

from .layout import DEFAULT_ROOT, root_of  # noqa: F401  (re-exported: the root is named in layout)
from .transport import Transport


def gather(transport: Transport, *, python: str | None = None, adopt: str | None = None,
           interpreter: str | None = None) -> dict:
    """The host's facts; `python` ("3.12", a lock's) narrows the interpreters looked for to that version, and
    `interpreter` (the operator's --python PATH) is then the only one tried."""
    payload = {"root": root_of(transport), "python": python, "adopt": adopt,
               "nvidia_smi": transport.target.vars.get("provision_nvidia_smi")}
    if interpreter is not None:
        payload["interpreter"] = interpreter_arg(interpreter)
    facts = transport.run_agent("facts", payload)
    facts["host"] = transport.target.name
    return facts


def interpreter_arg(path: str | None) -> str | None:
    """The operator's --python PATH: an absolute path, nothing a shell or a path join could read otherwise
    (InputError naming --python); it is only ever one argv element on the host."""
    from .errors import InputError

    if path is None:
        return None
    if not (path.startswith("/") and "\0" not in path and "\n" not in path and ".." not in path.split("/")):
        raise InputError(f"must be an absolute path to an interpreter on the host, not {path!r}", where="--python")
    return path


def interpreter_of(facts: dict, version: str) -> str | None:
    """The host's interpreter for Python `version` as facts report it (a fact from the host): an absolute
    path without NUL, newline or `..`, else None."""
    path = (facts.get("pythons") or {}).get(version)
    if isinstance(path, str) and path.startswith("/") and not {"\0", "\n"} & set(path) and ".." not in path.split("/"):
        return path
    return None


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
