"""Host agent (stdlib + optional torch): the probes that run inside a generation's own interpreter.

Run with the generation's interpreter; payload {probes: [...], ...}; returns {results: [...]}.
Each result: {name, status: pass|fail|skip|warn, reason, figures}. Never imports SGLang.
"""
import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from . import kernels
from .build import driver_libcuda
from .collective import p_allreduce, p_collective
from .gpu_probes import (SAFE_ENV, major_minor, p_arch, p_driver, p_nvcc, p_packages, p_smoke, p_torch_cuda, result, sm,
                         specific, targets, vtuple)
from .host import AgentError, answer, event, installed_dists, read_json, start_agent


def op_jit(a):
    """flashinfer's JIT for one capability, without a GPU, in a process of its own ({op: jit, build, check}: lists
    of module names; FLASHINFER_CUDA_ARCH_LIST set by `flashinfer_jit`). Each module's JitSpec is generated
    (flashinfer refuses a capability there: RuntimeError) and, unless it is only checked, built with nvcc and
    ninja into a .so (JitSpec.build). `compiled`: the objects this build wrote (0: all were in the cache)."""
    import torch
    from flashinfer.jit import activation, comm, norm
    from flashinfer.jit.attention import modules as att

    f16 = torch.float16
    gen = {
        "decode": lambda: att.gen_single_decode_module(f16, f16, f16, 128, 128, 0, False, False),
        "norm": norm.gen_norm_module,
        "silu-and-mul": lambda: activation.gen_act_and_mul_module("silu"),
        "allreduce-fusion": comm.gen_trtllm_comm_module,
    }

    def why(text):
        lines = [l.strip() for l in text.splitlines() if l.strip()]
        hits = [l for l in lines if re.search(r"error|fatal|cannot find", l, re.I)
                and not l.startswith(("[", "FAILED")) and " -o " not in l]
        return (hits or lines or ["no output"])[0][:300]

    def objects(spec):
        # What the link step takes, as the module's build.ninja says (flashinfer 0.7 names its objects otherwise
        # than get_object_paths does); that list where the file has no link line.
        ninja = getattr(spec, "ninja_path", None) or spec.build_dir / "build.ninja"
        try:
            m = re.search(r"^build \S+: (?:nvcc_)?link (.+)$", ninja.read_text(), re.M)
        except OSError:
            m = None
        return [spec.build_dir / o for o in m.group(1).split()] if m else spec.get_object_paths()

    def written(paths, since):
        n = 0
        for p in paths:
            try:
                n += os.stat(p).st_mtime >= since
            except OSError:
                pass
        return n

    build, check = list(a["build"]), list(a["check"])
    out = {}
    for name in build + check:
        t0, since = time.perf_counter(), time.time() - 0.05   # the filesystem's clock may lag this one a tick
        try:
            spec = gen[name]()
        except Exception as e:  # noqa: BLE001 - flashinfer's refusal of the capability is the finding
            out[name] = {"status": "refused", "error": why(str(e))}
            continue
        if name in check:
            out[name] = {"status": "accepted", "module": spec.name}
            continue
        try:
            spec.build(verbose=False)
            out[name] = {"status": "built" if spec.jit_library_path.exists() else "failed", "module": spec.name}
        except Exception as e:  # noqa: BLE001 - a failed compile is reported with its first error line
            objs = objects(spec)
            done = bool(objs) and all(p.exists() for p in objs)
            out[name] = {"status": "compiled" if done else "failed", "module": spec.name, "error": why(str(e)),
                         "missing": sorted(set(re.findall(r"cannot find -l([A-Za-z0-9_+.-]+)", str(e))))}
        out[name]["compiled"] = written(objects(spec), since)
        out[name]["seconds"] = round(time.perf_counter() - t0, 2)
    return out


# What the flashinfer probe JIT-compiles per capability the lock targets (bounded: decode attention, norm and the
# activation SGLang serves with; decode attention for the GPUs' own capability is compiled and run by the check on
# the GPUs present), and what it only checks flashinfer accepts: the trtllm
# all-reduce fusion kernels, which flashinfer 0.6.4 refuses for 12.0 and the patched SGLang does not use there:
# a refusal is a finding.
JIT_BUILD = {"decode": "decode attention", "norm": "norm", "silu-and-mul": "silu-and-mul"}
JIT_CHECK = {"allreduce-fusion": "trtllm allreduce fusion"}
JIT_TIMEOUT = 1200      # seconds per build
JIT_DONE = "provision-jit.json"   # in flashinfer's cache dir: {arch: [the builds it holds]}
COMPILE_MEMORY = 2 << 30   # bytes one nvcc of a flashinfer module may take (cicc on the norm module: about 1.5 GiB)


def cores():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def mem_available():
    """MemAvailable of /proc/meminfo in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def compile_slots(jobs, per=COMPILE_MEMORY):
    """(workers, compiles each) for `jobs` builds: at most one compiler per core and as many as the available
    memory holds at `per` bytes each, shared among min(jobs, slots) builds that run at once."""
    mem = mem_available()
    slots = max(1, min(cores(), mem // per if mem else cores()))
    workers = max(1, min(jobs, slots))
    return workers, max(1, slots // workers)


def run_parallel(jobs, workers, timeout, said=None, every=None):
    """Run `jobs` [(label, start)], `start()` starting one process (stdout and stderr piped), at most `workers` at
    a time, each within `timeout` seconds: {label: (process, stdout, stderr, seconds, started)}, `started` the
    seconds from this run's start to the process's, a process that overran killed (its stdout then b'').
    `said(running labels, done, total)` hears each start and end, and every `every` seconds between them. A
    process still running when this ends early (an error, the agent stopped) is killed."""
    lock, running, started, out = threading.Lock(), [], [], {}
    queue = list(jobs)
    t_run = time.perf_counter()
    ended = threading.Event()

    def tell():
        if said:
            said(list(running), len(out), len(jobs))

    def one():
        while True:
            with lock:
                if not queue:
                    return
                label, start = queue.pop(0)
                t0 = time.perf_counter()
                p = start()
                started.append(p)
                running.append(label)
                tell()
            try:
                stdout, stderr = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                stdout, stderr = b"", p.communicate()[1]
            with lock:
                running.remove(label)
                out[label] = (p, stdout, stderr, round(time.perf_counter() - t0, 2), round(t0 - t_run, 2))
                tell()

    def ticker():
        while not ended.wait(every):
            with lock:
                tell()

    threads = [threading.Thread(target=one, daemon=True) for _ in range(max(1, min(workers, len(jobs))))]
    tick = threading.Thread(target=ticker, daemon=True) if said and every else None
    try:
        for t in threads:
            t.start()
        if tick:
            tick.start()
        for t in threads:
            t.join()
    finally:
        ended.set()
        with lock:
            queue.clear()
            for p in started:
                if p.poll() is None:
                    p.kill()
    return out


def flashinfer_jit(cc, cuda_home, python=sys.executable, build=tuple(JIT_BUILD), check=tuple(JIT_CHECK),
                   timeout=JIT_TIMEOUT, workspace=None):
    """flashinfer's JIT modules generated (and `build` ones compiled) for capability `cc`; see `jit_builds`."""
    return jit_builds([cc], cuda_home, python, build, check, timeout, workspace)[sm(specific(cc))]


CHECK = "check on the GPUs"      # the label of the flashinfer probe's check among the JIT builds


def jit_builds(ccs, cuda_home, python=sys.executable, build=tuple(JIT_BUILD), check=tuple(JIT_CHECK),
               timeout=JIT_TIMEOUT, workspace=None, said=None, beside=None, every=None):
    """flashinfer's JIT modules generated (and `build` ones compiled) for each capability in `ccs` by `python`'s
    flashinfer with the nvcc of `cuda_home`, no GPU visible, each build in a process of its own, all at once as far
    as cores and memory allow (`compile_slots`), in `workspace` (flashinfer's base: the kernel cache; default a
    scratch one): {arch: {module: {status, seconds, compiled, error}}}; status built, compiled (objects, not
    linked), failed, refused (flashinfer rejects the capability) or accepted (only checked). The `_workers` key
    says how many ran at once, `_spans` when each process started and ended ({label: [s, s]} from the start).
    `beside`: the payload of one more agent process, started first and run among the builds with the GPUs
    visible and a build's share of the cores (the probe's check, whose first call compiles its own kernel): its
    answer under `_beside`. `said(running, done, total)` hears each start and end (and every `every` seconds)."""
    bindirs = [os.path.dirname(python)] + ([os.path.join(cuda_home, "bin")] if cuda_home else [])   # ninja, nvcc
    ready = (read_json(os.path.join(workspace, JIT_DONE)) or {}) if workspace else {}
    jobs = []
    for cc in ccs:   # a build not yet in the cache: a process of its own; those that are, and the checks: one
        warm = [n for n in build if n in (ready.get(sm(specific(cc))) or ())]
        jobs += [(cc, (n,), ()) for n in build if n not in warm]
        if warm or check:
            jobs.append((cc, tuple(warm), tuple(check)))
    workers, each = compile_slots(len(jobs) + (beside is not None) or 1)
    with tempfile.TemporaryDirectory(prefix="provision-flashinfer-jit-") as scratch:
        base = workspace or scratch
        path = os.pathsep.join(bindirs + [os.environ.get("PATH", "")])

        def starter(cc, b, c):
            env = dict(os.environ, CUDA_HOME=cuda_home, CUDA_PATH=cuda_home, CUDA_VISIBLE_DEVICES="",
                       FLASHINFER_CUDA_ARCH_LIST=specific(cc), FLASHINFER_WORKSPACE_BASE=base, MAX_JOBS=str(each),
                       PATH=path)
            env.pop("FLASHINFER_DISABLE_JIT", None)
            return lambda: start_agent(python, "probes", {"op": "jit", "build": list(b), "check": list(c)},
                                       env=env, cwd=base)

        labelled = [("%s %s" % (" ".join(b) or "check", sm(specific(cc))), starter(cc, b, c)) for cc, b, c in jobs]
        if beside is not None:   # first: it compiles for the GPUs' own capability, the longest single job
            env = dict(os.environ, MAX_JOBS=str(each), PATH=path)
            labelled.insert(0, (CHECK, lambda: start_agent(python, "probes", beside, env=env)))
        done = run_parallel(labelled, workers, timeout, said, every)
    out = {"_workers": workers, "_spans": {label: [started, round(started + seconds, 2)]
                                           for label, (_, _, _, seconds, started) in done.items()}}
    if beside is not None:
        p, stdout, stderr, _, _ = done[CHECK]
        try:
            out["_beside"] = answer(p, stdout, stderr) if stdout else {"error": "not done within %ds" % timeout}
        except RuntimeError as e:
            out["_beside"] = {"error": str(e)[:300]}
    for (cc, b, c), (label, _) in zip(jobs, labelled[1:] if beside is not None else labelled):
        arch = sm(specific(cc))
        per = out.setdefault(arch, {})
        p, stdout, stderr, seconds, _ = done[label]
        try:
            got = answer(p, stdout, stderr) if stdout else {"error": "not done within %ds" % timeout}
        except RuntimeError as e:
            got = {"error": str(e)[:300]}
        if isinstance(got.get("error"), str):
            got = {name: {"status": "failed", "error": got["error"][:300]} for name in b + c}
        for name in b:      # the build's process from start to end (the interpreter and flashinfer's import too)
            got.setdefault(name, {"status": "failed", "error": "no result"})["process_seconds"] = seconds
        per.update(got)
    if workspace and jobs:    # what this cache now holds, for the next run's grouping (ninja still decides what is stale)
        held = {arch: sorted(n for n, r in mods.items() if r.get("status") in ("built", "compiled"))
                for arch, mods in out.items() if not arch.startswith("_")}
        try:
            tmp = os.path.join(workspace, "%s.tmp-%d" % (JIT_DONE, os.getpid()))
            with open(tmp, "w") as f:
                json.dump(held, f)
            os.replace(tmp, os.path.join(workspace, JIT_DONE))
        except OSError:
            pass
    return out


PROGRESS_EVERY = 2.0     # seconds between the flashinfer probe's progress events while it compiles


def jit_part(a, python=sys.executable, build=tuple(JIT_BUILD), check=tuple(JIT_CHECK), beside=None):
    """(status, reason, figures) of JIT-compiling flashinfer for every capability the lock targets, into the
    kernel cache where the probe run has one (`jit_compiled`: the builds that compiled anything; 0: all warm).
    `beside`: the payload of the check to run among the builds (see `jit_builds`; run alone where nothing is
    compiled); its answer in the figures under `_beside`, its process's span under `jit_spans`."""
    ccs = sorted(a.get("ccs") or [], key=vtuple)
    home = a.get("cuda_home")
    nvcc = os.path.join(home, "bin", "nvcc") if home else None
    skip = ("JIT not compiled: the lock names no compute capability" if not ccs else
            "JIT not compiled: no nvcc at %s" % nvcc if not nvcc or not os.path.exists(nvcc) else None)
    ok, bad, refused, unlinked = [], [], [], []
    driver = driver_libcuda()
    t0 = time.perf_counter()

    def said(running, done, total):
        event(step="probe", doing="flashinfer (jit %s; %d of %d done; %.0fs)" % (
            ", ".join(running) or "-", done, total, time.perf_counter() - t0))

    if skip and beside is None:
        return "skip", skip, {}
    cache = (KERNEL_CACHE.get("env") or {}).get(kernels.KINDS["flashinfer"])
    per = jit_builds([] if skip else ccs, home, python, build, check, workspace=cache, said=said, beside=beside,
                     every=PROGRESS_EVERY)
    workers, spans = per.pop("_workers"), per.pop("_spans", {})
    extra = {"_beside": per.pop("_beside")} if beside is not None else {}
    if skip:
        return "skip", skip, dict(extra, jit_spans=spans)
    for arch, got in per.items():
        for name, r in got.items():
            what = JIT_BUILD.get(name) or JIT_CHECK.get(name)
            if name in JIT_CHECK:
                if r["status"] == "refused":
                    refused.append("%s (%s)" % (what, arch))
            elif r["status"] == "built":
                ok.append("%s %s (%.0fs)" % (what, arch, r["seconds"]))
            elif r["status"] == "compiled" and r.get("missing") == ["cuda"] and not driver:
                unlinked.append("%s %s (%.0fs)" % (what, arch, r["seconds"]))
            else:
                bad.append("%s %s %s: %s" % (what, arch, r["status"], r.get("error")))
    builds = [r for got in per.values() for n, r in got.items() if n not in JIT_CHECK and "compiled" in r]
    jit_end = max([end for label, (_, end) in spans.items() if label != CHECK] or [0.0])
    figs = dict(extra, jit=per, jit_refused=refused, jit_unlinked=unlinked, jit_workers=workers,
                jit_seconds=jit_end, jit_spans=spans, jit_builds=len(builds),
                jit_compiled=sum(1 for r in builds if r["compiled"]), jit_cache=cache)
    tail = "; refused: %s" % ", ".join(refused) if refused else ""
    if bad:
        return "fail", "JIT failed: %s%s" % ("; ".join(bad), tail), figs
    if unlinked:        # compiled; the link alone wants the driver's libcuda (the toolkit has no stub of it)
        return "skip", ("no NVIDIA driver on this host: JIT compiled %s; not linked: -lcuda needs the driver's "
                        "library and the toolkit has no stub of it%s" % (", ".join(ok + unlinked), tail)), figs
    return "pass", "JIT-compiled %s%s" % (", ".join(ok), tail), figs


def op_flashinfer_check(a):
    """The flashinfer probe's check on this host's GPUs, in a process of its own run beside the JIT builds
    ({op: flashinfer-check}): torch's and flashinfer's import timed apart from the check, whose first call
    JIT-compiles the decode kernel for the GPUs' own capability (`check_seconds` holds that compile)."""
    imports = {}
    for mod in ("torch", "flashinfer"):
        t0 = time.perf_counter()
        try:
            __import__(mod)
        except Exception:  # noqa: BLE001 - the check below says what is missing or broken
            break
        imports[mod] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    r = p_smoke(a, "flashinfer")
    r["figures"].update(import_seconds=imports, check_seconds=round(time.perf_counter() - t0, 2))
    return r


def p_flashinfer(a, python=sys.executable):
    """The runtime check on this host's GPUs, and flashinfer's JIT for the lock's capabilities (no GPU), side by
    side: the check in a process of its own, started first among the JIT builds. The figures say where the
    seconds went: each process's span from the probe's start (`jit_spans`), the check's imports and its run (its
    compile included), the JIT builds' end (`jit_seconds`) and the probe's `wall_seconds`."""
    if "flashinfer-python" not in installed_dists():
        return result("flashinfer", "skip", "flashinfer-python is not installed in this generation")
    t0 = time.perf_counter()
    gpus = bool(a.get("gpus"))
    status, reason, figs = jit_part(a, python, beside={"op": "flashinfer-check"} if gpus else None)
    if gpus:
        got = figs.pop("_beside")
        if isinstance(got.get("error"), str) or got.get("status") not in ("pass", "fail", "skip", "warn"):
            got = result("flashinfer", "fail", "the check on the GPUs ended without a result: %s" % got.get("error"))
        parts = [(got["status"], got["reason"], got.get("figures") or {})]
    else:
        parts = [("skip", "no GPU on this host: no runtime smoke", {})]
    parts.append((status, reason, figs))
    figs = {}
    for _, _, f in parts:
        figs.update(f)
    figs["wall_seconds"] = round(time.perf_counter() - t0, 2)
    states = [s for s, _, _ in parts]
    status = "fail" if "fail" in states else "pass" if "pass" in states else "skip"
    return result("flashinfer", status, "; ".join(r for _, r, _ in parts), **figs)


def cuda_of_path(text):
    """A CUDA major.minor named by a toolkit path in a build file (cuda-12.8, /nvidia/cu13/, cuda_12.8)."""
    m = re.search(r"cuda[-_](\d+\.\d+)", text)
    if m:
        return m.group(1)
    m = re.search(r"/nvidia/cu(\d+)/", text)
    return m.group(1) if m else None


def p_jit_cache(a):
    want = major_minor(a.get("cuda_version"))
    var = kernels.KINDS["flashinfer"]    # where an engine started outside provision looks: not the kernel cache
    base = (OPERATOR_ENV[var] if var in OPERATOR_ENV else os.environ.get(var)) or os.path.expanduser("~")
    cache = os.path.join(base, ".cache", "flashinfer")
    if not os.path.isdir(cache):
        return result("jit-cache", "pass", "no flashinfer JIT cache at %s" % cache, path=cache)
    if not want:
        return result("jit-cache", "skip", "the lock names no CUDA version", path=cache)
    stale, seen = {}, 0
    for f in glob.glob(os.path.join(cache, "**", "build.ninja"), recursive=True)[:500]:
        seen += 1
        try:
            text = open(f, errors="replace").read(20000)
        except OSError:
            continue
        got = cuda_of_path(text)
        if got and not (want == got or want.split(".")[0] == got):
            top = os.path.relpath(f, cache).split(os.sep)[0]
            stale.setdefault(os.path.join(cache, top), got)
    figs = {"path": cache, "build_files": seen, "stale": stale}
    if stale:
        where, got = sorted(stale.items())[0]
        return result("jit-cache", "warn", "flashinfer JIT cache built for CUDA %s (lock: %s); clear %s" %
                      (got, want, where), **figs)
    return result("jit-cache", "pass", "%d flashinfer JIT build(s), none for another CUDA" % seen, **figs)


# ------------------------------------------------------------------ engine end to end

def _post(url, body, timeout):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _healthy(base):
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _pdeathsig():
    """Engine child: die with the agent (Linux), in its own process group."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def listen_inodes(port):
    """Inodes of the sockets listening on TCP `port` (IPv4 and IPv6), from /proc/net."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                out.add(f[9])
    return out


def cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return "?"


def socket_owners(port):
    """{pid: command line} of the processes (that this user can see) holding a socket listening on `port`."""
    inodes = listen_inodes(port)
    owners = {}
    for pid in os.listdir("/proc") if inodes else []:
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir("/proc/%s/fd" % pid):
                link = os.readlink("/proc/%s/fd/%s" % (pid, fd))
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    owners[int(pid)] = cmdline(int(pid))
                    break
        except OSError:
            continue
    return owners


def describe_owners(port):
    owners = socket_owners(port)
    if owners:
        return ", ".join("pid %d (%s)" % kv for kv in sorted(owners.items()))
    return "a process this user cannot see" if listen_inodes(port) else "nothing (no listening socket)"


def in_tree(pid, root):
    """`pid` is `root`, in the session `root` leads (start_new_session), or descends from it."""
    for _ in range(64):
        if pid == root:
            return True
        try:
            with open("/proc/%d/stat" % pid) as f:
                state = f.read().rsplit(")", 1)[1].split()   # state ppid pgrp session ...
        except OSError:
            return False
        if int(state[3]) == root:
            return True
        pid = int(state[1])
        if pid <= 1:
            return False
    return False


class Server:
    """One engine process: started in its own group, always stopped (TERM, then KILL)."""

    def __init__(self, argv, env, log, cwd=None):
        self.log = log
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, env=env, text=True, cwd=cwd,
                                  start_new_session=True, preexec_fn=_pdeathsig)
        self.lines = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.append(line.rstrip())

    def wait_ready(self, base, deadline):
        """base: a fixed URL, or None to take it from the 'serving ... on http://...' line."""
        while time.time() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError("engine exited with %s: %s" % (self.p.returncode, self.tail()))
            if base is None:
                for l in self.lines:
                    m = re.search(r"(http://[0-9.:a-z]+)", l)
                    if m:
                        base = m.group(1)
            if base and _healthy(base):
                self.check_owner(base)
                return base
            time.sleep(0.2)
        raise RuntimeError("engine not healthy after %.0fs: %s" % (deadline - self.t0, self.tail()))

    def check_owner(self, base):
        """Trust no answer that the launched process (or its children) did not give: the socket behind
        `base` must be held by this engine's process tree."""
        from urllib.parse import urlparse

        u = urlparse(base)
        if u.hostname not in ("127.0.0.1", "localhost", "::1"):
            raise RuntimeError("engine announced %s: not a loopback address; refusing to trust it" % base)
        port = u.port
        if not any(in_tree(pid, self.p.pid) for pid in socket_owners(port)):
            raise RuntimeError("port %d answers, but not from the launched engine (pid %d): held by %s" %
                               (port, self.p.pid, describe_owners(port)))

    def tail(self):
        try:
            self.log.flush()
            with open(self.log.name, errors="replace") as f:
                lines = [l.strip() for l in f.read().splitlines() if l.strip()]
            return (lines[-1] if lines else "(no output)")[:300]
        except OSError:
            return "(no log)"

    def stop(self):
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
                self.p.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.p.pid, signal.SIGKILL)
                except OSError:
                    pass
                self.p.wait()
        return self.p.returncode


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
           "The quick brown fox jumps over the lazy dog. The quick brown", "1, 2, 3, 4, 5, 6,",
           "In the beginning"]


# Unit roundoff of the dtypes an engine computes in (half the spacing of numbers in [1, 2)).
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


def near_tie_bound(dtype, layers, scale):
    """The largest top-2 logit gap at which two correct evaluations of the same step, rounded differently, may
    pick different greedy tokens: 2·√(2L+2)·u·max|logit| (docs/probes.md derives it). None for an unknown dtype."""
    u = UNIT_ROUNDOFF.get(dtype)
    return None if u is None else 2.0 * math.sqrt(2 * layers + 2) * u * scale


def first_divergence(a, b):
    """Index of the first token where a and b differ (the shorter one's end counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def judge_divergence(plain, spec, report):
    """One prompt's plain and speculative greedy token ids, and the plain run's `margins` report (dtype, layers,
    gaps, scales, top): where they first differ, the plain step's logit gap between its token and the speculative
    one there (from `top`; beyond it, at least its last gap; without it, the top-2 gap) and the near-tie bound."""
    i = first_divergence(plain, spec)
    d = {"position": i, "plain_token": plain[i] if i < len(plain) else None,
         "spec_token": spec[i] if i < len(spec) else None, "dtype": report.get("dtype"),
         "layers": report.get("layers")}
    gaps, scales = report.get("gaps") or [], report.get("scales") or []
    if i >= len(plain) or i >= len(spec):
        d.update(near_tie=False, why="the outputs differ in length at token %d" % i)
        return d
    if i >= len(gaps) or i >= len(scales):
        d.update(near_tie=False, why="the engine reports no margin for token %d" % i)
        return d
    bound = near_tie_bound(d["dtype"], int(d["layers"] or 0), abs(scales[i]))
    top = report.get("top") or []
    cand = {int(t): float(g) for t, g in top[i]} if i < len(top) and top[i] else {}
    gap = cand.get(d["spec_token"], max(cand.values()) if cand else gaps[i])
    d.update(gap=gap, gap_at_least=bool(cand) and d["spec_token"] not in cand, top2_gap=gaps[i], scale=scales[i],
             bound=bound)
    if bound is None:
        d.update(near_tie=False, why="no unit roundoff known for dtype %r" % d["dtype"])
    else:
        d["near_tie"] = gap <= bound
    return d


def _included_round(base, prompts, max_tokens, timeout):
    """Baseline (speculative: false) and EAGLE-3 per prompt, interleaved, each twice; warm-up first, at the
    round's full length, so that what a fresh server does once (new cache spans, first-use allocations) is not
    timed. Where a prompt's greedy outputs differ, one more (untimed) plain run reports its margins, and the
    first divergence is judged against the near-tie bound."""
    url = base + "/v1/completions"
    for spec in (False, True):
        _post(url, {"prompt": prompts[0], "max_tokens": max_tokens, "temperature": 0, "speculative": spec}, timeout)
    t = {False: 0.0, True: 0.0}
    n = {False: 0, True: 0}
    accepts, mismatch, ratios, diverged = [], [], [], []
    for k, p in enumerate(prompts):
        outs, tps = {False: [], True: []}, {False: 0.0, True: 0.0}
        for spec in (False, True, True, False):   # each mode twice, in mirrored order; its faster run counts,
            t0 = time.perf_counter()              # so a stall from elsewhere on the host does not decide a ratio
            r = _post(url, {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "speculative": spec}, timeout)
            dt = time.perf_counter() - t0
            t[spec] += dt
            ch = r["choices"][0]
            outs[spec].append(ch.get("token_ids") if ch.get("token_ids") is not None else ch.get("text"))
            n[spec] += r["usage"]["completion_tokens"]
            tps[spec] = max(tps[spec], r["usage"]["completion_tokens"] / dt if dt else 0.0)
            if spec:
                accepts.append(float(r["usage"].get("accept_length") or 0.0))
        if tps[False]:
            ratios.append(tps[True] / tps[False])
        plain, spec = outs[False][0], outs[True][0]
        if outs[False][1] != plain or outs[True][1] != spec:
            mismatch.append(p)
            diverged.append({"prompt": k, "near_tie": False, "why": "greedy output changed between two runs of "
                                                                    "the same mode"})
        elif plain != spec:
            mismatch.append(p)
            diverged.append(dict(_judged(url, p, max_tokens, timeout, plain, spec), prompt=k))
    return t, n, accepts, mismatch, ratios, diverged


def _judged(url, prompt, max_tokens, timeout, plain, spec):
    """Ask the plain run again, with its margins, and judge where the two greedy outputs part."""
    if not isinstance(plain, list) or not isinstance(spec, list):
        return {"near_tie": False, "why": "the engine returns no token ids to compare"}
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "speculative": False, "margins": True}
    try:
        r = _post(url, body, timeout)
    except urllib.error.HTTPError as ex:
        return {"near_tie": False, "why": "the engine reports no margins (HTTP %d)" % ex.code}
    if r["choices"][0].get("token_ids") != plain:
        return {"near_tie": False, "why": "plain greedy output changed when its margins were asked for"}
    return judge_divergence(plain, spec, r.get("margins") or {})


def _sglang_round(base, prompts, max_tokens, timeout, spec):
    url = base + "/generate"
    _post(url, {"text": prompts[0], "sampling_params": {"temperature": 0, "max_new_tokens": 8}}, timeout)
    secs, toks, outs, accepts = 0.0, 0, [], []
    for p in prompts:
        t0 = time.perf_counter()
        r = _post(url, {"text": p, "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens}}, timeout)
        secs += time.perf_counter() - t0
        meta = r.get("meta_info") or {}
        toks += int(meta.get("completion_tokens") or 0)
        outs.append(r.get("output_ids") or r.get("text"))
        if spec and meta.get("spec_verify_ct"):
            accepts.append(meta["completion_tokens"] / meta["spec_verify_ct"])
    return secs, toks, outs, accepts


def p_engine(a):
    e = a["engine"]
    deadline_s = float(e.get("timeout") or 900)
    env = dict(os.environ, **SAFE_ENV, **(e.get("env") or {}))
    if a.get("cuda_home"):   # the generation's toolkit: what the engine's JIT (flashinfer, DeepGEMM) compiles with
        env.update(CUDA_HOME=a["cuda_home"], CUDA_PATH=a["cuda_home"])
    prompts = e.get("prompts") or PROMPTS
    max_tokens = int(e.get("max_tokens") or 64)
    req_timeout = float(e.get("request_timeout") or 300)
    min_speedup = float(e.get("min_speedup") or 1.0)
    figs = {"kind": e["kind"], "argv": e["argv"], "device": e.get("device"), "prompts": len(prompts),
            "max_tokens": max_tokens, "min_speedup": min_speedup}
    if e.get("log"):   # the generation's own dir: kept with it, shown by `provision logs`
        log = open(e["log"], "w+")
    else:
        log = tempfile.NamedTemporaryFile("w+", prefix="provision-engine-", suffix=".log", delete=False)
    figs["log"] = log.name
    servers = []
    t_start = time.time()

    def launch(argv, base):
        port = int(base.rsplit(":", 1)[1]) if base else None
        if port and listen_inodes(port):   # whatever answers there is not the engine this probe launches
            raise RuntimeError("port %d is already in use by %s: refusing to probe through it" %
                               (port, describe_owners(port)))
        s = Server(argv, env, log, cwd=e.get("cwd"))   # cwd: so `-m` finds the shipped code, not a checkout
        s.t0 = time.time()
        servers.append(s)
        url = s.wait_ready(base, t_start + deadline_s)
        figs.setdefault("ready_s", round(time.time() - s.t0, 1))
        return s, url

    try:
        if e["kind"] == "sglang":
            base = "http://127.0.0.1:%d" % int(e.get("port") or 30000)
            s, url = launch(e["argv"], base)
            st, nt, out_s, accepts = _sglang_round(url, prompts, max_tokens, req_timeout, True)
            s.stop()
            s, url = launch(e["baseline_argv"], base)
            sb, nb, out_b, _ = _sglang_round(url, prompts, max_tokens, req_timeout, False)
            s.stop()
            t, n = {False: sb, True: st}, {False: nb, True: nt}
            mismatch = [p for p, x, y in zip(prompts, out_b, out_s) if x != y]
            diverged = [{"prompt": k, "near_tie": False, "why": "SGLang reports no margins"}
                        for k, p in enumerate(prompts) if p in mismatch]
            ratios = []   # two launches, not interleaved: the totals' ratio is the figure
        else:
            s, url = launch(e["argv"], None)
            figs["url"] = url
            t, n, accepts, mismatch, ratios, diverged = _included_round(url, prompts, max_tokens, req_timeout)
    except (RuntimeError, urllib.error.URLError, OSError, ValueError, KeyError) as ex:
        return result("engine", "fail", "%s: %s" % (type(ex).__name__, ex), **figs)
    finally:
        figs["exit_codes"] = [s.stop() for s in servers]
        log.close()
    base_tps = n[False] / t[False] if t[False] else 0.0
    spec_tps = n[True] / t[True] if t[True] else 0.0
    acc = sum(accepts) / len(accepts) if accepts else 0.0
    # The gate uses the median of per-prompt ratios (baseline and speculative interleaved per prompt, each
    # mode's faster of two runs), so a request stalled by something else on the host cannot decide it alone.
    ratio = sorted(ratios)[len(ratios) // 2] if ratios else (spec_tps / base_tps if base_tps else 0.0)
    figs.update(baseline_tok_s=round(base_tps, 2), spec_tok_s=round(spec_tps, 2), speedup=round(ratio, 3),
                accept_length=round(acc, 3), greedy_identical=not mismatch, mismatched=mismatch[:3],
                identical_prompts=len(prompts) - len(mismatch), divergences=diverged)
    bad, far = [], [d for d in diverged if not d["near_tie"]]
    if far:
        bad.append("greedy output differs with speculation on %d of %d prompts, %d not at a near-tie: %s" %
                   (len(mismatch), len(prompts), len(far), _why(far[0], prompts)))
    if acc <= 1.0:
        bad.append("mean acceptance length %.2f ≤ 1.0: speculation accepts nothing (silent fallback)" % acc)
    if ratio < min_speedup:
        bad.append("speedup %.2f (median per prompt; totals %.1f ÷ %.1f tok/s) < min_speedup %.2f" %
                   (ratio, spec_tps, base_tps, min_speedup))
    if bad:
        return result("engine", "fail", "; ".join(bad), **figs)
    same = "identical greedy output" if not diverged else \
        "greedy identical on %d of %d prompts; %d divergence(s) at near-ties (%s, %s)" % (
            len(prompts) - len(diverged), len(prompts), len(diverged),
            ", ".join("gap %s%.3g ≤ bound %.3g" % ("≥ " if d["gap_at_least"] else "", d["gap"], d["bound"])
                      for d in diverged), diverged[0]["dtype"])
    return result("engine", "pass", "%s, accept length %.2f, speedup %.2f× ≥ %.2f" % (same, acc, ratio, min_speedup),
                  **figs)


def _why(d, prompts):
    """One divergence that is not a near-tie, in words."""
    where = "prompt %r" % prompts[d["prompt"]][:40]
    if "gap" in d and d.get("bound") is not None:
        return "%s at token %d (plain %s, speculative %s): their logit gap in the plain step %s%.3g > near-tie " \
               "bound %.3g (%s, %s layers, max |logit| %.3g)" % (
                   where, d["position"], d["plain_token"], d["spec_token"], "≥ " if d["gap_at_least"] else "",
                   d["gap"], d["bound"], d["dtype"], d["layers"], d["scale"])
    return "%s: %s" % (where, d["why"])


PROBES = {
    "driver": p_driver, "nvcc": p_nvcc, "packages": p_packages, "torch-cuda": p_torch_cuda, "arch": p_arch,
    "matmul": lambda a: p_smoke(a, "matmul"), "flashinfer": p_flashinfer,
    "sgl-kernel": lambda a: p_smoke(a, "sgl-kernel"), "nccl": lambda a: p_collective(a, "nccl"),
    "symm-mem": lambda a: p_collective(a, "symm-mem"), "allreduce": p_allreduce, "jit-cache": p_jit_cache,
    "engine": p_engine,
}


def _stop(signum, frame):
    raise SystemExit(128 + signum)   # unwinds through `finally`, which stops any engine


KERNEL_CACHE = {}       # this run's entry of the host's kernel cache (kernels.prepare); its variables are set here
OPERATOR_ENV = {}       # what the probe's environment said for those variables before


def use_kernel_cache(a):
    """{kernels: {root, generation}}: the generation's entry of the kernel cache, for every capability it
    compiles for (the lock's and the GPUs'), made and put in this process's environment, so that the JIT builds,
    the smoke tests and the engine launched here all compile into it; None without; {error} when it cannot be."""
    k = a.get("kernels")
    if not isinstance(k, dict):
        return None
    try:
        rec = kernels.prepare(k.get("root"), k.get("generation"), a.get("cuda_home"),
                              [specific(cc) for cc in targets(a)])
    except (OSError, AgentError) as e:
        return {"error": "kernel cache: %s" % e}
    OPERATOR_ENV.update({v: os.environ.get(v) for v in rec["env"]})
    os.environ.update(rec["env"])
    KERNEL_CACHE.update(rec)
    return rec


def op_run(a):
    """{op: run, probes: [name], kernels: {root, generation}, ...what they need} -> {results, python, version,
    dists, kernels}. Each probe is announced as it starts (an event: the controller names it while it waits)."""
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _stop)
    cache = use_kernel_cache(a)
    out = []
    for name in a.get("probes", []):
        event(step="probe", doing=name)
        t0 = time.perf_counter()
        try:
            r = PROBES[name](a)
        except Exception as e:  # noqa: BLE001 - a probe that crashes is a failed probe, not a dead agent
            r = result(name, "fail", "probe crashed: %s: %s" % (type(e).__name__, (str(e).splitlines() or [""])[0][:300]))
        r["seconds"] = round(time.perf_counter() - t0, 2)
        out.append(r)
    return {"results": out, "python": sys.executable, "version": "%d.%d.%d" % sys.version_info[:3],
            "dists": installed_dists(), "kernels": cache}


OPS = {"run": op_run, "jit": op_jit, "flashinfer-check": op_flashinfer_check}
