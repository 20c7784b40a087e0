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
from concurrent.futures import ThreadPoolExecutor

from .host import norm

CHUNK = 1 << 20
SKIP_SUFFIXES = (".pyc",)       # written at run time by the interpreter, never installed content


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


def hash_file(path):
    """(sha256 as RECORD writes it, size) of one file."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while True:
            b = f.read(CHUNK)
            if not b:
                break
            h.update(b)
            n += len(b)
    return b64digest(h.digest()), n


def entries(site, info, top):
    """[(relative path as RECORD names it, absolute path or None when it escapes `top`, algo, digest, size)]
    for one dist-info. RECORD itself (and other unhashed entries) carry no digest."""
    path = os.path.join(site, info, "RECORD")
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        rows = list(csv.reader(io.StringIO(f.read())))
    real_top = os.path.realpath(top)
    out = []
    for row in rows:
        if not row or not row[0]:
            continue
        rel = row[0]
        algo, _, digest = (row[1] if len(row) > 1 else "").partition("=")
        size = int(row[2]) if len(row) > 2 and row[2].isdigit() else None
        full = os.path.normpath(os.path.join(site, rel))
        ok = "\0" not in rel and not os.path.isabs(rel) and \
            (os.path.realpath(os.path.dirname(full)) + os.sep).startswith(real_top + os.sep)
        out.append((rel, full if ok else None, algo, digest, size))
    return out


def check(venv, jobs=None, only=None):
    """Every installed file of the venv against its RECORD. Returns
    {site, dists: {name: {version, info, files, bytes, changed: [rel], missing: [rel], outside: [rel],
    unhashed: n}}, files, bytes, extra: [paths relative to site-packages no RECORD lists]}.
    `only`: a set of normalized names to check (default all)."""
    site = site_packages(venv)
    if site is None:
        raise OSError("no site-packages under %s" % venv)
    dists, work, listed = {}, [], set()
    for name, version, info in dist_infos(site):
        if only is not None and name not in only:
            continue
        d = dists[name] = {"version": version, "info": info, "files": 0, "bytes": 0, "changed": [], "missing": [],
                           "outside": [], "unhashed": 0}
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
            if not digest or algo != "sha256":
                d["unhashed"] += 1
                continue
            work.append((name, rel, full, digest))

    def one(item):
        name, rel, full, digest = item
        try:
            got, n = hash_file(full)
        except FileNotFoundError:
            return name, rel, None, 0
        except OSError:
            return name, rel, "", 0
        return name, rel, got == digest, n

    with ThreadPoolExecutor(max_workers=jobs or min(32, (os.cpu_count() or 1) * 2)) as ex:
        for name, rel, ok, n in ex.map(one, sorted(work, key=lambda w: -_size(w[2]))):
            d = dists[name]
            d["files"] += 1
            d["bytes"] += n
            if ok is None:
                d["missing"].append(rel)
            elif not ok:
                d["changed"].append(rel)
    extra = []
    if only is None:
        for dirpath, dirnames, filenames in os.walk(site):
            dirnames[:] = [x for x in dirnames if x != "__pycache__"]
            for fn in filenames:
                full = os.path.join(dirpath, fn)
                if full not in listed and not fn.endswith(SKIP_SUFFIXES):
                    extra.append(os.path.relpath(full, site))
    for d in dists.values():
        for k in ("changed", "missing", "outside"):
            d[k].sort()
    return {"site": site, "dists": dists, "extra": sorted(extra),
            "files": sum(d["files"] for d in dists.values()), "bytes": sum(d["bytes"] for d in dists.values())}


def _size(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
