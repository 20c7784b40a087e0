"""Host facts: what a plan is made from, gathered in one round trip by the stdlib agent (agent/facts.py).

A host's reply is untrusted: `Facts.from_reply` is the one place where it becomes typed values, each checked
(its type; paths absolute and plain; generation ids as the store names them), and a reply that fails is one
HostError naming the host and the field. `capture_lock` turns a live environment into lock data (used by
`apply --adopt` and `lock capture`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .errors import HostError
from .layout import venv_python
from .replies import GEN_ID, PATH, host_path, read
from .transport import Transport


@dataclass(frozen=True)
class HostOs:
    id: str | None = None
    version_id: str | None = None
    pretty: str | None = None
    kernel: str | None = None
    arch: str | None = None
    glibc: str | None = None


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    uuid: str
    driver: str
    compute_cap: str
    memory: str
    pci: str


@dataclass(frozen=True)
class GenerationFacts:
    """One generation as the host's store lists it (its manifest's summary)."""
    id: str = field(metadata=GEN_ID)
    number: int
    status: str = "incomplete"
    lock_name: str | None = None
    lock_digest: str | None = None
    venv_ok: bool = False             # its venv's interpreter exists (gc collects venvs)
    stack: dict = field(default_factory=dict)    # the Stack it recorded at apply (plan.Stack as a dict)
    python: str | None = None
    created: str | None = None
    adopted_from: str | None = None
    cuda_home: str | None = None
    isolation: str | None = None      # how its build kept it apart: store | reflink | copy
    probes: dict | None = None
    patches: list[str | None] = field(default_factory=list)   # its patch series' names

    @property
    def settled(self) -> str:
        """Its status once apply's first step (`recover`) settled it: one left `switching` returns to runnable
        whether or not the switch committed (`recover` records the switch when `current` names it)."""
        return "ready" if self.status == "switching" else self.status


@dataclass(frozen=True)
class Environment:
    """A Python environment's distributions, read by its own interpreter (the current generation's, or one
    to adopt)."""
    dists: dict[str, str] = field(default_factory=dict)
    python: str | None = None         # X.Y.Z
    prefix: str | None = field(default=None, metadata=PATH)
    executable: str | None = field(default=None, metadata=PATH)
    path: str | None = None           # the interpreter asked
    error: str | None = None


@dataclass(frozen=True)
class Facts:
    host: str
    root: str | None = field(default=None, metadata=PATH)
    os: HostOs = field(default_factory=HostOs)
    pythons: dict[str, str] = field(default_factory=dict, metadata=PATH)   # X.Y → an interpreter that ran
    python_versions: dict[str, str] = field(default_factory=dict)  # X.Y → X.Y.Z
    broken_pythons: dict[str, str] = field(default_factory=dict)   # path → why it is not offered
    pythons_looked_for: str | None = None                          # X.Y, or "all"
    pythons_looked_in: list[str] = field(default_factory=list)
    python_given: str | None = field(default=None, metadata=PATH)  # the operator's --python PATH
    python_executable: str | None = field(default=None, metadata=PATH)   # the interpreter the agent ran under
    uv: str | None = field(default=None, metadata=PATH)
    user: str | None = None
    cached_wheels: list[str] = field(default_factory=list)         # sha256 of each complete cache entry
    disk_free_bytes: int | None = None
    nvidia_smi: str | None = None                                  # the nvidia-smi it ran
    gpus: list[Gpu] = field(default_factory=list)
    driver: str | None = None
    cuda_visible_devices: str | None = None
    gpu_error: str | None = None                                   # nvidia-smi is there but failed
    toolkits: list[dict] = field(default_factory=list)             # {home, nvcc}: toolkits under /usr/local
    nvcc_on_path: str | None = field(default=None, metadata=PATH)
    nvcc_on_path_version: str | None = None
    generations: list[GenerationFacts] = field(default_factory=list)
    current: str | None = field(default=None, metadata=GEN_ID)
    current_dists: dict[str, str] | None = None    # None: no current generation, or its interpreter did not run
    current_python: str | None = None
    current_error: str | None = None
    managed: bool = False
    adopt: Environment | None = None
    lock_file: str | None = field(default=None, metadata=PATH)
    isolation: str | None = None              # what a build here gets: store | reflink | copy (agent/store.py)
    isolation_why: str | None = None          # why not the store, where it is not
    stored_wheels: list[str] = field(default_factory=list)    # sha256 of wheels whose files the store holds

    def generation(self, gen_id: str | None) -> GenerationFacts | None:
        return next((g for g in self.generations if g.id == gen_id), None)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_reply(cls, data, host: str) -> "Facts":
        """The facts agent's reply, checked field by field against the types above (HostError naming the host
        and the field): what the controller reads from it is what this returns."""
        return read(cls, data, host, "facts", title="the host's facts are", given={"host": host})


def gather(transport: Transport, *, python: str | None = None, adopt: str | None = None,
           interpreter: str | None = None, wheels: list[str] | None = None) -> Facts:
    """The host's facts; `python` ("3.12", a lock's) narrows the interpreters looked for to that version, and
    `interpreter` (the operator's --python PATH) is then the only one tried; `wheels` (a lock's sha256s): their
    cache entries count as cached only if their bytes still match (`cached_wheels`)."""
    payload = {"op": "gather", "root": transport.target.root, "python": python, "adopt": adopt,
               "nvidia_smi": transport.target.nvidia_smi, "wheels": list(wheels or [])}
    if interpreter is not None:
        payload["interpreter"] = interpreter_arg(interpreter)
    return Facts.from_reply(transport.run_agent("facts", payload), transport.target.name)


def gather_for(transport: Transport, lock, interpreter: str | None = None) -> Facts:
    """The host's facts as a plan for `lock` reads them: its Python looked for, its wheels' cache entries checked."""
    return gather(transport, python=lock.platform.python, interpreter=interpreter,
                  wheels=[p.sha256 for p in lock.packages if p.sha256])


def interpreter_arg(path: str | None) -> str | None:
    """The operator's --python PATH: an absolute path, nothing a shell or a path join could read otherwise
    (InputError naming --python); it is only ever one argv element on the host."""
    from .errors import InputError

    if path is None:
        return None
    if not host_path(path):
        raise InputError(f"must be an absolute path to an interpreter on the host, not {path!r}", where="--python")
    return path


def env_paths(path: str) -> tuple[str, str]:
    """(prefix, interpreter) of an environment named by either (`/opt/env` or `/opt/env/bin/python3`)."""
    path = path.rstrip("/")
    if path.rsplit("/", 1)[-1].startswith("python"):
        return path.rsplit("/", 2)[0], path
    return path, venv_python(path)


def capture_lock(transport: Transport, python: str, name: str = "adopted") -> dict:
    """Lock data describing the environment of `python` (an interpreter or a prefix) as it is.

    Captured packages carry name and version only (no wheel hashes exist for what is already
    installed); the lock is a record to roll back to, not something `apply` can rebuild.
    """
    facts = gather(transport, adopt=env_paths(python)[1])
    env = facts.adopt or Environment(error="the host did not read it")
    if env.error or not env.python:
        raise HostError(f"cannot read environment {python}: {env.error or 'no Python version reported'}",
                        where=transport.target.name)
    major_minor = ".".join(env.python.split(".")[:2])
    data = {
        "lock": 1, "name": name,
        "description": f"captured from {env.prefix} on {facts.host}",
        "platform": {"python": major_minor, "os": f"{facts.os.id}-{facts.os.version_id}",
                     "arch": facts.os.arch or "x86_64"},
        "requires": [], "packages": [{"name": n, "version": v} for n, v in sorted(env.dists.items())],
        "patches": [], "engine": {}, "probes": {},
    }
    if facts.gpus:
        data["platform"]["gpus"] = {"compute_capability": sorted({g.compute_cap for g in facts.gpus})}
    return data
