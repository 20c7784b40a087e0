"""Host agent (stdlib only): builds a generation. Payload {op: build, root, gen_dir, python, installer, ...}: the
lock's wheels fetched into the cache (the fetch agent's step), the venv made at its final path and filled from the
cache (uv, linking from a shared cache, or pip), its files made its own (store, reflink or copy) and read-only.
Progress goes to the controller as events while it happens.
"""
import errno
import os
import re
import shutil
import subprocess
import threading
import time

from ..layout import Generation
from . import store as filestore
from .fetch import wheels
from .host import AgentError, disk_full, ensure_root, event, inside
from .verify import read_only


class BuildLog:
    """<generation>/build.log: every line of the build (the commands, their whole output, the figures), kept
    in the generation for `provision logs`, healthy or failed."""

    def __init__(self, gen):
        self.f = open(gen.build_log, "a", encoding="utf-8", errors="replace")

    def __call__(self, line):
        self.f.write("%s %s\n" % (time.strftime("%H:%M:%S"), line))
        self.f.flush()

    def close(self):
        self.f.close()


WORKING_EVERY = 5.0    # seconds between the checks that a quiet build command still writes


def _run(argv, env, what, log, where=None):
    """Run one build command with a clean environment; its output goes to the controller as events and,
    whole, to the build log. While it prints nothing, the file system under `where` changing (blocks or
    inodes: files unpacked, linked, written) is progress too, sent as a `working` event every WORKING_EVERY s."""
    t0 = time.monotonic()
    log("$ " + " ".join(argv))
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                         stdin=subprocess.DEVNULL)
    quiet = threading.Event()
    if where:
        threading.Thread(target=_working, args=(where, what, t0, quiet), daemon=True).start()
    tail = []
    try:
        for line in p.stdout:
            line = line.rstrip()
            if line:
                tail = (tail + [line])[-20:]
                log(line)
                event(step=what, line=line[:300], seconds=time.monotonic() - t0)
    finally:
        quiet.set()
    if p.wait() != 0:
        log("%s failed (exit %d)" % (what, p.returncode))
        raise AgentError("%s failed (exit %d): %s" % (what, p.returncode, last_words(" | ".join(tail[-3:]))))
    log("%s: %.1fs" % (what, time.monotonic() - t0))
    return time.monotonic() - t0


def last_words(text, limit=600):
    """The end of `text` in at most about `limit` characters, cut between words (an ellipsis says where); a
    word longer than 160 characters (a deep path) keeps its start and its end."""
    text = " ".join(w if len(w) <= 160 else w[:60] + "…" + w[-90:] for w in text.split(" "))
    if len(text) <= limit:
        return text
    cut = text[-limit:]
    return "… " + (cut.split(None, 1)[1] if len(cut.split(None, 1)) > 1 else cut)


def _disk(path):
    try:
        st = os.statvfs(path)
        return st.f_bfree, st.f_ffree
    except OSError:
        return None


def _working(where, what, t0, done):
    last = _disk(where)
    while not done.wait(WORKING_EVERY):
        now = _disk(where)
        if now is not None and now != last:
            event(step=what, working=True, seconds=time.monotonic() - t0)
        last = now


def clean_env(extra):
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/"), "LANG": "C.UTF-8"}
    env.update(extra)
    return env


def op_build(a):
    """{root, gen_dir, python, installer: uv|pip, uv?, packages: [{name, version, sha256, filename, url?}],
    cuda_home?, jobs?} -> figures. The generation dir and its requirements.txt were made by the state agent."""
    lay = ensure_root(a["root"])
    gen = Generation(inside(lay.generations, a["gen_dir"]))
    python, installer = a["python"], a.get("installer") or "uv"
    if a.get("cuda_home"):
        inside(gen.venv, a["cuda_home"])
    if not os.path.isabs(python):
        raise AgentError("interpreter %r is not an absolute path" % python)
    log = BuildLog(gen)
    try:
        return _build(a, lay, gen, python, installer, log)
    except Exception as e:
        log("build failed: %s" % e)
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(e):
            raise AgentError("build: %s; %s" % (e, disk_full(lay)))
        raise
    finally:
        log.close()


def _build(a, lay, gen, python, installer, log):
    gen_dir, venv = gen.dir, gen.venv
    figs = {"installer": installer}
    t0 = time.monotonic()
    log("build %s with %s from %s (%d packages)" % (os.path.basename(gen_dir), installer, python,
                                                    len(a.get("packages") or [])))
    figs.update(wheels(a, lay, log, t0))
    reqs = gen.requirements
    if installer == "uv":
        uv = a.get("uv")
        if not uv or not os.path.isabs(uv):
            raise AgentError("no uv on the host (%r)" % uv)
        os.makedirs(lay.uv_cache, exist_ok=True)
        figs["isolation"], why = isolation(lay, gen_dir)
        if why:
            figs["isolation_why"] = why
            log("isolation: copies (%s)" % why)
        mode = {"reflink": "clone", "store": "hardlink", "copy": "copy"}[figs["isolation"]]
        env = clean_env({"UV_NO_CONFIG": "1", "UV_PYTHON_DOWNLOADS": "never", "UV_CACHE_DIR": lay.uv_cache,
                         "UV_LINK_MODE": mode, "UV_NO_PROGRESS": "1"})
        if not os.path.exists(gen.python):
            figs["venv_seconds"] = round(_run([uv, "venv", "--quiet", "--python", python, venv], env, "venv", log), 2)
        if a.get("packages"):
            event(step="install", phase=True, line="installing %d packages with uv (%s from %s)"
                  % (len(a["packages"]), {"clone": "reflinked", "hardlink": "linked", "copy": "copied"}[mode],
                     lay.uv_cache))
            figs["install_seconds"] = round(_run(
                [uv, "pip", "install", "--python", gen.python, "--no-deps",
                 "--require-hashes", "--offline", "--no-index", "--link-mode", mode, "-r", reqs],
                env, "install", log, venv), 2)
    elif installer == "pip":
        env = clean_env({"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
        if not os.path.exists(gen.python):
            figs["venv_seconds"] = round(_run([python, "-I", "-m", "venv", venv], env, "venv", log), 2)
        if a.get("packages"):
            event(step="install", phase=True, line="installing %d packages with pip" % len(a["packages"]))
            figs["install_seconds"] = round(_run(
                [gen.python, "-I", "-m", "pip", "install", "--isolated", "--no-deps",
                 "--require-hashes", "--no-index", "--no-cache-dir", "--progress-bar", "off", "-r", reqs],
                env, "install", log, venv), 2)
        figs["isolation"] = "copy"
    else:
        raise AgentError("unknown installer %r" % installer)
    if a.get("cuda_home"):
        figs["cuda_home"] = cuda_home(venv, inside(venv, a["cuda_home"]))
        log("cuda home: %(home)s (%(links)d links, libcuda: %(libcuda)s)" % figs["cuda_home"])
    inodes = set()
    if figs["isolation"] == "store":     # uv's hardlinks become links to the store, or the generation's own copies
        t1 = time.monotonic()
        st = filestore.link_venv(lay.file_store, venv, int(a.get("jobs") or 8),
                                 progress=lambda **k: event(step="store", **k))
        inodes = st.pop("inodes")
        st["lost"] = filestore.still_shared(lay.generations, gen_dir, st.pop("left"))
        figs["store"] = st
        log("store: %(linked)d files linked (%(linked_bytes)d bytes), %(entered)d entered (%(entered_bytes)d "
            "bytes), %(own)d own copies (%(own_bytes)d bytes), %(hashed)d entries hashed again (%(hashed_bytes)d "
            "bytes), %(evicted)d evicted; %(seconds).1fs" % st)
        for lost in st["lost"]:
            log("store: a former entry (%d bytes), no longer immutable, is still shared by %s (%d links)"
                % (lost["bytes"], ", ".join(lost["generations"]), lost["links"]))
        figs["store_seconds"] = round(time.monotonic() - t1, 2)
    t1 = time.monotonic()
    ro = read_only(venv, inodes)
    figs.update(read_only_files=ro["files"], read_only_seconds=round(time.monotonic() - t1, 2))
    if ro["shared"]:     # uv linked where it was asked to copy: a write through this venv would reach others
        raise AgentError("%d installed files share their inode with another path (the uv cache or another "
                         "generation) and are not immutable store entries; a generation must own its files"
                         % ro["shared"])
    figs["seconds"] = round(time.monotonic() - t0, 2)
    if figs.get("install_seconds") is not None:
        event(step="install", phase=True, line="installed %d packages in %.1fs" % (len(a["packages"]),
                                                                                  figs["install_seconds"]))
    log("read-only: %d files (%.1fs); build done in %.1fs" % (ro["files"], figs["read_only_seconds"], figs["seconds"]))
    return figs


CUDA_HOME_DIRS = (("bin", "bin"), ("include", "include"), ("lib", "lib64"), ("lib64", "lib64"), ("nvvm", "nvvm"))
VERSIONED_SO = re.compile(r"^(lib[A-Za-z0-9_+-]+\.so)\.[0-9][0-9.]*$")
DRIVER_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib64",
               "/usr/local/nvidia/lib64")


def driver_libcuda():
    """The NVIDIA driver's libcuda.so.1 in the loader's usual directories, or None: this host has no driver."""
    return next((os.path.join(d, "libcuda.so.1") for d in DRIVER_DIRS
                 if os.path.exists(os.path.join(d, "libcuda.so.1"))), None)


def cuda_home(venv, home):
    """Lay out `home` (in `venv`) as a CUDA toolkit home over NVIDIA's toolkit wheels: bin, include, nvvm and
    lib64 hold relative links to what each component (CUDA 13: site-packages/nvidia/cu13; CUDA 12: one directory
    per component) ships in bin, include, nvvm and lib; lib64 also gets the unversioned names a `-lcudart` link
    needs (libcudart.so -> libcudart.so.13), and lib64/stubs/libcuda.so -> the driver's libcuda.so.1 where the
    host has a driver but no libcuda.so of its own (the wheels ship no stub: where the host has no driver at all,
    a `-lcuda` link fails). Returns {home, components, links, libcuda: host | the driver linked | none}."""
    lib = os.path.join(venv, "lib")
    pythons = sorted(d for d in (os.listdir(lib) if os.path.isdir(lib) else []) if d.startswith("python"))
    sites = [os.path.join(lib, d, "site-packages", "nvidia") for d in pythons]
    nvidia = next((inside(venv, n) for n in sites if os.path.isdir(n)), None)
    if nvidia is None:
        raise AgentError("the lock takes its CUDA toolkit from wheels but %s has no site-packages/nvidia" % venv)
    if os.path.lexists(home):
        shutil.rmtree(home)
    os.makedirs(home)
    comps = sorted(d for d in os.listdir(nvidia) if os.path.isdir(os.path.join(nvidia, d)))
    made, links = set(), 0
    for comp in comps:
        for src, dst in CUDA_HOME_DIRS:
            sdir = os.path.join(nvidia, comp, src)
            if not os.path.isdir(sdir) or os.path.islink(sdir):
                continue
            ddir = os.path.join(home, dst)
            os.makedirs(ddir, exist_ok=True)
            for name in sorted(os.listdir(sdir)):
                if os.path.join(dst, name) in made or name == "__pycache__" or name.startswith("__init__.py"):
                    continue
                os.symlink(os.path.relpath(os.path.join(sdir, name), ddir), os.path.join(ddir, name))
                made.add(os.path.join(dst, name))
                links += 1
    lib64 = os.path.join(home, "lib64")
    os.makedirs(lib64, exist_ok=True)
    for name in sorted(os.listdir(lib64)):
        m = VERSIONED_SO.match(name)
        if m and not os.path.lexists(os.path.join(lib64, m.group(1))):
            os.symlink(name, os.path.join(lib64, m.group(1)))
            links += 1
    libcuda = "host"
    if not any(os.path.exists(os.path.join(d, "libcuda.so")) for d in DRIVER_DIRS):
        driver = driver_libcuda()
        libcuda = driver or "none"
        if driver:
            os.makedirs(os.path.join(lib64, "stubs"))
            os.symlink(driver, os.path.join(lib64, "stubs", "libcuda.so"))
            links += 1
    return {"home": home, "components": comps, "links": links, "libcuda": libcuda}


FICLONE = 0x40049409    # ioctl: share one file's extents with another, copy-on-write (XFS, btrfs, ...)


def isolation(lay, gen_dir):
    """How a build here keeps generations apart: (`reflink` uv clones its cache: a write lands on a private
    copy | `store` uv hardlinks, then files link immutable store entries: a write is refused | `copy` uv copies
    every file, None or why the store is unavailable)."""
    if reflinks(lay.uv_cache, gen_dir):
        return "reflink", None
    why = filestore.unavailable(lay.file_store, gen_dir)
    return ("copy", why) if why else ("store", None)


def reflinks(src_dir, dst_dir):
    """Whether a file under `src_dir` can be reflinked into `dst_dir` (same copy-on-write filesystem). uv's
    `--link-mode clone` falls back to hardlinks silently where it cannot reflink, so this is asked first and the
    build uses the store (or copies) when the answer is no."""
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


OPS = {"build": op_build}
