"""The build step of apply: wheels the controller holds are pushed by hash (the `cache` agent), the host's `build`
agent fetches the rest in parallel into its content-addressed cache (the `fetch` step) and installs them (uv by default,
linking from a shared cache; pip only when asked); its events become readable progress lines."""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import unquote, urlparse

from . import layout
from .errors import HostError, InputError, ProvisionError
from .facts import Facts
from .lock import Lock
from .replies import BuildEvent, Built, Have, refuse
from .toolkit import wheels_home
from .transport import Transport
from .units import human_size

Progress = Callable[[str, str, str], None]   # (step, state: start|done|fail|info, detail)
CHUNK = 1 << 20


def local_wheel(lock: Lock, url: str) -> Path | None:
    """A package url the controller holds (file:// or a path relative to the lock), else None."""
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        return None
    path = Path(unquote(parsed.path)) if parsed.scheme == "file" else Path(url)
    return path if path.is_absolute() else lock.resolve_path(url)


def packages_of(lock: Lock) -> tuple[list[dict], list[tuple[dict, Path]]]:
    """(the build agent's package list, [(package, local file)] for wheels the controller pushes)."""
    pkgs, local = [], []
    for p in lock.packages:
        item = {"name": p.name, "version": p.version, "sha256": p.sha256, "filename": p.filename, "label": p.pin}
        if p.size is not None:
            item["size"] = p.size
        path = local_wheel(lock, p.url) if p.url else None
        if path is None:
            item["url"] = p.url           # None: the host's cache must hold it (plan says when it does not)
        else:
            if not path.is_file():
                raise ProvisionError(f"{p.pin}: wheel {path} not found", where=f"{lock.path}:{p.line}")
            local.append((item, path))
        pkgs.append(item)
    return pkgs, local


def _stream(paths: list[Path]) -> Iterator[bytes]:
    for path in paths:
        with open(path, "rb") as f:
            yield from iter(lambda: f.read(CHUNK), b"")


def push(transport: Transport, root: str, files: list[tuple[dict, Path]]) -> dict:
    """Copy files the host's cache lacks into it (by sha256; the host verifies each on the way in). The host
    first hashes again the entries it holds, and one that changed is removed and sent again.
    Returns {sent, recheck: {checked, bytes, seconds, healed: [file names]}, rechecked: [sha256]}."""
    entries = [{"sha256": f["sha256"], "filename": f["filename"], "store": f.get("store") or "wheels"}
               for f, _ in files]
    if not entries:
        return {"sent": 0, "recheck": None, "rechecked": []}
    host = transport.target.name
    have = Have.of(transport.run_agent("cache", {"op": "have", "root": root, "files": entries}), host)
    missing = have.missing
    if any(not 0 <= i < len(entries) for i in missing) or len(set(missing)) < len(missing):
        refuse(host, "have", "missing", f"not indexes of the {len(entries)} files asked about")
    rc = have.recheck.to_json() if have.recheck else {}
    rc = dict(rc, healed=[p.rsplit("/", 1)[-1] for p in have.recheck.healed] if have.recheck else [])
    out = {"sent": len(missing), "recheck": rc, "rechecked": [e["sha256"] for e in entries]}
    if not missing:
        return out
    send = [files[i] for i in missing]
    header = [dict(entries[i], size=path.stat().st_size, mode=f.get("mode"), label=f.get("label"))
              for i, (f, path) in zip(missing, send)]
    transport.run_agent("cache", {"op": "push", "root": root, "files": header},
                        extra_stdin=_stream([path for _, path in send]))
    return out


def sha256_file(path: Path) -> str:
    """sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def controller_uv() -> Path:
    """The uv binary this tool depends on."""
    from uv import find_uv_bin

    return Path(find_uv_bin())


def under(root: str, path, what: str, host: str) -> str:
    """`path` from a host's reply, if it is absolute and inside `root`; else HostError."""
    parts = path.split("/") if isinstance(path, str) else []
    if not (isinstance(path, str) and path.startswith(root.rstrip("/") + "/") and ".." not in parts
            and "\0" not in path and "\n" not in path):
        raise HostError(f"host reported {what} {path!r}, not a path under {root}; refusing", where=host)
    return path


def ensure_uv(transport: Transport, facts: Facts) -> tuple[str, dict | None]:
    """The host's uv, or the controller's pushed by hash into the host's cache/uv-bin (which gc keeps); with
    what `push` found (None when the host has its own)."""
    if facts.uv:
        return facts.uv, None
    path = controller_uv()
    f = {"sha256": sha256_file(path), "filename": "uv", "mode": "750", "store": "uv", "label": "uv"}
    lay = layout.of(transport)
    return layout.cache_entry(lay.uv_bin, f["sha256"], f["filename"]), push(transport, lay.root, [(f, path)])


def setting(name: str, default: float, lo: float, hi: float) -> float:
    """A number from the environment (PROVISION_FETCH_JOBS, PROVISION_FETCH_STALL), within its bounds."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not lo <= v <= hi:
        raise InputError(f"{name}={text[:40]!r}: expected a number from {lo:g} to {hi:g}", where=name)
    return v


def describe(ev: BuildEvent) -> str | None:
    """One readable line for a build agent event (None: nothing worth showing); `level` says how loud."""
    if ev.step == "cache" and ev.healed:
        return healed_line(ev.healed)
    if ev.step == "fetch" and ev.summary:
        if not ev.fetched:
            return f"fetch: all {ev.cached} wheels cached"
        rate = ev.bytes / ev.seconds if ev.seconds else 0
        return (f"fetch: {ev.fetched} wheels, {human_size(ev.bytes)} in {ev.seconds or 0:.1f}s "
                f"({human_size(rate)}/s); {ev.cached} cached")
    if ev.step == "fetch" and ev.retry:
        return f"fetch: {ev.retry[:120]}: {str(ev.why)[:200]}; again in {ev.wait:.1f}s"
    if ev.step == "fetch":
        eta = f", {ev.eta:.0f}s left" if ev.eta is not None else ""
        return (f"fetch {ev.done}/{ev.total} · {human_size(ev.bytes)} of "
                f"~{human_size(ev.total_bytes)} · {human_size(ev.rate)}/s{eta}")
    if ev.step == "store" and ev.total:
        return f"store: {ev.done}/{ev.total} contents linked ({ev.seconds or 0:.0f}s)"
    if ev.step in ("venv", "install") and ev.line:
        secs = f" ({ev.seconds:.0f}s)" if ev.seconds else ""
        return f"{ev.step}: {ev.line}{secs}"
    return None


def level(ev: BuildEvent) -> str:
    """"info" for a phase's line (fetch done, a fetch retried, install started, cache healed), "detail" for a
    per-package one (fetch counters, each line uv or pip prints)."""
    if ev.step == "fetch" and not (ev.summary or ev.retry) or ev.step in ("venv", "install") and not ev.phase:
        return "detail"
    return "info"


def build(transport: Transport, lock: Lock, facts: Facts, gen: dict, installer: str | None,
          progress: Progress | None = None, wheels_from: str | None = None) -> dict:
    """Fill the generation's venv with the lock's closure; returns the build figures. `wheels_from`:
    "host" (default: the host fetches what its store lacks) or "controller" (the controller fetches each
    wheel once into its own cache and pushes it by hash; the host builds from its store, offline)."""
    say = progress or (lambda *a: None)
    installer = installer or "uv"
    if installer not in ("uv", "pip"):
        raise ProvisionError(f"unknown installer {installer!r} (uv or pip)")
    if wheels_from not in (None, "host", "controller"):
        raise ProvisionError(f"unknown wheel source {wheels_from!r} (host or controller)")
    try:
        return _build(transport, lock, facts, gen, installer, say, wheels_from == "controller")
    except HostError as e:      # name the lock line of the package the host refused
        hit = next((p for p in lock.packages if e.message.startswith(f"{p.pin}:") or f" {p.pin}:" in e.message), None)
        if hit is None:
            raise
        raise HostError(f"{e.message} ({lock.path}:{hit.line})", where=e.where) from None


def _build(transport: Transport, lock: Lock, facts: Facts, gen: dict, installer: str, say: Progress,
           from_controller: bool) -> dict:
    python = facts.pythons.get(lock.platform.python)
    if python is None:
        raise HostError(f"host has no usable Python {lock.platform.python}", where=transport.target.name)
    pkgs, local = packages_of(lock)
    lay = layout.of(transport)
    root = lay.root
    for what in ("dir", "venv"):      # the state agent's reply: untrusted until checked
        under(lay.generations, gen.get(what), f"generation {what}", transport.target.name)
    if from_controller:     # every wheel then comes from the controller's cache; the host gets no URL
        from .wheelcache import WheelCache

        remote = [p for p in pkgs if p.get("url")]
        for item, path in zip(remote, WheelCache().fetch(lock, remote)):
            del item["url"]
            local.append((item, path))
    pushes = [push(transport, root, local)]
    pushed = pushes[0]["sent"]
    if pushes[0]["recheck"] and pushes[0]["recheck"]["healed"]:
        say("build", "info", healed_line(pushes[0]["recheck"]["healed"], "pushed"))
    if pushed:
        say("build", "info", f"pushed {pushed} wheel(s) held by the controller")
    payload = {"op": "build", "root": root, "gen_dir": gen["dir"], "python": python,
               "installer": installer, "packages": pkgs, "stall": setting("PROVISION_FETCH_STALL", 30, 0.1, 3600),
               "rechecked": pushes[0]["rechecked"]}
    if wheels_home(lock, gen["venv"]):
        payload["cuda_home"] = wheels_home(lock, gen["venv"])
    if os.environ.get("PROVISION_FETCH_JOBS"):      # else the host's agent picks by its cores
        payload["jobs"] = int(setting("PROVISION_FETCH_JOBS", 8, 1, 64))
    if installer == "uv":
        payload["uv"], uv_push = ensure_uv(transport, facts)
        if uv_push:
            pushes.append(uv_push)
            if uv_push["recheck"]["healed"]:
                say("build", "info", healed_line(uv_push["recheck"]["healed"], "pushed"))

    def on_event(raw: dict) -> None:       # a malformed event ends the step (ReplyError), as a malformed reply does
        ev = BuildEvent.of(raw, transport.target.name)
        line = describe(ev)
        if line:
            say("build", level(ev), line)

    figs = Built.of(transport.run_agent("build", payload, on_event=on_event), transport.target.name).to_json()
    figs.update(pushed=pushed, wheels_from="controller" if from_controller else "host")
    rcs = [p["recheck"] for p in pushes if p["recheck"]] + [figs.get("recheck") or {}]
    figs["recheck"] = {"checked": sum(r.get("checked", 0) for r in rcs), "bytes": sum(r.get("bytes", 0) for r in rcs),
                       "seconds": round(sum(r.get("seconds", 0) for r in rcs), 3),
                       "healed": [h for r in rcs for h in r.get("healed") or []]}
    if lock.platform.cuda.source == "apt":
        figs.update(host_steps(transport, lock, gen["id"], facts, say))
    return figs


PLAIN_PATH = re.compile(r"^/[A-Za-z0-9._+/-]{1,4095}\Z")


def host_steps(transport: Transport, lock: Lock, label: str, facts: Facts, say: Progress) -> dict:
    """What Ansible does for a build (playbooks/build.yml): the apt CUDA toolkit. Returns its figures."""
    from . import runner

    cu = lock.platform.cuda
    say("build", "info", f"apt: {cu.package}")
    py = facts.python_executable       # Ansible's inventory takes it only as a plain path
    interp = {transport.target.name: py} if py and PLAIN_PATH.match(py) else None
    res = runner.run_playbook("build", [transport.target], {"cuda_source": cu.source, "cuda_apt_package": cu.package},
                              label=label, interpreters=interp)
    if res.error:
        raise HostError(f"build failed: {res.error}", where=transport.target.name)
    return {"run_dir": res.run_dir, "ansible_seconds": round(res.seconds, 2)}


def healed_line(names: list[str], how: str = "fetched") -> str:
    """The one line that says the host's cache held changed copies, removed and replaced."""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    one = len(names) == 1
    return (f"cache: {len(names)} entr{'y' if one else 'ies'} no longer matched {'its' if one else 'their'} "
            f"sha256 ({shown}): removed and {how} again")


def lost_line(lost: dict) -> str:
    """What the build found of an inode that left the host's store without its attribute (removed by hand, or
    written with the attribute left off and set aside): the generations that still share it."""
    return (f"a former store entry, no longer immutable, is still shared by {', '.join(lost['generations'])} "
            f"({lost['links']} links, {human_size(lost['bytes'])}): a write through one reaches the others; the "
            "store holds its bytes anew")


def summary(figs: dict, count: int) -> str:
    """The build step's line: what was fetched, what came from the cache, how long each phase took, how the
    generation's files are its own (isolation), store entries hashed again, set aside or still shared outside
    the store, and cache entries healed."""
    parts = [f"{count} packages with {figs['installer']}"]
    if figs.get("fetched"):
        again = f", {figs['retries']} retr{'y' if figs['retries'] == 1 else 'ies'}" if figs.get("retries") else ""
        parts.append(f"fetched {figs['fetched']} ({human_size(figs['fetched_bytes'])} in "
                     f"{figs['fetch_seconds']:.1f}s{again})")
    pushed = figs.get("pushed") or 0          # the host's store held these because they were just pushed
    if figs.get("cached", 0) - pushed > 0:
        parts.append(f"{figs['cached'] - pushed} cached")
    if pushed:
        parts.append(f"{pushed} pushed by the controller")
    if figs.get("install_seconds") is not None:
        parts.append(f"install {figs['install_seconds']:.1f}s")
    if figs.get("isolation"):
        st = figs.get("store") or {}
        parts.append({"reflink": "own files by reflink (copy-on-write)",
                      "store": f"{st.get('linked', 0)} files linked from the host's store (immutable; "
                               f"{st.get('entered', 0)} contents new there, {human_size(st.get('entered_bytes', 0))})",
                      "copy": "own files by copy (%s)" % (figs.get("isolation_why") or "no reflinks here")
                      }.get(figs["isolation"], figs["isolation"]) + ", read-only")
    st = figs.get("store") or {}
    if st.get("hashed"):
        parts.append(f"{st['hashed']} store entr{'y' if st['hashed'] == 1 else 'ies'} hashed again (stat moved since "
                     "a build last hashed it)")
    if st.get("evicted"):
        parts.append(f"{st['evicted']} store entr{'y' if st['evicted'] == 1 else 'ies'} set aside (not the bytes "
                     "their name says, or not a file) and entered anew")
    for lost in st.get("lost") or []:
        parts.append(lost_line(lost))
    rc = figs.get("recheck") or {}
    if rc.get("healed"):
        parts.append(f"healed {len(rc['healed'])} changed cache entr{'y' if len(rc['healed']) == 1 else 'ies'}")
    return ", ".join(parts)
