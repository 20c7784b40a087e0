"""Host agent (stdlib only): the host's content-addressed wheel cache. Payload {op, root, ...}:
`have` which files the cache holds (those it holds hashed again first) · `push` files (wheels, or the tool's uv)
streamed in after the payload, each verified on the way in. `store` is how every file enters a cache.
"""
import hashlib
import json
import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ..layout import cache_entry
from .host import AgentError, ensure_root

SHA256 = re.compile(r"^[0-9a-f]{64}$")
FILENAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+!-]*$")
CHUNK = 1 << 20


def entry(store, sha256, filename):
    """The cache entry of one file in a content-addressed store: <store>/<sha256>/<filename>, its name checked; a
    file there was verified on its way in, and is hashed again before a build uses it (`recheck`)."""
    if not SHA256.match(sha256 or "") or not FILENAME.match(filename or "") or ".." in filename:
        raise AgentError("bad cache entry %r/%r" % (sha256, filename))
    return cache_entry(store, sha256, filename)


def store_of(lay, f):
    """The store a pushed file `f` goes to: the wheel cache, or (`store` "uv") the tool's own uv under
    cache/uv-bin, which gc keeps."""
    name = f.get("store") or "wheels"
    if name not in lay.stores:
        raise AgentError("bad cache store %r" % (name,))
    return lay.stores[name]


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(CHUNK), b""):
            h.update(b)
    return h.hexdigest()


VERIFIED = ".verified"     # in an entry's directory: the entry's inode as it was when its bytes were last hashed


def _identity(path):
    st = os.stat(path)
    return [os.path.basename(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def mark_verified(path):
    """Note that the entry's bytes matched its name just now (any later write, rename or chmod moves its ctime)."""
    note = os.path.join(os.path.dirname(path), VERIFIED)
    tmp = "%s.tmp-%d-%d" % (note, os.getpid(), threading.get_ident())
    try:        # not synced: a note lost or torn in a crash only means the entry is hashed again
        with open(tmp, "w") as f:
            json.dump(_identity(path), f)
        os.replace(tmp, note)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def still_verified(path):
    """The entry is the inode last verified, untouched since (same size, mtime and ctime)."""
    try:
        with open(os.path.join(os.path.dirname(path), VERIFIED)) as f:
            return json.load(f) == _identity(path)
    except (OSError, ValueError):
        return False


def recheck(paths, jobs=8):
    """Before a build uses them, the cache entries {path: sha256} not untouched since they were verified are hashed
    again, in parallel (the others are trusted, as hashed once: `still_verified`). An entry whose bytes no longer
    match its name (a disk fault, a write through it) is removed, so it is fetched or pushed again. Returns
    {checked, hashed, bytes (hashed), seconds, healed: [path]}."""
    t0 = time.monotonic()
    present = [(p, sha) for p, sha in paths if os.path.isfile(p)]
    trusted = [p for p, _ in present if still_verified(p)]
    skip = set(trusted)

    def one(item):
        path, sha = item
        if path in skip:
            return path, True, 0
        try:
            ok, n = sha256_file(path) == sha, os.path.getsize(path)
        except OSError:
            return path, False, 0
        if ok:
            mark_verified(path)
        return path, ok, n

    healed, nbytes = [], 0
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(present) or 1))) as pool:
        for path, ok, n in pool.map(one, present):
            nbytes += n
            if not ok:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                healed.append(path)
    return {"checked": len(present), "hashed": len(present) - len(trusted), "bytes": nbytes,
            "seconds": round(time.monotonic() - t0, 3), "healed": healed}


def store(path, sha256, chunks, label):
    """Write chunks to `path` through a temp file, hashing on the way; the file appears only if it matches
    (the controller's wheel cache stores the same way)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = "%s.part-%d-%d" % (path, os.getpid(), threading.get_ident())
    h, n = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                h.update(chunk)
                f.write(chunk)
                n += len(chunk)
        if h.hexdigest() != sha256:
            raise AgentError("%s: sha256 mismatch for %s: file is %s, the lock says %s; refusing"
                             % (label, os.path.basename(path), h.hexdigest(), sha256))
        os.replace(tmp, path)
        mark_verified(path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return n


def op_have(a):
    """{root, files: [{sha256, filename, store?}]} -> {missing: [index, ...], recheck: {...}}: entries present are
    hashed again first (`recheck`), and one that changed is removed and reported missing, so it is sent again."""
    lay = ensure_root(a["root"])
    paths = [entry(store_of(lay, f), f["sha256"], f["filename"]) for f in a["files"]]
    rc = recheck([(p, f["sha256"]) for p, f in zip(paths, a["files"])], int(a.get("jobs") or 8))
    return {"missing": [i for i, p in enumerate(paths) if not os.path.isfile(p)], "recheck": rc}


def op_push(a):
    """{root, files: [{sha256, filename, size}]}; the files' bytes follow the payload on stdin, in order."""
    lay = ensure_root(a["root"])
    stream = sys.stdin.buffer
    stored = []
    for f in a["files"]:
        left = int(f["size"])

        def chunks():
            nonlocal left
            while left:
                b = stream.read(min(CHUNK, left))
                if not b:
                    raise AgentError("stream ended inside %s" % f["filename"])
                left -= len(b)
                yield b

        stored.append(entry(store_of(lay, f), f["sha256"], f["filename"]))
        store(stored[-1], f["sha256"], chunks(), f.get("label") or f["filename"])
        if f.get("mode"):
            os.chmod(stored[-1], int(f["mode"], 8) & 0o750)
    return {"stored": stored}


OPS = {"have": op_have, "push": op_push}
