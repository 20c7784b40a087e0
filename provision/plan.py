"""A plan is a pure function of (host facts, lock): the stack changes, rendered Terraform-style.

`make_plan(Facts, Lock)` is the function; `plan_host` gathers a host's facts and makes its plan.
`diff_stacks` is shared by `plan` (host → lock) and `lock diff` (lock → lock); a saved plan
(`load_plans`, `plans_for`) carries the lock and a digest of the facts it was made from, so apply can refuse drift.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from . import yamlio
from .errors import InputError
from .facts import Facts, GenerationFacts, gather_for
from .lock import Lock, from_data
from .transport import Transport
from .toolkit import nvcc_missing
from .units import human_size

PLAN_FORMAT = 3
SYMBOL = {"add": "+", "change": "~", "remove": "-"}
ORDER = ("lock", "python", "toolkit", "driver", "package", "hash", "index", "patch", "probe", "engine", "service")
HEADINGS = {"package": "  packages", "patch": "  patches", "hash": "  wheel hashes (same version)",
            "index": "  indexes", "probe": "  probe expectations", "service": "  service (its cutover)"}
MIN_FREE_BYTES = 1 << 30   # what a build should leave free under the root (less is a warning, not a refusal)
UNPACK_FACTOR = 3   # disk estimate of a wheel not at hand to read: installed, it takes about 3 times its download
BLOCK = 4096        # an installed file takes whole blocks


@dataclass
class Stack:
    """What a host runs (or a lock describes), reduced to everything apply acts on."""

    name: str | None = None
    packages: dict[str, str] = field(default_factory=dict)
    cuda: str | None = None           # "13.0.1 (wheels)"
    driver_min: str | None = None
    patches: dict[str, str] = field(default_factory=dict)   # series name → sha256 of its files
    engine: dict = field(default_factory=dict)
    python: str | None = None
    hashes: dict[str, str] = field(default_factory=dict)    # package → wheel sha256
    indexes: dict[str, str] = field(default_factory=dict)
    probes: dict = field(default_factory=dict)
    service: dict = field(default_factory=dict)             # the lock's service section, its defaults filled in


@dataclass
class Change:
    category: str    # lock | python | toolkit | driver | package | hash | index | patch | probe | engine | service
    name: str
    action: str      # add | change | remove
    old: str | None = None
    new: str | None = None

    @property
    def direction(self) -> str:
        """upgrade / downgrade for version changes, else ''."""
        try:
            if self.action == "change" and self.old and self.new and self.category in ("package", "python", "driver"):
                return "upgrade" if Version(self.new) > Version(self.old) else "downgrade"
        except InvalidVersion:
            pass
        return ""


def series_digest(path: Path) -> str:
    """sha256 over a patch series' files (names and bytes): a changed patch changes the plan."""
    if not path.is_dir():
        return "missing"
    h = hashlib.sha256()
    for f in sorted(x for x in path.rglob("*") if x.is_file() and "__pycache__" not in x.parts):
        h.update(f.relative_to(path).as_posix().encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def stack_of_lock(lock: Lock) -> Stack:
    cu = lock.platform.cuda
    return Stack(name=lock.name, packages=lock.versions(),
                 cuda=f"{cu.version} ({cu.source})" if cu.source != "none" else None,
                 driver_min=lock.platform.driver_min,
                 patches={p.rstrip("/").rsplit("/", 1)[-1]: series_digest(lock.resolve_path(p)) for p in lock.patches},
                 engine=lock.engine or {}, python=lock.platform.python,
                 hashes={p.name: p.sha256 for p in lock.packages if p.sha256},
                 indexes=dict(lock.indexes or {}), probes=dict(lock.probes or {}),
                 service=asdict(lock.service) if lock.service else {})


def _flat(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = json.dumps(v) if not isinstance(v, str) else v
    return out


def _diff_maps(category: str, old: dict, new: dict) -> list[Change]:
    changes = []
    for name in sorted(set(old) | set(new)):
        o, n = old.get(name), new.get(name)
        if o == n:
            continue
        action = "add" if o is None else "remove" if n is None else "change"
        changes.append(Change(category, name, action, o, n))
    return changes


def _one(category: str, name: str, old, new) -> list[Change]:
    return _diff_maps(category, {name: old} if old else {}, {name: new} if new else {})


def _short(sha: str | None) -> str | None:
    return sha if sha in (None, "missing") else f"sha256 {sha[:12]}…"


def diff_stacks(old: Stack, new: Stack) -> list[Change]:
    changes = []
    if old.python and new.python and old.python != new.python:
        changes += _one("python", "python", old.python, new.python)
    changes += _one("toolkit", "cuda", old.cuda, new.cuda)
    changes += _one("driver", "driver min", old.driver_min, new.driver_min)
    changes += _diff_maps("package", old.packages, new.packages)
    same = [n for n in new.packages if old.packages.get(n) == new.packages[n]]
    changes += _diff_maps("hash", {n: _short(old.hashes[n]) for n in same if old.hashes.get(n) and new.hashes.get(n)},
                          {n: _short(new.hashes[n]) for n in same if old.hashes.get(n) and new.hashes.get(n)})
    changes += _diff_maps("index", old.indexes, new.indexes)
    changes += _diff_maps("patch", {k: _short(v) for k, v in old.patches.items()},
                          {k: _short(v) for k, v in new.patches.items()})
    changes += _diff_maps("probe", _flat(old.probes), _flat(new.probes))
    changes += _diff_maps("engine", _flat(old.engine), _flat(new.engine))
    changes += _diff_maps("service", _flat(old.service), _flat(new.service))
    return changes


def summarize(changes: list[Change]) -> dict[str, int]:
    s = {"add": 0, "change": 0, "remove": 0}
    for c in changes:
        s[c.action] += 1
    return s


@dataclass
class Plan:
    host: str
    lock: dict                      # the lock's data, applied exactly by `apply --plan`
    lock_name: str
    lock_digest: str
    facts_digest: str
    base: str | None                # current generation when planned
    changes: list[Change]
    action: str = "build"           # noop | reuse | build: what apply will do, decided here only
    reuse: str | None = None        # the complete generation apply switches to (action reuse)
    current_error: str | None = None   # the current generation's interpreter does not run
    warnings: list[str] = field(default_factory=list)   # every preflight finding
    errors: list[str] = field(default_factory=list)     # the fatal ones: apply refuses before acting
    download: dict = field(default_factory=dict)        # wheels, bytes, unknown, disk_needed, disk_free
    root: str | None = None         # the host root planned for
    format: int = PLAN_FORMAT

    @property
    def noop(self) -> bool:
        return self.action == "noop"

    @property
    def summary(self) -> dict[str, int]:
        return summarize(self.changes)

    def to_json(self) -> dict:
        d = asdict(self)
        d["summary"], d["noop"] = self.summary, self.noop
        return d

    @classmethod
    def from_json(cls, d: dict, where: str = "plan") -> "Plan":
        """A saved plan, checked field by field (InputError: malformed or edited; exit 2)."""
        check_plan_data(d, where)
        p = cls(**{k: d[k] for k in ("host", "lock", "lock_name", "lock_digest", "facts_digest", "base", "action",
                                      "reuse", "current_error", "warnings", "errors", "download", "root")},
                changes=[Change(**c) for c in d["changes"]])
        if from_data(p.lock, where).digest != p.lock_digest:
            raise InputError("the plan's lock was edited after planning", where=where)
        return p


PLAN_FIELDS = {"host": str, "lock": dict, "lock_name": str, "lock_digest": str, "facts_digest": str,
               "base": (str, type(None)), "changes": list, "warnings": list, "noop": bool, "format": int,
               "action": str, "reuse": (str, type(None)), "current_error": (str, type(None)), "errors": list,
               "download": dict, "root": (str, type(None))}
CHANGE_FIELDS = {"category": str, "name": str, "action": str, "old": (str, type(None)), "new": (str, type(None))}


def check_plan_data(d, where: str) -> None:
    """The saved-plan schema: known fields only, each of its type; changes and warnings well formed."""
    def bad(field_name: str, msg: str):
        raise InputError(f"{field_name}: {msg}" if field_name else msg, where=where)

    if not isinstance(d, dict):
        bad("", "not a provision plan (expected a JSON object)")
    if type(d.get("format")) is not int or d["format"] != PLAN_FORMAT:
        bad("format", f"unsupported plan format {d.get('format')!r} (this tool reads {PLAN_FORMAT})")
    for k in d:
        if k not in PLAN_FIELDS and k != "summary":
            bad(k, "unknown field in a saved plan")
    for k, typ in PLAN_FIELDS.items():
        if k not in d:
            bad(k, "missing from the saved plan")
        if not isinstance(d[k], typ) or (typ is int and isinstance(d[k], bool)):
            bad(k, f"wrong type ({type(d[k]).__name__})")
    for k in ("lock_digest", "facts_digest"):
        if len(d[k]) != 64 or any(c not in "0123456789abcdef" for c in d[k]):
            bad(k, "not a sha256 digest")
    for k in ("warnings", "errors"):
        if not all(isinstance(w, str) for w in d[k]):
            bad(k, "expected a list of strings")
    if d["action"] not in ("noop", "reuse", "build"):
        bad("action", f"unknown action {d['action']!r}")
    for i, c in enumerate(d["changes"]):
        if (not isinstance(c, dict) or not set(c) <= set(CHANGE_FIELDS) or not {"category", "name", "action"} <= set(c)
                or not all(isinstance(c[k], CHANGE_FIELDS[k]) for k in c)):
            bad(f"changes[{i}]", "expected {category, name, action, old, new} of strings")
        if c["category"] not in ORDER or c["action"] not in ("add", "change", "remove"):
            bad(f"changes[{i}]", f"unknown category or action ({c['category']!r}, {c['action']!r})")


def load_plans(path: str | Path) -> list[Plan]:
    """A saved plan file: one host's plan, or a fleet's (a list, one per host, all of one lock)."""
    data = yamlio.load_json(path, error=InputError)
    plans = [Plan.from_json(d, where=str(path)) for d in (data if isinstance(data, list) else [data])]
    if not plans:
        raise InputError("the plan file holds no host's plan", where=str(path))
    if len({p.lock_digest for p in plans}) > 1:
        raise InputError("the plans in this file are of different locks", where=str(path))
    return plans


def save_plans(path: Path, plans: list[Plan], fleet: bool) -> None:
    """Write what `load_plans` reads: one host's plan alone, a fleet's (`fleet`) as a list, one per host."""
    data = [p.to_json() for p in plans] if fleet else plans[0].to_json()
    Path(path).write_text(json.dumps(data, indent=2))


def plans_for(saved: list[Plan], targets: list, where: str) -> dict[str, Plan]:
    """Each target's saved plan by host name, checked before any host is contacted: a plan applies only to
    the host and root it was made for (InputError naming the plan file and whom it was made for)."""
    by_host = {p.host: p for p in saved}
    for t in targets:
        p = by_host.get(t.name)
        root = t.root
        if p is None and len(saved) == 1:
            p = saved[0]
        if p is None:
            raise InputError(f"the saved plan has no entry for {t.name} (planned: {', '.join(by_host)}); "
                             "plan that host first", where=where)
        if p.host != t.name or (p.root is not None and p.root != root):
            raise InputError(f"this plan was made for {p.host} (root {p.root or '?'}), not for {t.name} "
                             f"(root {root}); plan {t.name} first", where=where)
    return by_host


def lock_of_plan(p: Plan) -> Lock:
    return from_data(p.lock, f"plan:{p.lock_name}")


def facts_digest(facts: Facts) -> str:
    """What a saved plan depends on: generations (as apply's recovery settles them), current, and the
    current environment."""
    keep = {"current": facts.current, "current_error": facts.current_error,
            "generations": [(g.id, g.settled, g.lock_digest, g.venv_ok) for g in facts.generations],
            "dists": sorted((facts.current_dists or {}).items())}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()


def _value(c: Change) -> str:
    if c.action == "add":
        return str(c.new)
    if c.action == "remove":
        return str(c.old)
    return f"{c.old} → {c.new}" + (f"  ({c.direction})" if c.direction else "")


def _lines(group: list[Change], width: int) -> list[str]:
    return [f"  {SYMBOL[c.action]} {c.name:<{width}}  {_value(c)}" for c in group]


def total_line(summary: dict | None, verb: str = "Plan") -> str:
    """The last line: Terraform's "Plan: 1 to add, …" for a plan, "Diff: 1 added, …" for a diff."""
    s = summary or {"add": 0, "change": 0, "remove": 0}
    if verb == "Plan":
        return f"Plan: {s['add']} to add, {s['change']} to change, {s['remove']} to remove."
    return f"{verb}: {s['add']} added, {s['change']} changed, {s['remove']} removed."


def render(changes: list[Change], header: str = "", summary: dict | None = None, verb: str = "Plan") -> str:
    """Terraform-like text: one line per change with + ~ -, grouped, and a summary line."""
    lines = [header] if header else []
    width = max((len(c.name) for c in changes), default=10)
    for cat in ORDER:
        group = [c for c in changes if c.category == cat]
        if group:
            lines += [HEADINGS.get(cat, f"  {cat}")] + _lines(group, width)
    lines.append(total_line(summary, verb) if changes else "No changes.")
    return "\n".join(lines)


SUMMED = {"package": "package", "hash": "wheel hash"}   # counted by a summary; the rest (toolkit, patches…) listed


def _counts(group: list[Change], kind: str) -> str:
    """"3 to add, 150 to change (148 upgrades, 2 downgrades), 1 to remove" for one category."""
    parts = []
    for action, words in (("add", "to add"), ("change", "to change"), ("remove", "to remove")):
        of = [c for c in group if c.action == action]
        if not of:
            continue
        dirs = {d: sum(c.direction == d for c in of) for d in ("upgrade", "downgrade")}
        how = ", ".join(f"{n} {d}{'s' if n != 1 else ''}" for d, n in dirs.items() if n)
        parts.append(f"{len(of)} {words}" + (f" ({how})" if how and action == "change" else ""))
    return f"  {kind}: " + ", ".join(parts)


def headline_names(*requires) -> set[str]:
    """The packages a lock's `requires` names (what people pin: torch, sglang, flashinfer…), normalized."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    out = set()
    for reqs in requires:
        for r in reqs or []:
            try:
                out.add(canonicalize_name(Requirement(str(r)).name))
            except InvalidRequirement:
                continue
    return out


def render_summary(changes: list[Change], header: str, summary: dict | None, headline: set[str]) -> str:
    """The short form: every change outside packages and wheel hashes (toolkit, driver, python, patches, probes,
    engine, indexes), counts per kind for packages and hashes with the headline packages (`headline`: the
    lock's requires) listed, and how many lines `--full` adds."""
    from packaging.utils import canonicalize_name

    if not changes:
        return render(changes, header, summary)
    lines = [header] if header else []
    width = max((len(c.name) for c in changes), default=10)
    for cat in ORDER:
        group = [c for c in changes if c.category == cat]
        if not group:
            continue
        if cat not in SUMMED:
            lines += [HEADINGS.get(cat, f"  {cat}")] + _lines(group, width)
            continue
        shown = [c for c in group if canonicalize_name(c.name) in headline]
        lines.append(_counts(group, HEADINGS[cat].strip()))
        lines += _lines(shown, width)
        hidden = len(group) - len(shown)
        if hidden:
            lines.append(f"  … {hidden} more {SUMMED[cat]} line{'s' if hidden != 1 else ''} (--full lists every one)")
    lines.append(total_line(summary))
    return "\n".join(lines)


def render_plan(plan: Plan, full: bool = False) -> str:
    """A plan as text: header, what apply will do, the changes (a summary unless `full`), findings."""
    base = plan.base or "no managed generation"
    header = f"Plan for {plan.host}: {base} → {plan.lock_name}"
    lines = []
    if plan.current_error:
        lines.append(f"  ! current generation {plan.base} is broken: {plan.current_error} "
                     "(compared with what it recorded at apply)")
    if plan.noop:
        lines.append(f"No changes: the host already runs lock {plan.lock_name} ({plan.base}).")
        text = "\n".join([header, *lines])
    else:
        if plan.action == "reuse":
            lines.append(f"  reuse (probe): generation {plan.reuse} already holds this lock: apply probes it "
                         "again inside it, then switches to it; nothing is built")
        else:
            dl = plan.download
            if dl:
                unknown = f" (+{dl['unknown']} of unknown size)" if dl.get("unknown") else ""
                lines.append(f"  build: {len(plan.lock.get('packages') or [])} packages; download "
                             f"{dl['wheels']} wheels, {human_size(dl['bytes'])}{unknown}; disk needed "
                             f"{'≥ ' if dl.get('unknown') else ''}{human_size(dl['disk_needed'])}"
                             + (f" of {human_size(dl['disk_free'])} free" if dl.get("disk_free") is not None else ""))
                if dl.get("isolation"):
                    lines.append("  files: " + files_line(dl))
        head = "\n".join([header, *lines])
        text = render(plan.changes, head, plan.summary) if full else \
            render_summary(plan.changes, head, plan.summary, headline_names(plan.lock.get("requires")))
    text += "".join(f"\nerror: {w}" for w in plan.errors)
    text += "".join(f"\nwarning: {w}" for w in plan.warnings if w not in plan.errors)
    return text


def files_line(dl: dict) -> str:
    """What the build does with each file, with sizes, and how generations are kept apart."""
    guessed = dl.get("estimated") or 0      # packages whose files are not at hand: counted by size alone

    def n(part: str) -> str:
        return f"{dl[part]['files']}{'+' if guessed else ''} ({'~' if guessed else ''}{human_size(dl[part]['bytes'])})"
    how = {"store": "linked from the host's immutable store, uv hardlinks from its cache",
           "reflink": "uv clones its cache (copy-on-write): every file the generation's own",
           "copy": f"uv copies every file ({dl.get('isolation_why') or 'no store here'})"}[dl["isolation"]]
    return (f"{n('linked')} linked from the store, {n('entered')} copied into it, {n('own')} the generation's own "
            f"(with its directories and stamp), compiled: none at build; isolation {dl['isolation']}: {how}"
            + (f"; {guessed} package{'s' if guessed > 1 else ''} not at hand to list: files uncounted, sizes "
               f"guessed as {UNPACK_FACTOR}x the download" if guessed else ""))


SEED_PACKAGES = {"pip", "setuptools", "wheel"}   # what `python -m venv` seeds, unless a lock lists them


def current_stack(facts: Facts) -> Stack | None:
    """The stack of the host's current generation: its installed distributions (or, when its interpreter
    does not run, the versions it recorded) and the rest from its manifest."""
    if not facts.current:
        return None
    gen = facts.generation(facts.current)
    stored = gen.stack if gen else {}
    if facts.current_error or facts.current_dists is None:
        dists = dict(stored.get("packages") or {})
    else:
        dists = dict(facts.current_dists)
    patches = stored.get("patches") or {}
    if isinstance(patches, list):   # manifests written before patch content was recorded
        patches = {p: "unknown" for p in patches}
    live_py = facts.current_python
    return Stack(name=gen and gen.lock_name, packages=dists, cuda=stored.get("cuda"),
                 driver_min=stored.get("driver_min"), patches=patches, engine=stored.get("engine") or {},
                 python=".".join(live_py.split(".")[:2]) if live_py else stored.get("python") or (gen and gen.python),
                 hashes=stored.get("hashes") or {}, indexes=stored.get("indexes") or {},
                 probes=stored.get("probes") or {}, service=stored.get("service") or {})


def _reusable(facts: Facts, lock: Lock, target: Stack) -> GenerationFacts | None:
    """The newest complete generation (probed, committed once, venv intact) built from exactly this lock."""
    for g in reversed(facts.generations):
        if (g.id != facts.current and g.lock_digest == lock.digest and g.settled == "ready" and g.venv_ok
                and (g.stack.get("patches") or {}) == target.patches):
            return g
    return None


def _local_size(lock: Lock, url: str | None) -> int | None:
    from urllib.parse import unquote, urlparse

    if not url:
        return None
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        return None
    path = Path(unquote(parsed.path)) if parsed.scheme == "file" else lock.resolve_path(url)
    try:
        return path.stat().st_size
    except OSError:
        return None


def _wheel_at_hand(lock: Lock, p) -> Path | None:
    """The wheel file of package `p` on this machine: its file URL (or a path the lock names), else the
    controller's wheel cache."""
    from urllib.parse import unquote, urlparse

    from .wheelcache import CACHE

    paths = []
    if p.url and urlparse(p.url).scheme not in ("http", "https"):
        parsed = urlparse(p.url)
        paths.append(Path(unquote(parsed.path)) if parsed.scheme == "file" else lock.resolve_path(p.url))
    if p.sha256 and p.filename and "/" not in p.filename:
        paths.append(CACHE / p.sha256 / p.filename)
    return next((x for x in paths if x.is_file()), None)


def blocks(size: int) -> int:
    """Bytes a file of `size` takes on disk: whole blocks."""
    return -(-size // BLOCK) * BLOCK


def wheel_files(lock: Lock, p) -> list[tuple[str, str | None, int]] | None:
    """(path, RECORD digest or None, size) of every file package `p`'s wheel installs, from the wheel's own
    listing and RECORD where the wheel is at hand; None where it is not."""
    import csv
    import io
    import zipfile

    path = _wheel_at_hand(lock, p)
    if path is None:
        return None
    try:
        with zipfile.ZipFile(path) as z:
            infos = [i for i in z.infolist() if not i.is_dir()]
            record = next((i.filename for i in infos if i.filename.endswith(".dist-info/RECORD")
                           and i.filename.count("/") == 1), None)
            digests = {}
            if record:
                for row in csv.reader(io.StringIO(z.read(record).decode("utf-8", "replace"))):
                    if len(row) > 1 and row[1].startswith("sha256="):
                        digests[row[0]] = row[1][len("sha256="):]
            return [(i.filename, digests.get(i.filename), i.file_size) for i in infos]
    except (OSError, zipfile.BadZipFile, KeyError):
        return None


def installed_size(lock: Lock, p, size: int | None) -> tuple[int, bool]:
    """(bytes package `p` takes installed, whether that is exact): the sum of its files' sizes, each in whole
    blocks, from the wheel's own listing where the wheel is at hand; else UNPACK_FACTOR times its download."""
    files = wheel_files(lock, p)
    if files is not None:
        return sum(blocks(n) for _, _, n in files), True
    return UNPACK_FACTOR * (size or 0), False


VENV_BYTES = 80 << 10       # what `uv venv` lays out: bin/, pyvenv.cfg, lib/pythonX.Y/site-packages, its scripts
GEN_BYTES = 6 * BLOCK       # a generation's lock.yaml, requirements.txt, manifest.json, logs, probes.json
STAMP_BYTES = 200           # the seal's stamp, per file
OWN_PER_PACKAGE = 4         # what uv writes for each distribution: INSTALLER, REQUESTED, direct_url.json, ...


def _own(path: str) -> bool:
    """Whether uv writes this wheel member anew (a file of the generation's own, never the store's)."""
    return path.endswith(".dist-info/RECORD") or ".data/scripts/" in path


def _dirs(paths) -> set[str]:
    out = set()
    for path in paths:
        d = path.rsplit("/", 1)[0] if "/" in path else ""
        while d and d not in out:
            out.add(d)
            d = d.rsplit("/", 1)[0] if "/" in d else ""
    return out


def download_estimate(facts: Facts, lock: Lock) -> dict:
    """Wheels the host's cache lacks, their bytes (where known), and the disk a build needs, by what each file
    becomes: `linked` (files whose content the host's store holds already: a link costs no data), `entered`
    (content new to the store: copied into it once), `own` (the generation's own files: what uv writes per
    generation, and with isolation `copy` or `reflink` every file), `compiled` (nothing at build: uv compiles no
    bytecode and no kernels; the interpreter writes __pycache__ at first import); plus the download, uv's
    unpacked copy of each wheel not cached yet, the venv's directories and the seal's stamp. `disk_needed` is
    their sum; `installed` the install's bytes; `estimated`, how many packages' sizes are a guess (their wheels
    are not at hand to read)."""
    iso = facts.isolation or "copy"
    cached, stored = set(facts.cached_wheels), set(facts.stored_wheels) if iso == "store" else set()
    need = [p for p in lock.packages if p.sha256 not in cached]
    sizes = {p.name: p.size if p.size is not None else _local_size(lock, p.url) for p in lock.packages}
    known = sum(sizes[p.name] or 0 for p in need)
    linked, entered, own = [0, 0], [0, 0], [0, 0]
    unpacked = installed = guessed = files_n = 0
    dirs, seen = set(), set()
    for p in lock.packages:
        listing = wheel_files(lock, p)
        if listing is None:         # not at hand: its whole guessed size is new (store or own), or linked
            guess = UNPACK_FACTOR * (sizes[p.name] or 0)
            guessed += 1
            installed += guess
            unpacked += guess if p.sha256 not in cached else 0
            if p.sha256 in stored:    # its files are in the host's store already: linked, no new data
                linked[1] += guess
            else:
                (entered if iso == "store" else own)[1] += guess
            continue
        size = sum(blocks(n) for _, _, n in listing)
        installed += size
        files_n += len(listing) + OWN_PER_PACKAGE
        here = _dirs(path for path, _, _ in listing)
        dirs |= here
        if p.sha256 not in cached:
            unpacked += size + len(here) * BLOCK
        own[0] += OWN_PER_PACKAGE
        own[1] += OWN_PER_PACKAGE * BLOCK
        for path, digest, n in listing:
            if iso != "store" or _own(path) or not digest:
                own[0] += 1
                own[1] += blocks(n)
            elif p.sha256 in stored or (digest, n) in seen:
                linked[0] += 1
                linked[1] += n
            else:
                seen.add((digest, n))
                entered[0] += 1
                entered[1] += blocks(n)
    tree = len(dirs) * BLOCK + VENV_BYTES + GEN_BYTES + files_n * STAMP_BYTES
    if iso == "store" and not stored and entered[0]:       # the store's own directories, made once
        tree += min(256, entered[0]) * BLOCK
    return {"wheels": len(need), "bytes": known, "unknown": sum(sizes[p.name] is None for p in need),
            "installed": installed, "estimated": guessed, "isolation": iso, "isolation_why": facts.isolation_why,
            "linked": {"files": linked[0], "bytes": linked[1]}, "entered": {"files": entered[0], "bytes": entered[1]},
            "own": {"files": own[0], "bytes": own[1] + tree}, "compiled": {"files": 0, "bytes": 0},
            "unpacked": unpacked,
            "disk_needed": known + unpacked + entered[1] + own[1] + tree, "disk_free": facts.disk_free_bytes}


def make_plan(facts: Facts, lock: Lock) -> Plan:
    """Pure: what applying `lock` would do on the host these facts describe, and why."""
    target = stack_of_lock(lock)
    old = current_stack(facts) or Stack()
    old.packages = {n: v for n, v in old.packages.items() if n not in SEED_PACKAGES or n in target.packages}
    changes = diff_stacks(old, target)
    cur = facts.current
    gen = facts.generation(cur)
    venv_ok = gen is None or gen.venv_ok
    healthy = bool(cur) and not facts.current_error and venv_ok
    same_build = gen is not None and gen.lock_digest == lock.digest and not changes
    if healthy and same_build and gen.settled == "ready":
        action, reuse = "noop", None
    else:
        g = _reusable(facts, lock, target)
        action, reuse = ("reuse", g.id) if g else ("build", None)
        if not changes and cur:   # nothing in the stack differs, yet apply acts: say why
            why = ("its interpreter does not run" if facts.current_error else
                   "its venv is missing" if not venv_ok else
                   f"it is {gen and gen.status}" if not gen or gen.settled != "ready" else "the lock's content changed")
            changes.append(Change("lock", lock.name, "change", f"{cur} ({why})", f"lock sha256 {lock.digest[:12]}…"))
    download = download_estimate(facts, lock) if action == "build" else {}
    findings = preflight_findings(facts, lock, action, download)
    return Plan(host=facts.host, lock=lock.raw, lock_name=lock.name, lock_digest=lock.digest,
                facts_digest=facts_digest(facts), base=cur, changes=changes, action=action, reuse=reuse,
                current_error=facts.current_error, warnings=[m for _, m in findings],
                errors=[m for fatal, m in findings if fatal], download=download, root=facts.root)


def plan_host(transport: Transport, lock: Lock, interpreter: str | None = None) -> Plan:
    """`provision plan`: the host's facts (one round trip), then `make_plan`."""
    return make_plan(gather_for(transport, lock, interpreter), lock)


def _driver_tuple(v: str) -> tuple:
    return tuple(int(x) for x in v.split(".") if x.isdigit())


def no_python(facts: Facts, py: str) -> str:
    """One line: the lock's Python is not on the host; what was found, what is broken, where it looked."""
    broken, given = facts.broken_pythons, facts.python_given
    if given:
        return f"--python {given} cannot run the lock's Python {py}: {broken.get(given, 'not usable')}"
    have = ", ".join(f"{v} ({p})" for v, p in sorted(facts.pythons.items())) or "none"
    text = f"host has no working Python {py} (found: {have})"
    if broken:
        text += "; broken: " + "; ".join(f"{p}: {why}" for p, why in sorted(broken.items()))
    if facts.pythons_looked_in:
        text += f"; looked for python{py} in {', '.join(facts.pythons_looked_in)}; name one with --python PATH"
    return text


def preflight_findings(facts: Facts, lock: Lock, action: str = "build",
                       download: dict | None = None) -> list[tuple[bool, str]]:
    """(fatal, message) for everything that would stop or weaken applying `lock` here; what only a build
    needs (the interpreter, hashes) is checked only when apply will build."""
    out: list[tuple[bool, str]] = []
    py = lock.platform.python
    if action == "build" and py not in facts.pythons:
        out.append((True, no_python(facts, py)))
    out += [(False, w) for w in lock.stale_override_warnings()]
    libc = facts.os.glibc
    if action == "build" and libc and _driver_tuple(libc) < _driver_tuple(lock.platform.glibc):
        out.append((True, f"host glibc {libc} is older than the lock's platform.glibc {lock.platform.glibc} "
                          f"(its wheels may be manylinux_2_{lock.platform.glibc.split('.')[1]})"))
    gpus = facts.gpus
    dmin = lock.platform.driver_min
    if gpus and dmin and facts.driver and _driver_tuple(facts.driver) < _driver_tuple(dmin):
        out.append((True, f"NVIDIA driver {facts.driver} is older than the lock's minimum {dmin}"))
    if not gpus and (dmin or lock.platform.compute_capability):
        out.append((False, "no NVIDIA GPU found (nvidia-smi absent or empty): driver and GPU checks skipped"))
    want = set(lock.platform.compute_capability)
    for g in gpus:
        if want and g.compute_cap not in want:
            out.append((False, f"GPU {g.index} ({g.name}) has compute capability {g.compute_cap}, "
                               f"the lock targets {', '.join(sorted(want))}"))
    free = facts.disk_free_bytes
    need = (download or {}).get("disk_needed", 0)
    if action == "build" and free is not None and free < need:
        out.append((True, f"only {human_size(free)} free under {facts.root}; this build needs about "
                          f"{human_size(need)} (the wheels to fetch and the install)"))
    elif action == "build" and free is not None and free < need + MIN_FREE_BYTES:
        out.append((False, f"this build leaves about {human_size(free - need)} free under {facts.root} "
                           f"(less than {human_size(MIN_FREE_BYTES)} to spare)"))
    if action == "build":
        cached = set(facts.cached_wheels)
        for p in lock.packages:
            if not p.sha256:
                out.append((True, f"{p.pin} has no sha256 in {lock.where('packages')}: cannot install with "
                                  "--require-hashes"))
            elif not p.filename:
                out.append((True, f"{p.pin} has no filename in the lock"))
            elif not p.url and p.sha256 not in cached:
                out.append((True, f"{p.pin} has no url in the lock and is not in the host's wheel cache"))
        for u in lock.unresolved:
            out.append((True, f"{u['name']} is unresolved in the lock: {u['reason']}"))
        no_nvcc = nvcc_missing(lock)
        if no_nvcc:
            out.append((True, no_nvcc))
        for name, digest in stack_of_lock(lock).patches.items():
            if digest == "missing":
                out.append((True, f"patch series {name} not found next to {lock.path}"))
    return out
