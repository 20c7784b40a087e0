"""The demo on a throwaway loopback host: plan → apply A → plan → apply B → plan → rollback → history, each through
the playbook the CLI runs for it; all real (sshd, ansible-runner, uv, PyPI wheels, the included engine probed in
generation B); output goes through the CLI's callbacks. Also lock B's wheelhouse: the CPU torch wheel it pins by
name and sha256, found, checked, named."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from . import apply as applymod, generations
from .fleet import values
from . import lock as lockmod
from .build import sha256_file
from .bundled import DEMO_LOCKS
from .errors import InputError, ProvisionError
from .loopback import LoopbackHost
from .plan import render_plan
from .plays import Play, typed
from .replies import History
from .transport import trust_host
from .units import human_size

ROOM = 2 << 30      # the throwaway host's disk: generation B's CPU torch (its plan asks about 1.6 GiB), wheelhouse


def _pip_download(pin: str, house: Path) -> None:
    """`pip download PIN` into `house`: pip looks where it is configured to (its find-links and indexes)."""
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--no-input",
            "--disable-pip-version-check", "-q", "-d", str(house), pin]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900)
    except subprocess.TimeoutExpired:
        raise InputError(f"{pin}: pip download did not finish in 900 s; pass --torch-wheel PATH",
                         where="demo") from None
    if p.returncode != 0:
        why = ([ln.strip() for ln in p.stderr.splitlines() if ln.strip()] or ["(no output)"])[-1]
        raise InputError(f"{pin}: no wheel found by pip download ({why[:200]}); pass --torch-wheel PATH",
                         where="demo")


def wheelhouse_lock(path: Path, house: Path, given: Path | None = None,
                    say: Callable[[str], None] = lambda text: None) -> Path:
    """A copy of the lock at `path`, written into `house`, in which every package the lock names without a
    URL (lock B's CPU torch: not on PyPI) is named by file:// in `house`.

    The wheel is `given` when its file name is the one the lock pins, else what `pip download` finds for the
    pin; either way its sha256 must equal the lock's. Returns the written lock's path.
    """
    lk = lockmod.load(path)
    data = dict(lk.raw)
    house.mkdir(parents=True, exist_ok=True)
    missing = [p for p in lk.packages if p.url is None]
    if given is not None and given.name not in {p.filename for p in missing}:
        raise InputError(f"{given} is not {' or '.join(p.filename for p in missing) or 'a wheel'} "
                         f"(what {path.name} pins)", where="--torch-wheel")
    packages = []
    for p in lk.packages:
        item = lockmod.package_data(p)
        if p.url is None:
            target = house / p.filename
            if given is not None and given.name == p.filename:
                shutil.copyfile(given, target)
                how = f"from {given}"
            else:
                _pip_download(p.pin, house)
                how = "found by pip download (pip's find-links and indexes)"
            if not target.is_file():
                raise InputError(f"{p.pin}: pip found a wheel, but not {p.filename}, the one the lock pins "
                                 f"(found: {', '.join(sorted(x.name for x in house.glob('*.whl'))) or 'none'})",
                                 where=f"{lk.path}:{p.line}")
            digest = sha256_file(target)
            if digest != p.sha256:
                raise InputError(f"{p.filename}: sha256 {digest} is not the lock's {p.sha256}",
                                 where=f"{lk.path}:{p.line}")
            item["url"] = target.resolve().as_uri()
            say(f"{p.filename}: {how}; sha256 {digest[:16]}… = the lock's pin")
        packages.append(item)
    data["packages"] = packages
    out = house / path.name
    out.write_text(f"# {path.name} with every wheel it pins by name and sha256 only named in this folder\n"
                   + lockmod.dump(data))
    return out


def scratch(need: int = ROOM, places: list[Path] | None = None) -> Path:
    """Where the throwaway host goes: the first of the temporary directory (TMPDIR), /var/tmp and
    ~/.cache/provision with `need` bytes free; a machine's /tmp is often a small tmpfs. None with room is one
    line naming the most free found."""
    places = places or [Path(tempfile.gettempdir()), Path("/var/tmp"), Path.home() / ".cache" / "provision"]
    free = {}
    for d in places:
        near = next((p for p in (d, *d.parents) if p.exists()), d)     # the directory it would be made in
        try:
            st = os.statvfs(near)
            free[d] = st.f_bavail * st.f_frsize if os.access(near, os.W_OK) else 0
        except OSError:
            free[d] = 0
        if free[d] >= need:
            d.mkdir(parents=True, exist_ok=True)
            return d
    most = max(free, key=free.get)
    raise InputError(f"the throwaway host needs about {human_size(need)} free; the most found is "
                     f"{human_size(free[most])} under {most} (of {', '.join(map(str, places))}): free some, "
                     "or set TMPDIR to a directory with room", where="demo")


def run_demo(say: Callable[[str], None], progress, show_history: Callable[[History, str], None],
             show_probes: Callable[[dict | None], None], keep: bool = False,
             torch_wheel: Path | None = None) -> dict:
    host = LoopbackHost(base=scratch())
    figures = {}
    try:
        a = lockmod.load(DEMO_LOCKS / "a.yaml")
        say(f"## lock B's wheels that PyPI does not serve, into {host.dir / 'wheelhouse'}")
        b = lockmod.load(wheelhouse_lock(DEMO_LOCKS / "b.yaml", host.dir / "wheelhouse", torch_wheel, say))
        host.start()
        t = host.target
        say(f"\n## throwaway host {host.spec} (sshd on loopback, root {host.root})")
        kind, fp = trust_host(t)
        say(f"trusted its fresh host key {kind} {fp} (in {t.known_hosts})")

        def steps(step: str, state: str, detail: str) -> None:    # the plan line is the plan step's to show
            if state != "plan":
                progress(step, state, detail)
        for step, lk in (("plan", a), ("apply", a), ("plan", b), ("apply", b), ("plan", b)):
            say(f"\n## provision {step} {host.spec} --lock {lk.path}")
            if step == "plan":
                say(render_plan(values(applymod.plan_fleet([t], lk))[0]))
                continue
            rep = applymod.apply_fleet([t], lk, forks=1, progress_for=lambda h: steps).reports[0]
            if rep.status not in ("applied", "reused", "noop"):
                raise ProvisionError(rep.error or f"apply {lk.name}: {rep.status}", where="demo")
            show_probes(rep.probes)
            say(f"Applied {lk.name}: current {rep.previous or '(none)'} → {rep.generation} in {rep.seconds:.1f}s")
            figures[f"apply_{lk.name}_s"] = rep.seconds
            engine = next((r for r in (rep.probes or {}).get("results", []) if r["name"] == "engine"), None)
            if engine and engine["status"] != "skip":
                figures["engine"] = {k: engine["figures"].get(k) for k in
                                     ("greedy_identical", "accept_length", "speedup", "baseline_tok_s",
                                      "spec_tok_s")}
        say(f"\n## provision rollback {host.spec}")
        rb = values(generations.rollback_play([t]))[0]
        figures["rollback_s"] = rb.seconds
        say(f"Rolled back: current {rb.from_} → {rb.to} in {rb.seconds:.2f}s (nothing reinstalled)")
        say(f"\n## provision history {host.spec}")
        show_history(values(Play("history", read=typed(History)).rows([t]))[0], host.spec)
    finally:
        if keep:
            host.stop()
            say(f"\nsandbox kept at {host.dir}")
        else:
            host.cleanup()
    return figures
