"""Host agent (stdlib only): builds a generation and keeps the host's caches. Payload {op, root, ...}:

`have` which wheels the cache holds · `push` wheels (or a uv binary) streamed in after the payload ·
`build` fetch the rest in parallel (hashed once, on the way into the cache), make the venv, install ·
`unpack` the tool's own code. Progress goes to the controller as events while it happens.
"""
import base64
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from .host import AgentError, ensure_root, event, inside
from .verify import read_only

SHA256 = re.compile(r"^[0-9a-f]{64}$")
FILENAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+!-]*$")
CHUNK = 1 << 20
LOOPBACK = ("127.0.0.1", "localhost", "::1")     # a mirror on the host itself may speak plain http


def entry(lay, sha256, filename, store="wheels"):
    """The cache entry of one file: <cache>/<sha256>/<filename> (`store` "uv": the tool's own uv, under
    cache/uv-bin, which gc keeps); a file there was verified on its way in, and is hashed again before a build
    uses it (`recheck`)."""
    if not SHA256.match(sha256 or "") or not FILENAME.match(filename or "") or ".." in filename:
        raise AgentError("bad cache entry %r/%r" % (sha256, filename))
    if store not in ("wheels", "uv"):
        raise AgentError("bad cache store %r" % (store,))
    return os.path.join(lay[store], sha256, filename)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(CHUNK), b""):
            h.update(b)
    return h.hexdigest()


def recheck(paths, jobs=8):
    """Hash again, in parallel, the cache entries a build is about to use: {path: sha256} pairs. An entry whose
    bytes no longer match its name (a disk fault, a write through it) is removed, so it is fetched or pushed
    again. Returns {checked, bytes, seconds, healed: [path]}."""
    t0 = time.monotonic()
    present = [(p, sha) for p, sha in paths if os.path.isfile(p)]

    def one(item):
        path, sha = item
        try:
            return path, sha256_file(path) == sha, os.path.getsize(path)
        except OSError:
            return path, False, 0

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
    return {"checked": len(present), "bytes": nbytes, "seconds": round(time.monotonic() - t0, 3), "healed": healed}


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
            raise AgentError("%s: sha256 mismatch for %s: file is %s…, the lock says %s…; refusing"
                             % (label, os.path.basename(path), h.hexdigest()[:16], sha256[:16]))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return n


def op_have(a):
    """{root, files: [{sha256, filename, store?}]} -> {missing: [index, ...], recheck: {...}}: entries present are
    hashed again first (`recheck`), and one that changed is removed and reported missing, so it is sent again."""
    lay = ensure_root(a["root"])
    paths = [entry(lay, f["sha256"], f["filename"], f.get("store") or "wheels") for f in a["files"]]
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

        stored.append(entry(lay, f["sha256"], f["filename"], f.get("store") or "wheels"))
        store(stored[-1], f["sha256"], chunks(), f.get("label") or f["filename"])
        if f.get("mode"):
            os.chmod(stored[-1], int(f["mode"], 8) & 0o750)
    return {"stored": stored}


class Meter:
    """Counts bytes and files fetched; sends a progress event at most every `every` seconds."""

    def __init__(self, total, every=0.5):
        self.total, self.every = total, every
        self.done = self.bytes = self.expected = self.started = 0
        self.t0 = self.last = time.monotonic()
        self.lock = threading.Lock()

    def start(self, size):
        with self.lock:
            self.started += 1
            self.expected += size or 0

    def add(self, n=0, finished=False):
        with self.lock:
            self.bytes += n
            self.done += finished
            now = time.monotonic()
            if now - self.last >= self.every or (finished and self.done == self.total):
                self.last = now
                self.report(now)

    def report(self, now):
        secs = max(now - self.t0, 1e-6)
        rate = self.bytes / secs
        # Bytes still to come: what started downloads announced, plus their average for the rest.
        avg = self.expected / self.started if self.started else 0
        est = self.expected + avg * (self.total - self.started)
        eta = (est - self.bytes) / rate if rate > 0 and est >= self.bytes else None
        event(step="fetch", done=self.done, total=self.total, bytes=self.bytes, total_bytes=int(est),
              rate=rate, eta=eta, seconds=secs)


def fetchable(url, label):
    """The fetch rule of the host and the controller alike: https, or plain http from this machine itself."""
    u = urllib.parse.urlsplit(url)
    if not (u.scheme == "https" or (u.scheme == "http" and u.hostname in LOOPBACK)):
        raise AgentError("%s: only https:// URLs are fetched (http:// only from this machine), not %r"
                         % (label, url[:80]))


def _fetch(url, path, sha256, meter, timeout, label):
    fetchable(url, label)
    req = urllib.request.Request(url, headers={"User-Agent": "provision"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        meter.start(int(r.headers.get("Content-Length") or 0))

        def chunks():
            for b in iter(lambda: r.read(CHUNK), b""):
                meter.add(len(b))
                yield b

        store(path, sha256, chunks(), label)
    meter.add(finished=True)


def fetch(lay, packages, jobs, timeout):
    """Every package not in the cache, `jobs` at a time; returns (count, bytes, seconds)."""
    todo = [(p, entry(lay, p["sha256"], p["filename"])) for p in packages]
    todo = [(p, path) for p, path in todo if not os.path.isfile(path)]
    if not todo:
        return 0, 0, 0.0
    for p, _ in todo:
        if not p.get("url"):
            raise AgentError("%s==%s is not in the host's cache and has no URL to fetch" % (p["name"], p["version"]))
    meter = Meter(len(todo))
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(todo)))) as pool:
        futures = [pool.submit(_fetch, p["url"], path, p["sha256"], meter, timeout, "%s==%s" % (p["name"], p["version"]))
                   for p, path in todo]
        errors = []
        for (p, _), fut in zip(todo, futures):
            try:
                fut.result()
            except AgentError as e:
                errors.append(str(e))
            except Exception as e:  # noqa: BLE001 - named per package
                errors.append("%s==%s: %s" % (p["name"], p["version"], e))
    if errors:
        more = " (and %d more)" % (len(errors) - 1) if len(errors) > 1 else ""
        raise AgentError("fetch failed: %s%s" % (errors[0], more))
    meter.report(time.monotonic())
    return len(todo), meter.bytes, time.monotonic() - meter.t0


class BuildLog:
    """<generation>/build.log: every line of the build (the commands, their whole output, the figures), kept
    in the generation for `provision logs`, healthy or failed."""

    def __init__(self, gen_dir):
        self.f = open(os.path.join(gen_dir, "build.log"), "a", encoding="utf-8", errors="replace")

    def __call__(self, line):
        self.f.write("%s %s\n" % (time.strftime("%H:%M:%S"), line))
        self.f.flush()

    def close(self):
        self.f.close()


def _run(argv, env, what, log):
    """Run one build command with a clean environment; its output goes to the controller as events and,
    whole, to the build log."""
    t0 = time.monotonic()
    log("$ " + " ".join(argv))
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                         stdin=subprocess.DEVNULL)
    tail = []
    for line in p.stdout:
        line = line.rstrip()
        if line:
            tail = (tail + [line])[-20:]
            log(line)
            event(step=what, line=line[:300], seconds=time.monotonic() - t0)
    if p.wait() != 0:
        log("%s failed (exit %d)" % (what, p.returncode))
        raise AgentError("%s failed (exit %d): %s" % (what, p.returncode, " | ".join(tail[-3:])[-600:]))
    log("%s: %.1fs" % (what, time.monotonic() - t0))
    return time.monotonic() - t0


def clean_env(extra):
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/"), "LANG": "C.UTF-8"}
    env.update(extra)
    return env


def op_build(a):
    """{root, gen_dir, venv, python, installer: uv|pip, uv?, packages: [{name, version, sha256, filename, url?}],
    jobs?} -> figures. The generation dir and its requirements.txt were made by the state agent."""
    lay = ensure_root(a["root"])
    gen_dir, venv = inside(lay["generations"], a["gen_dir"]), inside(lay["generations"], a["venv"])
    python, installer = a["python"], a.get("installer") or "uv"
    if not os.path.isabs(python):
        raise AgentError("interpreter %r is not an absolute path" % python)
    log = BuildLog(gen_dir)
    try:
        return _build(a, lay, gen_dir, venv, python, installer, log)
    except Exception as e:
        log("build failed: %s" % e)
        raise
    finally:
        log.close()


def _build(a, lay, gen_dir, venv, python, installer, log):
    figs = {"installer": installer}
    t0 = time.monotonic()
    log("build %s with %s from %s (%d packages)" % (os.path.basename(gen_dir), installer, python,
                                                    len(a.get("packages") or [])))
    skip = set(a.get("rechecked") or [])      # what `have` hashed again in this apply already
    rc = recheck([(entry(lay, p["sha256"], p["filename"]), p["sha256"]) for p in a.get("packages") or []
                  if p["sha256"] not in skip], int(a.get("jobs") or 8))
    if rc["healed"]:
        event(step="cache", healed=[os.path.basename(p) for p in rc["healed"]])
    figs["recheck"] = dict(rc, healed=[os.path.basename(p) for p in rc["healed"]])
    log("cache: %d entries hashed again (%d bytes, %.1fs)%s" % (rc["checked"], rc["bytes"], rc["seconds"], "".join(
        "; healed " + os.path.basename(p) for p in rc["healed"])))
    n, nbytes, secs = fetch(lay, a.get("packages") or [], int(a.get("jobs") or 8), float(a.get("timeout") or 300))
    figs.update(fetched=n, fetched_bytes=nbytes, fetch_seconds=round(secs, 2), cached=len(a.get("packages") or []) - n)
    event(step="fetch", summary=True, fetched=n, cached=figs["cached"], bytes=nbytes, seconds=time.monotonic() - t0)
    log("fetch: %d wheels, %d bytes in %.1fs; %d cached" % (n, nbytes, secs, figs["cached"]))
    for p in a.get("packages") or []:
        log("  %s==%s %s" % (p["name"], p["version"], entry(lay, p["sha256"], p["filename"])))
    reqs = os.path.join(gen_dir, "requirements.txt")
    if installer == "uv":
        uv = a.get("uv")
        if not uv or not os.path.isabs(uv):
            raise AgentError("no uv on the host (%r)" % uv)
        os.makedirs(lay["uv_cache"], exist_ok=True)
        mode = "clone" if reflinks(lay["uv_cache"], gen_dir) else "copy"
        figs["isolation"] = "reflink" if mode == "clone" else "copy"
        env = clean_env({"UV_NO_CONFIG": "1", "UV_PYTHON_DOWNLOADS": "never", "UV_CACHE_DIR": lay["uv_cache"],
                         "UV_LINK_MODE": mode, "UV_NO_PROGRESS": "1"})
        if not os.path.exists(os.path.join(venv, "bin", "python")):
            figs["venv_seconds"] = round(_run([uv, "venv", "--quiet", "--python", python, venv], env, "venv", log), 2)
        if a.get("packages"):
            event(step="install", phase=True, line="installing %d packages with uv (%s from %s)"
                  % (len(a["packages"]), "reflinked" if mode == "clone" else "copied", lay["uv_cache"]))
            figs["install_seconds"] = round(_run(
                [uv, "pip", "install", "--python", os.path.join(venv, "bin", "python"), "--no-deps",
                 "--require-hashes", "--offline", "--no-index", "--link-mode", mode, "-r", reqs],
                env, "install", log), 2)
    elif installer == "pip":
        env = clean_env({"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
        if not os.path.exists(os.path.join(venv, "bin", "python")):
            figs["venv_seconds"] = round(_run([python, "-I", "-m", "venv", venv], env, "venv", log), 2)
        if a.get("packages"):
            event(step="install", phase=True, line="installing %d packages with pip" % len(a["packages"]))
            figs["install_seconds"] = round(_run(
                [os.path.join(venv, "bin", "python"), "-I", "-m", "pip", "install", "--isolated", "--no-deps",
                 "--require-hashes", "--no-index", "--no-cache-dir", "--progress-bar", "off", "-r", reqs],
                env, "install", log), 2)
        figs["isolation"] = "copy"
    else:
        raise AgentError("unknown installer %r" % installer)
    t1 = time.monotonic()
    ro = read_only(venv)
    figs.update(read_only_files=ro["files"], read_only_seconds=round(time.monotonic() - t1, 2))
    if ro["shared"]:     # uv linked where it was asked to copy: a write through this venv would reach others
        raise AgentError("%d installed files share their inode with another path (the uv cache or another "
                         "generation); a generation must own its files" % ro["shared"])
    figs["seconds"] = round(time.monotonic() - t0, 2)
    if figs.get("install_seconds") is not None:
        event(step="install", phase=True, line="installed %d packages in %.1fs" % (len(a["packages"]),
                                                                                  figs["install_seconds"]))
    log("read-only: %d files (%.1fs); build done in %.1fs" % (ro["files"], figs["read_only_seconds"], figs["seconds"]))
    return figs


FICLONE = 0x40049409    # ioctl: share one file's extents with another, copy-on-write (XFS, btrfs, ...)


def reflinks(src_dir, dst_dir):
    """Whether a file under `src_dir` can be reflinked into `dst_dir` (same copy-on-write filesystem). uv's
    `--link-mode clone` falls back to hardlinks silently where it cannot reflink, so this is asked first and uv
    is told to copy when the answer is no."""
    import fcntl

    src = os.path.join(src_dir, ".reflink-probe-%d" % os.getpid())
    dst = os.path.join(dst_dir, ".reflink-probe-%d" % os.getpid())
    try:
        with open(src, "wb") as f:
            f.write(b"\0" * 4096)
        with open(src, "rb") as s, open(dst, "wb") as d:
            fcntl.ioctl(d.fileno(), FICLONE, s.fileno())
        return True
    except OSError:
        return False
    finally:
        for p in (src, dst):
            try:
                os.unlink(p)
            except OSError:
                pass


def op_unpack(a):
    """{root, name, tar?}: the tool's code at <root>/tool/<name>, once (content-addressed name); without
    `tar`, says whether it is there already."""
    lay = ensure_root(a["root"])
    name = a["name"]
    if not name.isalnum():
        raise AgentError("bad bundle name %r" % name)
    final = os.path.join(lay["tool"], name)
    if os.path.exists(os.path.join(final, ".complete")):
        return {"path": final, "complete": True}
    if not a.get("tar"):
        return {"path": final, "complete": False}
    tmp = "%s.tmp-%d" % (final, os.getpid())
    os.makedirs(tmp)
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(a["tar"]))) as t:
        for m in t.getmembers():
            if not (m.isfile() or m.isdir()) or m.name.startswith("/") or ".." in m.name.split("/"):
                raise AgentError("unsafe member in bundle: %r" % m.name)
        t.extractall(tmp)
    open(os.path.join(tmp, ".complete"), "w").close()
    if os.path.exists(final):
        shutil.rmtree(inside(lay["root"], final))
    os.replace(tmp, final)
    return {"path": final, "complete": True}


OPS = {"have": op_have, "push": op_push, "build": op_build, "unpack": op_unpack}


def main(a):
    if a.get("op") not in OPS:
        raise AgentError("unknown op %r" % a.get("op"))
    return OPS[a["op"]](a)
