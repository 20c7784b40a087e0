"""Host agent (stdlib + optional torch and flashinfer): the flashinfer probes.

`flashinfer`: flashinfer's JIT built for each capability the lock targets, each build a process of this agent (`jit`),
all at once as cores and memory allow, beside its check on the GPUs (`flashinfer-check`); `jit-cache`: the
operator's own flashinfer JIT cache, checked for builds of another CUDA.
"""
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

from . import kernels
from .build import driver_libcuda
from .gpu_probes import major_minor, p_smoke, result, sm, specific, vtuple
from .host import answer, event, installed_dists, read_json, start_agent


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
JIT_DONE = "provision-jit.json"   # in flashinfer's cache dir: {"sources": digest, "held": {arch: [builds]}}
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


def held(workspace):
    """(sources, {arch: [builds]}) the kernel cache's flashinfer workspace records (None, {}: nothing recorded)."""
    rec = (read_json(os.path.join(workspace, JIT_DONE)) or {}) if workspace else {}
    if not isinstance(rec, dict) or not isinstance(rec.get("held"), dict):
        return None, {}
    return rec.get("sources"), {a: [n for n in v if isinstance(n, str)] for a, v in rec["held"].items()
                                if isinstance(v, list)}


def compiler_version():
    """The host C++ compiler nvcc calls by default (g++ on the PATH): its version, or None."""
    try:
        p = subprocess.run(["g++", "-dumpfullversion", "-dumpversion"], capture_output=True, text=True, timeout=30)
        return p.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def package_files(record):
    """A RECORD's lines for the package's own files, sorted: not its scripts (outside site-packages: their first
    line names the environment's interpreter), its bytecode, nor its .dist-info (what the installer wrote)."""
    out = []
    for line in record.splitlines():
        path = line.rsplit(",", 2)[0]
        top = path.split("/", 1)[0]
        if path and not path.startswith("../") and "__pycache__" not in path and not top.endswith(".dist-info"):
            out.append(line)
    return sorted(out)


def sources(cuda_home, patched=None):
    """What compiling flashinfer's JIT modules reads besides the kernel cache's key, by content: every file of
    flashinfer and of tvm-ffi as this interpreter has them (each distribution's RECORD hashes them all; `patched`,
    {path: sha256}, the files a patch changed since), the toolkit's nvcc and the host's C++ compiler (their
    versions). Equal sources compile alike; one digest of them."""
    from importlib import metadata

    h = hashlib.sha256()
    for dist in ("flashinfer-python", "apache-tvm-ffi"):
        try:
            rec = metadata.distribution(dist).read_text("RECORD") or ""
        except metadata.PackageNotFoundError:
            rec = ""
        h.update(("%s\0%s\0" % (dist, "\n".join(package_files(rec)))).encode())
    mine = sorted((k, v) for k, v in (patched or {}).items() if str(k).startswith(("flashinfer/", "tvm_ffi/")))
    h.update(json.dumps([mine, kernels.cuda_version(cuda_home), compiler_version()]).encode())
    return h.hexdigest()[:20]


def patched_files(a):
    """{path: sha256} of the files the probed generation's patch series changed ({} where the probe run names
    no generation of a root)."""
    from ..layout import Layout
    from .verify import patched_files as of

    k = a.get("kernels")
    if not isinstance(k, dict) or not isinstance(k.get("root"), str) or not isinstance(k.get("generation"), str):
        return {}
    return of(Layout(k["root"]).gen(k["generation"]))


def jit_builds(ccs, cuda_home, python=sys.executable, build=tuple(JIT_BUILD), check=tuple(JIT_CHECK),
               timeout=JIT_TIMEOUT, workspace=None, said=None, beside=None, every=None, reuse=None):
    """flashinfer's JIT modules generated (and `build` ones compiled) for each capability in `ccs` by `python`'s
    flashinfer with the nvcc of `cuda_home`, no GPU visible, each build in a process of its own, all at once as far
    as cores and memory allow (`compile_slots`), in `workspace` (flashinfer's base: the kernel cache; default a
    scratch one): {arch: {module: {status, seconds, compiled, error}}}; status built, compiled (objects, not
    linked), failed, refused (flashinfer rejects the capability) or accepted (only checked). The `_workers` key
    says how many ran at once, `_spans` when each process started and ended ({label: [s, s]} from the start).
    `beside`: the payload of one more agent process, started first and run among the builds with the GPUs
    visible and a build's share of the cores (the probe's check, whose first call compiles its own kernel): its
    answer under `_beside`. `said(running, done, total)` hears each start and end (and every `every` seconds).
    `reuse`: the digest of these `sources`, on a host that only compiles (no driver to link or run them): a build
    the workspace holds for the same sources is not run again (status compiled, `reused`); its objects stand for
    it, as a compile of the same sources would make them again."""
    bindirs = [os.path.dirname(python)] + ([os.path.join(cuda_home, "bin")] if cuda_home else [])   # ninja, nvcc
    recorded, ready = held(workspace)
    same = reuse is not None and recorded == reuse
    jobs, reused = [], {}
    for cc in ccs:   # a build not yet in the cache: a process of its own; those that are, and the checks: one
        arch = sm(specific(cc))
        reused[arch] = [n for n in build if same and n in ready.get(arch, ())]
        warm = [n for n in build if n in ready.get(arch, ()) and n not in reused[arch]]
        jobs += [(cc, (n,), ()) for n in build if n not in warm and n not in reused[arch]]
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
            return lambda: start_agent(python, "jit", {"op": "jit", "build": list(b), "check": list(c)},
                                       env=env, cwd=base)

        labelled = [("%s %s" % (" ".join(b) or "check", sm(specific(cc))), starter(cc, b, c)) for cc, b, c in jobs]
        if beside is not None:   # first: it compiles for the GPUs' own capability, the longest single job
            env = dict(os.environ, MAX_JOBS=str(each), PATH=path)
            labelled.insert(0, (CHECK, lambda: start_agent(python, "jit", beside, env=env)))
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
    for arch, names in reused.items():
        for n in names:
            out.setdefault(arch, {})[n] = {"status": "compiled", "reused": True, "compiled": 0, "seconds": 0.0,
                                           "missing": ["cuda"]}
    if workspace and (jobs or any(reused.values())):   # what the cache now holds, and for which sources (ninja
        now = {arch: sorted(n for n, r in mods.items() if r.get("status") in ("built", "compiled"))   # still
               for arch, mods in out.items() if not arch.startswith("_")}                             # decides)
        try:
            tmp = os.path.join(workspace, "%s.tmp-%d" % (JIT_DONE, os.getpid()))
            with open(tmp, "w") as f:
                json.dump({"sources": reuse, "held": now}, f)
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
    ok, bad, refused, unlinked, before = [], [], [], [], []
    driver = driver_libcuda()
    t0 = time.perf_counter()

    def said(running, done, total):
        event(step="probe", doing="flashinfer (jit %s; %d of %d done; %.0fs)" % (
            ", ".join(running) or "-", done, total, time.perf_counter() - t0))

    if skip and beside is None:
        return "skip", skip, {}
    cache = (kernels.IN_USE.get("env") or {}).get(kernels.KINDS["flashinfer"])
    reuse = sources(home, patched_files(a)) if cache and not driver and not skip else None   # compile-only host
    per = jit_builds([] if skip else ccs, home, python, build, check, workspace=cache, said=said, beside=beside,
                     every=PROGRESS_EVERY, reuse=reuse)
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
            elif r.get("reused"):
                before.append("%s %s" % (what, arch))
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
    again = ("; compiled earlier for the same sources (flashinfer's and tvm-ffi's files, nvcc, g++), not again: %s"
             % ", ".join(before)) if before else ""
    if unlinked or before:   # compiled; the link alone wants the driver's libcuda (the toolkit has no stub of it)
        return "skip", ("no NVIDIA driver on this host: JIT compiled %s%s; not linked: -lcuda needs the driver's "
                        "library and the toolkit has no stub of it%s" % (", ".join(ok + unlinked) or "nothing new",
                                                                         again, tail)), dict(figs, jit_sources=reuse)
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
    before = kernels.OPERATOR_ENV
    base = (before[var] if var in before else os.environ.get(var)) or os.path.expanduser("~")
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


OPS = {"jit": op_jit, "flashinfer-check": op_flashinfer_check}
