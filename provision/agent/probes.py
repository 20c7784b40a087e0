"""Host agent (stdlib + optional torch): the probes run inside a generation's own interpreter, by name (PROBES).

Payload {op: run, probes: [...], ...}; returns {results: [...]}, each {name, status: pass|fail|skip|warn, reason,
figures}. The probes live in gpu_probes.py, jit.py, collective.py and engine_probe.py; none imports SGLang.
"""
import signal
import sys
import time

from . import kernels
from .collective import p_allreduce, p_collective
from .engine_probe import p_engine
from .gpu_probes import p_arch, p_driver, p_nvcc, p_packages, p_smoke, p_torch_cuda, result, specific, targets
from .host import AgentError, event, installed_dists
from .jit import p_flashinfer, p_jit_cache


PROBES = {
    "driver": p_driver, "nvcc": p_nvcc, "packages": p_packages, "torch-cuda": p_torch_cuda, "arch": p_arch,
    "matmul": lambda a: p_smoke(a, "matmul"), "flashinfer": p_flashinfer,
    "sgl-kernel": lambda a: p_smoke(a, "sgl-kernel"), "nccl": lambda a: p_collective(a, "nccl"),
    "symm-mem": lambda a: p_collective(a, "symm-mem"), "allreduce": p_allreduce, "jit-cache": p_jit_cache,
    "engine": p_engine,
}


def _stop(signum, frame):
    raise SystemExit(128 + signum)   # unwinds through `finally`, which stops any engine


def use_kernel_cache(a):
    """{kernels: {root, generation}}: the generation's entry of the kernel cache, for every capability it
    compiles for (the lock's and the GPUs'), made and put in this process's environment, so that the JIT builds,
    the smoke tests and the engine launched here all compile into it; None without; {error} when it cannot be."""
    k = a.get("kernels")
    if not isinstance(k, dict):
        return None
    try:
        return kernels.use(k.get("root"), k.get("generation"), a.get("cuda_home"), [specific(cc) for cc in targets(a)])
    except (OSError, AgentError) as e:
        return {"error": "kernel cache: %s" % e}


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


OPS = {"run": op_run}
