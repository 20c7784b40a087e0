"""A host cut off from its controller mid-run lets its lock go: its agents hear the controller's heartbeat and end
their work when it stops; the controller says it waits before it gives up; a stopped agent is ended at the step
deadline; `provision unlock` breaks the lock of an orphaned run and refuses while the holder hears its controller."""
from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from provision import agent
from provision import apply as applymod
from provision import lock as lockmod
from provision.agent.host import open_by
from provision.errors import HostError, HostLockedError, StepStalled
from provision.loopback import LoopbackHost
from provision.transport import connect, trust_host
from test_core import cli, host_args
from test_faults import StalledWheel, applied, assert_settled, gone, lock_free, root_processes
from wheelhouse import make_wheel, write_lock


# One wheel served on 127.0.0.1 (argv[1] the file): until a line comes on stdin, half of it and then nothing (a
# download that hangs); after, the whole file. Prints its port, then "requested" when a download hangs.
STALLING = r"""
import http.server, sys, threading
data, release = open(sys.argv[1], "rb").read(), threading.Event()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            if release.is_set():
                self.wfile.write(data)
                return
            self.wfile.write(data[:len(data) // 2])
            self.wfile.flush()
            print("requested", flush=True)
            release.wait()
            self.wfile.write(data[len(data) // 2:])
        except OSError:
            pass
    def log_message(self, *a):
        pass
srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
srv.daemon_threads = True
print(srv.server_port, flush=True)
threading.Thread(target=lambda: (sys.stdin.readline(), release.set()), daemon=True).start()
srv.serve_forever()
"""


class Stalling:
    """A wheel served from inside the host's network namespace, on its loopback (see STALLING)."""

    def __init__(self, wheel: Path, netns: str):
        self.proc = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-c", STALLING, str(wheel)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{int(self.proc.stdout.readline())}/{wheel.name}"

    def requested(self, timeout: float) -> bool:
        import select

        ready = select.select([self.proc.stdout], [], [], timeout)[0]
        return bool(ready) and "requested" in self.proc.stdout.readline()

    def release(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def working_agents(root: str) -> list[int]:
    """Pids of the agents working under `root` (each holds <root>/.work open)."""
    return open_by(os.path.realpath(Path(root) / ".work"))


def resume(pids) -> None:
    """SIGCONT to each process a test stopped (those still there)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def record(root: str) -> dict:
    """The holder record in the host lock file (read again when caught mid-write)."""
    for _ in range(50):
        try:
            return json.loads((Path(root) / ".lock").read_text())
        except ValueError:
            time.sleep(0.02)
    raise AssertionError((Path(root) / ".lock").read_text())


@pytest.fixture
def cut_host(tmp_path, wheels):
    """A host in its own network namespace on generation A, and lock B whose second wheel hangs mid-download
    from a server on the host's side of the link: (host, target, report A, lock B, server)."""
    h = LoopbackHost(netns=True).start()
    try:
        t = copy.deepcopy(h.target)
        t.known_hosts = tmp_path / "known_hosts"
        trust_host(t)
        t.heartbeat, t.timeout = 1.0, 2.0        # the host gives up after 3 s of silence; the controller after 6 s
        a = applied(t, lockmod.load(write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]])))
        wheel = make_wheel(tmp_path / "slow", "slowpkg", "1.0", body="x = %r\n" % ("y" * 50000))
        slow = Stalling(wheel, h.netns)
        lk = write_lock(tmp_path / "b.yaml", "stack-b", [wheels["alpha-1.0"], wheel])
        lk.write_text(lk.read_text().replace(wheel.resolve().as_uri(), slow.url))
        yield h, t, a, lockmod.load(lk), slow
        slow.close()
    finally:
        h.cleanup()


def link(h: LoopbackHost, state: str) -> None:
    subprocess.run(["ip", "link", "set", f"pvh{h._index}", state], check=True)


def test_a_partition_mid_build_says_it_waits_and_frees_the_host_lock(cut_host):
    h, t, a, lk, slow = cut_host
    said, out = [], {}
    t.notice = 300.0          # no step's own silence is said: what is said comes from the unanswered keepalives
    tr = connect(t)

    def run():
        try:
            out["report"] = applymod.apply(tr, lk, progress=lambda s, st, d: said.append((s, st, d)))
        except HostError as e:
            out["error"] = e
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    assert slow.requested(60)
    assert working_agents(h.root)
    deadline = time.monotonic() + 10
    while record(h.root)["step"] != "build":      # the holder's heartbeat names the step the run is in
        assert time.monotonic() < deadline, record(h.root)
        time.sleep(0.1)
    link(h, "down")
    try:
        lock_free(h.root, 15)      # its agents heard no heartbeat for 3 s: they ended and the lock went
        assert not working_agents(h.root) and not root_processes(h.root)
        worker.join(60)                   # a hang guard: the keepalives give up after 6 s
        assert not worker.is_alive()
        assert isinstance(out.get("error"), HostError) and "connection lost" in str(out["error"]), out
        waits = [d for s, st, d in said if st == "wait"]
        assert waits and waits[0] == f"waiting for {t.name}: fetch (no progress for 2 s)", said
    finally:
        link(h, "up")
        tr.close()
    slow.release()
    report = applied(t, lk)               # the next apply takes the lock and finishes the build
    assert report.status == "applied" and report.generation.endswith("stack-b"), report
    assert_settled(t, report.generation)


def test_a_stopped_agent_is_ended_at_the_step_deadline(target, wheels, tmp_path):
    a = applied(target, lockmod.load(write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]])))
    wheel = make_wheel(tmp_path / "slow", "slowpkg", "1.0", body="x = %r\n" % ("y" * 50000))
    slow = StalledWheel(wheel)
    lk = write_lock(tmp_path / "b.yaml", "stack-b", [wheels["alpha-1.0"], wheel])
    lk.write_text(lk.read_text().replace(wheel.resolve().as_uri(), slow.url))
    root = target.root
    t = copy.deepcopy(target)
    t.deadline, t.notice = 4.0, 1.0
    tr = connect(t)
    stopped: list[int] = []

    def stop_when_fetching():
        assert slow.requested.wait(60)
        for pid in working_agents(root):
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
    threading.Thread(target=stop_when_fetching, daemon=True).start()
    try:
        with pytest.raises(StepStalled) as e:
            applymod.apply(tr, lockmod.load(lk))
        assert stopped
        assert (f"fetch made no progress for 4 s (the step deadline): stopped; its host agent (pid {stopped[0]}, "
                f"stopped) did not end with its session: ended it; current left at {a.generation}") in str(e.value)
        lock_free(root, 10)      # without SIGCONT
        gone(root, "stalled")
    finally:
        resume(stopped)
        tr.close()
        slow.release.set()
    try:
        report = applied(target, lockmod.load(lk))
    finally:
        slow.close()
    assert report.status == "applied", report
    assert_settled(target, report.generation)


def test_unlock_refuses_a_live_holder_and_breaks_an_orphaned_one(target, tmp_path, wheels):
    root = target.root
    t = copy.deepcopy(target)
    t.heartbeat = 0.5                     # the holder's bound: 1.5 s
    p = cli("unlock", *host_args(t), check=0)
    assert p.stdout.strip() == f"{t.name}: {root}/.lock is not held", p.stdout
    inv = tmp_path / "inv.yml"
    inv.write_text(f"all:\n  hosts:\n    gpu0: {{ansible_host: {t.host}, ansible_port: {t.port}, "
                   f"ansible_user: {t.user}, ansible_ssh_private_key_file: {t.key_file}, provision_root: {root}}}\n"
                   f"    gpu1: {{ansible_host: {t.host}, ansible_port: {t.port}, provision_root: {tmp_path / 'r1'}}}\n")
    p = cli("unlock", "-i", inv, "--limit", "gpu0", "--known-hosts", t.known_hosts, "--json", check=0)
    assert json.loads(p.stdout) == {"state": "free", "lock": f"{root}/.lock", "ended": []}, p.stdout

    tr = connect(t)
    held = tr.hold()
    held.__enter__()
    holder = record(root)
    assert holder["controller"] == agent.controller() and holder["heartbeat"] == 1.5 and holder["step"] == "hold"
    with pytest.raises(HostLockedError, match=rf"host lock {root}/.lock: pid {holder['pid']} \({holder['controller']}, "
                                              rf"since {holder['since']}, step hold\); `provision unlock`"):
        applied(target, lockmod.load(write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]])))
    time.sleep(2)                         # longer than the bound: the holder still hears its controller
    p = cli("unlock", *host_args(t), check=1)
    assert p.stdout.startswith(f"{t.name}: {root}/.lock is held by pid {holder['pid']} ({holder['controller']}, "), p
    assert "it hears its controller; not unlocked" in p.stdout, p.stdout
    p = cli("unlock", *host_args(t), "--json", check=1)
    assert json.loads(p.stdout)["state"] == "held"

    os.kill(holder["pid"], signal.SIGSTOP)   # the holder stops; its controller goes: nothing can release the lock
    tr.close()
    time.sleep(2)
    try:
        p = cli("unlock", *host_args(t), check=0)
        assert p.stdout.startswith(f"{t.name}: broke {root}/.lock: its holder pid {holder['pid']} "), p.stdout
        assert f"ended pids {holder['pid']}" in p.stdout, p.stdout
        lock_free(root, 1)
    finally:
        try:
            os.kill(holder["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
    report = applied(target, lockmod.load(write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]])))
    assert report.status == "applied", report


def test_unlock_ends_the_stopped_work_of_a_gone_controller(target, wheels, tmp_path):
    """The controller goes while its fetch agent is stopped: the holder lets its stdin go and waits for that agent
    for ever; unlock ends both."""
    root = target.root
    applied(target, lockmod.load(write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]])))
    wheel = make_wheel(tmp_path / "slow", "slowpkg", "1.0", body="x = %r\n" % ("y" * 50000))
    slow = StalledWheel(wheel)
    lk = write_lock(tmp_path / "b.yaml", "stack-b", [wheels["alpha-1.0"], wheel])
    lk.write_text(lk.read_text().replace(wheel.resolve().as_uri(), slow.url))
    t = copy.deepcopy(target)
    t.heartbeat = 0.5
    tr = connect(t)
    threading.Thread(target=lambda: pytest.raises(HostError, applymod.apply, tr, lockmod.load(lk)),
                     daemon=True).start()
    assert slow.requested.wait(60)
    stopped = working_agents(root)
    holder = record(root)
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    tr.close()                             # the controller is gone
    time.sleep(2)
    try:
        assert record(root)["pid"] == holder["pid"]
        with pytest.raises(AssertionError):
            lock_free(root, 2)      # the holder waits for the stopped agent
        p = cli("unlock", *host_args(t), check=0)
        assert p.stdout.startswith(f"{t.name}: broke {root}/.lock"), p.stdout
        for pid in [holder["pid"], *stopped]:
            assert str(pid) in p.stdout.rsplit("ended pids", 1)[1], p.stdout
        lock_free(root, 1)
        assert not working_agents(root)
    finally:
        resume(stopped)
        slow.close()



def test_a_partition_under_the_cli_is_said_at_every_notice_then_names_its_step_and_current(cut_host):
    """`apply --wait-notice 1 --timeout 2` (its play, as the operator runs it) while the link to the host goes down
    mid-fetch: a line every second, each saying one second more, until the keepalives give the host up (3 x 2 s
    unanswered); then one error line that names the step and where `current` is."""
    h, t, a, lk, slow = cut_host
    from test_deadlines import host_args as deadline_host_args

    p = subprocess.Popen([sys.executable, "-m", "provision.cli", "apply", *deadline_host_args(t), "--lock",
                          str(lk.path), "--wait-notice", "1", "--timeout", "2"], cwd=Path(__file__).parent.parent,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert slow.requested(120), "the host never asked for the slow wheel"
        link(h, "down")
        try:
            out, err = p.communicate(timeout=120)
        finally:
            link(h, "up")
    finally:
        p.kill()
    lines = err.strip().splitlines()
    assert p.returncode == 1 and "Traceback" not in err, err
    prefix = f"waiting for {t.name}: fetch (no progress for "
    said = [float(line[len(prefix):].split()[0]) for line in lines if line.startswith(prefix)]
    assert len(said) >= 3 and said == [float(n) for n in range(1, len(said) + 1)], err
    assert lines[-1] == (f"error: {t.name}: connection lost during fetch: the host answered no keepalive for 6s; "
                         f"current left at {a.generation}"), err
    slow.release()
    report = applied(t, lk)               # the next apply settles the build that was cut off
    assert report.status == "applied", report
    assert_settled(t, report.generation)


def test_ending_a_tree_survives_a_process_reaped_while_it_is_read(monkeypatch):
    """kill_tree waits for the processes it killed; one reaped between two reads of /proc is ended, not an error."""
    from provision.agent import host
    child = subprocess.Popen(["sleep", "60"])
    reads = iter([("S", 1), None])
    real = host.proc_stat
    monkeypatch.setattr(host, "proc_stat", lambda pid: next(reads, None) if pid == child.pid else real(pid))
    monkeypatch.setattr(host, "descendants", lambda pid: [])
    try:
        assert host.kill_tree(child.pid) == [child.pid]
    finally:
        child.kill()
        child.wait()
