"""Installed distributions against their RECORD (stdlib only): what `verify` and `pack` both read.

A venv's distribution lists every file it installed in `<name>.dist-info/RECORD` as `path,sha256=<urlsafe
b64, unpadded>,size`, paths relative to site-packages (scripts and data files climb out with `../`). Paths
come from the host's own files, so each is contained under the venv before it is read. Hashing runs on a
thread pool: hashlib releases the GIL on large buffers, so threads use every core.
"""
import base64
import csv
import hashlib
import io
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .host import norm

CHUNK = 1 << 20
# What `uv venv` itself writes into site-packages (no distribution's RECORD lists them): not extra.
UV_WRITES = ("_virtualenv.py", "_virtualenv.pth")


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


_BUF = threading.local()


def buffer():
    """This thread's read buffer (one per thread, reused for every file it reads)."""
    buf = getattr(_BUF, "buf", None)
    if buf is None:
        buf = _BUF.buf = bytearray(CHUNK)
    return buf


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


def check(venv, jobs=None, only=None, expect=None, baseline=False, digests=False, known=None):
    """Every installed file of the venv against its RECORD. Returns
    {site, dists: {name: {version, info, files, bytes, changed: [rel], missing: [rel], outside: [rel],
    unhashed: n, overridden: n}}, files, bytes, seconds, extra: [paths relative to site-packages no RECORD
    lists], unclaimed: [keys of `expect` no RECORD lists]}.
    `only`: a set of normalized names to check (default all). `expect`: {path relative to site-packages:
    sha256 hex} that replace RECORD's hash for those files (a patch series' results). `baseline`: then read the
    same files without hashing, in parallel, before hashing (`first_read_seconds`: from disk or the page cache,
    as they were) and after it (`read_seconds`, `read_bytes`): hashing and the second read then both read from
    the page cache when the files fit in memory, so their ratio is hashing's own cost.
    `digests`: also {absolute path: digest found} of every file hashed (`digests`). `known`: {absolute path:
    (digest, size)} of files whose bytes are known without reading them (the host store's entries).
    A path several distributions' RECORDs list holds one of their copies (the one installed last): it is
    judged against each owner's hash and is changed only if it matches none; a distribution whose copy lost
    lists it under `overwritten` (e.g. two wheels that both ship a top-level build_backend.py)."""
    site = site_packages(venv)
    if site is None:
        raise OSError("no site-packages under %s" % venv)
    expect = {os.path.normpath(k): _b64_of_hex(v) for k, v in (expect or {}).items()}
    claimed = set()
    dists, work, listed, owners = {}, [], set(), {}
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

    known = known or {}

    def one(item):
        name, rel, full, digest, _ = item
        if full in known:
            return name, rel, full, known[full][0], known[full][0] == digest, known[full][1]
        try:
            got, n = hash_file(full)
        except FileNotFoundError:
            return name, rel, full, None, None, 0
        except OSError:
            return name, rel, full, None, False, 0
        return name, rel, full, got, got == digest, n

    def many(items):
        return [one(item) for item in items]

    work.sort(key=lambda w: -w[4])       # largest first (RECORD's sizes): the pool's tail is short
    if baseline:      # a first plain read brings the files into the page cache, as it would for hashing
        first = read_all([w[2] for w in work], jobs)
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=jobs or jobs_default()) as ex:
        found = {}
        for name, rel, full, got, ok, n in (r for rs in ex.map(many, batches(work, lambda w: w[4])) for r in rs):
            if got is not None:
                found[full] = got
            d = dists[name]
            d["files"] += 1
            d["bytes"] += n
            if ok is None:
                d["missing"].append(rel)
            elif not ok and got in owners[full]:
                d["overwritten"].append(rel)
            elif not ok:
                d["changed"].append(rel)
    seconds = time.monotonic() - t0
    extra = []
    if only is None:
        for dirpath, dirnames, filenames in os.walk(site):
            dirnames[:] = [x for x in dirnames if x != "__pycache__"]   # the interpreter's: judged by verify
            for fn in filenames:
                full = os.path.join(dirpath, fn)
                if full not in listed and not (dirpath == site and fn in UV_WRITES):
                    extra.append(os.path.relpath(full, site))
    for d in dists.values():
        for k in ("changed", "missing", "outside", "overwritten"):
            d[k].sort()
    out = {"site": site, "dists": dists, "extra": sorted(extra), "unclaimed": sorted(set(expect) - claimed),
           "files": sum(d["files"] for d in dists.values()), "bytes": sum(d["bytes"] for d in dists.values()),
           "seconds": seconds}
    if digests:
        out["digests"] = found
    if baseline:
        out["first_read_seconds"] = first[0]
        out["read_seconds"], out["read_bytes"] = read_all([w[2] for w in work], jobs)
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
    """(seconds, bytes) to read every file of `paths` in parallel, without hashing: what `verify`'s hashing and
    `pack`'s check and pack are measured against."""
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
                           batches([(p, _size(p)) for p in paths], lambda p: p[1])))
    return time.monotonic() - t0, total


def _size(path):
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
