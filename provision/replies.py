"""The declared interface of the host steps: one dataclass per agent reply the controller reads (those of the steps
declared in provision/steps with them, the rest here), and the one checked reader that builds it. A reply of the wrong shape is one ReplyError line naming the host, the step and the field;
`to_json` gives the reply back as the host sent it, each field the reader checked in its checked form."""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from .errors import HostError
from .steps import GENERATION_RE, Reply, as_json, check, host_path  # noqa: F401  (host_path: facts.py)
from .steps.state import (Collected, Gc, GenerationVerify, History, HistoryGeneration, KernelEntry,  # noqa: F401
                          KernelsCollected, Logs, LogTail, ProbeLine, ProbeMark, QuickCheck, Recovered, Rollback,
                          Status, StoreCollected, Switched, VerifyMark)
WHEEL_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+!-]{0,250}\.whl\Z")

PATH = {"path": True}                                              # a field that names a path on the host
GEN_ID = {"pattern": GENERATION_RE, "what": "a generation id"}
WHEEL = {"pattern": WHEEL_FILE, "what": "a wheel file name"}
SHA256 = {"pattern": re.compile(r"^[0-9a-f]{64}\Z"), "what": "a sha256"}
VERDICT = {"pattern": re.compile(r"^(clean|drift)\Z"), "what": "clean or drift"}


class ReplyError(HostError):
    """A host's reply that is not of its step's declared shape (where = host)."""


def read(cls, data, host: str, step: str, *, title: str | None = None, given: dict | None = None):
    """An instance of reply dataclass `cls` from `data`, each field checked against its declaration (steps.check);
    a field without a default must be there. `given` fields are set, not read. ReplyError: "the host's STEP reply
    is malformed: FIELD: why" (`title` in its place)."""
    def bad(name: str, why: str):
        refuse(host, step, name, why, title)

    return check(cls, data, bad, given=given, raw=True, top=step)


def refuse(host: str, step: str, name: str, why: str, title: str | None = None):
    """The one line for a reply of the wrong shape: ReplyError naming the host, the step and the field."""
    what = title or "the host's %s reply is" % step
    raise ReplyError(f"{what} malformed: {name}: {why}", where=host)


def given(reply, **values):
    """`reply` with fields the controller sets (metadata `given`; dataclasses.replace), the host's reply kept for
    `to_json`."""
    made = replace(reply, **values)
    if hasattr(reply, "_raw"):
        object.__setattr__(made, "_raw", reply._raw)
    return made


to_json = as_json       # a reply read by `read` as the host sent it (keys no dataclass declares kept), checked fields as checked


# ---------------------------------------------------------------- the state agent (generations.py)
# status, history, logs, rollback, switch and gc are declared with their steps (steps/state.py)

@dataclass(frozen=True)
class Prepared(Reply):
    """`prepare`: the new generation's directory and venv (under the root's generations/: the caller checks)."""
    STEP = "prepare"
    id: str = field(metadata=GEN_ID)
    dir: str = field(metadata=PATH)
    venv: str = field(metadata=PATH)


@dataclass(frozen=True)
class Adopted(Reply):
    STEP = "adopt"
    id: str = field(metadata=GEN_ID)
    dir: str = field(metadata=PATH)


@dataclass(frozen=True)
class Marked(Reply):
    STEP = "mark"
    id: str = field(metadata=GEN_ID)
    status: str | None = None
    bookkeeping_failed: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class GenerationRead(Reply):
    """`read`: a generation's manifest and lock text."""
    STEP = "read"
    id: str = field(metadata=GEN_ID)
    manifest: dict = field(default_factory=dict)
    lock_text: str | None = None


# ---------------------------------------------------------------- the verify agent (verify.py)

@dataclass(frozen=True)
class DistCheck(Reply):
    version: str
    changed: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Sealed(Reply):
    changed: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    bytecode: dict[str, str] = field(default_factory=dict)
    generation: list[str] = field(default_factory=list)      # the generation's own files that steer what runs
    unchecked: list[str] = field(default_factory=list)       # what no record of an older version lets it check
    how: str | None = None


@dataclass(frozen=True)
class OutsideCode(Reply):
    """Code a generation runs from outside itself (an editable install, a .pth path, a finder, an .egg-link)."""
    file: str
    where: str
    why: str
    dist: str | None = None
    version: str | None = None


@dataclass(frozen=True)
class Checked(Reply):
    """`verify` and `seal`: every file of a generation against its RECORD, by distribution, and its seal."""
    STEP = "verify"
    files: int
    bytes: int
    seconds: float
    dists: dict[str, DistCheck] = field(default_factory=dict)
    extra: list[str] = field(default_factory=list)
    unclaimed_patches: list[str] = field(default_factory=list)
    sealed: Sealed | None = None
    outside_code: list[OutsideCode] = field(default_factory=list)
    jobs: int | None = None
    bytecode_checked: int = 0
    read_seconds: float | None = None
    read_bytes: int | None = None
    cache: str | None = None
    stored: int = 0
    stored_bytes: int = 0
    stamped: int | None = None


# ---------------------------------------------------------------- the pack agent (pack.py)

@dataclass(frozen=True)
class PackedWheel(Reply):
    name: str
    version: str
    filename: str = field(metadata=WHEEL)
    sha256: str = field(metadata=SHA256)
    size: int = 0
    stored: int = 0
    deflated: int = 0


@dataclass(frozen=True)
class PackSeconds(Reply):
    plan: float
    pack: float
    read: float


@dataclass(frozen=True)
class Unpackable(Reply):
    """A distribution no wheel can hold truthfully: its name, the path that says so, why."""
    dist: str
    path: str
    why: str
    version: str | None = None


@dataclass(frozen=True)
class PackRefused(Reply):
    """`pack` refused: installed files that no longer match their RECORD, by distribution (`drift`), or
    distributions no wheel can hold (`unpackable`)."""
    STEP = "pack"
    refused: str
    drift: dict[str, list[str]] = field(default_factory=dict)
    unpackable: list[Unpackable] = field(default_factory=list)


@dataclass(frozen=True)
class Packed(Reply):
    """`pack`: the wheels rebuilt from a generation, what was read, and how long each phase took."""
    STEP = "pack"
    python: str
    wheels: list[PackedWheel]
    seconds: PackSeconds
    files: int
    bytes: int
    read_bytes: int
    drift: dict[str, list[str]] = field(default_factory=dict)
    jobs: int | None = None
    workers: str | None = None
    cache: str | None = None
    level: int | None = None
    level_auto: bool = False
    extra: int = 0

    @classmethod
    def of(cls, data, host: str):
        """A PackRefused where the host refused, else a Packed."""
        refused = isinstance(data, dict) and data.get("refused") is not None
        return read(PackRefused if refused else cls, data, host, cls.STEP)


# ---------------------------------------------------------------- the fetch and install agents (build.py)

@dataclass(frozen=True)
class Recheck(Reply):
    """Cache entries hashed again before a build uses them; `healed`: those that no longer matched, removed."""
    checked: int = 0
    bytes: int = 0
    seconds: float = 0.0
    healed: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Have(Reply):
    """`have`: which of the files asked about the host's cache lacks (their indexes in the request)."""
    STEP = "have"
    missing: list[int]
    recheck: Recheck | None = None


@dataclass(frozen=True)
class LostEntry(Reply):
    """An inode that left the host's store without its attribute, and the generations that still share it."""
    generations: list[str] = field(metadata=GEN_ID)
    links: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class StoreFigures(Reply):
    linked: int = 0
    entered: int = 0
    entered_bytes: int = 0
    hashed: int = 0
    evicted: int = 0
    lost: list[LostEntry] = field(default_factory=list)


@dataclass(frozen=True)
class Built(Reply):
    """`build`: the generation's venv filled; the figures the build step's line shows."""
    STEP = "build"
    installer: str
    fetched: int = 0
    fetched_bytes: int = 0
    fetch_seconds: float = 0.0
    cached: int = 0
    retries: int = 0
    install_seconds: float | None = None
    isolation: str | None = None
    isolation_why: str | None = None
    store: StoreFigures | None = None
    recheck: Recheck | None = None


@dataclass(frozen=True)
class BuildEvent(Reply):
    """A progress event of the build (its steps cache, fetch, store, venv, install): what the progress line shows."""
    STEP = "build progress"
    step: str | None = None
    healed: list[str] = field(default_factory=list)      # cache: entries removed, as they no longer matched
    summary: bool = False                                # fetch: done (fetched, cached, bytes, seconds)
    fetched: int = 0
    cached: int = 0
    retry: str | None = None                             # fetch: what is tried again, why, in how long
    why: str | None = None
    wait: float = 0.0
    done: int = 0                                        # fetch and store: how far
    total: int = 0
    bytes: int = 0
    total_bytes: int = 0
    rate: float = 0.0
    eta: float | None = None
    seconds: float | None = None
    line: str | None = None                              # venv, install: a line of the installer's
    phase: bool = False


# ---------------------------------------------------------------- the probes agent (probes/__init__.py)

PROBE_STATUS = {"pattern": re.compile(r"^(pass|fail|skip|warn)\Z"), "what": "pass, fail, skip or warn"}


@dataclass(frozen=True)
class ProbeResult(Reply):
    name: str
    status: str = field(metadata=PROBE_STATUS)
    reason: str
    figures: dict
    seconds: float | None = None


@dataclass(frozen=True)
class ProbesRun(Reply):
    """`run`: each host probe's verdict, in the generation's interpreter; what that interpreter has installed."""
    STEP = "probe"
    results: list[ProbeResult]
    python: str | None = None
    version: str | None = None
    dists: dict[str, str] = field(default_factory=dict)
    kernels: dict | None = None


# ---------------------------------------------------------------- the patcher and contracts agents (patches.py)

@dataclass(frozen=True)
class InstalledDist(Reply):
    name: str
    version: str
    root: str = field(metadata=PATH)


@dataclass(frozen=True)
class Inspected(Reply):
    """`inspect`: each package asked about, installed (its distribution) or not (None)."""
    STEP = "inspect"
    packages: dict[str, InstalledDist | None]
    python: str | None = None
    site_packages: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PatchRow(Reply):
    name: str
    status: str
    files: list[str] = field(default_factory=list)
    reason: str | None = None


@dataclass(frozen=True)
class SeriesRun(Reply):
    name: str
    patches: list[PatchRow]
    site_packages: str = field(metadata=PATH)


@dataclass(frozen=True)
class PatchRefused(Reply):
    """`run` refused: the patch that did not apply, and why (nothing written)."""
    STEP = "patch"
    mode: str
    failed: str


@dataclass(frozen=True)
class PatchRun(Reply):
    """`run`: each series' patches and their status, each file's sha256 after (PatchRefused where one did not
    apply)."""
    STEP = "patch"
    mode: str
    written: bool
    series: list[SeriesRun]
    files: dict[str, str] = field(metadata=SHA256)
    changed: list[str]

    @classmethod
    def of(cls, data, host: str):
        failed = isinstance(data, dict) and data.get("failed") is not None
        return read(PatchRefused if failed else cls, data, host, cls.STEP)


@dataclass(frozen=True)
class Mismatch(Reply):
    path: str
    expected: str
    actual: str | None = None


@dataclass(frozen=True)
class Mismatches(Reply):
    """`verify`: the manifest's patched files whose sha256 differs (actual None: missing)."""
    STEP = "patch verify"
    mismatches: list[Mismatch]


@dataclass(frozen=True)
class Via(Reply):
    member: str
    class_: str = field(metadata={"key": "class"})
    status: str
    from_: str = field(metadata={"key": "from"})


@dataclass(frozen=True)
class ContractMethod(Reply):
    """A required method: where it is defined (`from`, `at`), or missing (perhaps reachable `via` a member)."""
    method: str
    status: str = field(metadata={"pattern": re.compile(r"^(defined|inherited|missing)\Z"),
                                  "what": "defined, inherited or missing"})
    at: str | None = None
    from_: str | None = field(default=None, metadata={"key": "from"})
    via: Via | None = None


@dataclass(frozen=True)
class ContractMissing(Reply):
    """`check`: no class of the architecture found (why: `reason`)."""
    STEP = "contract"
    arch: str
    found: bool
    ok: bool = False
    reason: str | None = None


@dataclass(frozen=True)
class Contract(Reply):
    """`check`: the EAGLE-3 interface contract of one architecture's class in the installed SGLang, method by
    method (ContractMissing where the class is not found)."""
    STEP = "contract"
    arch: str
    found: bool
    ok: bool
    package: InstalledDist
    module: str
    class_: str = field(metadata={"key": "class"})
    at: str
    mro_: list[str] = field(metadata={"key": "mro"})      # `mro` would be the class's own method
    required_source: str
    methods: list[ContractMethod]

    @classmethod
    def of(cls, data, host: str):
        found = isinstance(data, dict) and data.get("found") is True
        made = read(cls if found else ContractMissing, data, host, cls.STEP)
        for i, m in enumerate(getattr(made, "methods", [])):
            if m.status != "missing" and None in (m.at, m.from_):
                refuse(host, cls.STEP, f"methods[{i}].{'at' if m.at is None else 'from'}", f"missing ({m.status})")
        return made


# ---------------------------------------------------------------- the tool agent (probes/ship.py)

@dataclass(frozen=True)
class Unpacked(Reply):
    """`unpack`: the tool's directory on the host, and whether it is all there (the caller checks where it is)."""
    STEP = "unpack"
    path: str = field(metadata=PATH)
    complete: bool = False


# ---------------------------------------------------------------- the host agent's lock replies (transport.py)

@dataclass(frozen=True)
class Ended(Reply):
    """`end`: a stopped step's agent ended here (`stopped`: it was stopped, not running)."""
    STEP = "end"
    ended: bool = False
    stopped: bool = False


@dataclass(frozen=True)
class Unlocked(Reply):
    """`unlock`: the host lock free, held (why) or broken (the pids ended)."""
    STEP = "unlock"
    state: str = field(metadata={"pattern": re.compile(r"^(free|held|broken)\Z"), "what": "free, held or broken"})
    holder: str | None = None
    why: str | None = None
    heard: float | None = None
    bound: float | None = None
    ended: list[int] = field(default_factory=list)
