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

SHA256 = re.compile(r"^[0-9a-f]{64}$")
FILENAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+!-]*$")
CHUNK = 1 << 20
LOOPBACK = ("127.0.0.1", "localhost", "::1")     # a mirror on the host itself may speak plain http


def entry(lay, sha256, filename):
    """The cache entry of one file: <cache>/<sha256>/<filename>; a file there was verified on its way in."""
    if not SHA256.match(sha256 or "") or not FILENAME.match(filename or "") or ".." in filename:
        raise AgentError("bad cache entry %r/%r" % (sha256, filename))
    return os.path.join(lay["wheels"], sha256, filename)


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
    """{root, files: [{sha256, filename}]} -> {missing: [index, ...]}."""
    lay = ensure_root(a["root"])
    return {"missing": [i for i, f in enumerate(a["files"]) if not os.path.isfile(entry(lay, f["sha256"], f["filename"]))]}


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

        stored.append(entry(lay, f["sha256"], f["filename"]))
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


def _run(argv, env, what):
    """Run one build command with a clean environment; its output goes to the controller as events."""
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                         stdin=subprocess.DEVNULL)
    tail = []
    for line in p.stdout:
        line = line.rstrip()
        if line:
            tail = (tail + [line])[-20:]
            event(step=what, line=line[:300], seconds=time.monotonic() - t0)
    if p.wait() != 0:
        raise AgentError("%s failed (exit %d): %s" % (what, p.returncode, " | ".join(tail[-3:])[-600:]))
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
    figs = {"installer": installer}
    t0 = time.monotonic()
    n, nbytes, secs = fetch(lay, a.get("packages") or [], int(a.get("jobs") or 8), float(a.get("timeout") or 300))
    figs.update(fetched=n, fetched_bytes=nbytes, fetch_seconds=round(secs, 2), cached=len(a.get("packages") or []) - n)
    event(step="fetch", summary=True, fetched=n, cached=figs["cached"], bytes=nbytes, seconds=time.monotonic() - t0)
    reqs = os.path.join(gen_dir, "requirements.txt")
    if installer == "uv":
        uv = a.get("uv")
        if not uv or not os.path.isabs(uv):
            raise AgentError("no uv on the host (%r)" % uv)
        env = clean_env({"UV_NO_CONFIG": "1", "UV_PYTHON_DOWNLOADS": "never", "UV_CACHE_DIR": lay["uv_cache"],
                         "UV_LINK_MODE": "hardlink", "UV_NO_PROGRESS": "1"})
        if not os.path.exists(os.path.join(venv, "bin", "python")):
            figs["venv_seconds"] = round(_run([uv, "venv", "--quiet", "--python", python, venv], env, "venv"), 2)
        if a.get("packages"):
            event(step="install", line="installing %d packages with uv (hardlinks from %s)"
                  % (len(a["packages"]), lay["uv_cache"]))
            figs["install_seconds"] = round(_run(
                [uv, "pip", "install", "--python", os.path.join(venv, "bin", "python"), "--no-deps",
                 "--require-hashes", "--offline", "--no-index", "--link-mode", "hardlink", "-r", reqs],
                env, "install"), 2)
    elif installer == "pip":
        env = clean_env({"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
        if not os.path.exists(os.path.join(venv, "bin", "python")):
            figs["venv_seconds"] = round(_run([python, "-I", "-m", "venv", venv], env, "venv"), 2)
        if a.get("packages"):
            event(step="install", line="installing %d packages with pip" % len(a["packages"]))
            figs["install_seconds"] = round(_run(
                [os.path.join(venv, "bin", "python"), "-I", "-m", "pip", "install", "--isolated", "--no-deps",
                 "--require-hashes", "--no-index", "--no-cache-dir", "--progress-bar", "off", "-r", reqs],
                env, "install"), 2)
    else:
        raise AgentError("unknown installer %r" % installer)
    figs["seconds"] = round(time.monotonic() - t0, 2)
    return figs


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
