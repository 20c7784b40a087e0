"""`provision pack`: a generation (managed or adopted) back into a hashed wheelhouse, DIR/*.whl and DIR/lock.yaml,
from which a host that reaches no index rebuilds it. The host's `pack` agent checks every file against its RECORD
and rebuilds the wheels; this side brings them back (over SSH), adds extra wheels, writes the lock and checks it.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from . import generations, layout, lock as lockmod
from .build import setting, sha256_file
from .errors import DriftError, HostError, InputError, ProvisionError
from .replies import Packed, PackedWheel, PackRefused
from .transport import Transport

SHOWN = 5      # drifted files named in a refusal before "and N more"


def progress_every() -> float:
    """Seconds between a host agent's progress events while it packs or verifies (PROVISION_PROGRESS_EVERY)."""
    return setting("PROVISION_PROGRESS_EVERY", 2.0, 0.01, 5.0)


def drift_line(drift: dict) -> str:
    """`dist: path, dist: path, … and N more` over {dist: [paths]}."""
    flat = [f"{name}: {path}" for name, paths in sorted(drift.items()) for path in paths]
    more = f" and {len(flat) - SHOWN} more" if len(flat) > SHOWN else ""
    return ", ".join(flat[:SHOWN]) + more


def extra_wheels(paths: list[Path]) -> list[dict]:
    """The `--with` wheels, checked before any host is contacted: {path, name, version, filename}."""
    out, seen = [], {}
    for p in paths:
        if not p.is_file():
            raise InputError(f"{p}: no such wheel file", where="--with")
        try:
            name, version, _, _ = parse_wheel_filename(p.name)
        except InvalidWheelFilename as e:
            raise InputError(f"{p.name} is not a wheel file name: {e}", where="--with") from None
        name = canonicalize_name(name)
        if name in seen:
            raise InputError(f"{name} given twice ({seen[name]} and {p})", where="--with")
        seen[name] = p
        out.append({"path": p, "name": name, "version": str(version), "filename": p.name})
    return out


def out_dir(out: Path, force: bool = False, keep: list[Path] = ()) -> Path:
    """DIR, created if needed, refused (one line) when it cannot be written, or holds anything but the `keep`
    files (the `--with` wheels) and `force` is not given."""
    out = out.expanduser().resolve()
    try:
        there = sorted(p.name for p in out.iterdir() if p.resolve() not in {k.resolve() for k in keep})
    except FileNotFoundError:
        there = []
    except OSError as e:
        raise InputError(f"cannot read {out}: {e.strerror or e}", where="--out") from None
    if there and not force:
        more = f" and {len(there) - 3} more" if len(there) > 3 else ""
        raise InputError(f"{out} is not empty ({', '.join(there[:3])}{more}): pack into an empty folder, or "
                         f"`--force` to write over it", where="--out")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".pack-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise InputError(f"cannot write into {out}: {e.strerror or e}", where="--out") from None
    return out


def venv_of(transport: Transport, gen_id: str, manifest: dict) -> str:
    """The environment a generation runs: its venv, or for an adopted one the prefix it was adopted from."""
    if manifest.get("status") == "adopted" or manifest.get("adopted_from"):
        prefix = manifest.get("adopted_from")
        if not (isinstance(prefix, str) and prefix.startswith("/") and "\0" not in prefix and "\n" not in prefix):
            raise HostError(f"generation {gen_id} records no usable prefix ({prefix!r})", where=transport.target.name)
        return prefix
    return layout.of(transport).gen(gen_id).venv


def series_payload(source: lockmod.Lock, base: lockmod.Lock | None, host: str) -> list[dict]:
    """The patch series a generation's lock names, as the host agent reverses them, when this controller has
    them (beside the --base lock, or shipped with provision); [] otherwise (the host's cached wheels serve)."""
    from . import patches

    out = []
    versions = {p.name: p.version for p in source.packages}
    for rel in source.patches:
        try:
            s = patches.load_series((base or source).resolve_path(rel))
        except ProvisionError:
            continue
        try:
            out += patches.gate([s], versions, host)
        except ProvisionError:
            continue
    return out


def copy_series(lock: lockmod.Lock, out: Path) -> list[str]:
    """Copy the patch series the lock names into DIR (so DIR is whole); the names of those not found here."""
    from . import patches

    missing = []
    for rel in lock.patches:
        try:
            src = lock.resolve_path(rel)
            patches.load_series(src)
        except ProvisionError:
            missing.append(rel)
            continue
        dest = out / rel
        if dest.resolve() != src.resolve():
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(src, dest, symlinks=False)
    return missing


def pack(transport: Transport, out: Path, generation: str | None = None, *, allow_drift: bool = False,
         base: Path | None = None, extra: list[Path] = (), name: str | None = None, jobs: int | None = None,
         force: bool = False, progress=None) -> dict:
    """Pack a generation of the host into the wheelhouse `out` (an empty folder, unless `force`); returns the
    report (what was packed, sizes, seconds, drift, the lock written and its check; `ratio`: the pack's seconds,
    its reading of the RECORDs included, over those of a first read of the same files from disk, `cache` says how
    it was made one). `progress(event)`
    sees the agent's events (one at least every PROVISION_PROGRESS_EVERY seconds)."""
    out = out_dir(out, force, list(extra))
    base_lock = lockmod.load(base) if base else None
    extras = extra_wheels(list(extra))
    host = transport.target.name
    t0 = time.perf_counter()

    gen_id = generations.resolve(transport, generation)
    source, manifest = generations.lock_of(transport, gen_id)
    venv = venv_of(transport, gen_id, manifest)
    rules = base_lock or source      # what the packed lock says besides its packages
    if base_lock and base_lock.platform.python != source.platform.python:
        raise InputError(f"generation {gen_id} runs Python {source.platform.python}; {base} is for Python "
                         f"{base_lock.platform.python}", where="--base")
    lay = layout.of(transport)
    remote = str(out) if transport.target.local else lay.scratch(f"pack-{gen_id}-{os.getpid()}-{int(time.time())}")
    payload = {"op": "pack", "venv": venv, "out": remote, "root": lay.root, "allow_drift": allow_drift,
               "series": series_payload(source, base_lock, host), "jobs": jobs,
               "filenames": {p.name: p.filename for p in source.packages if p.filename},
               "workers": os.environ.get("PROVISION_PACK_WORKERS", "processes"),
               "level": int(setting("PROVISION_PACK_LEVEL", 1, 0, 9)) if os.environ.get("PROVISION_PACK_LEVEL")
               else None, "progress_every": progress_every()}
    if not manifest.get("adopted_from"):
        payload["gen_dir"] = lay.gen(gen_id).dir
    try:
        res = Packed.of(transport.run_agent("pack", payload, on_event=progress, timeout=None), host)
        if isinstance(res, PackRefused) and res.unpackable:
            raise HostError(f"generation {gen_id} ({venv}): refusing to pack what no wheel holds truthfully: "
                            + "; ".join(f"{u.dist}{' ' + u.version if u.version else ''} ({u.path}): {u.why}"
                                        for u in res.unpackable), where=host)
        if isinstance(res, PackRefused):
            n = sum(len(v) for v in res.drift.values())
            raise DriftError(f"generation {gen_id} ({venv}): {n} installed file(s) no longer match their RECORD: "
                             f"{drift_line(res.drift)}; refusing to pack (`--allow-drift` packs them as they are "
                             f"and records them in the lock)", where=host)
        wheels = res.wheels       # their file names are plain wheel names (the reader checked): files in DIR
        t_fetch = time.perf_counter()
        if not transport.target.local:
            fetch(transport, remote, out, wheels)
        t_fetch = time.perf_counter() - t_fetch
    finally:
        if not transport.target.local:
            try:
                transport.run_agent("pack", {"op": "clean", "root": lay.root, "dir": remote})
            except ProvisionError:
                pass

    if res.python != f"python{rules.platform.python}":
        raise HostError(f"{venv} runs {res.python!r}, not Python {rules.platform.python} as its lock says",
                        where=host)

    by_name = {w.name: dict(w.to_json(), drift=res.drift.get(w.name)) for w in wheels}
    replaced = []
    for x in extras:
        dest = out / x["filename"]
        if x["path"].resolve() != dest.resolve():
            shutil.copyfile(x["path"], dest)
        if x["name"] in by_name:
            replaced.append(f"{x['name']} {by_name[x['name']]['version']} → {x['version']}")
            old = out / by_name[x["name"]]["filename"]
            if old.name != x["filename"]:
                old.unlink(missing_ok=True)
        by_name[x["name"]] = {"name": x["name"], "version": x["version"], "filename": x["filename"],
                              "sha256": sha256_file(dest), "size": dest.stat().st_size, "extra": True}

    packages = []
    for n in sorted(by_name):
        w = by_name[n]
        pkg = {"name": n, "version": w["version"], "filename": w["filename"], "url": (out / w["filename"]).as_uri(),
               "sha256": w["sha256"]}
        if w.get("drift"):
            pkg["drift"] = w["drift"]
        packages.append(pkg)
    raw = rules.raw
    data = {"lock": lockmod.SCHEMA, "name": name or rules.name,
            "description": f"packed from {host}:{gen_id} ({venv}): {len(wheels)} distributions"
                           + (f" and {len(extras)} added wheels" if extras else ""),
            "platform": raw["platform"]}
    for key in ("requires", "overrides"):
        if raw.get(key):
            data[key] = raw[key]
    data["packages"] = packages
    data.update({"patches": list(raw.get("patches") or []), "engine": raw.get("engine") or {},
                 "probes": raw.get("probes") or {}})
    lock_path = out / "lock.yaml"
    tmp = out / f".lock.yaml.tmp-{os.getpid()}"
    tmp.write_text(lockmod.dump(data))
    os.replace(tmp, lock_path)
    written = lockmod.load(lock_path)
    missing_series = copy_series(rules, out) if rules.patches else []

    from . import lockcheck

    check = lockcheck.check(written, offline=True)
    secs = dict(res.seconds.to_json(), fetch=t_fetch, total=time.perf_counter() - t0)
    members = {k: sum(getattr(w, k) for w in wheels) for k in ("stored", "deflated")}
    return {"host": host, "generation": gen_id, "venv": venv, "out": str(out), "lock": str(lock_path),
            "name": written.name, "distributions": len(wheels), "extra": [x["filename"] for x in extras],
            "replaced": replaced, "files": res.files, "bytes": res.bytes, "read_bytes": res.read_bytes,
            "wheel_bytes": sum(w.size for w in wheels), "jobs": res.jobs, "workers": res.workers,
            "seconds": secs, "cache": res.cache, "level": res.level, "level_auto": res.level_auto,
            "members": members,
            "ratio": (secs["plan"] + secs["pack"]) / secs["read"] if secs["read"] > 0 else None,
            "drift": res.drift, "not_owned": res.extra,
            "missing_series": missing_series, "check": check}


def fetch(transport: Transport, remote: str, out: Path, wheels: list[PackedWheel]) -> None:
    """Bring each wheel the host wrote into DIR, verified against the sha256 the host reported on the way in."""
    from .agent.cache import AgentError, store

    for w in wheels:
        try:
            store(str(out / w.filename), w.sha256, transport.read(f"{remote}/{w.filename}"), w.name)
        except AgentError as e:
            raise HostError(str(e), where=transport.target.name) from None
