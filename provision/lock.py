"""The lock model: load and validate a stack lockfile (errors carry file:line and field), dump it.

A lock names a platform, what people require, the resolved closure (`packages`, each with
sha256), deliberate `overrides` of a package's own pins, patch series, engine and probes.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from . import yamlio
from .errors import LockError

SCHEMA = 1
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,99}$")
SHA_RE = re.compile(r"^[0-9a-f]{64}$")
CUDA_SOURCES = ("wheels", "apt", "host", "none")
TOP_KEYS = {"lock", "name", "description", "platform", "indexes", "requires", "overrides", "packages",
            "unresolved", "patches", "engine", "probes"}


@dataclass
class Package:
    name: str                    # canonical (PEP 503) name
    version: str
    sha256: str | None = None    # of the wheel file; required to install
    filename: str | None = None
    url: str | None = None       # https://..., file:///..., or a path relative to the lock
    index: str | None = None     # key into `indexes`, for information
    line: int = 0

    @property
    def pin(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass
class Override:
    package: str
    pins: str        # the requirement the package declares, e.g. flashinfer_python==0.6.3
    use: str         # what the lock uses instead, e.g. flashinfer-python==0.6.4
    reason: str
    line: int = 0


@dataclass
class Cuda:
    version: str | None = None
    source: str = "none"         # wheels | apt | host | none
    package: str | None = None   # apt package, e.g. cuda-toolkit-13-0
    home: str | None = None      # CUDA_HOME override (apt: /usr/local/cuda-X.Y)


@dataclass
class Platform:
    python: str
    os: str | None = None
    arch: str = "x86_64"
    compute_capability: list[str] = field(default_factory=list)
    driver_min: str | None = None
    cuda: Cuda = field(default_factory=Cuda)


@dataclass
class Lock:
    name: str
    platform: Platform
    path: str = "<lock>"
    description: str = ""
    indexes: dict[str, str] = field(default_factory=dict)
    requires: list[str] = field(default_factory=list)
    overrides: list[Override] = field(default_factory=list)
    packages: list[Package] = field(default_factory=list)
    unresolved: list[dict] = field(default_factory=list)
    patches: list[str] = field(default_factory=list)
    engine: dict = field(default_factory=dict)
    probes: dict = field(default_factory=dict)
    raw: dict = field(default_factory=dict, repr=False)
    doc: yamlio.Doc | None = field(default=None, repr=False)

    @property
    def digest(self) -> str:
        """sha256 of the lock's content (canonical JSON), independent of formatting."""
        return hashlib.sha256(json.dumps(self.raw, sort_keys=True, default=str).encode()).hexdigest()

    def package(self, name: str) -> Package | None:
        n = canonicalize_name(name)
        return next((p for p in self.packages if p.name == n), None)

    def versions(self) -> dict[str, str]:
        return {p.name: p.version for p in self.packages}

    def where(self, *keys) -> str:
        return self.doc.where(*keys) if self.doc else self.path

    def resolve_path(self, rel: str) -> Path:
        """A path named in the lock: absolute, relative to the lock's folder or its parents, else shipped with provision."""
        p = Path(rel)
        if p.is_absolute():
            return p
        base = Path(self.path).resolve().parent
        for d in (base, *base.parents[:2]):
            if (d / p).exists():
                return d / p
        from .bundled import find     # a series shipped with provision, e.g. patches/sglang-0.5.9
        return find(rel) or base / p


class _V:
    """Validation helpers bound to one document, raising LockError at file:line."""

    def __init__(self, doc: yamlio.Doc):
        self.doc = doc

    def fail(self, keys: tuple, msg: str):
        field_name = ".".join(str(k) for k in keys) or "<document>"
        raise LockError(f"{field_name}: {msg}", where=self.doc.where(*keys))

    def get(self, obj: dict, keys: tuple, key: str, typ, required=False, default=None):
        if key not in obj or obj[key] is None:
            if required:
                self.fail(keys, f"missing required field '{key}'")
            return default
        v = obj[key]
        if typ is str and isinstance(v, (int, float)) and not isinstance(v, bool):
            v = str(v)   # python: 3.12 written without quotes
        if not isinstance(v, typ):
            want = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
            self.fail(keys + (key,), f"expected {want}, got {type(v).__name__}")
        return v


def _parse(doc: yamlio.Doc) -> Lock:
    v = _V(doc)
    d = doc.data
    if not isinstance(d, dict):
        v.fail((), "a lock is a YAML mapping")
    unknown = sorted(set(map(str, d)) - TOP_KEYS)
    if unknown:
        v.fail((unknown[0],), f"unknown field (known: {', '.join(sorted(TOP_KEYS))})")
    schema = v.get(d, (), "lock", int, required=True)
    if schema != SCHEMA:
        v.fail(("lock",), f"unsupported lock schema {schema} (this tool reads {SCHEMA})")
    name = v.get(d, (), "name", str, required=True)
    if not NAME_RE.match(name):
        v.fail(("name",), f"{name!r} is not a valid name (letters, digits, . _ + -)")

    pl = v.get(d, (), "platform", dict, required=True)
    k = ("platform",)
    python = v.get(pl, k, "python", str, required=True)
    if not re.match(r"^3\.\d+$", python):
        v.fail(k + ("python",), f"expected a minor version like \"3.12\", got {python!r}")
    gpus = v.get(pl, k, "gpus", dict, default={})
    ccs = [str(c) for c in v.get(gpus, k + ("gpus",), "compute_capability", list, default=[])]
    for i, c in enumerate(ccs):
        if not re.match(r"^\d+\.\d+$", c):
            v.fail(k + ("gpus", "compute_capability", i), f"expected like \"12.0\", got {c!r}")
    drv = v.get(pl, k, "driver", dict, default={})
    driver_min = v.get(drv, k + ("driver",), "min", str)
    if driver_min and not re.match(r"^\d+(\.\d+){0,2}$", driver_min):
        v.fail(k + ("driver", "min"), f"not a driver version: {driver_min!r}")
    cu = v.get(pl, k, "cuda", dict, default={})
    ck = k + ("cuda",)
    cuda = Cuda(version=v.get(cu, ck, "version", str), source=v.get(cu, ck, "source", str, default="none"),
                package=v.get(cu, ck, "package", str), home=v.get(cu, ck, "home", str))
    if cuda.source not in CUDA_SOURCES:
        v.fail(ck + ("source",), f"expected one of {', '.join(CUDA_SOURCES)}, got {cuda.source!r}")
    if cuda.source != "none" and not cuda.version:
        v.fail(ck, "cuda.version is required when a CUDA source is named")
    if cuda.source == "apt" and not cuda.package:
        v.fail(ck, "cuda.source apt needs cuda.package (e.g. cuda-toolkit-13-0)")
    platform = Platform(python=python, os=v.get(pl, k, "os", str), arch=v.get(pl, k, "arch", str, default="x86_64"),
                        compute_capability=ccs, driver_min=driver_min, cuda=cuda)

    indexes = v.get(d, (), "indexes", dict, default={})
    for key, url in indexes.items():
        if not isinstance(url, str):
            v.fail(("indexes", key), "expected a URL string")

    requires = [str(r) for r in v.get(d, (), "requires", list, default=[])]
    for i, r in enumerate(requires):
        try:
            Requirement(r)
        except InvalidRequirement as e:
            v.fail(("requires", i), f"invalid requirement {r!r}: {e}")

    overrides = []
    for i, o in enumerate(v.get(d, (), "overrides", list, default=[])):
        ok = ("overrides", i)
        if not isinstance(o, dict):
            v.fail(ok, "expected a mapping with package, pins, use, reason")
        ov = Override(package=canonicalize_name(v.get(o, ok, "package", str, required=True)),
                      pins=v.get(o, ok, "pins", str, required=True), use=v.get(o, ok, "use", str, required=True),
                      reason=v.get(o, ok, "reason", str, required=True), line=doc.line(*ok))
        if len(ov.reason.strip()) < 10:
            v.fail(ok + ("reason",), "an override needs a real reason")
        for fld in ("pins", "use"):
            try:
                Requirement(getattr(ov, fld))
            except InvalidRequirement as e:
                v.fail(ok + (fld,), f"invalid requirement: {e}")
        overrides.append(ov)

    packages, seen = [], {}
    for i, p in enumerate(v.get(d, (), "packages", list, default=[])):
        pk = ("packages", i)
        if not isinstance(p, dict):
            v.fail(pk, "expected a mapping with name, version, sha256, url")
        pname = canonicalize_name(v.get(p, pk, "name", str, required=True))
        ver = v.get(p, pk, "version", str, required=True)
        try:
            Version(ver)
        except InvalidVersion:
            v.fail(pk + ("version",), f"invalid version {ver!r} for {pname}")
        sha = v.get(p, pk, "sha256", str)
        if sha is not None and not SHA_RE.match(sha):
            v.fail(pk + ("sha256",), f"{pname}: sha256 must be 64 lowercase hex digits")
        if pname in seen:
            v.fail(pk + ("name",), f"{pname} listed twice (also at line {seen[pname]})")
        seen[pname] = doc.line(*pk)
        idx = v.get(p, pk, "index", str)
        if idx and idx not in indexes:
            v.fail(pk + ("index",), f"{pname}: index {idx!r} is not declared under indexes")
        packages.append(Package(name=pname, version=ver, sha256=sha, filename=v.get(p, pk, "filename", str),
                                url=v.get(p, pk, "url", str), index=idx, line=doc.line(*pk)))

    unresolved = v.get(d, (), "unresolved", list, default=[])
    for i, u in enumerate(unresolved):
        if not isinstance(u, dict) or "name" not in u or "reason" not in u:
            v.fail(("unresolved", i), "expected {name, reason}")

    patches = [str(x) for x in v.get(d, (), "patches", list, default=[])]
    engine = v.get(d, (), "engine", dict, default={})
    probes = v.get(d, (), "probes", dict, default={})
    ms = probes.get("min_speedup")
    if ms is not None and (isinstance(ms, bool) or not isinstance(ms, (int, float)) or ms <= 0):
        v.fail(("probes", "min_speedup"), f"expected a positive number, got {ms!r}")
    return Lock(name=name, platform=platform, path=doc.path, description=str(d.get("description") or ""),
                indexes=indexes, requires=requires, overrides=overrides, packages=packages,
                unresolved=unresolved, patches=patches, engine=engine, probes=probes, raw=d, doc=doc)


def load(path: str | Path) -> Lock:
    return _parse(yamlio.load(path))


def loads(text: str, name: str = "<lock>") -> Lock:
    return _parse(yamlio.loads(text, name))


def from_data(data: dict, name: str = "<lock>") -> Lock:
    """A lock from already-parsed data (a saved plan, a generation's lock.yaml)."""
    return loads(yamlio.dump(data), name)


def dump(lock_or_data) -> str:
    data = lock_or_data.raw if isinstance(lock_or_data, Lock) else lock_or_data
    return yamlio.dump(data)


def package_data(p: Package) -> dict:
    return {k: v for k, v in asdict(p).items() if v is not None and k != "line"}
