"""Verification probes: a registry (name, needs, required) and `run_probes`, which runs them inside one
generation's own interpreter on the host, stores `probes.json` in that generation and a `probe` event
in history. Host-side probes are run by `agent/probes.py`; patches and the contract are checked from here.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from .. import generations
from .. import lock as lockmod
from ..errors import Cancelled, HostError, ProvisionError
from .. import layout, toolkit
from ..facts import Environment, Facts, gather
from ..lock import Lock
from ..replies import ProbesRun, refuse
from ..transport import Transport
from .ship import ship_tool


@dataclass(frozen=True)
class Probe:
    name: str
    title: str
    needs: tuple = ()          # "gpu", "gpus>=2", "cuda", "engine"; packages are checked on the host
    required: bool = True      # a failure blocks the switch; warnings never do
    side: str = "host"         # host: the probes agent in the generation's python; control: from here


REGISTRY = [
    Probe("driver", "NVIDIA driver ≥ the lock's minimum", ("gpu",)),
    Probe("nvcc", "nvcc / CUDA_HOME = the lock; compiles for every capability the lock targets and the GPUs "
                  "have", ("cuda",)),
    Probe("packages", "installed distributions = the lock exactly"),
    Probe("torch-cuda", "torch.version.cuda = the lock's CUDA"),
    Probe("arch", "every GPU's capability in torch's (and sgl-kernel's, flashinfer's) targets", ("gpu",)),
    Probe("matmul", "bf16 matmul vs fp32 reference on every GPU", ("gpu",)),
    Probe("flashinfer", "flashinfer decode attention vs SDPA on every GPU; its JIT kernels compile for every "
                        "capability the lock targets"),
    Probe("sgl-kernel", "sgl-kernel rmsnorm vs torch on every GPU", ("gpu",)),
    Probe("nccl", "NCCL all-reduce across GPUs (bf16, fp32; bus bandwidth)", ("gpus>=2",)),
    Probe("symm-mem", "torch symmetric-memory two-shot all-reduce", ("gpus>=2",)),
    Probe("allreduce", "all-reduce latency at decode sizes per path (NCCL, symmetric memory, flashinfer); "
                       "SGLang's choice", ("gpus>=2",)),
    Probe("patches", "patched files' sha256 = the manifest", side="control"),
    Probe("contract", "EAGLE-3 interface contract of engine.architecture", side="control"),
    Probe("jit-cache", "no flashinfer JIT cache built for another CUDA", required=False),
    Probe("engine", "engine end to end: greedy output identical (or parting only at a near-tie), accept length > 1, "
                    "speedup", ("engine",)),
]
BY_NAME = {p.name: p for p in REGISTRY}
ENGINE_KINDS = ("included", "sglang")


def _res(name: str, status: str, reason: str = "", **figures) -> dict:
    return {"name": name, "status": status, "reason": reason, "figures": figures}


def check_names(names, flag: str) -> None:
    unknown = [n for n in names or [] if n not in BY_NAME]
    if unknown:
        raise ProvisionError(f"{flag}: unknown probe {unknown[0]!r} (known: {', '.join(BY_NAME)})")


def unmet(probe: Probe, facts: Facts, lock: Lock) -> str | None:
    """Why `probe` cannot run here, decided from the host's facts and the lock; None if it can."""
    gpus = facts.gpus
    for need in probe.needs:
        if need == "gpu" and not gpus and not facts.gpu_error:    # a failing nvidia-smi: run, and fail naming it
            return "no NVIDIA GPU on this host (nvidia-smi absent or lists none)"
        if need == "gpus>=2" and len(gpus) < 2:
            return ("one GPU on this host: needs at least 2" if gpus else "no NVIDIA GPU on this host") + \
                " (nothing to all-reduce across)"
        if need == "cuda" and lock.platform.cuda.source == "none":
            return "the lock names no CUDA toolkit (platform.cuda.source: none)"
        if need == "engine":
            kind = (lock.engine or {}).get("kind", "none")
            if kind not in ENGINE_KINDS:
                return f"the lock names no engine to launch (engine.kind: {kind})"
            if kind == "sglang" and not gpus:
                return "SGLang's server needs a GPU; none on this host"
    return None


def resolve_generation(transport: Transport, generation: str | None) -> str:
    return generations.resolve(transport, generation)


def _engine_spec(transport: Transport, lock: Lock, python: str, facts: Facts) -> dict:
    """What the host agent launches and checks: argv (and the baseline argv for SGLang), env, limits."""
    e = dict(lock.engine or {})
    kind = e.get("kind")
    spec = {"kind": kind, "min_speedup": float(lock.probes.get("min_speedup", 1.0)),
            "max_tokens": lock.probes.get("max_tokens"), "prompts": lock.probes.get("prompts"),
            "timeout": lock.probes.get("engine_timeout"), "port": e.get("port")}
    if kind == "sglang":
        argv = [str(a) for a in e.get("launch") or []]
        if not argv:
            raise ProvisionError("engine.kind sglang needs engine.launch (the argv that serves it)",
                                 where=lock.where("engine"))
        if argv[0] in ("python", "python3"):
            argv[0] = python
        base, i = [], 0
        while i < len(argv):   # the baseline: the same server without speculative decoding
            if argv[i].startswith("--speculative"):
                i += 1 if "=" in argv[i] else 2
                continue
            base.append(argv[i])
            i += 1
        spec.update(argv=argv, baseline_argv=base, device="cuda")
        return spec
    tool = ship_tool(transport)
    device = e.get("device") or ("cuda" if facts.gpus else "cpu")
    argv = [python, "-m", "provision.engine.serve", "--host", "127.0.0.1", "--port", "0", "--device", device]
    for key, flag in (("model", "--model"), ("draft", "--draft"), ("dtype", "--dtype"), ("steps", "--steps"),
                      ("topk", "--topk"), ("num_draft_tokens", "--num-draft-tokens"),
                      ("max_seq_len", "--max-seq-len"), ("threads", "--threads")):
        if e.get(key) is not None:
            argv += [flag, str(e[key])]
    spec.update(argv=argv, env={"PYTHONPATH": tool}, cwd=tool, device=device)
    return spec


def _run_host(transport: Transport, names: list[str], payload: dict, python: str, timeout: float) -> ProbesRun:
    """The probes agent's verdicts (a failed agent: each probe failed, naming why); ReplyError for a reply of the
    wrong shape."""
    payload = dict(payload, op="run", probes=names)
    env = {str(k): str(v) for k, v in transport.target.probe_env.items()}
    try:
        out = transport.run_agent("probes", payload, python=python, env=env or None, timeout=timeout)
    except Cancelled:        # Ctrl-C: the probes were interrupted, which is no verdict on the generation
        raise
    except HostError as e:
        out = {"results": [_res(n, "fail", f"probe agent failed in {python}: {e.message}") for n in names]}
    run = ProbesRun.of(out, transport.target.name)
    for i, r in enumerate(run.results):
        if r.name not in names:
            refuse(transport.target.name, ProbesRun.STEP, f"results[{i}].name", f"{r.name[:120]!r} was not asked for")
    return run


def _probe_patches(transport: Transport, lock: Lock, manifest: dict, python: str) -> dict:
    rep = manifest.get("patches") if isinstance(manifest.get("patches"), dict) else {}
    files = rep.get("files") or {}
    if not files:
        if lock.patches:
            return _res("patches", "skip", "the lock names patch series but the manifest records no patched "
                                           "files yet")
        return _res("patches", "skip", "no patches in this generation (the lock names no patch series)")
    from .. import patches

    bad = patches.verify_manifest(transport, files, python)
    figs = {"files": len(files), "mismatches": bad}
    if bad:
        b = bad[0]
        what = "missing" if b["actual"] is None else f"sha256 {b['actual']} ≠ manifest {b['expected']}"
        return _res("patches", "fail", f"{len(bad)} patched file(s) changed since apply: {b['path']} {what}", **figs)
    return _res("patches", "pass", f"{len(files)} patched file(s) match the manifest's sha256", **figs)


def _probe_contract(transport: Transport, lock: Lock, dists: dict, python: str) -> dict:
    arch = (lock.engine or {}).get("architecture")
    if not arch:
        return _res("contract", "skip", "the lock names no engine.architecture")
    if "sglang" not in dists:
        return _res("contract", "skip", "no sglang in this generation: no EAGLE-3 worker to hold a contract with",
                    architecture=arch)
    from .. import patches

    rep = patches.contract(transport, arch, python)
    figs = {"architecture": arch, "class": None, "module": None, "methods": {}}
    if not rep.found:
        return _res("contract", "fail", rep.reason or f"{arch} not found in sglang", **figs)
    figs.update({"class": rep.class_, "module": rep.module, "methods": {m.method: m.status for m in rep.methods}})
    missing = [m.method for m in rep.methods if m.status == "missing"]
    if missing or not rep.ok:
        return _res("contract", "fail", f"{rep.class_} lacks {', '.join(missing)} (called by the EAGLE-3 worker)",
                    **figs)
    return _res("contract", "pass", f"{rep.class_} provides {', '.join(figs['methods'])}", **figs)


def run_probes(transport: Transport, lock: Lock | None = None, *, generation: str | None = None,
               skip=(), only=None, during_apply: bool = False, facts: Facts | None = None,
               manifest: dict | None = None) -> dict:
    """Run the probes in one generation (default: `current`) and record the report there and in history.

    `lock` gives the expectations (default: the generation's own lock). An adopted generation's
    packages are compared with its captured lock. During apply, the caller hands forward the facts,
    the generation (`generation` is then its id) and its manifest, so nothing is fetched again.
    Returns the report (status pass|fail, results, summary, failed: the required probes that failed).
    """
    t0 = time.perf_counter()
    check_names(skip, "--skip-probe")
    check_names(only, "--only")
    lay = layout.of(transport)
    if manifest is None:
        gen_id = resolve_generation(transport, generation)
        info = generations.read_generation(transport, gen_id)
        manifest = info.manifest
        gen_lock = lockmod.loads(info.lock_text, f"{gen_id}/lock.yaml") if info.lock_text else None
    else:
        gen_id, gen_lock = generation, lock
    if lock is None and gen_lock is None:
        raise ProvisionError(f"generation {gen_id} has no lock.yaml; pass --lock", where=transport.target.name)
    lock = lock or gen_lock
    adopted = manifest.get("status") == "adopted" or manifest.get("installer") == "adopted"
    against = gen_lock if (adopted and gen_lock is not None) else lock
    venv = lay.gen(gen_id).venv
    python = lay.gen(gen_id).python
    facts = facts or gather(transport, python=lock.platform.python)

    selected = [p for p in REGISTRY if not only or p.name in only]
    results: dict[str, dict] = {}
    to_host: list[str] = []
    for p in selected:
        if p.name in (skip or ()):
            results[p.name] = _res(p.name, "skip", "skipped by the operator (--skip-probe; recorded in history)",
                                   operator=True)
            continue
        why = unmet(p, facts, lock)
        if why:
            results[p.name] = _res(p.name, "skip", why)
        elif p.side == "host":
            to_host.append(p.name)

    payload = {"driver_min": lock.platform.driver_min, "cuda_version": lock.platform.cuda.version,
               "cuda_source": lock.platform.cuda.source, "ccs": lock.platform.compute_capability,
               "cuda_home": (manifest.get("cuda_home") or toolkit.home(lock, venv))
               if lock.platform.cuda.source != "none" else None,
               "packages": against.versions(),
               "packages_source": f"{against.name} ({'captured at adoption' if against is gen_lock and adopted else 'lock'})",
               "nvidia_smi": transport.target.nvidia_smi or facts.nvidia_smi,
               "gpus": [asdict(g) for g in facts.gpus], "timeout": lock.probes.get("collective_timeout"),
               "kernels": {"root": lay.root, "generation": gen_id}}    # the host's kernel cache: agent/kernels.py
    if "engine" in to_host:
        try:
            payload["engine"] = dict(_engine_spec(transport, lock, python, facts), log=lay.gen(gen_id).engine_log)
        except ProvisionError as e:
            to_host.remove("engine")
            results["engine"] = _res("engine", "fail", str(e))
    dists: dict = {}
    host_python = kernels = None
    if to_host:
        out = _run_host(transport, to_host, payload, python, float(lock.probes.get("timeout", 3600)))
        host_python, kernels, dists = out.python, out.kernels, out.dists
        for r in out.results:
            results[r.name] = r.to_json()
    for p in selected:
        if p.side != "control" or p.name in results:
            continue
        try:
            if p.name == "patches":
                results[p.name] = _probe_patches(transport, lock, manifest, python)
            elif p.name == "contract":
                if not dists:   # no host probe ran: the generation's distributions from the facts agent
                    dists = (gather(transport, adopt=python).adopt or Environment()).dists
                results[p.name] = _probe_contract(transport, lock, dists, python)
        except Cancelled:
            raise
        except ProvisionError as e:
            results[p.name] = _res(p.name, "fail", str(e))

    ordered = []
    for p in selected:
        r = results.get(p.name) or _res(p.name, "fail", "the host agent returned no result")
        r["required"] = p.required
        r["title"] = p.title
        ordered.append(r)
    summary = {s: sum(r["status"] == s for r in ordered) for s in ("pass", "fail", "skip", "warn")}
    failed = [r["name"] for r in ordered if r["status"] == "fail" and r["required"]]
    report = {"status": "fail" if failed else "pass", "host": transport.target.name, "generation": gen_id,
              "lock": lock.name, "python": host_python or python, "during_apply": during_apply,
              "gpus": len(facts.gpus), "driver": facts.driver,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "results": ordered, "summary": summary, "failed": failed, "kernels": kernels,
              "skipped_by_operator": [n for n in skip or () if n in results],
              "seconds": round(time.perf_counter() - t0, 2)}
    record(transport, report)
    return report


def record(transport: Transport, report: dict) -> None:
    """probes.json in the generation; a `probe` event in history; the summary in the manifest."""
    gen_id = report["generation"]
    path = layout.of(transport).gen(gen_id).probes_json
    transport.put(json.dumps(report, indent=2, default=str).encode(), path)
    event = {"event": "probe", "status": report["status"], "summary": report["summary"],
             "failed": report["failed"], "lock": report["lock"], "during_apply": report["during_apply"]}
    if report["skipped_by_operator"]:
        event["skipped_probes"] = report["skipped_by_operator"]
    generations.mark(transport, gen_id, event=event, probes_summary=report["summary"],
                     probes_status=report["status"], probes_at=report["time"])
