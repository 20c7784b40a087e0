"""The lock model: load and validate a stack lockfile (errors carry file:line and field), dump it.

A lock names a platform, what people require, the resolved closure (`packages`, each with
sha256), deliberate `overrides` of a package's own pins, patch series, engine and probes.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version
from urllib.parse import unquote, urlsplit

from . import yamlio
from .errors import LockError

SCHEMA = 1
MAX_SIZE = (1 << 63) - 1       # a wheel's size: a non-negative integer (bytes)
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,99}\Z")
PROJECT_RE = re.compile(r"^([A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9._-]{0,198}[A-Za-z0-9])\Z")    # PEP 508 name
SHA_RE = re.compile(r"^[0-9a-f]{64}\Z")
PYTHON_RE = re.compile(r"^3\.\d{1,2}\Z")
CC_RE = re.compile(r"^\d{1,2}\.\d{1,2}\Z")
DRIVER_RE = re.compile(r"^\d{1,4}(\.\d{1,4}){0,2}\Z")
GLIBC_RE = re.compile(r"^2\.(1[7-9]|[2-9]\d)\Z")      # 2.17 (manylinux2014) and newer
CUDA_RE = re.compile(r"^\d{1,2}\.\d{1,2}(\.\d{1,3})?\Z")
APT_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]{1,99}\Z")
ABS_PATH_RE = re.compile(r"^/[A-Za-z0-9._+/-]{0,4095}\Z")
REL_PATH_RE = re.compile(r"^(?!/)[A-Za-z0-9._+-]+(/[A-Za-z0-9._+-]+)*/?\Z")
OS_RE = re.compile(r"^[A-Za-z0-9._+-]{1,64}\Z")
ARCH_RE = re.compile(r"^[a-z0-9_]{1,32}\Z")
IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,199}\Z")
ARG_RE = re.compile(r"^(?!-)[^\x00-\x1f\x7f]{1,4096}\Z")
DEVICE_RE = re.compile(r"^(cpu|cuda(:\d{1,3})?)\Z")
DTYPE_RE = re.compile(r"^(float32|float16|bfloat16)\Z")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_CONTROL_ML = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")       # newlines and tabs allowed (free text)
LOOPBACK = ("127.0.0.1", "::1", "localhost")
WHEELHOUSE_ENV = "PROVISION_WHEELHOUSE"
CUDA_SOURCES = ("wheels", "apt", "host", "none")
ENGINE_KINDS = ("none", "included", "sglang")
TOP_KEYS = {"lock", "name", "description", "platform", "indexes", "requires", "overrides", "packages",
            "unresolved", "patches", "engine", "probes", "service"}
PLATFORM_KEYS = {"python", "os", "arch", "glibc", "gpus", "driver", "cuda"}
OVERRIDE_KEYS = {"package", "pins", "use", "reason"}
PACKAGE_KEYS = {"name", "version", "filename", "url", "sha256", "size", "index", "drift"}
ENGINE_KEYS = {"kind", "model", "architecture", "draft", "tp", "port", "speculative", "launch", "device", "dtype",
               "steps", "topk", "num_draft_tokens", "max_seq_len", "threads"}
SPECULATIVE_KEYS = {"algorithm", "steps", "topk", "num_draft_tokens"}
SERVICE_KEYS = {"unit", "manage", "url", "health", "start_deadline", "stop_deadline", "probes", "revert_after",
                "bench", "gates", "gateway"}
BENCH_KEYS = {"prompts", "max_tokens", "concurrency", "repeats", "model"}
GATES_KEYS = {"min_tok_s_ratio", "min_accept_length", "max_ttft_ratio", "min_greedy_agreement", "noise"}
GATEWAY_KEYS = {"url", "worker"}
UNIT_RE = re.compile(r"^(?!-)[A-Za-z0-9:_.@-]{1,248}\.service\Z")     # a systemd service unit's name
_HOST = r"(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9]([A-Za-z0-9.-]{0,252}[A-Za-z0-9])?)"     # a bracketed IPv6, a name
HTTP_RE = re.compile(r"^https?://" + _HOST + r"(:\d{1,5})?/?\Z")              # groups: host, name tail, :port
MANAGE = ("own", "provision")       # the operator's own unit, or one provision writes from the engine's launch
HEALTH_KINDS = ("generate", "completion")    # SGLang's /health_generate; /health then one real completion
SERVICE_PROBES = ("after-stop", "beside")    # the GPU probes on GPUs the stop freed, or beside the server
PROBES_KEYS = {"min_speedup", "max_tokens", "prompts", "timeout", "engine_timeout", "collective_timeout"}


@dataclass
class Package:
    name: str                    # canonical (PEP 503) name
    version: str
    sha256: str | None = None    # of the wheel file; required to install
    filename: str | None = None
    url: str | None = None       # https://... or file:///...; None: only from the host's wheel cache
    index: str | None = None     # key into `indexes`, for information
    size: int | None = None      # bytes of the wheel file, where the index said (PEP 700)
    drift: list[str] | None = None   # `pack --allow-drift`: files packed as found, not as their RECORD says
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
    glibc: str = "2.28"          # the oldest glibc of the target hosts: wheels up to manylinux_2_<minor>
    compute_capability: list[str] = field(default_factory=list)
    driver_min: str | None = None
    cuda: Cuda = field(default_factory=Cuda)


@dataclass
class Bench:
    """The benchmark a cutover runs over the server's OpenAI API: against the generation it replaces, just before
    the stop, and against the new one after its start."""

    prompts: list[str] = field(default_factory=list)    # chat prompts; none: the ones shipped with provision
    max_tokens: int = 64
    concurrency: list[int] = field(default_factory=lambda: [1])
    repeats: int = 3
    model: str | None = None          # the API's model name; default: the first /v1/models lists


@dataclass
class Gates:
    """What the new generation must show against the one it replaces, measured in the same cutover."""

    min_tok_s_ratio: float = 0.9      # tok/s at each concurrency ≥ this × the reference's
    min_accept_length: float | None = None   # where speculation is on
    max_ttft_ratio: float | None = None       # time to first token ≤ this × the reference's
    min_greedy_agreement: float | None = None  # always reported; a gate where set
    noise: float = 0.05               # the margin the ratios allow for run-to-run noise


@dataclass
class Gateway:
    """An SGLang gateway (router) in front of the host: the worker is removed before the stop, re-added after."""

    url: str
    worker: str                       # this host's worker URL as the gateway lists it


@dataclass
class Service:
    """The systemd unit that serves from `<root>/current`, and how its cutover is proven."""

    unit: str
    manage: str = "own"
    url: str = "http://127.0.0.1:30000"
    health: str = "generate"
    start_deadline: float = 600.0     # seconds from the start to a healthy server
    stop_deadline: float = 120.0      # seconds from the stop until its processes and GPU contexts are gone
    probes: str = "after-stop"
    revert_after: float = 900.0       # a cutover its controller never confirms reverts by itself after this
    bench: Bench = field(default_factory=Bench)
    gates: Gates = field(default_factory=Gates)
    gateway: Gateway | None = None


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
    service: Service | None = None
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

    def stale_overrides(self) -> list[tuple[int, Override]]:
        """(index, override) of each override of a package the lock neither pins nor lists as unresolved."""
        have = {p.name for p in self.packages} | {canonicalize_name(str(u["name"])) for u in self.unresolved}
        return [(i, o) for i, o in enumerate(self.overrides) if canonicalize_name(o.package) not in have]

    def stale_override_warnings(self) -> list[str]:
        return [f"override for {o.package}, which is not in the closure ({self.where('overrides', i)})"
                for i, o in self.stale_overrides()]

    def resolve_path(self, rel: str) -> Path:
        """A path named in the lock: absolute, relative to the lock's folder or its parents, else shipped with provision."""
        p = Path(rel)
        if p.is_absolute():
            return p
        base = Path(self.path).resolve().parent
        for d in (base, *base.parents[:2]):
            if (d / p).exists():
                if ".." in p.parts or not _inside(os.path.realpath(d / p), d):
                    raise LockError(f"{rel!r} leads outside {d} (through '..' or a symbolic link); refused",
                                    where=self.path)
                return d / p
        from .bundled import find     # a series shipped with provision, e.g. patches/sglang-0.5.9
        return find(rel) or base / p


class _V:
    """Typed field readers bound to one document: unknown keys and mistyped values raise LockError at file:line."""

    def __init__(self, doc: yamlio.Doc):
        self.doc = doc

    def fail(self, keys: tuple, msg: str):
        field_name = ".".join(str(k) for k in keys) or "<document>"
        raise LockError(f"{field_name}: {msg}", where=self.doc.where(*keys))

    def mapping(self, obj, keys: tuple, known, what: str = "a mapping") -> dict:
        """`obj` as a mapping whose keys are all in `known`."""
        if not isinstance(obj, dict):
            self.fail(keys, f"expected {what}, got {_kind(obj)}")
        for k in obj:
            if not isinstance(k, str) or k not in known:
                self.fail(keys + (k,), f"unknown field {str(k)!r} (known here: {', '.join(sorted(known))})")
        return obj

    def get(self, obj: dict, keys: tuple, key: str, typ, required=False, default=None, multiline=False):
        if key not in obj or obj[key] is None:
            if required:
                self.fail(keys, f"missing required field '{key}'")
            return default
        v = obj[key]
        if typ is str and isinstance(v, (int, float)) and not isinstance(v, bool):
            written = self.doc.text(*keys, key) or str(v)
            self.fail(keys + (key,), f"expected a string, got the number {v!r}: quote it (\"{written}\")")
        if isinstance(v, bool) and typ in (int, float, (int, float)):
            self.fail(keys + (key,), f"expected a number, got {v!r}")
        if not isinstance(v, typ):
            want = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
            self.fail(keys + (key,), f"expected {want}, got {_kind(v)}")
        if typ is str:
            self.text(keys + (key,), v, multiline)
        return v

    def text(self, keys: tuple, v: str, multiline: bool = False) -> str:
        bad = _CONTROL_ML if multiline else _CONTROL
        if bad.search(v):
            self.fail(keys, "control characters (newline, tab, NUL, escape …) are not allowed here")
        return v

    def match(self, obj, keys, key, pattern, what, required=False, default=None):
        v = self.get(obj, keys, key, str, required=required, default=default)
        if v is not None and not pattern.match(v):
            self.fail(keys + (key,), f"{v!r} is not {what}")
        return v

    def number(self, obj, keys, key, lo, hi, integer=False, default=None):
        v = self.get(obj, keys, key, int if integer else (int, float), default=default)
        if v is not None and not (math.isfinite(v) and lo <= v <= hi):
            self.fail(keys + (key,), f"{v!r} is out of range ({lo}–{hi})")
        return v

    def strings(self, obj, keys, key, pattern=None, what="", default=(), multiline=False) -> list[str]:
        items = self.get(obj, keys, key, list, default=list(default))
        for i, item in enumerate(items):
            self.get({i: item}, keys + (key,), i, str, required=True, multiline=multiline)
            if pattern is not None and not pattern.match(item):
                self.fail(keys + (key, i), f"{item!r} is not {what}")
        return items

    def items(self, obj, keys, key, known, what) -> list[tuple[tuple, dict]]:
        """A list of mappings with `known` keys: [(keys of the item, item)]."""
        out = []
        for i, item in enumerate(self.get(obj, keys, key, list, default=[])):
            k = keys + (key, i)
            out.append((k, self.mapping(item, k, known, what)))
        return out


def _kind(v) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", type(None): "nothing"}.get(
        type(v), f"a {type(v).__name__}")


URL_REFUSED = re.compile(r"[^A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]|%(?![0-9A-Fa-f]{2})")


def _url(v: _V, keys: tuple, url: str, base: Path | None, wheelhouses: list[Path]) -> str:
    """https://, http:// to this machine only, or file:// inside the lock's folder (`base`) or a configured
    wheelhouse. Only the characters RFC 3986 allows (a space, a backtick, quotes, braces, `\\`, `|`, `^`, `<`, `>`
    or a control character is refused, as is a `%` not followed by two hex digits)."""
    bad = URL_REFUSED.search(url)
    if bad:
        v.fail(keys, f"invalid URL: character {bad.group(0)!r} at position {bad.start() + 1} is not allowed in a "
                     f"URL (RFC 3986): {url!r}")
    try:
        u = urlsplit(url)
        host = u.hostname
        u.port                      # raises ValueError for a port that is not a number 0-65535
    except ValueError as e:
        v.fail(keys, f"invalid URL: {e}")
    if u.username or u.password:
        v.fail(keys, "credentials in a URL are refused (keep them out of the lock: uv and pip read them from "
                     "their own configuration)")
    if u.scheme == "https" or (u.scheme == "http" and host in LOOPBACK):
        if not host:
            v.fail(keys, f"{url!r} names no host")
        return url
    if u.scheme == "file":
        if host not in (None, "", "localhost"):
            v.fail(keys, f"file:// URL names a host ({host})")
        path = Path(unquote(u.path))
        if not path.is_absolute() or ".." in path.parts:
            v.fail(keys, f"file:// URL must be an absolute path without '..': {url!r}")
        real = os.path.realpath(path)
        if base is not None and not any(_inside(real, d) for d in (base, *wheelhouses)):
            v.fail(keys, f"file:// URL outside the lock's folder ({base}) and the configured wheelhouses "
                         f"({WHEELHOUSE_ENV}): {url!r}")
        return url
    v.fail(keys, f"URL must be https:// (http:// only to this machine) or file://, got {url!r}")


def _inside(real: str, folder: Path) -> bool:
    top = os.path.realpath(folder)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def wheelhouses() -> list[Path]:
    """Folders whose wheels a lock may name by file:// besides its own folder (PROVISION_WHEELHOUSE, os.pathsep)."""
    return [Path(p) for p in os.environ.get(WHEELHOUSE_ENV, "").split(os.pathsep) if p.strip()]


def _parse(doc: yamlio.Doc) -> Lock:
    v = _V(doc)
    d = v.mapping(doc.data, (), TOP_KEYS, "a lock (a YAML mapping)")
    schema = v.get(d, (), "lock", int, required=True)
    if isinstance(schema, bool) or schema != SCHEMA:
        v.fail(("lock",), f"unsupported lock schema {schema!r} (this tool reads {SCHEMA})")
    name = v.match(d, (), "name", NAME_RE, "a valid name (letters, digits, . _ + -)", required=True)
    description = v.get(d, (), "description", str, default="", multiline=True)
    # file:// containment is judged against the folder of a lock read from a file here; a lock carried
    # in a saved plan was judged when the plan was read, and one read back from a host is never built.
    base = Path(doc.path).resolve().parent if Path(doc.path).is_file() else None
    houses = wheelhouses()

    k = ("platform",)
    pl = v.mapping(v.get(d, (), "platform", dict, required=True), k, PLATFORM_KEYS)
    python = v.match(pl, k, "python", PYTHON_RE, 'a minor version like "3.12"', required=True)
    gpus = v.mapping(v.get(pl, k, "gpus", dict, default={}), k + ("gpus",), {"compute_capability"})
    ccs = v.strings(gpus, k + ("gpus",), "compute_capability", CC_RE, 'a compute capability like "12.0"')
    drv = v.mapping(v.get(pl, k, "driver", dict, default={}), k + ("driver",), {"min"})
    driver_min = v.match(drv, k + ("driver",), "min", DRIVER_RE, "a driver version like 580.65.06")
    ck = k + ("cuda",)
    cu = v.mapping(v.get(pl, k, "cuda", dict, default={}), ck, {"version", "source", "package", "home"})
    cuda = Cuda(version=v.match(cu, ck, "version", CUDA_RE, "a CUDA version like 13.0.1"),
                source=v.get(cu, ck, "source", str, default="none"),
                package=v.match(cu, ck, "package", APT_RE, "a Debian package name"),
                home=v.match(cu, ck, "home", ABS_PATH_RE, "an absolute path without '..'"))
    if cuda.home and ".." in cuda.home.split("/"):
        v.fail(ck + ("home",), "an absolute path without '..'")
    if cuda.source not in CUDA_SOURCES:
        v.fail(ck + ("source",), f"expected one of {', '.join(CUDA_SOURCES)}, got {cuda.source!r}")
    if cuda.source != "none" and not cuda.version:
        v.fail(ck, "cuda.version is required when a CUDA source is named")
    if cuda.source == "apt" and not cuda.package:
        v.fail(ck, "cuda.source apt needs cuda.package (e.g. cuda-toolkit-13-0)")
    platform = Platform(python=python, os=v.match(pl, k, "os", OS_RE, "an OS name like ubuntu-24.04"),
                        arch=v.match(pl, k, "arch", ARCH_RE, "a machine name like x86_64", default="x86_64"),
                        glibc=v.match(pl, k, "glibc", GLIBC_RE, 'a glibc version from "2.17" up, like "2.34"',
                                      default="2.28"),
                        compute_capability=ccs, driver_min=driver_min, cuda=cuda)

    indexes = v.get(d, (), "indexes", dict, default={})
    for key in indexes:
        if not isinstance(key, str) or not NAME_RE.match(key):
            v.fail(("indexes", key), f"index name {key!r} is not a valid name (letters, digits, . _ + -)")
        _url(v, ("indexes", key), v.get(indexes, ("indexes",), key, str, required=True), base, houses)

    requires = v.strings(d, (), "requires")
    for i, r in enumerate(requires):
        _requirement(v, ("requires", i), r)

    overrides = []
    for ok, o in v.items(d, (), "overrides", OVERRIDE_KEYS, "a mapping with package, pins, use, reason"):
        ov = Override(package=_name(v, o, ok, "package"), pins=v.get(o, ok, "pins", str, required=True),
                      use=v.get(o, ok, "use", str, required=True),
                      reason=v.get(o, ok, "reason", str, required=True, multiline=True),
                      line=doc.line(*ok))
        if len(ov.reason.strip()) < 10:
            v.fail(ok + ("reason",), "an override needs a real reason")
        for fld in ("pins", "use"):
            _requirement(v, ok + (fld,), getattr(ov, fld))
        overrides.append(ov)

    packages, seen = [], {}
    for pk, p in v.items(d, (), "packages", PACKAGE_KEYS, "a mapping with name, version, filename, url, sha256"):
        pname = _name(v, p, pk, "name")
        ver = v.get(p, pk, "version", str, required=True)
        try:
            version = Version(ver)
        except InvalidVersion:
            v.fail(pk + ("version",), f"invalid version {ver!r} for {pname} (PEP 440)")
        sha = v.match(p, pk, "sha256", SHA_RE, "a sha256 (64 lowercase hex digits)")
        if pname in seen:
            v.fail(pk + ("name",), f"{pname} listed twice (also at line {seen[pname]})")
        seen[pname] = doc.line(*pk)
        idx = v.get(p, pk, "index", str)
        if idx and idx not in indexes:
            v.fail(pk + ("index",), f"{pname}: index {idx!r} is not declared under indexes")
        filename = v.get(p, pk, "filename", str)
        if filename is not None:
            _wheel_filename(v, pk + ("filename",), filename, pname, version)
        url = v.get(p, pk, "url", str)
        if url is not None:
            _url(v, pk + ("url",), url, base, houses)
            last = unquote(urlsplit(url).path.rsplit("/", 1)[-1])
            if filename is not None and last != filename:
                v.fail(pk + ("url",), f"{pname}: the URL's file {last!r} is not the lock's filename {filename!r}")
        drift = v.strings(p, pk, "drift") if p.get("drift") is not None else None
        size = v.number(p, pk, "size", 0, MAX_SIZE, integer=True)
        packages.append(Package(name=pname, version=ver, sha256=sha, filename=filename, url=url, index=idx,
                                size=size, drift=drift, line=doc.line(*pk)))

    unresolved = []
    for uk, u in v.items(d, (), "unresolved", {"name", "requirement", "reason"}, "a mapping with name, reason"):
        _name(v, u, uk, "name")
        if u.get("requirement") is not None:
            _requirement(v, uk + ("requirement",), v.get(u, uk, "requirement", str))
        v.get(u, uk, "reason", str, required=True, multiline=True)
        unresolved.append(u)

    patches = v.strings(d, (), "patches", REL_PATH_RE, "a relative path inside the repository (no '..')")
    for i, rel in enumerate(patches):
        if ".." in rel.split("/"):
            v.fail(("patches", i), f"{rel!r} is not a relative path inside the repository (no '..')")
    engine = _engine(v, d)
    probes = _probes(v, d)
    return Lock(name=name, platform=platform, path=doc.path, description=description,
                indexes=indexes, requires=requires, overrides=overrides, packages=packages,
                unresolved=unresolved, patches=patches, engine=engine, probes=probes, service=_service(v, d, engine),
                raw=d, doc=doc)


def _name(v: _V, obj: dict, keys: tuple, key: str) -> str:
    """A project name (PEP 508), returned in its PEP 503 canonical form."""
    return canonicalize_name(v.match(obj, keys, key, PROJECT_RE, "a valid project name (PEP 508)", required=True))


def _requirement(v: _V, keys: tuple, text: str) -> Requirement:
    try:
        req = Requirement(text)
    except InvalidRequirement as e:     # packaging's message is several lines (a caret under the text): its first
        v.fail(keys, f"invalid requirement {text!r}: {str(e).splitlines()[0] if str(e) else 'unparseable'}")
    if req.url:
        v.fail(keys, f"{text!r}: direct URL requirements are refused (name the package and its version)")
    return req


def _wheel_filename(v: _V, keys: tuple, filename: str, name: str, version: Version) -> None:
    if "/" in filename or "\\" in filename or filename in (".", ".."):
        v.fail(keys, f"{filename!r} must be a plain file name (no path separator)")
    try:
        wname, wversion, _, _ = parse_wheel_filename(filename)
    except (InvalidWheelFilename, InvalidVersion) as e:
        v.fail(keys, f"{filename!r} is not a wheel file name: {e}")
    if canonicalize_name(wname) != name or wversion != version:
        v.fail(keys, f"{filename!r} is a wheel of {wname} {wversion}, not of {name} {version}")


def _engine(v: _V, d: dict) -> dict:
    k = ("engine",)
    e = v.mapping(v.get(d, (), "engine", dict, default={}), k, ENGINE_KEYS)
    kind = v.get(e, k, "kind", str, default="none")
    if kind not in ENGINE_KINDS:
        v.fail(k + ("kind",), f"expected one of {', '.join(ENGINE_KINDS)}, got {kind!r}")
    for key in ("model", "draft"):
        v.match(e, k, key, ARG_RE, "a model path or hub id (not starting with '-')")
    v.match(e, k, "architecture", IDENT_RE, "a Python class name like KimiK25ForConditionalGeneration")
    v.match(e, k, "device", DEVICE_RE, "cpu, cuda or cuda:N")
    v.match(e, k, "dtype", DTYPE_RE, "one of float32, float16, bfloat16")
    v.number(e, k, "tp", 1, 1024, integer=True)
    v.number(e, k, "port", 1, 65535, integer=True)
    v.number(e, k, "max_seq_len", 1, 1 << 22, integer=True)
    v.number(e, k, "threads", 0, 1024, integer=True)
    for sk, obj in ((k, e), (k + ("speculative",), v.mapping(v.get(e, k, "speculative", dict, default={}),
                                                               k + ("speculative",), SPECULATIVE_KEYS))):
        v.number(obj, sk, "steps", 1, 64, integer=True)
        v.number(obj, sk, "topk", 1, 64, integer=True)
        v.number(obj, sk, "num_draft_tokens", 1, 1024, integer=True)
    v.match(e.get("speculative") or {}, k + ("speculative",), "algorithm", IDENT_RE, "an algorithm name like EAGLE3")
    launch = e.get("launch")
    if launch is not None:
        if not isinstance(launch, list) or not launch:
            v.fail(k + ("launch",), "expected the command as a non-empty list of strings (argv), not a shell line")
        v.strings(e, k, "launch")
        if not launch[0].strip():
            v.fail(k + ("launch", 0), "the program to run is empty")
    return e


def _probes(v: _V, d: dict) -> dict:
    k = ("probes",)
    p = v.mapping(v.get(d, (), "probes", dict, default={}), k, PROBES_KEYS)
    ms = p.get("min_speedup")
    if ms is not None and (isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 < ms <= 1000):
        v.fail(k + ("min_speedup",), f"expected a positive number (at most 1000), got {ms!r}")
    v.number(p, k, "max_tokens", 1, 1 << 20, integer=True)
    for key in ("timeout", "engine_timeout", "collective_timeout"):
        v.number(p, k, key, 1, 7 * 86400)
    v.strings(p, k, "prompts", multiline=True)
    return p


def _service(v: _V, d: dict, engine: dict) -> Service | None:
    k = ("service",)
    s = v.get(d, (), "service", dict)
    if s is None:
        return None
    v.mapping(s, k, SERVICE_KEYS)
    kind = engine.get("kind", "none")
    manage = _choice(v, s, k, "manage", MANAGE, "own")
    if manage == "provision" and kind == "none":
        v.fail(k + ("manage",), "provision writes the unit from the engine it launches: the lock names none "
                                "(engine.kind: none)")
    out = Service(unit=v.match(s, k, "unit", UNIT_RE, "a systemd service unit name like sglang.service",
                               required=True),
                  manage=manage, url=_http_url(v, s, k, "url", Service.url),
                  health=_choice(v, s, k, "health", HEALTH_KINDS, "completion" if kind == "included" else "generate"),
                  probes=_choice(v, s, k, "probes", SERVICE_PROBES, "after-stop"))
    for key in ("start_deadline", "stop_deadline", "revert_after"):
        setattr(out, key, float(v.number(s, k, key, 1, 86400, default=getattr(out, key))))
    bk = k + ("bench",)
    b = v.mapping(v.get(s, k, "bench", dict, default={}), bk, BENCH_KEYS)
    conc = v.get(b, bk, "concurrency", list, default=[1])
    if not conc:
        v.fail(bk + ("concurrency",), "name at least one concurrency level")
    for i in range(len(conc)):
        v.number({i: conc[i]}, bk + ("concurrency",), i, 1, 4096, integer=True)
    out.bench = Bench(prompts=v.strings(b, bk, "prompts", multiline=True), concurrency=list(conc),
                      max_tokens=v.number(b, bk, "max_tokens", 1, 1 << 16, integer=True, default=Bench.max_tokens),
                      repeats=v.number(b, bk, "repeats", 1, 100, integer=True, default=Bench.repeats),
                      model=v.match(b, bk, "model", ARG_RE, "a model name (not starting with '-')"))
    gk = k + ("gates",)
    g = v.mapping(v.get(s, k, "gates", dict, default={}), gk, GATES_KEYS)
    out.gates = Gates(min_tok_s_ratio=v.number(g, gk, "min_tok_s_ratio", 0.01, 100, default=Gates.min_tok_s_ratio),
                      min_accept_length=v.number(g, gk, "min_accept_length", 1, 1024),
                      max_ttft_ratio=v.number(g, gk, "max_ttft_ratio", 0.01, 1000),
                      min_greedy_agreement=v.number(g, gk, "min_greedy_agreement", 0, 1),
                      noise=v.number(g, gk, "noise", 0, 0.5, default=Gates.noise))
    speculates = kind == "included" or bool(engine.get("speculative") or engine.get("draft"))
    if out.gates.min_accept_length is not None and not speculates:
        v.fail(gk + ("min_accept_length",), "the engine does not speculate (no draft, no speculative): "
                                            "no acceptance length to gate")
    if s.get("gateway") is not None:
        wk = k + ("gateway",)
        w = v.mapping(v.get(s, k, "gateway", dict), wk, GATEWAY_KEYS)
        out.gateway = Gateway(url=_http_url(v, w, wk, "url", None, required=True),
                              worker=_http_url(v, w, wk, "worker", None, required=True))
    return out


def _choice(v: _V, obj: dict, keys: tuple, key: str, choices: tuple, default: str) -> str:
    got = v.get(obj, keys, key, str, default=default)
    if got not in choices:
        v.fail(keys + (key,), f"expected one of {', '.join(choices)}, got {got!r}")
    return got


def _http_url(v: _V, obj: dict, keys: tuple, key: str, default: str | None, required: bool = False) -> str | None:
    """An http(s) URL of a server: scheme, host and port alone (no user, path, query or fragment)."""
    url = v.get(obj, keys, key, str, default=default, required=required)
    m = HTTP_RE.match(url) if url is not None else None
    if url is not None and m is None:
        v.fail(keys + (key,), f"{url!r} is not an http(s) URL of a server (scheme, host, port; no path)")
    if m and m.group(3) and not 1 <= int(m.group(3)[1:]) <= 65535:
        v.fail(keys + (key,), f"{url!r}: port {m.group(3)[1:]} is out of range (1–65535)")
    return url.rstrip("/") if url else url


def load(path: str | Path) -> Lock:
    return _parse(yamlio.load(path))


def loads(text: str, name: str = "<lock>") -> Lock:
    return _parse(yamlio.loads(text, name))


def from_data(data: dict, name: str = "<lock>") -> Lock:
    """A lock from already-parsed data (a saved plan, a generation's lock.yaml)."""
    return loads(yamlio.dump(data), name)


def write(path: Path, text: str) -> Lock:
    """Write a lock's text to `path` once it loads (what provision writes as a lock always loads); its Lock."""
    lock = loads(text, str(path))
    Path(path).write_text(text)
    return lock


def dump(lock_or_data) -> str:
    data = lock_or_data.raw if isinstance(lock_or_data, Lock) else lock_or_data
    return yamlio.dump(data)


def package_data(p: Package) -> dict:
    return {k: v for k, v in asdict(p).items() if v is not None and k != "line"}
