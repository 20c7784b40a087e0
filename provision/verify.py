"""What is on a host against what its lock says: every file of a generation against its RECORD hash (patched
files against the hashes their series produced) and the installed distributions against the generation's lock,
judged here, by distribution. The build's seal and `provision verify` both end in `judge`."""
from __future__ import annotations

import re
import time

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from . import generations
from .errors import HostError, InputError, ProvisionError
from .lock import Lock
from .replies import Checked, QuickCheck, read
from .transport import Transport

GENERATION_RE = re.compile(r"[0-9]{1,9}(-[A-Za-z0-9][A-Za-z0-9._+-]{0,99})?")   # a number, or NNNN-<lock name>
FEW = 3          # files named per distribution before "and N more"
INSTALLER_OWN = {"pip": {"pip", "setuptools", "wheel"}}    # what `python -m venv` seeds before the lock


def _same_version(a: str, b: str) -> bool:
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def named(files: list[str], few: int = FEW) -> str:
    shown = ", ".join(files[:few])
    return shown + (f" and {len(files) - few} more" if len(files) > few else "")


def _short(path: str) -> str:
    """A path under a venv as its site-packages-relative tail (lib/pythonX.Y/site-packages/ dropped)."""
    return re.sub(r"^lib/python[0-9.]+/site-packages/", "", path)


def judge(found: Checked, lock: Lock, installer: str | None = None) -> dict:
    """The verdict on an agent's check (`agent/verify.full`, and `drift` against the seal under `sealed`):
    {verdict: clean|drift, rows: [{dist, version, what, files}], counts}. One row per distribution that drifted:
    changed, missing and outside files; missing, extra and other-version distributions against the lock; then
    files no RECORD lists, patched files no RECORD lists, what else differs from the seal or the adoption's record
    (bin/, pyvenv.cfg, files RECORD lists without a hash), bytecode that is not its source's compile, the
    generation's own files that steer what runs (kernels.env) and code it runs from outside itself."""
    want = {canonicalize_name(p.name): p.version for p in lock.packages}
    have = found.dists
    tolerated = INSTALLER_OWN.get(installer or "", set())
    rows, counts = [], {"changed": 0, "missing": 0, "extra": 0, "dists_missing": 0, "dists_extra": 0,
                        "dists_other_version": 0, "outside_code": 0}
    for name in sorted(set(want) | set(have)):
        d = have.get(name)
        if d is None:
            rows.append({"dist": name, "version": None, "what": f"not installed (the lock says {want[name]})",
                         "files": []})
            counts["dists_missing"] += 1
            continue
        parts, files = [], []
        if name not in want:
            if name in tolerated:
                continue
            parts.append("installed, but not in the lock")
            counts["dists_extra"] += 1
        elif not _same_version(d.version, want[name]):
            parts.append(f"version {d.version} installed, the lock says {want[name]}")
            counts["dists_other_version"] += 1
        for key, label in (("changed", "changed"), ("missing", "missing"), ("outside", "outside the venv")):
            if getattr(d, key):
                parts.append(f"{len(getattr(d, key))} {label} ({named(getattr(d, key))})")
                files += getattr(d, key)
        counts["changed"] += len(d.changed) + len(d.outside)
        counts["missing"] += len(d.missing)
        if parts:
            rows.append({"dist": name, "version": d.version, "what": "; ".join(parts), "files": files})
    if found.extra:
        rows.append({"dist": "(no distribution)", "version": None, "files": found.extra,
                     "what": f"{len(found.extra)} files no RECORD lists ({named(found.extra)})"})
        counts["extra"] += len(found.extra)
    if found.unclaimed_patches:
        un = found.unclaimed_patches
        rows.append({"dist": "(patches)", "version": None, "files": un,
                     "what": f"{len(un)} patched files no RECORD lists ({named(un)})"})
        counts["missing"] += len(un)
    sealed = found.sealed
    adopted = bool(sealed and sealed.how == "adopted")
    since = "it was adopted" if adopted else "the build sealed it"
    for key, label in (("changed", f"changed since {since}"), ("missing", f"gone since {since}"),
                       ("extra", "not recorded at adoption" if adopted else "not installed by the build")):
        files = [_short(f) for f in (getattr(sealed, key) if sealed else [])]
        if files:
            rows.append({"dist": "(venv)", "version": None, "files": files,
                         "what": f"{len(files)} {label} ({named(files)})"})
            counts["changed" if key == "changed" else key] += len(files)
    bytecode = sealed.bytecode if sealed else {}
    if bytecode:
        files = [_short(f) for f in bytecode]
        rows.append({"dist": "(bytecode)", "version": None, "files": files,
                     "what": f"{len(files)} not the interpreter's compile of their source "
                             f"({named([f'{_short(f)}: {why}' for f, why in bytecode.items()])})"})
        counts["changed"] += len(files)
    steer = sealed.generation if sealed else []
    if steer:
        rows.append({"dist": "(generation)", "version": None, "files": [w.split(":", 1)[0] for w in steer],
                     "what": "; ".join(steer)})
        counts["changed"] += len(steer)
    by_dist: dict = {}
    for o in found.outside_code:
        by_dist.setdefault((o.dist or "(no distribution)", o.version), []).append(o)
    for (dist, version), found_here in sorted(by_dist.items(), key=lambda kv: kv[0][0]):
        rows.append({"dist": dist, "version": version, "files": [o.file for o in found_here],
                     "what": "runs code from outside the generation, which verify does not check: "
                             + named([o.why for o in found_here])})
        counts["outside_code"] += len(found_here)
    return {"verdict": "drift" if rows else "clean", "rows": rows, "counts": counts}


def summary(found: Checked, verdict: dict, how: str) -> dict:
    """What the manifest keeps of a verdict (status shows it; rollback refuses on its drift)."""
    named_files = [f"{r['dist']}: {f}" for r in verdict["rows"] for f in r["files"][:FEW]][:10]
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "verdict": verdict["verdict"], "how": how,
            "files": found.files, "bytes": found.bytes, "seconds": round(found.seconds, 3),
            "drifted": len(verdict["rows"]), "named": named_files, **verdict["counts"]}


def line(row: dict) -> str:
    """One line per drifted distribution."""
    v = f" {row['version']}" if row.get("version") else ""
    return f"{row['dist']}{v}: {row['what']}"


def generation_arg(generation: str | None) -> None:
    """A GENERATION argument that cannot name one (not a number, nor NNNN-<lock name>): InputError naming it."""
    if generation is not None and not GENERATION_RE.fullmatch(str(generation)):
        raise InputError(f"{generation!r} is not a generation number or id (NNNN-<lock name>)", where="GENERATION")


def verify(t: Transport, generation: str | None = None, baseline: bool = False, jobs: int | None = None,
           progress=None, record: bool = True) -> dict:
    """`provision verify HOST [GEN]`: the generation (default current) checked on the host, judged against its
    lock, the verdict recorded (manifest `verify`, history event `verify`). Returns the verdict with the
    figures: bytes hashed, seconds, and (baseline) the seconds of a first read of the same files from disk
    (`cache` says how: each file's page cache is dropped before the hashing and before the read), the ratio
    hashing ÷ that read. `progress(event)` sees the host's progress events (one at least every
    PROVISION_PROGRESS_EVERY seconds). `record` false: the verdict is only returned (`recorded` says which)."""
    generation_arg(generation)
    try:
        gen_id = generations.resolve(t, generation)
    except HostError:
        raise
    except ProvisionError as e:       # the generation named is not on the host: the argument is wrong
        if generation is None:
            raise
        raise InputError(e.message, where=e.where) from None
    lock, manifest = generations.lock_of(t, gen_id)
    from .pack import progress_every

    found = t.run_agent("verify", {"op": "verify", "root": t.target.root, "id": gen_id, "baseline": baseline,
                                   "jobs": jobs, "progress_every": progress_every()}, on_event=progress)
    out = verdict_of(found, lock, manifest.get("installer"), gen_id, t.target.name)
    rec = out.pop("record")
    warnings, recorded = [], False
    if found_unchecked := out.pop("unchecked"):
        why = ("adopted before adoptions were recorded" if manifest.get("status") == "adopted"
               or manifest.get("adopted_from") else "built before stamps")
        warnings.append(f"not checked: {', '.join(found_unchecked)}: {gen_id} was {why}, and nothing records "
                        "what they were")
    try:
        if record:
            generations.mark(t, gen_id, event=event_of(rec), verify=rec)
            recorded = True
    except HostError as e:        # a root mounted read-only: the verdict stands, unrecorded
        warnings.append(f"the verdict is not recorded: {e.message}")
    return dict(out, host=t.target.name, warnings=warnings, recorded=recorded)


def verify_play(targets: list, generation: str | None = None, baseline: bool = False, jobs: int | None = None,
                forks: int | None = None, on_progress=None) -> list:
    """`provision verify`: playbooks/verify.yml through Ansible on every host, the verdict recorded. One fleet.Row
    per host, in order: the verdict as `verify` returns it (clean or drift), or the host's error (unreachable:
    stage "connect"; a generation named that the host lacks: InputError). `on_progress(host, event)` hears each
    host's progress (files and bytes hashed), at least every few seconds."""
    from .plays import Play

    generation_arg(generation)
    return Play("verify", {"generation": generation, "jobs": jobs, "baseline": baseline, "record": True},
                on_progress=on_progress).rows(targets, forks)


def event_of(rec: dict) -> dict:
    """The history event of a verdict recorded (`summary`'s)."""
    return {"event": "verify", **{k: rec[k] for k in ("verdict", "files", "bytes", "seconds", "drifted", "changed",
                                                      "missing", "extra")}}


def verdict_of(reply, lock: Lock, installer: str | None, gen_id: str, host: str = "host") -> dict:
    """The verdict on the agent's `verify` reply for generation `gen_id` (judged against its lock), with the
    figures and one line per drifted distribution; `record` is what the manifest keeps of it. The CLI and the
    playbooks' verify both read the agent's reply here (ReplyError naming `host` when it has the wrong shape)."""
    found = Checked.of(reply, host)
    verdict = judge(found, lock, installer)
    out = dict(verdict, generation=gen_id, files=found.files, bytes=found.bytes, seconds=found.seconds,
               jobs=found.jobs, bytecode_checked=found.bytecode_checked,
               unchecked=found.sealed.unchecked if found.sealed else [],
               lines=[line(r) for r in verdict["rows"]], record=summary(found, verdict, "verify"))
    out["rate_gbs"] = found.bytes / found.seconds / 1e9 if found.seconds > 0 else None
    if found.read_seconds is not None:
        rs, rb = found.read_seconds, found.read_bytes or 0
        out.update(read_seconds=rs, read_bytes=rb, cache=found.cache, read_rate_gbs=rb / rs / 1e9 if rs > 0 else None,
                   ratio=found.seconds / rs if rs > 0 else None)
    return out


def seal(t: Transport, lock: Lock, gen_id: str, installer: str | None) -> dict:
    """The build's last step (after patches, before probes): files read-only, a stamp of every file for rollback's
    quick check, and a full check judged against the lock. Drift fails the build (HostError naming it)."""
    found = read(Checked, t.run_agent("verify", {"op": "seal", "root": t.target.root, "id": gen_id}),
                 t.target.name, "seal")
    verdict = judge(found, lock, installer)
    rec = summary(found, verdict, "build")
    if verdict["verdict"] != "clean":
        rows = verdict["rows"]
        more = f" (and {len(rows) - 2} more distributions)" if len(rows) > 2 else ""
        hint = ("; uv's unpacked cache (cache/uv) may hold a changed copy: remove it and apply again, uv rebuilds "
                "it from the verified wheels" if verdict["counts"]["changed"] else "")
        raise HostError(f"{gen_id} does not match its lock after the build: "
                        + "; ".join(line(r) for r in rows[:2]) + more + hint, where=t.target.name)
    from .units import human_size

    rate = found.bytes / found.seconds if found.seconds > 0 else 0.0
    linked = (f"; {found.stored} linked from the host's store ({human_size(found.stored_bytes)}), hashed "
              "when entered" if found.stored else "")
    detail = (f"{found.files} files, {human_size(found.bytes)} hashed in {found.seconds:.1f}s "
              f"({human_size(rate)}/s){linked}: all match RECORD and the lock; stamped, read-only")
    return {"detail": detail, "record": rec, "stamped": found.stamped}


def check(t: Transport, gen_id: str) -> dict:
    """Rollback's quick check of one generation (every file's stat against its build's stamp, hashing what
    changed), for a switch that did not go through `rollback`: apply's reuse of an existing generation."""
    q = QuickCheck.of(t.run_agent("verify", {"op": "quick", "root": t.target.root, "id": gen_id}), t.target.name)
    verdict = "clean" if q.verdict == "clean" else f"drift: {q.named or ''}"
    return dict(q.to_json(), named=q.named or "",
                detail=f"{gen_id}: {q.files} files against its stamp, {q.hashed} hashed: {verdict}")
