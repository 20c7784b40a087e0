"""Resolve a lock's `requires` into its complete, hashed closure for the lock's platform (uv),
and read package indexes: PEP 691/503 project pages and each wheel's METADATA (PEP 658,
HTTP range reads of the wheel, or the whole wheel), cached under ~/.cache/provision/metadata.
"""
from __future__ import annotations

import hashlib
import html.parser
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
import zipfile
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import Path

import requests
from packaging.markers import InvalidMarker, Marker
from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from .errors import ResolveError
from .lock import Lock

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

# The manylinux levels uv's --python-platform names; the lock's glibc picks the highest not above it
# (wheels tagged between two of these are still ranked by `platform_tags`).
UV_MANYLINUX = (17, 28, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40)
TIMEOUT = 30
CACHE = Path(os.environ.get("PROVISION_CACHE", Path.home() / ".cache" / "provision"))
JSON_ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
# Settings of pip and uv that would add sources the lock does not name (a pip.conf may add local
# wheel folders or a constraints file): never passed to the resolver.
_ENV_DROP = ("PIP_", "UV_")


# ---------------------------------------------------------------- platform

def marker_env(lock: Lock, extra: str = "") -> dict[str, str]:
    """PEP 508 marker environment of the lock's target (CPython on Linux)."""
    py = lock.platform.python
    return {"python_version": py, "python_full_version": f"{py}.0", "implementation_name": "cpython",
            "implementation_version": f"{py}.0", "platform_python_implementation": "CPython",
            "os_name": "posix", "sys_platform": "linux", "platform_system": "Linux",
            "platform_machine": lock.platform.arch, "platform_release": "", "platform_version": "",
            "extra": extra}


def marker_true(marker: Marker | str | None, lock: Lock, extras=("",)) -> bool:
    if marker is None or marker == "":
        return True
    try:
        m = marker if isinstance(marker, Marker) else Marker(marker)
    except InvalidMarker:
        return True
    return any(m.evaluate(marker_env(lock, e)) for e in extras)


def glibc_minor(lock: Lock) -> int:
    return int(lock.platform.glibc.split(".")[1])


def uv_platform(lock: Lock) -> str:
    """uv's --python-platform for the lock: manylinux at the lock's glibc, or the highest uv names below it."""
    level = max(m for m in UV_MANYLINUX if m <= glibc_minor(lock))
    return f"{lock.platform.arch}-manylinux_2_{level}"


def platform_tags(lock: Lock) -> list[Tag]:
    """Wheel tags the target accepts, best first (CPython, manylinux ≤ the lock's glibc, then linux)."""
    major, minor = (int(x) for x in lock.platform.python.split("."))
    arch = lock.platform.arch
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    plats = [p for m in range(glibc_minor(lock), 4, -1) for p in
             ([f"manylinux_2_{m}_{arch}"] + ([f"{legacy[m]}_{arch}"] if m in legacy else []))]
    plats.append(f"linux_{arch}")
    return list(cpython_tags((major, minor), platforms=plats)) + \
        list(compatible_tags((major, minor), f"cp{major}{minor}", plats))


def wheel_rank(filename: str, tags: list[Tag]) -> int | None:
    """Position of the wheel's best tag in `tags` (lower is better), None if unsupported."""
    try:
        _, _, _, wtags = parse_wheel_filename(filename)
    except InvalidWheelFilename:
        return None
    ranks = {t: i for i, t in enumerate(tags)}
    hits = [ranks[t] for t in wtags if t in ranks]
    return min(hits) if hits else None


# ---------------------------------------------------------------- indexes

@dataclass
class Dist:
    filename: str
    url: str
    sha256: str | None = None
    metadata: bool = False          # the index serves PEP 658 metadata for it

    @property
    def version(self) -> str | None:
        try:
            return str(parse_wheel_filename(self.filename)[1])
        except InvalidWheelFilename:
            return None


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[dict] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.links.append(dict(attrs))


def _session() -> requests.Session:
    s = requests.Session()
    s.trust_env = True            # proxies and CA bundle from the environment
    return s


def _read_url(url: str, headers: dict | None = None, session=None) -> tuple[bytes, str]:
    """(body, content type) of an http(s) or file URL."""
    if url.startswith("file://"):
        p = Path(urllib.parse.unquote(urllib.parse.urlparse(url).path))
        if p.is_dir():
            p = p / "index.html"
        return p.read_bytes(), "text/html"
    r = (session or _session()).get(url, headers=headers or {}, timeout=TIMEOUT)
    r.raise_for_status()
    return r.content, r.headers.get("content-type", "")


def project_files(index_url: str, name: str, session=None) -> list[Dist]:
    """The wheels an index serves for a project (PEP 691 JSON, else PEP 503 HTML)."""
    base = index_url.rstrip("/") + "/"
    url = urllib.parse.urljoin(base, canonicalize_name(name) + "/")
    body, ctype = _read_url(url, {"Accept": JSON_ACCEPT}, session)
    out = []
    if "json" in ctype:
        for f in json.loads(body)["files"]:
            if f["filename"].endswith(".whl") and not f.get("yanked"):
                out.append(Dist(f["filename"], urllib.parse.urljoin(url, f["url"]), f.get("hashes", {}).get("sha256"),
                                bool(f.get("core-metadata") or f.get("dist-info-metadata"))))
        return out
    parser = _Links()
    parser.feed(body.decode("utf-8", "replace"))
    for a in parser.links:
        href = a.get("href") or ""
        full = urllib.parse.urljoin(url, href)
        path, _, frag = full.partition("#")
        fname = urllib.parse.unquote(path.rsplit("/", 1)[-1])
        if not fname.endswith(".whl") or "data-yanked" in a:
            continue
        sha = frag[len("sha256="):] if frag.startswith("sha256=") else None
        meta = a.get("data-core-metadata") or a.get("data-dist-info-metadata")
        out.append(Dist(fname, path, sha, bool(meta) and meta != "false"))
    return out


def probe_index(url: str) -> str | None:
    """None if the index answers, else why not (one line)."""
    try:
        if url.startswith("file://"):
            p = Path(urllib.parse.unquote(urllib.parse.urlparse(url).path))
            return None if p.is_dir() else f"{p} is not a folder"
        r = _session().get(url.rstrip("/") + "/", timeout=10, headers={"Accept": JSON_ACCEPT}, stream=True)
        r.close()
        if r.status_code >= 500:
            return f"HTTP {r.status_code}"
        return None
    except requests.RequestException as e:
        return f"unreachable ({type(e).__name__})"


# ---------------------------------------------------------------- wheel metadata

class _RangeFile(io.RawIOBase):
    """A remote file read through HTTP range requests, in 256 KiB blocks (for zipfile)."""

    BLOCK = 256 * 1024

    def __init__(self, url: str, session):
        self.url, self.s, self.pos, self.blocks = url, session, 0, {}
        r = self.s.get(url, headers={"Range": "bytes=0-0"}, timeout=TIMEOUT)
        r.raise_for_status()
        rng = r.headers.get("content-range", "")
        if r.status_code != 206 or "/" not in rng:
            raise OSError("server does not serve byte ranges")
        self.size = int(rng.rsplit("/", 1)[1])

    def seekable(self):
        return True

    def readable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, off, whence=0):
        self.pos = off if whence == 0 else self.pos + off if whence == 1 else self.size + off
        return self.pos

    def _block(self, i):
        if i not in self.blocks:
            lo = i * self.BLOCK
            hi = min(self.size, lo + self.BLOCK) - 1
            r = self.s.get(self.url, headers={"Range": f"bytes={lo}-{hi}"}, timeout=TIMEOUT)
            r.raise_for_status()
            self.blocks[i] = r.content
        return self.blocks[i]

    def read(self, n=-1):
        if n is None or n < 0:
            n = self.size - self.pos
        n = max(0, min(n, self.size - self.pos))
        out = bytearray()
        while len(out) < n:
            i, off = divmod(self.pos, self.BLOCK)
            chunk = self._block(i)[off:off + n - len(out)]
            out += chunk
            self.pos += len(chunk)
        return bytes(out)

    def readinto(self, b):
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


def _metadata_from_zip(zf: zipfile.ZipFile) -> str:
    names = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
    if not names:
        raise OSError("no .dist-info/METADATA in the wheel")
    return zf.read(names[0]).decode("utf-8", "replace")


def _cache_path(sha256: str | None, filename: str) -> Path:
    key = sha256 or hashlib.sha256(filename.encode()).hexdigest()
    return CACHE / "metadata" / f"{key}.METADATA"


def wheel_metadata(url: str, filename: str, sha256: str | None, base: Path | None = None,
                   offline: bool = False, session=None) -> str:
    """A wheel's METADATA text: cache, local file, PEP 658, HTTP ranges, or the whole wheel.

    Raises OSError (with a reason) when none of these work.
    """
    cached = _cache_path(sha256, filename)
    if cached.exists():
        return cached.read_text()
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme in ("", "file"):
        p = Path(urllib.parse.unquote(parsed.path))
        if not p.is_absolute() and base is not None:
            p = base / p
        with zipfile.ZipFile(p) as zf:
            text = _metadata_from_zip(zf)
    else:
        if offline:
            raise OSError("not in the metadata cache (offline)")
        s = session or _session()
        text = None
        try:
            r = s.get(url + ".metadata", timeout=TIMEOUT)
            if r.status_code == 200 and r.content.startswith(b"Metadata-Version"):
                text = r.text
        except requests.RequestException:
            pass
        if text is None:
            try:
                with zipfile.ZipFile(_RangeFile(url, s)) as zf:
                    text = _metadata_from_zip(zf)
            except (OSError, zipfile.BadZipFile, requests.RequestException):
                try:
                    r = s.get(url, timeout=600)
                    r.raise_for_status()
                except requests.RequestException as e:
                    raise OSError(f"cannot fetch {url}: {e}") from None
                if sha256 and hashlib.sha256(r.content).hexdigest() != sha256:
                    raise OSError(f"sha256 mismatch for {filename}")
                with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
                    text = _metadata_from_zip(zf)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(cached)
    return text


def requires_dist(metadata: str) -> list[Requirement]:
    msg = HeaderParser().parsestr(metadata)
    out = []
    for r in msg.get_all("Requires-Dist") or []:
        try:
            out.append(Requirement(r))
        except Exception:  # an unparseable line in someone's wheel is skipped, not fatal
            continue
    return out


# ---------------------------------------------------------------- resolution

@dataclass
class Resolution:
    packages: list[dict]
    unresolved: list[dict]
    indexes_down: dict[str, str] = field(default_factory=dict)
    command: list[str] = field(default_factory=list)

    def data(self, lock: Lock) -> dict:
        """The lock's data with `packages` and `unresolved` replaced (other fields kept)."""
        tail = ("patches", "engine", "probes")     # conventional order: closure before these
        out = {k: v for k, v in lock.raw.items() if k not in ("packages", "unresolved") + tail}
        out["packages"] = self.packages
        out["unresolved"] = self.unresolved
        out.update({k: lock.raw[k] for k in tail if k in lock.raw})
        return out


def _index_key(url: str, indexes: dict[str, str]) -> str | None:
    host = urllib.parse.urlparse(url).netloc
    for key, iu in indexes.items():
        if url.startswith(iu.rstrip("/") + "/"):
            return key
    for key, iu in indexes.items():
        ih = urllib.parse.urlparse(iu).netloc
        if host == ih or (host == "files.pythonhosted.org" and ih == "pypi.org"):
            return key
    return None


def _served(req: Requirement, up: dict[str, str], tags: list[Tag]) -> tuple[bool, list[str]]:
    """Whether any reachable index serves a wheel for `req` on the platform; notes per index."""
    notes = []
    for key, url in up.items():
        try:
            dists = project_files(url, req.name)
        except (OSError, requests.RequestException, ValueError, KeyError) as e:
            notes.append(f"{key}: {type(e).__name__}")
            continue
        ok = [d for d in dists if d.version and req.specifier.contains(d.version, prereleases=True)
              and wheel_rank(d.filename, tags) is not None]
        if ok:
            return True, notes
        versions = sorted({d.version for d in dists if d.version}, key=_vkey)
        name = canonicalize_name(req.name)
        pypi = "pypi.org" in url and any(s.operator == "==" and "+" in s.version for s in req.specifier)
        notes.append(f"{key} serves {name} {_span(versions)} but no wheel matching {req.specifier}"
                     + (" (PyPI does not host +local versions)" if pypi else "") if versions
                     else f"{key} does not serve {name}")
    return False, notes


def _vkey(v: str):
    try:
        return Version(v)
    except InvalidVersion:
        return Version("0")


def _span(versions: list[str]) -> str:
    if not versions:
        return "nothing"
    return versions[0] if len(versions) == 1 else f"{versions[0]} to {versions[-1]}"


def find_uv() -> str:
    uv = shutil.which("uv")
    if uv:
        return uv
    try:
        from uv import find_uv_bin  # the `uv` wheel, a dependency of provision
        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        raise ResolveError("uv is not installed (pip install uv)") from None


def clean_env() -> dict[str, str]:
    """This process's environment without pip/uv settings that would add sources."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_ENV_DROP)}


def resolve(lock: Lock, *, timeout: int = 900) -> Resolution:
    """The closure of `lock.requires` for the lock's platform from the lock's reachable indexes.

    Requirements no reachable index serves (and anything only they would pull in) are left
    out of the resolution and listed as unresolved with the reason; nothing is invented.
    """
    if not lock.indexes:
        raise ResolveError("the lock names no indexes to resolve from", where=lock.where("indexes"))
    tags = platform_tags(lock)
    down = {k: why for k, u in lock.indexes.items() if (why := probe_index(u))}
    up = {k: u for k, u in lock.indexes.items() if k not in down}
    down_note = "; ".join(f"index {k} ({lock.indexes[k]}) {why}" for k, why in down.items())

    unresolved, keep = [], []
    for r in lock.requires:
        req = Requirement(r)
        if not marker_true(req.marker, lock):
            continue
        ok, notes = _served(req, up, tags)
        if ok:
            keep.append(r)
            continue
        reason = "no reachable index serves a matching wheel for python " \
                 f"{lock.platform.python} manylinux_2_{glibc_minor(lock)} {lock.platform.arch}"
        detail = "; ".join(x for x in (down_note, *notes) if x)
        unresolved.append({"name": canonicalize_name(req.name), "requirement": r,
                           "reason": f"{reason}: {detail}" if detail else reason})
    if not up:
        return Resolution([], unresolved, down)

    # An unresolved pin with a local tag (torch==2.9.1+cu130) whose public version a reachable
    # index serves stands in as a proxy during resolution, so that its dependents are chosen
    # compatible with it; the proxy and what only it requires are then dropped from the closure.
    proxies: dict[str, str] = {}
    for u in unresolved:
        v = _pin(Requirement(u["requirement"]))
        if v and Version(v).local and _served(Requirement(f"{u['name']}=={Version(v).public}"), up, tags)[0]:
            proxies[u["name"]] = f"{u['name']}=={Version(v).public}"
    excluded = {u["name"] for u in unresolved} - set(proxies)
    keep += list(proxies.values())
    overrides = [o.use for o in lock.overrides if canonicalize_name(Requirement(o.use).name) not in excluded]
    keys = list(up)
    with tempfile.TemporaryDirectory(prefix="provision-resolve-") as td:
        tdp = Path(td)
        (tdp / "requirements.in").write_text("\n".join(keep) + "\n")
        (tdp / "overrides.txt").write_text("\n".join(overrides) + "\n")
        (tdp / "excludes.txt").write_text("\n".join(sorted(excluded)) + "\n")
        # --python: this interpreter only runs uv's discovery (fast); --python-version and
        # --python-platform say what the closure is for.
        cmd = [find_uv(), "pip", "compile", "--no-config", "--quiet", "--no-header", "--python", sys.executable,
               "--python-platform", uv_platform(lock),
               "--python-version", lock.platform.python, "--only-binary", ":all:", "--generate-hashes",
               "--format", "pylock.toml", "--index-strategy", "first-index",
               "--default-index", up[keys[-1]]]
        for k in keys[:-1]:
            cmd += ["--index", up[k]]
        if overrides:
            cmd += ["--overrides", str(tdp / "overrides.txt")]
        if excluded:
            cmd += ["--excludes", str(tdp / "excludes.txt")]
        cmd += [str(tdp / "requirements.in"), "-o", str(tdp / "pylock.toml")]
        env = clean_env()
        env["UV_CACHE_DIR"] = os.environ.get("UV_CACHE_DIR", str(CACHE / "uv"))
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ResolveError(f"resolver did not finish in {timeout}s", where=lock.path) from None
        if p.returncode != 0:
            tail = " ".join(p.stderr.strip().split())[-1500:]
            raise ResolveError(f"resolution failed: {tail}", where=lock.path)
        pylock = tomllib.loads((tdp / "pylock.toml").read_text())

    packages = []
    for entry in pylock.get("packages", []):
        if not marker_true(entry.get("marker"), lock):
            continue
        name = canonicalize_name(entry["name"])
        wheels = [w for w in entry.get("wheels", []) if wheel_rank(_wheel_name(w), tags) is not None]
        if not wheels:
            unresolved.append({"name": name, "requirement": f"{name}=={entry['version']}",
                               "reason": "the resolver chose a version with no wheel for the platform"})
            continue
        best = min(wheels, key=lambda w: wheel_rank(_wheel_name(w), tags))
        url = best.get("url") or best.get("path")
        size = best.get("size")         # the index's (PEP 700), carried by pylock.toml
        pkg = {"name": name, "version": str(entry["version"]), "filename": _wheel_name(best), "url": url,
               "sha256": (best.get("hashes") or {}).get("sha256"),
               "size": size if type(size) is int and size >= 0 else None}
        key = _index_key(url, lock.indexes)
        if key:
            pkg["index"] = key
        packages.append({k: v for k, v in pkg.items() if v is not None})
    if proxies:
        packages = _without_proxies(lock, packages, set(proxies))
    packages.sort(key=lambda p: p["name"])
    return Resolution(packages, unresolved, down, cmd)


def _pin(req: Requirement) -> str | None:
    specs = [s for s in req.specifier if s.operator in ("==", "===") and "*" not in s.version]
    return specs[0].version if len(specs) == 1 else None


def _without_proxies(lock: Lock, packages: list[dict], proxies: set[str]) -> list[dict]:
    """The packages reachable from `requires` through Requires-Dist without passing a proxy."""
    from concurrent.futures import ThreadPoolExecutor

    by_name = {p["name"]: p for p in packages}

    def meta(p):
        return p["name"], requires_dist(wheel_metadata(p["url"], p["filename"], p.get("sha256")))

    try:
        with ThreadPoolExecutor(max_workers=16) as ex:
            deps = dict(ex.map(meta, packages))
    except (OSError, zipfile.BadZipFile, requests.RequestException) as e:
        raise ResolveError(f"cannot read wheel metadata to prune proxies: {e}", where=lock.path) from None
    extras: dict[str, set[str]] = {}
    todo = []
    for r in lock.requires:
        req = Requirement(r)
        n = canonicalize_name(req.name)
        if n in by_name and n not in proxies and marker_true(req.marker, lock):
            extras.setdefault(n, set()).update(req.extras)
            todo.append(n)
    seen: set[str] = set()
    while todo:
        n = todo.pop()
        key = (n, frozenset(extras.get(n, ())))
        if key in seen:
            continue
        seen.add(key)
        active = ("", *sorted(extras.get(n, ())))
        for req in deps.get(n, []):
            d = canonicalize_name(req.name)
            if d in proxies or d not in by_name or not marker_true(req.marker, lock, active):
                continue
            extras.setdefault(d, set()).update(req.extras)
            todo.append(d)
    return [by_name[n] for n in sorted({n for n, _ in seen})]


def _wheel_name(w: dict) -> str:
    if w.get("name"):
        return w["name"]
    src = w.get("url") or w.get("path") or ""
    return urllib.parse.unquote(src.rsplit("/", 1)[-1])


def resolve_data(lock: Lock, **kw) -> tuple[dict, Resolution]:
    res = resolve(lock, **kw)
    return res.data(lock), res


# ------------------------------------------------- what people wrote, and what the machine wrote

MACHINE_KEYS = ("packages", "unresolved")     # the only sections `lock resolve` writes


def rewrite_resolved(text: str, res: Resolution) -> str:
    """The lock's text with only its machine-written sections replaced by the resolution; every
    line people wrote (requires, overrides, engine, probes, their comments) is kept as written."""
    from .yamlio import dump

    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    for key in MACHINE_KEYS:
        block = dump({key: getattr(res, key)})
        start = next((i for i, ln in enumerate(lines) if ln.startswith(f"{key}:")), None)
        if start is None:
            lines.append(block)
            continue
        end = start + 1             # the block: indented lines and column-0 list items under the key
        while end < len(lines) and (lines[end].startswith((" ", "\t", "- ")) or lines[end].strip() in ("", "-")):
            end += 1
        while end > start + 1 and not lines[end - 1].strip():   # blank lines after it stay people's
            end -= 1
        lines[start:end] = [block]
    return "".join(lines)


def _closure(packages: list, unresolved: list) -> tuple:
    return (sorted((canonicalize_name(p["name"]), str(p["version"]), p.get("sha256") or "") for p in packages),
            sorted(canonicalize_name(u["name"]) for u in unresolved))


def staleness(lock: Lock, res: Resolution) -> list[str]:
    """How the lock's resolved sections differ from a fresh resolution (empty: up to date)."""
    have, want = _closure(lock.raw.get("packages") or [], lock.raw.get("unresolved") or []), \
        _closure(res.packages, res.unresolved)
    out = []
    old, new = {(n, v) for n, v, _ in have[0]}, {(n, v) for n, v, _ in want[0]}
    out += [f"+ {n}=={v}" for n, v in sorted(new - old)] + [f"- {n}=={v}" for n, v in sorted(old - new)]
    if not out and have[0] != want[0]:
        out.append("the same versions with different hashes")
    if have[1] != want[1]:
        out.append(f"unresolved: {', '.join(have[1]) or 'none'} → {', '.join(want[1]) or 'none'}")
    return out


__all__ = ["resolve", "resolve_data", "rewrite_resolved", "staleness", "Resolution", "ResolveError", "wheel_metadata", "requires_dist",
           "marker_env", "marker_true", "platform_tags", "project_files"]
