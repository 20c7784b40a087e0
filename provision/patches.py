"""Patch series (patches/<package>-<version>/series.yaml + unified diffs): model, version gates, and
applying / checking / reverting them in a host environment through the stdlib agent `agent/patcher.py`;
also the manifest check and the EAGLE-3 interface contract (`agent/contracts.py`) run on a host.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from . import yamlio
from .agent import patcher as diffs
from .errors import LockError, PatchError, ProvisionError, SeriesError
from .lock import IDENT_RE, PROJECT_RE
from . import layout
from .replies import Contract, Inspected, Mismatches, PatchRefused, PatchRun, refuse
from .transport import Transport

SERIES_FILE = "series.yaml"


@dataclass
class Patch:
    name: str                       # the diff's file name, e.g. 0001-torch-symm-mem-sm120.patch
    text: str
    files: list[str]                # paths it touches, relative to site-packages
    applies_to: Requirement | None  # per-patch gate; None: the series' gate alone
    description: str = ""
    reason: str = ""
    where: str = ""                 # series.yaml:line


@dataclass
class Upstream:
    """A fix an earlier series carried that this release has upstream: the lines that prove it."""
    name: str                       # e.g. 0003-kimi-k25-eagle3-delegation
    evidence: dict[str, list[str]]  # file (relative to site-packages) -> lines it must contain
    contracts: list[str] = field(default_factory=list)   # architectures whose EAGLE-3 contract must pass
    description: str = ""
    reason: str = ""
    where: str = ""

    @property
    def files(self) -> list[str]:
        return list(self.evidence)


@dataclass
class Series:
    name: str                       # the directory name, e.g. sglang-0.5.9
    path: Path
    package: str
    specifier: SpecifierSet
    description: str = ""
    patches: list[Patch] = field(default_factory=list)
    upstream: list[Upstream] = field(default_factory=list)
    where: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "package": self.package, "version": str(self.specifier),
                "description": self.description,
                "patches": [{"name": p.name, "files": p.files, "description": p.description, "reason": p.reason,
                             "applies_to": str(p.applies_to) if p.applies_to else None} for p in self.patches],
                "upstream": [{"name": u.name, "files": u.files, "description": u.description, "reason": u.reason}
                             for u in self.upstream]}


SERIES_KEYS = {"series", "package", "version", "description", "patches", "upstream"}
PATCH_KEYS = {"file", "applies_to", "description", "reason"}
UPSTREAM_KEYS = {"name", "description", "reason", "evidence"}
EVIDENCE_KEYS = {"file", "lines", "contract"}
FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,199}\Z")


def _text(doc, data, key, where_keys, required=True) -> str:
    value = data.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or not value.strip():
        raise SeriesError(f"`{key}` must be a non-empty string", where=doc.where(*where_keys, key))
    return value.strip()


def _known(doc, data, keys: tuple, known: set, what: str) -> dict:
    if not isinstance(data, dict):
        raise SeriesError(f"expected {what}", where=doc.where(*keys))
    for k in data:
        if k not in known:
            raise SeriesError(f"unknown field {str(k)!r} (known here: {', '.join(sorted(known))})",
                              where=doc.where(*keys, k))
    return data


def load_series(path) -> Series:
    """Read and validate a series directory (series.yaml and every diff it names)."""
    d = Path(path)
    f = d / SERIES_FILE if d.is_dir() else d
    d = f.parent
    try:
        doc = yamlio.load(f)
    except LockError as e:                    # yamlio speaks for lockfiles; here it is a series
        raise SeriesError(e.message, where=e.where) from None
    data = _known(doc, doc.data, (), SERIES_KEYS, "a mapping with `series`, `package`, `version`, `patches`")
    if type(data.get("series")) is not int or data["series"] != 1:
        raise SeriesError("`series: 1` is the only format this version reads", where=doc.where("series"))
    package = _text(doc, data, "package", ())
    if not PROJECT_RE.match(package):
        raise SeriesError(f"{package!r} is not a valid project name (PEP 508)", where=doc.where("package"))
    try:
        spec = SpecifierSet(_text(doc, data, "version", ()))
    except InvalidSpecifier:
        raise SeriesError(f"invalid version specifier {data['version']!r}", where=doc.where("version")) from None
    series = Series(name=d.name, path=d, package=canonicalize_name(package), specifier=spec,
                    description=_text(doc, data, "description", (), required=False), where=doc.where())
    items = data.get("patches")
    if not isinstance(items, list) or not items:
        raise SeriesError("`patches` must be a non-empty list", where=doc.where("patches"))
    seen = set()
    top = d.resolve()
    for i, item in enumerate(items):
        keys = ("patches", i)
        _known(doc, item, keys, PATCH_KEYS, "a mapping with `file`, `description`, `reason`")
        name = _text(doc, item, "file", keys)
        source = d / name
        if not FILE_RE.match(name) or name in seen or source.is_symlink() or source.resolve().parent != top:
            raise SeriesError(f"patch file {name!r} must be a unique plain file name in {d} (no path, no link)",
                              where=doc.where(*keys, "file"))
        seen.add(name)
        try:
            text = source.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise SeriesError(f"cannot read {source}: {getattr(e, 'strerror', None) or 'not UTF-8 text'}",
                              where=doc.where(*keys, "file")) from None
        try:
            files = [fp.path for fp in diffs.parse(text, name)]
        except diffs.PatchFailed as e:
            raise SeriesError(f"{source}: {e}", where=doc.where(*keys, "file")) from None
        req = None
        if item.get("applies_to") is not None:
            try:
                req = Requirement(_text(doc, item, "applies_to", keys))
            except InvalidRequirement as e:
                raise SeriesError(f"invalid requirement: {e}", where=doc.where(*keys, "applies_to")) from None
        series.patches.append(Patch(name=name, text=text, files=files, applies_to=req,
                                    description=_text(doc, item, "description", keys),
                                    reason=_text(doc, item, "reason", keys),
                                    where=doc.where(*keys)))
    _load_upstream(doc, data, series, seen)
    return series


def _load_upstream(doc, data, series: Series, seen: set) -> None:
    """The series' `upstream` entries: fixes this release has upstream, each with the lines that show it."""
    items = data.get("upstream")
    if items is None:
        return
    if not isinstance(items, list) or not items:
        raise SeriesError("`upstream` must be a non-empty list", where=doc.where("upstream"))
    for i, item in enumerate(items):
        keys = ("upstream", i)
        _known(doc, item, keys, UPSTREAM_KEYS, "a mapping with `name`, `description`, `reason`, `evidence`")
        name = _text(doc, item, "name", keys)
        if not FILE_RE.match(name) or name in seen:
            raise SeriesError(f"upstream name {name!r} must be a unique plain name in the series",
                              where=doc.where(*keys, "name"))
        seen.add(name)
        evidence = item.get("evidence")
        if not isinstance(evidence, list) or not evidence:
            raise SeriesError("`evidence` must be a non-empty list of {file, lines} or {contract}",
                              where=doc.where(*keys, "evidence"))
        files: dict[str, list[str]] = {}
        contracts: list[str] = []
        for j, ev in enumerate(evidence):
            ek = keys + ("evidence", j)
            _known(doc, ev, ek, EVIDENCE_KEYS, "a mapping with `file` and `lines`, or `contract`")
            if "contract" in ev:
                arch = _text(doc, ev, "contract", ek)
                if len(ev) != 1 or not IDENT_RE.match(arch):
                    raise SeriesError("`contract` names one architecture (a Python class name) on its own",
                                      where=doc.where(*ek, "contract"))
                contracts.append(arch)
                continue
            rel = _text(doc, ev, "file", ek)
            try:
                diffs._check_target(rel, f"upstream {name}")
            except diffs.PatchFailed as e:
                raise SeriesError(str(e), where=doc.where(*ek, "file")) from None
            lines = ev.get("lines")
            if (not isinstance(lines, list) or not lines
                    or not all(isinstance(x, str) and x.strip() and "\n" not in x for x in lines)):
                raise SeriesError("`lines` must be a non-empty list of single lines of code",
                                  where=doc.where(*ek, "lines"))
            files.setdefault(rel, []).extend(lines)
        series.upstream.append(Upstream(name=name, evidence=files, contracts=contracts,
                                        description=_text(doc, item, "description", keys),
                                        reason=_text(doc, item, "reason", keys), where=doc.where(*keys)))


def discover_series(root) -> list[Path]:
    """Every series directory under `root` (e.g. the repository's patches/)."""
    return sorted(p.parent for p in Path(root).glob(f"*/{SERIES_FILE}"))


def chosen_series(dirs: list[Path] | None) -> tuple[list[Series], bool]:
    """(series, matching): the series in `dirs`, each applied as given; or, with none given, every series shipped
    with provision, each applied where it matches the installed release."""
    from .bundled import PATCHES

    return [load_series(d) for d in dirs or discover_series(PATCHES)], not dirs


def env_python(transport: Transport, python: str | None, site_packages: str | None) -> str:
    """The interpreter to run agents with: given, or python3 for a bare site-packages directory, or
    the host's current generation (`<root>/current/venv/bin/python`)."""
    if python:
        return python
    if site_packages:
        return "python3"
    return layout.of(transport).current_python


def _sp(site_packages):
    return str(site_packages) if site_packages else None


def _where(transport, python, site_packages):
    return f"{transport.target.name}:{site_packages or python}"


def installed(transport: Transport, packages: list[str], *, python: str, site_packages=None) -> dict:
    """{package: its InstalledDist (name, version, root) or None} in the target environment."""
    out = transport.run_agent("patcher", {"op": "inspect", "packages": packages,
                                          "site_packages": _sp(site_packages)}, python=python)
    return Inspected.of(out, transport.target.name).packages


def gate(series_list: list[Series], versions: dict[str, str], where: str) -> list[dict]:
    """The agent's payload for each series, with patches whose gate fails marked to skip; `versions`: each
    installed distribution's version by its canonical name.

    A series whose package is missing, or whose version is outside the series' specifier, is
    refused as a whole (PatchError)."""
    payload = []
    for s in series_list:
        installed_version = versions.get(s.package)
        if installed_version is None:
            raise PatchError(f"series {s.name}: {s.package} is not installed in {where}", where=s.where)
        version = _version(installed_version, s.where)
        if not s.specifier.contains(version, prereleases=True):
            raise PatchError(f"series {s.name} applies to {s.package}{s.specifier}, but {s.package} "
                             f"{installed_version} is installed in {where}; refusing", where=s.where)
        rows = []
        for p in s.patches:
            row = {"name": p.name, "text": p.text}
            if p.applies_to is not None:
                have = versions.get(canonicalize_name(p.applies_to.name))
                if have is None or not p.applies_to.specifier.contains(_version(have, p.where), prereleases=True):
                    row["skip"] = True
                    row["skip_reason"] = (f"needs {p.applies_to}; {p.applies_to.name} "
                                          + (f"{have} installed" if have else "not installed"))
            rows.append(row)
        payload.append({"name": s.name, "package": s.package, "version": installed_version,
                        "specifier": str(s.specifier), "patches": rows,
                        "upstream": [{"name": u.name, "evidence": u.evidence, "contracts": u.contracts}
                                     for u in s.upstream]})
    return payload


def for_installed(series_list: list[Series], dists: dict, where: str) -> list[Series]:
    """The series whose package is installed at a release they apply to; PatchError if none."""
    kept = [s for s in series_list if dists.get(s.package)
            and s.specifier.contains(_version(dists[s.package].version, s.where), prereleases=True)]
    if not kept:
        known = ", ".join(f"{s.name} ({s.package}{s.specifier})" for s in series_list)
        packages = sorted({s.package for s in series_list})
        if not any(dists.get(p) for p in packages):
            raise PatchError(f"{', '.join(packages)} is not installed in {where} (series: {known}); refusing",
                             where=where)
        have = ", ".join(sorted({f"{s.package} {dists[s.package].version}" if dists.get(s.package)
                                 else f"no {s.package}" for s in series_list}))
        raise PatchError(f"no series applies to {have} in {where} (series: {known}); refusing", where=where)
    return kept


def _version(text: str, where: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise PatchError(f"installed version {text!r} is not a PEP 440 version", where=where) from None


def apply_series(transport: Transport, series_list: list[Series], *, python: str, check_only: bool = False,
                 revert: bool = False, site_packages: str | None = None, matching: bool = False) -> dict:
    """Apply (or check, or revert) every series in the environment of `python` (or `site_packages`).

    All-or-nothing: every hunk of every patch is checked before any file is written; an applied
    patch is left alone. Returns the report: per series and patch a status (applied /
    already-applied / skipped-by-gate / failed; reverting: reverted / not-applied; a fix the series
    says is upstream: upstream when its lines are there, else failed) and per touched or vouched-for
    file its sha256 afterwards. Raises PatchError (naming patch, file, first failing hunk) with
    nothing written; in check mode failures are reported instead. `matching`: of the series given
    (every shipped one), only those for the installed release (PatchError if none is).
    """
    if check_only and revert:
        raise ProvisionError("check_only and revert are exclusive")
    mode = "check" if check_only else "revert" if revert else "apply"
    where = _where(transport, python, site_packages)
    names = sorted({s.package for s in series_list}
                   | {canonicalize_name(p.applies_to.name) for s in series_list for p in s.patches if p.applies_to})
    dists = installed(transport, names, python=python, site_packages=site_packages)
    if matching:
        series_list = for_installed(series_list, dists, where)
    payload = {"op": "run", "mode": mode, "site_packages": _sp(site_packages),
               "series": gate(series_list, {k: d.version for k, d in dists.items() if d is not None}, where)}
    host = transport.target.name
    run = PatchRun.of(transport.run_agent("patcher", payload, python=python), host)
    if isinstance(run, PatchRefused):
        raise PatchError(run.failed, where=where)
    by_name = {p["name"]: p for p in payload["series"]}
    files_of = {(s.name, p.name): p.files for s in series_list for p in [*s.patches, *s.upstream]}
    out = run.to_json()
    for i, (s, told) in enumerate(zip(run.series, out.get("series", []))):
        if s.name not in by_name:
            refuse(host, PatchRun.STEP, f"series[{i}].name", f"{s.name[:120]!r} is not a series asked for")
        told.update({k: by_name[s.name][k] for k in ("package", "version", "specifier")})
        for p, row in zip(s.patches, told["patches"]):
            row["files"] = files_of.get((s.name, p.name), [])
    out["ok"] = all(p.status != "failed" for s in run.series for p in s.patches)
    out["host"] = host
    out["python"] = python
    return out


def verify_manifest(transport: Transport, manifest_files: dict, python: str, *, site_packages=None) -> list:
    """[{path, expected, actual}] for each file whose sha256 differs from the manifest (actual None:
    missing). Relative paths are taken from the environment's site-packages."""
    out = transport.run_agent("patcher", {"op": "verify", "files": manifest_files,
                                          "site_packages": _sp(site_packages)}, python=python)
    return Mismatches.of(out, transport.target.name).to_json()["mismatches"]


def contract(transport: Transport, arch: str, python: str, *, site_packages=None):
    """The EAGLE-3 interface contract of `arch` (a name or a config.json on the host), statically: a Contract, or a
    ContractMissing where the host finds no class of it."""
    out = transport.run_agent("contracts", {"op": "check", "architecture": arch, "site_packages": _sp(site_packages)},
                              python=python)
    return Contract.of(out, transport.target.name)


def check_contract(transport: Transport, arch: str, python: str, *, site_packages=None) -> dict:
    """`contract` as JSON, naming the host."""
    return dict(contract(transport, arch, python, site_packages=site_packages).to_json(), host=transport.target.name)
