"""The fault matrix on real sshd hosts: ssh drops, a full disk, unwritable history, the controller killed at
seven moments and mid-download, concurrent applies, rollback during apply, a spoofed engine port, a failing probe.

After each fault: the host is on exactly one complete, runnable generation; what apply's report and
`history` say matches the host; a re-run converges (and then is a no-op); nothing is left half-done in
the host root, and no ssh master of the run survives on the controller.
Disk full is a real ENOSPC: the host root is a small tmpfs filled at the chosen moment. History is made
unwritable with `chattr +i` (root ignores file modes).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from provision import apply as applymod
from provision import generations
from provision import lock as lockmod
from provision import plan as planmod
from provision.errors import HostLockedError, ProvisionError
from provision.loopback import LoopbackHost
from provision.transport import connect, trust_host
from wheelhouse import make_wheel, write_lock

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- what every fault must leave

def host_state(target) -> dict:
    """The host's truth read from its files: `current`, each generation's status and venv."""
    root = Path(target.root)
    link = root / "current"
    cur = os.readlink(link).split("/")[-1] if link.is_symlink() else None
    gens = {}
    for d in sorted((root / "generations").iterdir()) if (root / "generations").is_dir() else []:
        man = json.loads((d / "manifest.json").read_text()) if (d / "manifest.json").exists() else {}
        gens[d.name] = {"status": man.get("status"), "venv": (d / "venv").exists()}
    return {"current": cur, "generations": gens}


def assert_settled(target, expect_current: str | None, report=None) -> dict:
    """Exactly one complete, runnable current generation; history and the report agree with the files."""
    root = Path(target.root)
    st = host_state(target)
    assert st["current"] == expect_current, st
    if expect_current:
        assert st["generations"][expect_current]["status"] in ("ready", "adopted"), st
        py = root / "current" / "venv" / "bin" / "python"
        assert subprocess.run([py, "-I", "-c", "import alpha"], capture_output=True).returncode == 0
    tr = connect(target)
    try:
        h = generations.history(tr)
    finally:
        tr.close()
    assert h.current == st["current"]
    assert {g.id: g.status for g in h.generations} == {k: v["status"] for k, v in st["generations"].items()}
    if report is not None:
        assert report.current in (st["current"], None) or report.status == "unknown", (report.current, st)
    leftovers = [p for p in root.rglob("*") if ".tmp-" in p.name or p.name.endswith(".tmp")]
    assert not leftovers, leftovers
    return st


def converge(target, lk, expect_new: bool = True) -> applymod.ApplyReport:
    """Re-run the apply with the fault gone: it settles what was left, lands on the lock, then is a no-op."""
    tr = connect(target)
    try:
        rep = applymod.apply(tr, lk)
        assert rep.status in (("applied", "reused") if expect_new else ("applied", "reused", "noop")), rep
        again = applymod.apply(tr, lk)
        assert again.status == "noop", again
        h = generations.history(tr)
    finally:
        tr.close()
    st = assert_settled(target, rep.generation, rep)
    for gid, g in st["generations"].items():   # nothing half-built survives a settling run
        assert g["status"] in ("ready", "adopted", "failed", "abandoned"), (gid, g)
        if g["status"] in ("failed", "abandoned"):
            assert not g["venv"], (gid, g)
    assert h.current == rep.generation
    return rep


def ssh_masters(target) -> list[int]:
    """ssh ControlMaster processes for this host still running on the controller (ControlPath %C: the
    sha1 of local host name, host, port and user)."""
    import hashlib
    import socket

    c = hashlib.sha1(f"{socket.gethostname()}{target.host}{target.port}{target.user}".encode()).hexdigest()
    return [pid for pid in host_processes(c) if b"[mux]" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def host_processes(marker: str) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes() and int(pid) != os.getpid():
                out.append(int(pid))
        except OSError:
            pass
    return out


def wait_quiet(marker: str, timeout: float = 60) -> None:
    """Wait until no process works under `marker` (what a killed run left running winds down)."""
    deadline = time.time() + timeout
    while host_processes(marker) and time.time() < deadline:
        time.sleep(0.2)


@pytest.fixture
def stacks(tmp_path, wheels):
    """Locks a..h: each one builds a distinct generation (alpha plus one distinct tiny wheel)."""
    extra = [make_wheel(tmp_path / "wh", f"pkg{i}", "1.0") for i in range(8)]
    return [lockmod.load(write_lock(tmp_path / f"{c}.yaml", f"stack-{c}", [wheels["alpha-1.0"], extra[i]]))
            for i, c in enumerate("abcdefgh")]


def applied(target, lk) -> applymod.ApplyReport:
    tr = connect(target)
    try:
        return applymod.apply(tr, lk)
    finally:
        tr.close()


# ---------------------------------------------------------------- the controller killed at seven moments

KILLER = r"""
import os, signal, sys, threading, time, json
sys.path.insert(0, sys.argv[1])
from provision import apply as applymod, lock as lockmod
from provision.transport import Target, connect
t = Target(**json.loads(sys.argv[2]))
step, state, delay = sys.argv[4], sys.argv[5], float(sys.argv[6])
def progress(s, st, detail):
    if (s, st) == (step, state):
        print("at", s, st, flush=True)
        threading.Timer(delay, lambda: os.killpg(0, signal.SIGKILL)).start() if delay else os.killpg(0, signal.SIGKILL)
tr = connect(t)
applymod.apply(tr, lockmod.load(sys.argv[3]), progress=progress)
print("finished", flush=True)
"""

MOMENTS = [("build", "start", 0.4), ("build", "done", 0), ("patch", "done", 0), ("probe", "start", 0),
           ("probe", "done", 0), ("switch", "start", 0), ("switch", "done", 0)]


def test_controller_killed_at_seven_moments(target, stacks, tmp_path):
    """SIGKILL of the controller (its process group: the tool and what it started) from mid-build to just
    after the switch; each time the host is on one complete generation and the re-run converges."""
    root = target.root
    tspec = json.dumps({"host": target.host, "user": target.user, "port": target.port, "key_file": target.key_file,
                        "known_hosts": str(target.known_hosts), "root": target.root,
                        "python": target.python})
    base = applied(target, stacks[0])
    cur = base.generation
    for i, (step, state, delay) in enumerate(MOMENTS):
        lk = stacks[1 + i]
        p = subprocess.run([sys.executable, "-c", KILLER, str(ROOT), tspec, lk.path, step, state, str(delay)],
                           capture_output=True, text=True, timeout=300, start_new_session=True,
                           env={**os.environ, "PYTHONPATH": ""})
        assert p.returncode == -signal.SIGKILL and f"at {step} {state}" in p.stdout, (step, p.stdout, p.stderr[-800:])
        lock_free(root)                       # the killed run's host work lets the host lock go...
        gone(root, (step, state))             # ...and ends: no process of it stays on the host
        st = host_state(target)
        committed = (step, state) == ("switch", "done")
        new = [g for g in st["generations"] if g.endswith(lk.name)]
        assert len(new) == 1, st
        # before the commit `current` is untouched; after it, the new generation is current
        assert st["current"] == (new[0] if committed else cur), (step, state, st)
        rep = converge(target, lk, expect_new=not committed)
        if committed:
            assert rep.status == "noop" and rep.generation == new[0]
        else:
            assert rep.generation != new[0]
            assert host_state(target)["generations"][new[0]]["status"] == "abandoned", (step, state)
        cur = rep.generation
    assert not ssh_masters(target)
    events = generations.history(connect(target)).events
    assert sum(e["event"] == "abandoned" for e in events) == len(MOMENTS) - 1


# ---------------------------------------------------------------- ssh drops

def kill_sessions(host: LoopbackHost) -> None:
    """Drop every ssh session of this host (its sshd's children), but not the listening sshd."""
    host.drop_sessions()


@pytest.mark.parametrize("how", ["whole sshd", "sessions only"])
def test_ssh_drop_mid_build(tmp_path, stacks, how):
    with LoopbackHost(base=tmp_path) as h:
        trust_host(h.target)
        t = h.target
        a = applied(t, stacks[0])
        tr = connect(t)
        drop = h.vanish if how == "whole sshd" else (lambda: kill_sessions(h))
        killer = threading.Thread(target=drop)

        def progress(step, state, detail):      # the build agent has said something: it runs on the host now
            if (step, state) == ("build", "info") and detail.startswith(("fetch", "install")) and killer.ident is None:
                killer.start()
                killer.join()

        with pytest.raises(ProvisionError) as e:
            applymod.apply(tr, stacks[1], progress=progress)
        killer.join()
        tr.close()
        rep = e.value.report
        assert rep.status in ("failed", "unknown") and "\n" not in str(e.value)
        wait_quiet(h.root)
        if how == "whole sshd":
            h.start()
        assert host_state(t)["current"] == a.generation
        converge(t, stacks[1])
        assert not ssh_masters(t)


# ---------------------------------------------------------------- a full disk, unwritable history

@pytest.fixture
def small_root(target, tmp_path, monkeypatch):
    """The host root on a 48 MiB tmpfs (real ENOSPC when full); the plan's reserve shrunk to match."""
    mnt = tmp_path / "root"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    monkeypatch.setattr(planmod, "MIN_FREE_BYTES", 1 << 20)
    yield target
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(root: str) -> Path:
    filler = Path(root) / "filler"
    with open(filler, "wb", buffering=0) as f:   # unbuffered: nothing left to flush when the disk is full
        try:
            while True:
                f.write(b"\0" * (1 << 16))
        except OSError:
            pass
    return filler


@pytest.mark.parametrize("moment", ["build", "probe", "switch"])
def test_disk_full(small_root, stacks, moment):
    t = small_root
    root = t.root
    a = applied(t, stacks[0])
    filler: list[Path] = []

    def progress(step, state, detail):
        if (step, state) == (moment, "start"):
            filler.append(fill(root))

    tr = connect(t)
    try:
        with pytest.raises(ProvisionError) as e:
            applymod.apply(tr, stacks[1], progress=progress)
    finally:
        tr.close()
    rep = e.value.report
    assert rep.status == "failed" and rep.failed_step == moment, (rep.failed_step, rep.error)
    assert "\n" not in rep.error and "Traceback" not in rep.error, rep.error   # the reason is one line
    st = host_state(t)
    gid = rep.generation
    if moment == "switch":   # the venv's space is freed first, so the failure can be recorded
        assert "No space left on device" in rep.error
        assert st["generations"][gid] == {"status": "failed", "venv": False}, st
    elif st["generations"][gid]["status"] != "failed":   # nothing to free: the report says so, truthfully
        assert any(f"could not mark {gid} failed" in w for w in rep.warnings), (rep.warnings, st)
    filler[0].unlink()
    if moment == "switch":
        assert_settled(t, a.generation, rep)
    converge(t, stacks[1])
    assert host_state(t)["generations"][gid]["status"] in ("failed", "abandoned")


def test_history_unwritable_after_the_commit(target, stacks):
    """The switch commits; writing history then fails: apply says it switched and names what failed;
    the next run (history writable again) records the missing event once."""
    a = applied(target, stacks[0])
    hist = Path(target.root) / "history.jsonl"
    tr = connect(target)
    try:

        def progress(step, state, detail):
            if (step, state) == ("switch", "start"):
                subprocess.run(["chattr", "+i", str(hist)], check=True)

        try:
            rep = applymod.apply(tr, stacks[1], progress=progress)
        finally:
            subprocess.run(["chattr", "-i", str(hist)], check=True)
        assert rep.status == "applied" and rep.current == rep.generation
        assert any("recording it failed (history:" in w and "Operation not permitted" in w for w in rep.warnings)
        assert host_state(target)["generations"][rep.generation]["status"] == "switching"
        applied_events = lambda: [e for e in generations.history(tr).events if e["event"] == "apply"]  # noqa: E731
        assert [e["to"] for e in applied_events()] == [a.generation]
        again = applymod.apply(tr, stacks[1])
        assert again.status == "noop" and again.recovered["repaired"] == [rep.generation]
        assert [e["to"] for e in applied_events()] == [a.generation, rep.generation]
        assert applied_events()[-1]["repaired"] is True
    finally:
        tr.close()
    assert_settled(target, rep.generation)


# ---------------------------------------------------------------- concurrency

def test_two_concurrent_applies_and_rollback_during_apply(target, stacks):
    a = applied(target, stacks[0])
    results: dict = {}
    gate = threading.Barrier(2)

    def run(lk):
        tr = connect(target)
        try:
            gate.wait()
            results[lk.name] = applymod.apply(tr, lk)
        except ProvisionError as e:
            results[lk.name] = e
        finally:
            tr.close()

    threads = [threading.Thread(target=run, args=(lk,)) for lk in stacks[1:3]]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    won = [r for r in results.values() if isinstance(r, applymod.ApplyReport)]
    lost = [r for r in results.values() if isinstance(r, ProvisionError)]
    assert len(won) == 1 and len(lost) == 1, results
    assert isinstance(lost[0], HostLockedError) and lost[0].report.generation is None
    st = assert_settled(target, won[0].generation, won[0])
    assert len(st["generations"]) == 2                       # the loser created nothing

    # a rollback while an apply builds is refused; the apply completes
    tr = connect(target)
    refusals = []

    def progress(step, state, detail):
        if (step, state) == ("build", "start"):
            side = connect(target)
            try:
                generations.rollback(side)
            except ProvisionError as e:
                refusals.append(str(e))
            finally:
                side.close()

    try:
        rep = applymod.apply(tr, stacks[3], progress=progress)
    finally:
        tr.close()
    assert refusals and "another run holds the host lock" in refusals[0]
    assert_settled(target, rep.generation, rep)
    rb = generations.rollback(connect(target))
    assert rb.to == won[0].generation
    assert_settled(target, won[0].generation)


# ---------------------------------------------------------------- probes that fail

def test_spoofed_engine_port_and_failing_probe(target, stacks, tmp_path):
    """A server already answering on the engine's port fails the probe (it is never trusted), as does a
    required probe failing; both leave `current` where it was, the venv gone, the reasons in the report."""
    import http.server

    from test_truth import StandIn, broken_toolkit

    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat {ROOT / 'tests' / 'data' / 'h200' / 'nvidia-smi-query.csv'}\n")
    smi.chmod(0o755)
    target.nvidia_smi = str(smi)
    a = applied(target, stacks[0])
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    data = yaml.safe_load(Path(stacks[1].path).read_text())
    data["engine"] = {"kind": "sglang", "port": port, "launch": ["python", "-c", "import time; time.sleep(60)"]}
    data["probes"] = {"engine_timeout": 20, "max_tokens": 4, "prompts": ["a"]}
    spoof = Path(stacks[1].path).with_name("spoof.yaml")
    spoof.write_text(yaml.safe_dump(data))
    nocuda = dict(yaml.safe_load(Path(stacks[2].path).read_text()))
    nocuda["platform"]["cuda"] = {"version": "13.0", "source": "host", "home": str(broken_toolkit(tmp_path))}
    broken = Path(stacks[2].path).with_name("nocuda.yaml")
    broken.write_text(yaml.safe_dump(nocuda))
    gpu_only = ["driver", "arch", "matmul", "flashinfer", "sgl-kernel", "torch-cuda"]
    host = [f"{target.user}@{target.host}:{target.port}", "--key", target.key_file, "--known-hosts",
            target.known_hosts, "--root", target.root]
    def check(rep: dict, probe: str, why: str) -> None:
        assert rep["status"] == "failed" and rep["failed_step"] == "probe" and rep["plan"]["action"] == "build"
        failed = {r["name"]: r["reason"] for r in rep["probes"]["results"] if r["status"] == "fail"}
        assert why in failed[probe], failed
        assert f"{probe} (" in rep["error"] and why in rep["error"]
        assert host_state(target)["generations"][rep["generation"]] == {"status": "failed", "venv": False}
        assert_settled(target, a.generation)
        logs = generations.logs(connect(target), rep["generation"])
        assert logs.status == "failed" and any(r.name == probe for r in logs.probes)

    tr = connect(target)   # the recorded nvidia-smi is a host variable: through the library
    try:
        with pytest.raises(applymod.ProbesFailed) as e:
            applymod.apply(tr, lockmod.load(spoof), skip_probes=gpu_only)
        check(e.value.report.to_json(), "engine", f"port {port} is already in use by pid {os.getpid()}")
        assert "engine.log" in generations.logs(tr, e.value.report.generation).logs
    finally:
        tr.close()
        srv.shutdown()
        srv.server_close()
    target.nvidia_smi = None
    p = subprocess.run([sys.executable, "-m", "provision.cli", "apply", *map(str, host), "--lock", str(broken),
                        "--json"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    check(json.loads(p.stdout), "nvcc", "--version failed")   # `apply --json` prints the report of a failure
    converge(target, stacks[1])


# ---------------------------------------------------------------- host work dies with its controller

class StalledWheel:
    """A loopback HTTP server for one wheel: until `release` is set it sends half of the file and then
    stalls, so a host fetching it waits mid-download; after, it sends the whole file."""

    def __init__(self, wheel: Path):
        import http.server

        data, self.requested, self.release = wheel.read_bytes(), threading.Event(), threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    if not outer.release.is_set():
                        self.wfile.write(data[:len(data) // 2])
                        self.wfile.flush()
                        outer.requested.set()
                        outer.release.wait(300)
                        self.wfile.write(data[len(data) // 2:])
                    else:
                        self.wfile.write(data)
                except OSError:
                    pass   # the fetching agent is gone

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}/{wheel.name}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def root_processes(root: str) -> list[str]:
    """Processes (other than this one) with `root` in their command line or a file under it open."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if root in cmd or any(link.startswith(root + "/") for link in links):
            out.append(f"{pid}: {cmd[:120]}")
    return out


def gone(root: str, said, seconds: float = 60) -> None:
    """Wait until no process works under `root` (each one exits on its own once its controller is gone; on a loaded
    machine a process can still be exiting when the lock it held is free); `seconds` guards against a process that
    stays, it is not a figure under test."""
    deadline = time.monotonic() + seconds
    while (left := root_processes(root)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, (said, left)


def lock_free(root: str, seconds: float = 120) -> None:
    """Wait until the host lock can be taken (the killed run's holder let it go), then let it go; `seconds`: how
    long it may take (by default a guard against a hang, not a figure under test)."""
    import fcntl

    deadline = time.monotonic() + seconds
    with open(Path(root) / ".lock", "a+") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(f, fcntl.LOCK_UN)
                return
            except OSError:
                assert time.monotonic() < deadline, \
                    f"the host lock is still held after {seconds} s: {root_processes(root)}"
                time.sleep(0.05)


def test_controller_killed_mid_fetch_ends_the_host_work(target, wheels, tmp_path):
    """SIGKILL of `provision apply` while the host's build agent is stalled in a download: by the time the
    host lock is free again, nothing the run started is left on the host; the next apply recovers."""
    wheel = make_wheel(tmp_path / "slow", "slowpkg", "1.0", body="x = %r\n" % ("y" * 50000))
    slow = StalledWheel(wheel)
    try:
        lk = write_lock(tmp_path / "slow.yaml", "stack-slow", [wheels["alpha-1.0"], wheel])
        lk.write_text(lk.read_text().replace(wheel.resolve().as_uri(), slow.url))
        root = target.root
        host = [f"{target.user}@{target.host}:{target.port}", "--key", target.key_file, "--known-hosts",
                str(target.known_hosts), "--root", root]
        env = {**os.environ, "PYTHONPATH": "", "COLUMNS": "200"}
        p = subprocess.Popen([sys.executable, "-m", "provision.cli", "apply", *host, "--lock", str(lk)], cwd=ROOT,
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        assert slow.requested.wait(120), "the host never asked for the slow wheel"
        assert root_processes(root), "the host shows no work of the run to end"
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        lock_free(root)
        gone(root, "mid-fetch")
        slow.release.set()
        r = subprocess.run([sys.executable, "-m", "provision.cli", "apply", *host, "--lock", str(lk), "--json"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (r.stdout[-800:], r.stderr[-800:])
        rep = json.loads(r.stdout)
        assert rep["status"] == "applied", rep
        assert_settled(target, rep["generation"])
    finally:
        slow.close()


def test_session_dropped_mid_fetch_is_said_so(tmp_path, wheels):
    """The ssh session drops while the host's build agent waits on a download: the error says the session to
    the host dropped and in which step, in one line (never a raw progress event); the host settles."""
    wheel = make_wheel(tmp_path / "slow", "slowpkg", "1.0", body="x = %r\n" % ("y" * 50000))
    slow = StalledWheel(wheel)
    try:
        with LoopbackHost(base=tmp_path) as h:
            trust_host(h.target)
            lk = write_lock(tmp_path / "slow.yaml", "stack-slow", [wheels["alpha-1.0"], wheel])
            lk.write_text(lk.read_text().replace(wheel.resolve().as_uri(), slow.url))
            dropper = threading.Thread(target=lambda: slow.requested.wait(120) and h.drop_sessions(), daemon=True)
            dropper.start()
            tr = connect(h.target)
            try:
                with pytest.raises(ProvisionError) as e:
                    applymod.apply(tr, lockmod.load(lk))
            finally:
                tr.close()
            msg = str(e.value)
            assert slow.requested.is_set()
            assert msg.startswith(f"{h.target.name}: the session to the host dropped during "), msg
            assert "_event" not in msg and "\n" not in msg, msg
            assert e.value.report.failed_step == "build", e.value.report
            slow.release.set()
            wait_quiet(h.root)     # the drop SIGKILLs the host's session processes too: nothing to assert here
            converge(h.target, lockmod.load(lk))
    finally:
        slow.close()
