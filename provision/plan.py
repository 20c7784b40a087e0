"""A plan is a pure function of (host facts, lock): the stack changes, rendered Terraform-style.

`diff_stacks` is shared by `plan` (host → lock) and `lock diff` (lock → lock); a saved plan
carries the lock and a digest of the facts it was made from, so apply can refuse drift.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from packaging.version import InvalidVersion, Version

from .errors import InputError
from .lock import Lock, from_data

PLAN_FORMAT = 1
SYMBOL = {"add": "+", "change": "~", "remove": "-"}
ORDER = ("toolkit", "driver", "package", "patch", "engine")


@dataclass
class Stack:
    """What a host runs (or a lock describes), reduced to what a plan compares."""

    name: str | None = None
    packages: dict[str, str] = field(default_factory=dict)
    cuda: str | None = None           # "13.0.1 (wheels)"
    driver_min: str | None = None
    patches: list[str] = field(default_factory=list)
    engine: dict = field(default_factory=dict)


@dataclass
class Change:
    category: str    # toolkit | driver | package | patch | engine
    name: str
    action: str      # add | change | remove
    old: str | None = None
    new: str | None = None

    @property
    def direction(self) -> str:
        """upgrade / downgrade for version changes, else ''."""
        try:
            if self.action == "change" and self.old and self.new:
                return "upgrade" if Version(self.new) > Version(self.old) else "downgrade"
        except InvalidVersion:
            pass
        return ""


def stack_of_lock(lock: Lock) -> Stack:
    cu = lock.platform.cuda
    return Stack(name=lock.name, packages=lock.versions(),
                 cuda=f"{cu.version} ({cu.source})" if cu.source != "none" else None,
                 driver_min=lock.platform.driver_min,
                 patches=[p.rstrip("/").rsplit("/", 1)[-1] for p in lock.patches],
                 engine=lock.engine or {})


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


def diff_stacks(old: Stack, new: Stack) -> list[Change]:
    changes = []
    if old.cuda != new.cuda:
        changes += _diff_maps("toolkit", {"cuda": old.cuda} if old.cuda else {}, {"cuda": new.cuda} if new.cuda else {})
    if old.driver_min != new.driver_min:
        changes += _diff_maps("driver", {"driver min": old.driver_min} if old.driver_min else {},
                              {"driver min": new.driver_min} if new.driver_min else {})
    changes += _diff_maps("package", old.packages, new.packages)
    changes += _diff_maps("patch", {p: "applied" for p in old.patches}, {p: "applied" for p in new.patches})
    changes += _diff_maps("engine", _flat(old.engine), _flat(new.engine))
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
    warnings: list[str] = field(default_factory=list)
    noop: bool = False              # the host already runs this exact lock
    format: int = PLAN_FORMAT

    @property
    def summary(self) -> dict[str, int]:
        return summarize(self.changes)

    def to_json(self) -> dict:
        d = asdict(self)
        d["summary"] = self.summary
        return d

    @classmethod
    def from_json(cls, d: dict, where: str = "plan") -> "Plan":
        """A saved plan, checked field by field (InputError: malformed or edited; exit 2)."""
        check_plan_data(d, where)
        p = cls(**{k: d[k] for k in ("host", "lock", "lock_name", "lock_digest", "facts_digest", "base",
                                      "warnings", "noop")}, changes=[Change(**c) for c in d["changes"]])
        if from_data(p.lock, where).digest != p.lock_digest:
            raise InputError("the plan's lock was edited after planning", where=where)
        return p


PLAN_FIELDS = {"host": str, "lock": dict, "lock_name": str, "lock_digest": str, "facts_digest": str,
               "base": (str, type(None)), "changes": list, "warnings": list, "noop": bool, "format": int}
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
    if not all(isinstance(w, str) for w in d["warnings"]):
        bad("warnings", "expected a list of strings")
    for i, c in enumerate(d["changes"]):
        if (not isinstance(c, dict) or not set(c) <= set(CHANGE_FIELDS) or not {"category", "name", "action"} <= set(c)
                or not all(isinstance(c[k], CHANGE_FIELDS[k]) for k in c)):
            bad(f"changes[{i}]", "expected {category, name, action, old, new} of strings")
        if c["category"] not in ORDER or c["action"] not in ("add", "change", "remove"):
            bad(f"changes[{i}]", f"unknown category or action ({c['category']!r}, {c['action']!r})")


def facts_digest(facts: dict) -> str:
    """What a saved plan depends on: generations, current, and the current environment."""
    keep = {"current": facts.get("current"),
            "generations": [(g.get("id"), g.get("status"), g.get("lock_digest")) for g in facts.get("generations", [])],
            "dists": sorted((facts.get("current_dists") or {}).items())}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()


def render(changes: list[Change], header: str = "", summary: dict | None = None) -> str:
    """Terraform-like text: one line per change with + ~ -, grouped, and a summary line."""
    lines = [header] if header else []
    width = max((len(c.name) for c in changes), default=10)
    for cat in ORDER:
        group = [c for c in changes if c.category == cat]
        if not group:
            continue
        lines.append({"package": "  packages", "patch": "  patches"}.get(cat, f"  {cat}"))
        for c in group:
            if c.action == "add":
                val = c.new
            elif c.action == "remove":
                val = c.old
            else:
                val = f"{c.old} → {c.new}" + (f"  ({c.direction})" if c.direction else "")
            lines.append(f"  {SYMBOL[c.action]} {c.name:<{width}}  {val}")
    s = summary or {"add": 0, "change": 0, "remove": 0}
    if not changes:
        lines.append("No changes.")
    else:
        lines.append(f"Plan: {s['add']} to add, {s['change']} to change, {s['remove']} to remove.")
    return "\n".join(lines)


def render_plan(plan: Plan) -> str:
    base = plan.base or "no managed generation"
    header = f"Plan for {plan.host}: {base} → {plan.lock_name}"
    text = render(plan.changes, header, plan.summary)
    if plan.noop:
        text = f"{header}\nNo changes: the host already runs lock {plan.lock_name} ({plan.base})."
    if plan.warnings:
        text += "\n" + "\n".join(f"warning: {w}" for w in plan.warnings)
    return text


SEED_PACKAGES = {"pip", "setuptools", "wheel"}   # what `python -m venv` seeds, unless a lock lists them


def current_stack(facts: dict) -> Stack | None:
    """The stack of the host's current generation, from its manifest and its installed distributions."""
    cur = facts.get("current")
    if not cur:
        return None
    gen = next((g for g in facts.get("generations", []) if g["id"] == cur), {})
    stored = gen.get("stack") or {}
    dists = dict(facts.get("current_dists") or {})
    return Stack(name=gen.get("lock_name"), packages=dists, cuda=stored.get("cuda"),
                 driver_min=stored.get("driver_min"), patches=list(stored.get("patches") or []),
                 engine=stored.get("engine") or {})


def make_plan(facts: dict, lock: Lock) -> Plan:
    """Pure: what applying `lock` would change on the host these facts describe."""
    target = stack_of_lock(lock)
    old = current_stack(facts) or Stack()
    old.packages = {n: v for n, v in old.packages.items() if n not in SEED_PACKAGES or n in target.packages}
    changes = diff_stacks(old, target)
    cur = facts.get("current")
    gen = next((g for g in facts.get("generations", []) if g["id"] == cur), {})
    noop = bool(cur) and gen.get("lock_digest") == lock.digest and gen.get("status") == "ready" and not changes
    return Plan(host=facts.get("host", "?"), lock=lock.raw, lock_name=lock.name, lock_digest=lock.digest,
                facts_digest=facts_digest(facts), base=cur, changes=changes, warnings=preflight_warnings(facts, lock),
                noop=noop)


def preflight_warnings(facts: dict, lock: Lock) -> list[str]:
    """Conditions worth showing in a plan; apply turns the fatal ones into errors (apply.preflight)."""
    from .apply import preflight_findings

    return [msg for fatal, msg in preflight_findings(facts, lock)]
