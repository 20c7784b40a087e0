"""Apply a lock to a host: preflight → build a new generation → patch → probe → atomic switch.

Any failure leaves `current` untouched and the new generation marked failed with a one-line
reason. Also: adoption of an unmanaged environment as generation 0, rollback, history.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import unquote, urlparse


from . import generations, lock as lockmod, runner
from .errors import HostError, PlanError, ProvisionError
from .facts import capture_lock, env_paths, gather, root_of
from .lock import Lock
from .plan import Plan, facts_digest, make_plan, stack_of_lock
from .transport import Transport

MIN_FREE_BYTES = 1 << 30
Progress = Callable[[str, str, str], None]   # (step, state: start|done|fail|info, detail)


class ProbesFailed(ProvisionError):
    """Required probes failed inside the new generation; it was not switched to."""


@dataclass
class Step:
    name: str
    status: str = "pending"
    seconds: float = 0.0
    detail: str = ""


@dataclass
class ApplyReport:
    host: str
    lock_name: str
    status: str = "pending"            # applied | noop | failed
    generation: str | None = None
    previous: str | None = None
    steps: list[Step] = field(default_factory=list)
    plan: dict | None = None
    probes: dict | None = None
    patches: dict | None = None
    run_dir: str | None = None
    error: str | None = None
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def _driver_tuple(v: str) -> tuple:
    return tuple(int(x) for x in v.split(".") if x.isdigit())


def preflight_findings(facts: dict, lock: Lock) -> list[tuple[bool, str]]:
    """(fatal, message) for everything that would stop or weaken an apply of `lock` here."""
    out: list[tuple[bool, str]] = []
    py = lock.platform.python
    if py not in (facts.get("pythons") or {}):
        have = ", ".join(sorted(facts.get("pythons") or {})) or "none"
        out.append((True, f"host has no Python {py} (found: {have})"))
    gpus = facts.get("gpus") or []
    dmin = lock.platform.driver_min
    if gpus and dmin and facts.get("driver") and _driver_tuple(facts["driver"]) < _driver_tuple(dmin):
        out.append((True, f"NVIDIA driver {facts['driver']} is older than the lock's minimum {dmin}"))
    if not gpus and (dmin or lock.platform.compute_capability):
        out.append((False, "no NVIDIA GPU found (nvidia-smi absent or empty): driver and GPU checks skipped"))
    want = set(lock.platform.compute_capability)
    for g in gpus:
        if want and g["compute_cap"] not in want:
            out.append((False, f"GPU {g['index']} ({g['name']}) has compute capability {g['compute_cap']}, "
                               f"the lock targets {', '.join(sorted(want))}"))
    free = facts.get("disk_free_bytes")
    if free is not None and free < MIN_FREE_BYTES:
        out.append((True, f"only {free >> 20} MiB free under {facts.get('root')}; need {MIN_FREE_BYTES >> 20} MiB"))
    for p in lock.packages:
        if not p.sha256:
            out.append((True, f"{p.pin} has no sha256 in {lock.where('packages')}: cannot install with --require-hashes"))
        elif not (p.url and p.filename):
            out.append((True, f"{p.pin} has no url/filename in the lock"))
    for u in lock.unresolved:
        out.append((True, f"{u['name']} is unresolved in the lock: {u['reason']}"))
    return out


def _local_wheel(lock: Lock, url: str) -> Path | None:
    """A package url the controller holds (file:// or a path), else None (fetched by the host)."""
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        return None
    path = Path(unquote(parsed.path)) if parsed.scheme == "file" else Path(url)
    return path if path.is_absolute() else lock.resolve_path(url)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_vars(lock: Lock, facts: dict, installer: str | None) -> dict:
    """Extravars for playbooks/build.yml; local wheels are checked against their sha256 here."""
    pkgs = []
    for p in lock.packages:
        item = {"name": p.name, "version": p.version, "sha256": p.sha256, "filename": p.filename}
        local = _local_wheel(lock, p.url)
        if local is None:
            item["url"] = p.url
        else:
            if not local.exists():
                raise ProvisionError(f"{p.pin}: wheel {local} not found", where=f"{lock.path}:{p.line}")
            got = _sha256(local)
            if got != p.sha256:
                raise ProvisionError(f"{p.pin}: sha256 mismatch for {local.name}: lock says {p.sha256[:16]}…, "
                                     f"file is {got[:16]}…; refusing", where=f"{lock.path}:{p.line}")
            item["src"] = str(local)
        pkgs.append(item)
    uv = facts.get("uv") or "" if installer in (None, "uv") else ""
    if installer == "uv" and not uv:
        raise HostError("--installer uv, but uv is not on the host's PATH", where=facts["host"])
    cu = lock.platform.cuda
    root = facts["root"]
    return {"root": root, "cache": f"{root}/cache/wheels", "python": facts["pythons"][lock.platform.python], "packages": pkgs, "uv": uv,
            "cuda_source": cu.source, "cuda_apt_package": cu.package or ""}


def _cuda_home(lock: Lock, venv: str) -> str | None:
    cu = lock.platform.cuda
    if cu.source == "wheels" and cu.version:
        # NVIDIA's CUDA 13 wheels put the toolkit at site-packages/nvidia/cu13 (bin/nvcc, include, lib).
        major = cu.version.split(".")[0]
        return f"{venv}/lib/python{lock.platform.python}/site-packages/nvidia/cu{major}"
    if cu.source == "apt":
        return cu.home or f"/usr/local/cuda-{'.'.join(cu.version.split('.')[:2])}"
    if cu.source == "host":
        return cu.home or "/usr/local/cuda"
    return None


# Hook points filled by the patch engine and the probes; each returns a JSON-able summary.
def patch_hook(transport: Transport, lock: Lock, gen: dict) -> dict:
    if not lock.patches:
        return {"status": "none", "detail": "the lock names no patch series"}
    from . import patches

    series = [patches.load_series(lock.resolve_path(p)) for p in lock.patches]
    report = patches.apply_series(transport, series, python=f"{gen['venv']}/bin/python")
    counts: dict[str, int] = {}
    for s in report["series"]:
        for p in s["patches"]:
            counts[p["status"]] = counts.get(p["status"], 0) + 1
    detail = ", ".join(f"{n} {k}" for k, n in counts.items()) + f"; {len(report.get('files', {}))} files recorded"
    return {"status": "applied", "detail": detail, **report}


def probe_hook(transport: Transport, lock: Lock, gen: dict, skip: list[str]) -> dict:
    try:
        from .probes import run_probes
    except ImportError:
        return {"status": "none", "detail": "no probes are installed yet"}
    report = run_probes(transport, lock, generation=gen["id"], skip=skip, during_apply=True)
    report.setdefault("detail", " · ".join(f"{n} {k}" for k, n in (report.get("summary") or {}).items() if n))
    return report


class _Steps:
    """Times each step, reports it to the progress callback, and keeps it in the report."""

    def __init__(self, report: ApplyReport, progress: Progress | None):
        self.report, self.progress = report, progress or (lambda *a: None)

    def run(self, name: str, fn, *a, **kw):
        step = Step(name, "running")
        self.report.steps.append(step)
        self.progress(name, "start", "")
        t0 = time.perf_counter()
        try:
            out = fn(*a, **kw)
        except BaseException as e:
            step.status, step.seconds, step.detail = "failed", time.perf_counter() - t0, str(e)
            self.progress(name, "fail", str(e))
            raise
        step.status, step.seconds = "done", time.perf_counter() - t0
        if isinstance(out, dict) and out.get("detail"):
            step.detail = out["detail"]
        self.progress(name, "done", step.detail)
        return out


def adopt(transport: Transport, prefix: str, facts: dict | None = None) -> dict:
    """Capture an unmanaged environment as generation 0000 (recorded as a lock; not moved)."""
    facts = facts or gather(transport)
    if facts.get("generations"):
        return {"id": None, "detail": "host is already managed; --adopt ignored"}
    data = capture_lock(transport, prefix, name="adopted")
    text = lockmod.dump(data)
    lk = lockmod.from_data(data, "adopted")
    manifest = {"lock_name": lk.name, "lock_digest": lk.digest, "stack": asdict(stack_of_lock(lk)),
                "installer": "adopted"}
    return generations.adopt(transport, env_paths(prefix)[0], lk.name, text, manifest)


def adopt_host(transport: Transport, prefix: str) -> dict:
    """`provision adopt`: adoption on its own, under the host lock like any mutating run."""
    with transport.hold(f"{root_of(transport)}/.lock"):
        return adopt(transport, prefix)


def apply(transport: Transport, lock: Lock, *, saved_plan: Plan | None = None, adopt_path: str | None = None,
          skip_probes: list[str] | None = None, installer: str | None = None,
          progress: Progress | None = None) -> ApplyReport:
    """One-command upgrade. Raises ProvisionError (after marking the generation failed) on any failure."""
    t_start = time.perf_counter()
    report = ApplyReport(host=transport.target.name, lock_name=lock.name)
    steps = _Steps(report, progress)
    root = root_of(transport)
    with transport.hold(f"{root}/.lock"):
        facts = steps.run("facts", gather, transport)
        if adopt_path and not facts.get("generations"):
            steps.run("adopt", adopt, transport, adopt_path, facts)
            facts = gather(transport)
        if saved_plan is not None:
            if saved_plan.host != facts["host"] or saved_plan.facts_digest != facts_digest(facts):
                raise PlanError("the host changed since this plan was made; plan again", where=facts["host"])
        plan = make_plan(facts, lock)
        report.plan, report.previous = plan.to_json(), facts.get("current")
        if plan.noop:
            report.status, report.generation = "noop", facts["current"]
            report.seconds = time.perf_counter() - t_start
            return report

        def preflight():
            fatal = [m for f, m in preflight_findings(facts, lock) if f]
            if fatal:
                raise HostError(fatal[0] + (f" (+{len(fatal) - 1} more)" if len(fatal) > 1 else ""),
                                where=facts["host"])
            return {"detail": "ok"}

        steps.run("preflight", preflight)
        manifest = {"lock_name": lock.name, "lock_digest": lock.digest, "stack": asdict(stack_of_lock(lock)),
                    "python": lock.platform.python, "cuda": asdict(lock.platform.cuda)}
        extravars = build_vars(lock, facts, installer)
        gen = generations.prepare(transport, lock.name, lockmod.dump(lock), manifest, extravars["packages"])
        extravars.update(gen_dir=gen["dir"], venv=gen["venv"])
        report.generation = gen["id"]
        try:

            def build():
                res = runner.run_playbook("build", [transport.target], extravars, label=gen["id"],
                                          interpreters={transport.target.name: facts.get("python_executable")},
                                          on_event=lambda kind, task, item: progress and progress(
                                              "build", "info", f"{task} {item}".strip()))
                report.run_dir = res.run_dir
                if res.error:
                    raise HostError(f"build failed: {res.error}", where=facts["host"])
                return {"detail": f"{len(lock.packages)} packages installed ({res.seconds:.1f}s)"}

            steps.run("build", build)
            cuda_home = _cuda_home(lock, gen["venv"])
            generations.mark(transport, gen["id"], status="built", cuda_home=cuda_home,
                             installer="uv" if extravars["uv"] else "pip", run_dir=report.run_dir)
            report.patches = steps.run("patch", patch_hook, transport, lock, gen)
            if report.patches.get("files"):   # recorded before probes: the patches probe checks these sha256
                generations.mark(transport, gen["id"], patches=report.patches)
            report.probes = steps.run("probe", probe_hook, transport, lock, gen, list(skip_probes or []))
            if report.probes.get("status") == "fail":
                failed = ", ".join(report.probes.get("failed", [])) or "?"
                raise ProbesFailed(f"probes failed in {gen['id']}: {failed}; current left at {facts.get('current')}",
                                   where=facts["host"])
            summary = report.probes.get("summary")
            generations.mark(transport, gen["id"], status="ready", probes_summary=summary,
                             patches=report.patches, skipped_probes=list(skip_probes or []))
            steps.run("switch", generations.switch, transport, gen["id"], "apply",
                      True, {"lock": lock.name, "skipped_probes": list(skip_probes or [])})
        except BaseException as e:
            reason = str(e) or type(e).__name__
            report.status, report.error = "failed", reason
            try:
                # A generation that failed its probes is kept for post-mortems; a broken build is removed.
                generations.mark(transport, gen["id"], status="failed", reason=reason,
                                 remove_venv=not isinstance(e, ProbesFailed),
                                 event={"event": "apply-failed", "lock": lock.name, "reason": reason})
            except ProvisionError:
                pass   # the host may be gone; `current` was never touched
            raise
    report.status = "applied"
    report.seconds = time.perf_counter() - t_start
    return report


def apply_fleet(targets: list, lock: Lock, *, serial: int = 0, forks: int = 5,
                progress_for: Callable[[str], Progress | None] | None = None, **kw) -> list[ApplyReport]:
    """Apply to many hosts in batches of `serial` (0: one batch), up to `forks` at a time within a
    batch; a batch with a failure stops the rollout (later hosts are reported as not attempted)."""
    from concurrent.futures import ThreadPoolExecutor

    from .transport import connect

    def one(t) -> ApplyReport:
        try:
            tr = connect(t)
        except ProvisionError as e:
            return ApplyReport(host=t.name, lock_name=lock.name, status="failed", error=str(e))
        try:
            return apply(tr, lock, progress=progress_for(t.name) if progress_for else None, **kw)
        except ProvisionError as e:
            return ApplyReport(host=t.name, lock_name=lock.name, status="failed", error=str(e))
        finally:
            tr.close()

    size = serial if serial > 0 else len(targets)
    reports: list[ApplyReport] = []
    for i in range(0, len(targets), size):
        batch = targets[i:i + size]
        with ThreadPoolExecutor(max_workers=max(1, min(forks, len(batch)))) as pool:
            reports += list(pool.map(one, batch))
        if any(r.status == "failed" for r in reports):
            reports += [ApplyReport(host=t.name, lock_name=lock.name, status="not-attempted",
                                    error="an earlier batch failed") for t in targets[i + size:]]
            break
    return reports


def plan(transport: Transport, lock: Lock) -> Plan:
    return make_plan(gather(transport), lock)


def rollback(transport: Transport, to: str | None = None) -> dict:
    t0 = time.perf_counter()
    out = generations.rollback(transport, to)
    out["seconds"] = time.perf_counter() - t0
    return out


def history(transport: Transport) -> dict:
    return generations.history(transport)


def load_plan(path: str | Path) -> Plan:
    from . import yamlio
    from .errors import InputError

    return Plan.from_json(yamlio.load_json(path, error=InputError), where=str(path))


def lock_of_plan(p: Plan) -> Lock:
    return lockmod.from_data(p.lock, f"plan:{p.lock_name}")
