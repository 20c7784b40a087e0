"""`lock check`: consistency rules beyond the schema (Requires-Dist closure, CUDA tags, driver,
flashinfer trio, hashes, unresolved entries), and `lock diff`: two locks' stack changes.

Findings name the package and the requirement; errors fail the check, warnings do not.
"""
from __future__ import annotations

import re
import shlex
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from . import plan as planmod
from .lock import Lock
from .resolve import marker_true, requires_dist, wheel_metadata
from .toolkit import nvcc_missing

# Minimum Linux driver for each CUDA major (NVIDIA's CUDA toolkit release notes, table 3:
# minor-version compatibility). CUDA 13.x needs the R580 branch.
DRIVER_MIN = {13: "580.65.06", 12: "525.60.13", 11: "450.80.02"}
FLASHINFER = ("flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache")
CU_TAG = re.compile(r"(?:^|\.)cu(\d{2,3})(?:\.|$)")
CU_SUFFIX = re.compile(r"-cu(\d+)$")


@dataclass
class Finding:
    level: str          # error | warning
    rule: str           # requires-dist | requires | cuda-tag | cuda-toolkit | driver | flashinfer | hash |
    #                     unresolved | override | metadata
    package: str
    requirement: str
    message: str
    where: str = ""


@dataclass
class Report:
    lock: str
    path: str
    packages: int
    findings: list[Finding] = field(default_factory=list)
    overrides_used: list[str] = field(default_factory=list)
    launch: list[str] | None = None     # engine.launch: the one command a lock makes a host run

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_json(self) -> dict:
        return {"lock": self.lock, "path": self.path, "packages": self.packages, "ok": self.ok,
                "errors": len(self.errors), "warnings": len(self.warnings),
                "overrides_used": self.overrides_used, "launch": self.launch,
                "findings": [asdict(f) for f in self.findings]}


def cuda_of_tag(version: str) -> str | None:
    """'2.9.1+cu130' → '13.0'; None without a cuNNN local tag."""
    try:
        local = Version(version).local
    except InvalidVersion:
        return None
    m = CU_TAG.search(local or "")
    if not m:
        return None
    d = m.group(1)
    return f"{int(d[:-1])}.{d[-1]}"


def _major_minor(v: str | None) -> str | None:
    if not v:
        return None
    parts = v.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 else parts[0]


def _pinned_version(req: Requirement) -> str | None:
    specs = [s for s in req.specifier if s.operator in ("==", "===")]
    return specs[0].version if len(specs) == 1 and "*" not in specs[0].version else None


class _Checker:
    def __init__(self, lock: Lock, offline: bool, workers: int):
        self.lock, self.offline, self.workers = lock, offline, workers
        self.findings: list[Finding] = []
        self.pkgs = {p.name: p for p in self.lock.packages}
        self.unresolved = {canonicalize_name(str(u["name"])): u for u in lock.unresolved}
        self.needed_by: dict[str, list[str]] = {}
        self.used_overrides: set[int] = set()

    def add(self, level, rule, package, requirement, message, where=""):
        self.findings.append(Finding(level, rule, package, requirement, message, where or self.lock.path))

    def at_pkg(self, name: str) -> str:
        p = self.pkgs.get(name)
        return f"{self.lock.path}:{p.line}" if p and p.line else self.lock.path

    # -- metadata and Requires-Dist -------------------------------------------------
    def _metadata(self, p):
        if not p.url:
            return p.name, None, "no url to read its METADATA from"
        try:
            text = wheel_metadata(p.url, p.filename or p.url.rsplit("/", 1)[-1], p.sha256,
                                  base=Path(self.lock.path).resolve().parent, offline=self.offline)
            return p.name, requires_dist(text), None
        except Exception as e:  # network, zip, OS: reported as a finding, never a traceback
            return p.name, None, f"{type(e).__name__}: {e}"

    def requires_dist(self):
        with ThreadPoolExecutor(max_workers=self.workers) as ex:
            results = list(ex.map(self._metadata, self.lock.packages))
        deps: dict[str, list[Requirement]] = {}
        for name, reqs, err in results:
            if err and not self.pkgs[name].url:   # a captured record: versions only, nothing to read
                self.add("warning", "metadata", name, self.pkgs[name].pin,
                         "no url: its Requires-Dist is not checked", self.at_pkg(name))
            elif err:
                self.add("error", "metadata", name, self.pkgs[name].pin,
                         f"cannot read its METADATA ({err}); its Requires-Dist is not checked", self.at_pkg(name))
            else:
                deps[name] = reqs

        # Extras in force: from the lock's requires, then propagated through Requires-Dist.
        extras: dict[str, set[str]] = {}
        for r in self.lock.requires:
            req = Requirement(r)
            if marker_true(req.marker, self.lock):
                extras.setdefault(canonicalize_name(req.name), set()).update(req.extras)
        changed = True
        while changed:
            changed = False
            for name, reqs in deps.items():
                active = ("", *sorted(extras.get(name, ())))
                for req in reqs:
                    if req.extras and marker_true(req.marker, self.lock, active):
                        have = extras.setdefault(canonicalize_name(req.name), set())
                        if not set(req.extras) <= have:
                            have.update(req.extras)
                            changed = True

        for name in sorted(deps):
            active = ("", *sorted(extras.get(name, ())))
            for req in deps[name]:
                if not marker_true(req.marker, self.lock, active):
                    continue
                self._one(name, req)

    def _one(self, name: str, req: Requirement):
        dep = canonicalize_name(req.name)
        text = str(req)
        if dep == name:          # self-reference through an extra (pkg[x] requires pkg[y])
            return
        if dep in self.unresolved:
            self.needed_by.setdefault(dep, []).append(f"{name} ({text})")
            try:
                pinned = _pinned_version(Requirement(str(self.unresolved[dep].get("requirement") or dep)))
            except Exception:
                pinned = None
            if pinned and not req.specifier.contains(pinned, prereleases=True) and not self._covered(name, dep, pinned):
                self.add("error", "requires-dist", name, text,
                         f"{name} requires {text} but the lock pins {dep} {pinned} (unresolved)", self.at_pkg(name))
            return
        have = self.pkgs.get(dep)
        if have is None and self._left_out(name, dep):
            return
        if have is None:
            self.add("error", "requires-dist", name, text,
                     f"{name} requires {text}, which is not in the closure", self.at_pkg(name))
            return
        if req.specifier.contains(have.version, prereleases=True) or self._covered(name, dep, have.version):
            return
        self.add("error", "requires-dist", name, text,
                 f"{name} requires {text} but the lock has {dep} {have.version} (no override covers it)",
                 self.at_pkg(name))

    def _covered(self, name: str, dep: str, version: str) -> bool:
        """An override of `name`'s pin on `dep` whose `use` admits `version`."""
        for i, o in enumerate(self.lock.overrides):
            if o.package == name and canonicalize_name(Requirement(o.pins).name) == dep:
                use = Requirement(o.use)
                if canonicalize_name(use.name) == dep and use.specifier.contains(version, prereleases=True):
                    self.used_overrides.add(i)
                    return True
        return False

    def _left_out(self, name: str, dep: str) -> bool:
        """An override of `name`'s pin on `dep` that leaves `dep` out: its `use` names `dep` under a marker false
        for this platform (uv's idiom, `dep; sys_platform == 'never'`, which the resolver passes on as written)."""
        for i, o in enumerate(self.lock.overrides):
            if o.package == name and canonicalize_name(Requirement(o.pins).name) == dep:
                use = Requirement(o.use)
                if canonicalize_name(use.name) == dep and use.marker is not None and not marker_true(use.marker, self.lock):
                    self.used_overrides.add(i)
                    return True
        return False

    # -- the lock's own requires ----------------------------------------------------
    def top_level(self):
        for i, r in enumerate(self.lock.requires):
            req = Requirement(r)
            if not marker_true(req.marker, self.lock):
                continue
            dep = canonicalize_name(req.name)
            if dep in self.unresolved:
                self.needed_by.setdefault(dep, []).insert(0, f"requires ({r})")
                continue
            have = self.pkgs.get(dep)
            where = self.lock.where("requires", i)
            if have is None:
                self.add("error", "requires", dep, r, f"required {r} is not in packages (run `provision lock resolve`)",
                         where)
            elif not req.specifier.contains(have.version, prereleases=True):
                self.add("error", "requires", dep, r, f"required {r} but packages has {have.version}", where)

    # -- CUDA, driver, flashinfer, hashes ---------------------------------------------
    def cuda(self):
        cu = self.lock.platform.cuda
        want = _major_minor(cu.version)
        tagged = [(p.name, p.version, self.at_pkg(p.name)) for p in self.lock.packages]
        for u in self.lock.unresolved:
            try:
                req = Requirement(str(u.get("requirement") or u["name"]))
            except Exception:
                continue
            v = _pinned_version(req)
            if v:
                tagged.append((canonicalize_name(req.name), v, self.lock.where("unresolved")))
        for name, version, where in tagged:
            tag = cuda_of_tag(version)
            if tag is None:
                continue
            if want is None:
                self.add("warning", "cuda-tag", name, f"{name}=={version}",
                         f"built for CUDA {tag} but platform.cuda names no version", where)
            elif tag != want:
                self.add("error", "cuda-tag", name, f"{name}=={version}",
                         f"local tag +cu{tag.replace('.', '')} is CUDA {tag}, the lock's CUDA is {cu.version}", where)
        if want:
            major = want.split(".")[0]
            for p in self.lock.packages:
                m = CU_SUFFIX.search(p.name)
                if m and m.group(1) != major:
                    self.add("warning", "cuda-tag", p.name, p.pin,
                             f"a CUDA {m.group(1)} library in a CUDA {cu.version} stack", self.at_pkg(p.name))
        why = nvcc_missing(self.lock)
        if why:
            self.add("error", "toolkit", "cuda-toolkit", f"cuda {cu.source} {cu.version}", why,
                     self.lock.where("platform", "cuda"))
        if cu.source == "wheels" and cu.version:
            tk = self.pkgs.get("cuda-toolkit")
            if tk is None:
                self.add("warning", "cuda-toolkit", "cuda-toolkit", f"cuda-toolkit=={cu.version}",
                         "platform.cuda.source is wheels but cuda-toolkit is not in the closure",
                         self.lock.where("platform", "cuda"))
            elif Version(tk.version) != Version(cu.version):      # 13.0.3.0 is 13.0.3
                self.add("error", "cuda-toolkit", "cuda-toolkit", tk.pin,
                         f"cuda-toolkit {tk.version} differs from platform.cuda.version {cu.version}",
                         self.at_pkg("cuda-toolkit"))

    def driver(self):
        cu = self.lock.platform.cuda
        if not cu.version:
            return
        try:
            major = int(cu.version.split(".")[0])
        except ValueError:
            return
        need = DRIVER_MIN.get(major)
        have = self.lock.platform.driver_min
        req = f"driver >= {need}" if need else f"CUDA {cu.version}"
        if need is None:
            return
        if not have:
            self.add("warning", "driver", "driver", req,
                     f"platform.driver.min is not set; CUDA {cu.version} needs driver {need} or newer",
                     self.lock.where("platform"))
        elif Version(have) < Version(need):
            self.add("error", "driver", "driver", req,
                     f"platform.driver.min {have} is too old for CUDA {cu.version} (needs {need} or newer)",
                     self.lock.where("platform", "driver", "min"))

    def flashinfer(self):
        present = [self.pkgs[n] for n in FLASHINFER if n in self.pkgs]
        if len(present) < 2:
            return
        base = present[0]
        for p in present[1:]:
            if Version(p.version).public != Version(base.version).public:
                self.add("error", "flashinfer", p.name, f"{p.name}=={Version(base.version).public}",
                         f"{p.name} {p.version} does not match {base.name} {base.version}", self.at_pkg(p.name))

    def hashes(self):
        for p in self.lock.packages:
            if not p.sha256:
                self.add("warning", "hash", p.name, p.pin, "no sha256: it cannot be installed with --require-hashes",
                         self.at_pkg(p.name))

    # -- listing --------------------------------------------------------------------
    def report_unresolved(self):
        for i, u in enumerate(self.lock.unresolved):
            name = canonicalize_name(str(u["name"]))
            by = self.needed_by.get(name, [])
            extra = f"; needed by {', '.join(by)}" if by else ""
            self.add("warning", "unresolved", name, str(u.get("requirement") or name),
                     f"unresolved: {u['reason']}{extra}", self.lock.where("unresolved", i))

    def report_overrides(self):
        stale = {i for i, _ in self.lock.stale_overrides()}
        for i, o in enumerate(self.lock.overrides):
            if i in stale:      # whatever else could be read: the package it overrides is not there
                msg = f"override for {o.package}, which is not in the closure"
            elif i in self.used_overrides or o.package in self.unresolved or \
                    canonicalize_name(Requirement(o.use).name) in self.unresolved:
                continue
            else:
                msg = f"override for {o.package} ({o.pins} → {o.use}) covers no failing requirement; remove it?"
            self.add("warning", "override", o.package, o.pins, msg, self.lock.where("overrides", i))


def check(lock: Lock, *, offline: bool = False, workers: int = 16) -> Report:
    """Every rule over one lock; the schema itself was checked when it was loaded."""
    c = _Checker(lock, offline, workers)
    c.top_level()
    c.requires_dist()
    c.cuda()
    c.driver()
    c.flashinfer()
    c.hashes()
    c.report_overrides()
    c.report_unresolved()
    used = [f"{lock.overrides[i].package}: {lock.overrides[i].pins} → {lock.overrides[i].use}"
            for i in sorted(c.used_overrides)]
    return Report(lock=lock.name, path=lock.path, packages=len(lock.packages), findings=c.findings,
                  overrides_used=used, launch=lock.engine.get("launch"))


def render_report(r: Report) -> str:
    lines = [f"{r.path}: lock {r.lock}, {r.packages} packages"]
    for f in sorted(r.findings, key=lambda f: (f.level != "error", f.rule, f.package)):
        lines.append(f"  {f.level:<7} [{f.rule}] {f.package}: {f.message}  ({f.where})")
    for o in r.overrides_used:
        lines.append(f"  override applied: {o}")
    if r.launch:
        lines.append("  engine.launch is a command that will run on the host (as the deploying user, from the "
                     "new generation):")
        lines.append(f"    {shlex.join(r.launch)}")
    verdict = "FAIL" if r.errors else "ok"
    lines.append(f"  {verdict}: {len(r.errors)} errors, {len(r.warnings)} warnings")
    return "\n".join(lines)


# ---------------------------------------------------------------- lock diff

def stack_of(lock: Lock) -> planmod.Stack:
    """plan's Stack of a lock, with unresolved pins shown as '<version> (unresolved)'."""
    st = planmod.stack_of_lock(lock)
    for u in lock.unresolved:
        name = canonicalize_name(str(u["name"]))
        if name in st.packages:
            continue
        try:
            v = _pinned_version(Requirement(str(u.get("requirement") or name)))
        except Exception:
            v = None
        st.packages[name] = f"{v or '?'} (unresolved)"
    return st


@dataclass
class LockDiff:
    old: str
    new: str
    changes: list[planmod.Change]

    @property
    def summary(self) -> dict[str, int]:
        return planmod.summarize(self.changes)

    def to_json(self) -> dict:
        return {"from": self.old, "to": self.new, "summary": self.summary,
                "changes": [dict(asdict(c), direction=c.direction) for c in self.changes]}

    def render(self) -> str:
        return planmod.render(self.changes, f"Lock diff: {self.old} → {self.new}", self.summary, verb="Diff")


def diff(old: Lock, new: Lock) -> LockDiff:
    return LockDiff(old.name, new.name, planmod.diff_stacks(stack_of(old), stack_of(new)))
