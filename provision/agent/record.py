"""Installed distributions against their RECORD (stdlib only): what `verify` and `pack` both read.

A venv's distribution lists every file it installed in `<name>.dist-info/RECORD` as `path,sha256=<urlsafe
b64, unpadded>,size`, paths relative to site-packages (scripts and data files climb out with `../`). Paths
come from the host's own files, so each is contained under the venv before it is read. Hashing runs on a
thread pool: hashlib releases the GIL on large buffers, so threads use every core.
"""
import ast
import base64
import csv
import hashlib
import io
import json
import os
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

from .host import event, norm, thread_buffer

CHUNK = 1 << 20
# What a venv's creator (virtualenv, uv before 0.4) writes into site-packages, no RECORD listing them: a .pth run
# at every start and the module it imports. Not exempt from any check: the seal's stamp and an adoption's record
# hold their bytes, and verify compares them (`creator_files`).
CREATOR_WRITES = ("_virtualenv.py", "_virtualenv.pth")


def site_packages(venv):
    """The venv's site-packages directory (lib/pythonX.Y/site-packages), or None."""
    lib = os.path.join(venv, "lib")
    for name in sorted(os.listdir(lib)) if os.path.isdir(lib) else []:
        sp = os.path.join(lib, name, "site-packages")
        if name.startswith("python") and os.path.isdir(sp):
            return sp
    return None


def dist_infos(site):
    """[(normalized name, version, dist-info dir name)] of the distributions installed in `site`, by name."""
    out = []
    for entry in sorted(os.listdir(site)):
        if not entry.endswith(".dist-info"):
            continue
        meta = os.path.join(site, entry, "METADATA")
        name = version = None
        try:
            with open(meta, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if not line.strip():
                        break
                    k, _, v = line.partition(":")
                    if k == "Name" and name is None:
                        name = v.strip()
                    elif k == "Version" and version is None:
                        version = v.strip()
        except OSError:
            continue
        if name:
            out.append((norm(name), version or "", entry))
    return sorted(out)


def b64digest(raw):
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def buffer():
    """This thread's read buffer of CHUNK bytes (one per thread, reused for every file it reads)."""
    return thread_buffer("read", CHUNK)[:CHUNK]


def hash_file(path):
    """(sha256 as RECORD writes it, size) of one file."""
    h, n = hashlib.sha256(), 0
    buf = buffer()
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                break
            h.update(view[:k])
            n += k
    return b64digest(h.digest()), n


def entries(site, info, top):
    """[(relative path as RECORD names it, absolute path or None when it escapes `top`, algo, digest, size)]
    for one dist-info. RECORD itself (and other unhashed entries) carry no digest."""
    path = os.path.join(site, info, "RECORD")
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        rows = list(csv.reader(io.StringIO(f.read())))
    real_top = os.path.realpath(top)
    real = {}           # directory → its realpath: a RECORD's files share a few directories
    out = []
    for row in rows:
        if not row or not row[0]:
            continue
        rel = row[0]
        algo, _, digest = (row[1] if len(row) > 1 else "").partition("=")
        size = int(row[2]) if len(row) > 2 and row[2].isdigit() else None
        full = os.path.normpath(os.path.join(site, rel))
        ok = "\0" not in rel and not os.path.isabs(rel)
        if ok:
            parent = os.path.dirname(full)
            if parent not in real:
                real[parent] = os.path.realpath(parent)
            ok = (real[parent] + os.sep).startswith(real_top + os.sep)
        out.append((rel, full if ok else None, algo, digest, size))
    return out


def jobs_default():
    return min(32, (os.cpu_count() or 1) * 2)


def listing(venv, only=None, expect=None):
    """What `check` reads, from every RECORD: {site, dists: {name: {version, info, files, bytes, changed,
    missing, outside, overwritten, unhashed, overridden}}, work: [(name, rel, absolute path, digest, size)] the
    files to hash (largest first, by RECORD's sizes), owners: {path: digests its owners expect}, listed: paths
    any RECORD names, rows: {name: its RECORD's `entries`}, unclaimed: keys of `expect` no RECORD lists}.
    `only` and `expect`: as `check` takes them."""
    site = site_packages(venv)
    if site is None:
        raise OSError("no site-packages under %s" % venv)
    expect = {os.path.normpath(k): _b64_of_hex(v) for k, v in (expect or {}).items()}
    claimed = set()
    dists, work, listed, owners, by_dist = {}, [], set(), {}, {}
    for name, version, info in dist_infos(site):
        if only is not None and name not in only:
            continue
        d = dists[name] = {"version": version, "info": info, "files": 0, "bytes": 0, "changed": [], "missing": [],
                           "outside": [], "overwritten": [], "unhashed": 0, "overridden": 0}
        try:
            rows = entries(site, info, venv)
        except OSError:
            d["missing"].append(info + "/RECORD")
            continue
        by_dist[name] = rows
        for rel, full, algo, digest, size in rows:
            if full is None:
                d["outside"].append(rel)
                continue
            listed.add(full)
            key = os.path.normpath(rel)
            if key in expect:
                algo, digest = "sha256", expect[key]
                claimed.add(key)
                d["overridden"] += 1
            if not digest or algo != "sha256":
                d["unhashed"] += 1
                continue
            work.append((name, rel, full, digest, size or 0))
            owners.setdefault(full, set()).add(digest)
    work.sort(key=lambda w: -w[4])       # largest first (RECORD's sizes): a pool's tail is short
    return {"site": site, "dists": dists, "work": work, "owners": owners, "listed": listed, "rows": by_dist,
            "unclaimed": sorted(set(expect) - claimed)}


def tally(lst, results):
    """Judge hashed files into `lst`'s dists: `results` are (work item, digest found or None when the file is
    missing or "" when it cannot be read, bytes read). A path several distributions' RECORDs list holds one of
    their copies (the one installed last): changed only if it matches none of their hashes; the distribution
    whose copy lost lists it under `overwritten`. Returns {path: digest found}."""
    found = {}
    for (name, rel, full, digest, _), got, n in results:
        if got:
            found[full] = got
        d = lst["dists"][name]
        d["files"] += 1
        d["bytes"] += n
        if got is None:
            d["missing"].append(rel)
        elif got != digest and got in lst["owners"][full]:
            d["overwritten"].append(rel)
        elif got != digest:
            d["changed"].append(rel)
    for d in lst["dists"].values():
        for k in ("changed", "missing", "outside", "overwritten"):
            d[k].sort()
    return found


def unlisted(site, listed):
    """Files under site-packages no RECORD lists (paths relative to it); bytecode caches are left out (the
    interpreter's: verify judges them). None is left out by its name."""
    extra = []
    for dirpath, dirnames, filenames in os.walk(site):
        dirnames[:] = [x for x in dirnames if x != "__pycache__"]
        for fn in filenames:
            full = os.path.join(dirpath, fn)
            if full not in listed:
                extra.append(os.path.relpath(full, site))
    return sorted(extra)


def creator_files(site):
    """The files of CREATOR_WRITES the venv's creator left in `site` (names relative to it)."""
    return [n for n in CREATOR_WRITES if os.path.isfile(os.path.join(site, n))]


# ------------------------------------------------------------------ code that runs from outside the venv

def _finder_paths(path):
    """The directories an `__editable___*_finder.py` (setuptools' PEP 660 finder) maps imports to: its MAPPING
    values and NAMESPACES lists, read as literals (never run)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return []
    out = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        named = any(isinstance(t, ast.Name) and t.id in ("MAPPING", "NAMESPACES") for t in targets)
        if not named or node.value is None:
            continue
        try:
            value = ast.literal_eval(node.value)
        except ValueError:
            continue
        for v in value.values() if isinstance(value, dict) else []:
            out += [v] if isinstance(v, str) else [x for x in v if isinstance(x, str)] if isinstance(v, list) else []
    return out


def _lines(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return []


def outside_code(venv):
    """What the venv runs from outside itself, which no check of its files can vouch for: [{dist, version, file,
    where, why}] (`dist` and `version` of the distribution whose RECORD lists `file`, or None; an `.egg-link`'s
    dist is its name; `file` relative to site-packages; `where` the path outside). An editable install (PEP 610's
    direct_url.json `dir_info.editable`), a `.pth` line that puts a directory outside the venv on the path (the
    interpreter reads each at start), an `__editable__` finder that maps imports outside it, a development
    install's `.egg-link`."""
    site = site_packages(venv)
    if site is None:
        return []
    top = os.path.realpath(venv)

    def outside(p):
        real = os.path.realpath(p)
        return real != top and not real.startswith(top + os.sep)

    found = []          # (absolute path, where, why, dist): owners looked up once, only when something is found

    def add(full, where, why, dist=None):
        found.append((full, where, why, dist))

    infos = dist_infos(site)
    for name, version, info in infos:
        du = os.path.join(site, info, "direct_url.json")
        try:
            with open(du, encoding="utf-8") as f:
                url = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(url, dict) and isinstance(url.get("dir_info"), dict) and url["dir_info"].get("editable") \
                and isinstance(url.get("url"), str):
            parts = urllib.parse.urlsplit(url["url"])
            where = urllib.parse.unquote(parts.path) if parts.scheme == "file" else url["url"]
            add(du, where, "an editable install of %s" % where, (name, version))
    for fn in sorted(os.listdir(site)):
        full = os.path.join(site, fn)
        if not os.path.isfile(full):
            continue
        if fn.endswith(".pth"):
            for line in _lines(full):
                line = line.rstrip()
                if not line or line.startswith("#") or line.startswith(("import ", "import\t")):
                    continue
                where = os.path.abspath(os.path.join(site, line))
                if outside(where):
                    add(full, where, "%s puts %s on the path" % (fn, where))
        elif fn.startswith("__editable__") and fn.endswith("_finder.py"):
            for where in _finder_paths(full):
                if os.path.isabs(where) and outside(where):
                    add(full, where, "%s imports from %s" % (fn, where))
        elif fn.endswith(".egg-link"):
            lines = _lines(full)
            if lines and lines[0].strip():
                where = os.path.abspath(os.path.join(site, lines[0].strip()))
                add(full, where, "a development install (%s) of %s" % (fn, where),
                    (norm(fn[:-len(".egg-link")]), None))
    owners = {}
    for name, version, info in infos if any(d is None for _, _, _, d in found) else ():
        try:
            rows = entries(site, info, venv)
        except OSError:
            continue
        for _, full, _, _, _ in rows:
            if full is not None:
                owners.setdefault(full, (name, version))
    out = []
    for full, where, why, dist in found:
        name, version = dist or owners.get(full, (None, None))
        out.append({"dist": name, "version": version, "file": os.path.relpath(full, site), "where": where,
                    "why": why})
    return out


def check(venv, jobs=None, only=None, expect=None, baseline=False, digests=False, known=None):
    """Every installed file of the venv against its RECORD. Returns
    {site, dists: {name: {version, info, files, bytes, changed: [rel], missing: [rel], outside: [rel],
    unhashed: n, overridden: n}}, files, bytes, seconds, extra: [paths relative to site-packages no RECORD
    lists], unclaimed: [keys of `expect` no RECORD lists]}.
    `only`: a set of normalized names to check (default all). `expect`: {path relative to site-packages:
    sha256 hex} that replace RECORD's hash for those files (a patch series' results). `baseline`: hash from
    disk (the page cache of these files dropped first, where it can be) and then time a first read of
    the same files, dropped again (`first_read_seconds`, `read_bytes`, `cache`: how the cache was dropped).
    `digests`: also {absolute path: digest found} of every file hashed (`digests`). `known`: {absolute path:
    (digest, size)} of files whose bytes are known without reading them (the host store's entries).
    A path several distributions' RECORDs list is judged as `tally` says (e.g. two wheels that both ship a
    top-level build_backend.py)."""
    lst = listing(venv, only, expect)
    work = lst["work"]
    known = known or {}

    def one(item):
        if item[2] in known:
            return item, known[item[2]][0], known[item[2]][1]
        try:
            got, n = hash_file(item[2])
        except FileNotFoundError:
            return item, None, 0
        except OSError:
            return item, "", 0
        return item, got, n

    def many(items):
        out = [one(item) for item in items]
        if meter() is not None:
            meter().add(len(out), sum(n for _, _, n in out))
        return out

    if baseline:
        drop([w[2] for w in work])
    m = meter()
    if m is not None:
        m.phase("hash", len(work), sum(w[4] for w in work))
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=jobs or jobs_default()) as ex:
        found = tally(lst, (r for rs in ex.map(many, batches(work, lambda w: w[4])) for r in rs))
    seconds = time.monotonic() - t0
    dists = lst["dists"]
    out = {"site": lst["site"], "dists": dists, "unclaimed": lst["unclaimed"],
           "extra": unlisted(lst["site"], lst["listed"]) if only is None else [],
           "files": sum(d["files"] for d in dists.values()), "bytes": sum(d["bytes"] for d in dists.values()),
           "seconds": seconds}
    if digests:
        out["digests"] = found
    if baseline:
        out["first_read_seconds"], out["read_bytes"], out["cache"] = first_read(list(found), jobs)
    return out


def batches(items, size_of, target=1 << 23):
    """`items` (largest first) in consecutive groups of about `target` bytes (at most 512 items): one pool task
    each, so that thousands of small files do not cost a task each."""
    out, cur, cur_bytes = [], [], 0
    for it in items:
        cur.append(it)
        cur_bytes += size_of(it)
        if cur_bytes >= target or len(cur) >= 512:
            out.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        out.append(cur)
    return out


def read_all(paths, jobs=None):
    """(seconds, bytes) to read every file of `paths` in parallel, without hashing."""
    def one(path):
        n, buf = 0, buffer()
        try:
            with open(path, "rb", buffering=0) as f:
                while True:
                    k = f.readinto(buf)
                    if not k:
                        break
                    n += k
        except OSError:
            pass
        return n

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=jobs or jobs_default()) as ex:
        total = sum(ex.map(lambda group: sum(one(p[0]) for p in group),
                           batches([(p, size_of(p)) for p in paths], lambda p: p[1])))
    return time.monotonic() - t0, total


def advise(paths, advice):
    """posix_fadvise(`advice`) over the whole of each file of `paths` that can be opened; False where the
    platform has no posix_fadvise."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, advice)
        except OSError:
            pass
        finally:
            os.close(fd)
    return True


def drop(paths):
    """Drop the page cache of each file (posix_fadvise DONTNEED: any reader may, for the pages no process maps
    or has dirtied), so that the next read comes from disk. Returns how, in words, or None where it cannot."""
    if not advise(paths, getattr(os, "POSIX_FADV_DONTNEED", 4)):
        return None
    return "the page cache dropped per file first by posix_fadvise(DONTNEED)"


def first_read(paths, jobs=None):
    """(seconds, bytes, how) of a first read of `paths` from disk: their page cache is dropped before the read
    and again after it (so whatever is timed next starts from disk too). `how` says what was done; without a
    way to drop it the read is timed as it comes (from the page cache where the files are in it)."""
    how = drop(paths) or "the page cache not dropped (no posix_fadvise): it may come from memory"
    seconds, n = read_all(paths, jobs)
    drop(paths)
    return seconds, n, how


class Meter:
    """Work done of a total in one phase, told to the controller as a progress event every `every` seconds
    (by a thread of its own, so one long file does not hold it up) while the meter is active (`with`)."""

    def __init__(self, step, every=2.0):
        self.step, self.every = step, max(0.01, float(every or 2.0))
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.name, self.files, self.bytes, self.files_total, self.bytes_total = None, 0, 0, None, None
        self.t0 = time.monotonic()

    def phase(self, name, files_total=None, bytes_total=None):
        """A new phase (its counts start from zero); told at once."""
        with self.lock:
            self.name, self.files, self.bytes = name, 0, 0
            self.files_total, self.bytes_total = files_total, bytes_total
        self.tell()

    def add(self, files, nbytes):
        with self.lock:
            self.files += files
            self.bytes += nbytes

    def tell(self):
        with self.lock:
            ev = {"step": self.step, "phase": self.name, "files": self.files, "bytes": self.bytes,
                  "files_total": self.files_total, "bytes_total": self.bytes_total,
                  "seconds": round(time.monotonic() - self.t0, 3), "every": self.every}
        event(**ev)

    def _run(self):
        while not self.stop.wait(self.every):
            self.tell()

    def __enter__(self):
        _METERS.append(self)
        self.thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        _METERS.remove(self)


_METERS = []


def meter():
    """The meter of the operation this agent process runs, when it keeps one (else None)."""
    return _METERS[-1] if _METERS else None


def size_of(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _b64_of_hex(hexdigest):
    """A sha256 hex digest as RECORD writes it (one that is not hex never matches)."""
    try:
        return b64digest(bytes.fromhex(hexdigest))
    except (TypeError, ValueError):
        return "!" + str(hexdigest)
