"""Transports to a host: Local (subprocess) and SSH (the ssh client, as Ansible's ssh connection plugin runs it).

Both offer run / run_agent / put / hold / spawn; remote command lines are quoted here and nowhere else
(`shlex.join`). Hosts are named `[user@]host[:port]` (an address, or a name the operator's ssh config knows) or
`local`; an inventory adds its ssh options (ansible_ssh_common_args, ...: a bastion, an ssh config) and become
(sudo). SSH takes its command line from Ansible's ssh connection plugin (`ssh_command`): ~/.ssh/config, ProxyJump,
the agent and certificates apply, host keys are checked strictly against the managed known_hosts, and one master
connection per SSH carries every host command; paramiko only reads and writes known_hosts keys (`hosts trust`). A host
command that shows no progress is said so after `notice` seconds and stopped after `deadline` (its host work ends
with it); agents hear a heartbeat and end their work when it stops (a cut-off controller), and `unlock` frees an
orphaned run's lock.
"""
from __future__ import annotations

import base64
import hashlib
import itertools
import json
import math
import os
import re
import shlex
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from . import layout
from .errors import Cancelled, ConnectionLost, HostError, HostKeyError, HostLockedError, InputError, StepStalled

CONTROLLER_HOME = Path(os.environ.get("PROVISION_HOME", Path.home() / ".provision"))   # the controller's own state
DEFAULT_KNOWN_HOSTS = CONTROLLER_HOME / "known_hosts"
HOST_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9._-]{0,252})\Z")
IPV6_RE = re.compile(r"^[0-9A-Fa-f:.]{2,45}\Z")
USER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}\Z")
TIMEOUT = 10.0      # seconds for the TCP connection, the SSH banner, the handshake and authentication; keepalive period
KEEPALIVE_COUNT = 3  # keepalives a host may leave unanswered in a row before it is disconnected (ServerAliveCountMax)
# Progress is a line from the host command (an agent's events: fetch bytes, installer lines, the install's disk
# activity). Silence this long is said, and again each time as long again; a step silent for DEADLINE is stopped.
# A stalled download or a host that stopped working is found within DEADLINE whatever its size; a 5 GB install
# shows progress every few seconds, so only a step that does nothing meets it.
NOTICE = 30.0
DEADLINE = 600.0
# An agent hears its controller: a byte on its stdin every HEARTBEAT seconds. One that hears none for HEARTBEAT_MISSES
# periods ends its work (and lets the host lock go): a network partition closes no channel, and sshd's own TCP
# keepalive takes hours to notice one.
HEARTBEAT = 10.0
HEARTBEAT_MISSES = 3


def parse_port(text, where: str) -> int:
    """A TCP port from text (a host spec, an inventory): digits only, 1–65535; InputError otherwise."""
    value = str(text).strip()
    if not value.isdigit() or not value.isascii():
        raise InputError(f"bad port {value!r} (a number 1–65535)", where=where)
    port = int(value)
    check_port(port, where)
    return port


def check_address(host, user, where: str) -> None:
    """A host name or IP address and an optional user name that no program can read as an option."""
    if user is not None and not (isinstance(user, str) and USER_RE.match(user)):
        raise InputError(f"bad user name {user!r}", where=where)
    if not isinstance(host, str) or not host:
        raise InputError("no host name", where=where)
    if not (HOST_RE.match(host) or (":" in host and IPV6_RE.match(host))):
        raise InputError(f"bad host name {host!r} (letters, digits, '.', '-', or an IP address)", where=where)


def check_root(root, where: str) -> None:
    """A host root: an absolute path, not `/`, without `..` or control characters."""
    if (not isinstance(root, str) or not root.startswith("/") or not root.strip("/") or ".." in root.split("/")
            or any(ord(c) < 32 or ord(c) == 127 for c in root)):
        raise InputError(f"host root {root!r} must be an absolute path other than / without '..'", where=where)


def check_port(port, where: str) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InputError(f"port {port!r} is out of range (1–65535)", where=where)


def quote(argv: list[str]) -> str:
    """The one place a command line for a remote shell is built."""
    return shlex.join([str(a) for a in argv])


@dataclass
class Target:
    """Where to run: `local`, or an SSH `[user@]host[:port]` (an address or a name the ssh config knows) with its
    key, known_hosts and the inventory's ssh options."""

    host: str
    user: str | None = None
    port: int = 22
    key_file: str | None = None
    known_hosts: Path = DEFAULT_KNOWN_HOSTS
    root: str = layout.DEFAULT_ROOT            # the host root (provision_root; checked where it is given)
    python: str = "python3"                    # the host's interpreter for provision's agents (ansible_python_interpreter)
    nvidia_smi: str | None = None              # the nvidia-smi the probes and facts run (provision_nvidia_smi)
    probe_env: dict = field(default_factory=dict)   # more environment for the probes' processes
    alias: str | None = None                   # the host's inventory name, when it comes from one
    inventory: str | None = None               # the inventory it comes from
    timeout: float = TIMEOUT                   # connect, banner, handshake and authentication; keepalive period
    notice: float = NOTICE                     # seconds without progress before a step says what it waits for
    deadline: float = DEADLINE                 # seconds without progress before a step is stopped
    heartbeat: float = HEARTBEAT               # seconds between heartbeats to an agent (HEARTBEAT_MISSES ends it)
    ssh_args: dict = field(default_factory=dict)   # the inventory's ansible_ssh_common_args, _extra_args, _args
    become: str | None = None                  # the user host commands run as (sudo -n), when not the login user

    @property
    def local(self) -> bool:
        return self.host == "local"

    @property
    def name(self) -> str:
        """How messages name the host: its inventory name, else its address."""
        return self.alias or self.address

    @property
    def address(self) -> str:
        if self.local:
            return "local"
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port != 22 else ""
        return f"{user}{self.host}{port}"

    def __post_init__(self):     # every Target, however built (spec, inventory), names a real address
        check_address(self.host, self.user, f"host {self.host!r}")
        check_port(self.port, f"host {self.host!r}")

    @classmethod
    def parse(cls, spec: str, **kw) -> "Target":
        """`[user@]host[:port]` (IPv6 as `[addr]:port`); `local` means this machine."""
        if spec == "local":
            return cls(host="local", **kw)
        user, _, hostport = spec.rpartition("@")
        host, port = hostport, "22"
        m = re.match(r"^\[([0-9A-Fa-f:.]+)\](?::(.*))?\Z", hostport)
        if m:
            host, port = m.group(1), m.group(2) if m.group(2) is not None else "22"
        elif hostport.count(":") == 1:
            host, port = hostport.split(":")
        check_address(host, user or None, f"host {spec!r}")
        return cls(host=host, user=user or None, port=parse_port(port, f"host {spec!r}"), **kw)


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str


@dataclass
class Watch:
    """What the host commands of one step run under: the step's name (`phase`: what the host last said it
    does, e.g. fetch or install), who hears that it waits, and the run's cancel flag."""

    step: str
    on_wait: Callable[[str, float], None] | None = None     # (what it waits for, seconds without progress)
    cancel: threading.Event | None = None
    phase: str | None = None
    doing: str | None = None        # what the host said it does within its phase (e.g. the probe that runs)

    @property
    def name(self) -> str:
        return (self.phase or self.step) + (f" {self.doing}" if self.doing else "")

    def heard(self, ev: dict) -> None:
        """A progress event from the host: its phase (`step`) and what it does there (`doing`), both checked."""
        step, doing = ev.get("step"), ev.get("doing")
        if isinstance(step, str) and STEP_RE.match(step):   # a host's word, checked
            self.phase = step
            self.doing = _printable(doing)[:160] if isinstance(doing, str) and doing.strip() else None


class _Watchdog:
    """Guards one host command: each line of output and each chunk of input sent is progress (`touch`). Silence
    tells `watch.on_wait` at `notice` and again every `notice` seconds; silence for the deadline (or for the command's own
    `timeout`, when its caller gave a longer one: the lock's probe timeout), or the watch's cancel flag, calls
    `stop` (the transport closes the command: the host agent's guard then ends everything it started) and
    `check` raises why."""

    def __init__(self, transport: "Transport", stop: Callable[[], None], timeout: float | None = None):
        self.target, self.watch, self.stop = transport.target, transport.watch, stop
        self.deadline = max(self.target.deadline, timeout or 0)
        self.last, self.why, self.done = time.monotonic(), None, threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"watchdog {self.target.name}", daemon=True)
        self.thread.start()

    def touch(self) -> None:
        self.last = time.monotonic()

    def _run(self) -> None:
        t, w = self.target, self.watch
        tell = t.notice
        while not self.done.wait(max(0.05, min(1.0, t.notice / 4, self.deadline / 4))):
            idle = time.monotonic() - self.last
            what = w.name if w else "the host command"
            if w and w.cancel is not None and w.cancel.is_set():
                self.why = Cancelled(f"{what} stopped: the run was cancelled", where=t.name)
            elif idle >= self.deadline:
                self.why = StepStalled(f"{what} made no progress for {self.deadline:g} s (the step deadline): "
                                       "stopped", where=t.name)
            elif idle >= tell:
                if w and w.on_wait:
                    w.on_wait(what, tell)
                tell += t.notice
                continue
            else:
                continue
            self.stop()
            return

    def check(self) -> None:
        self.done.set()
        if self.why is not None:
            raise self.why


def known_hosts_path(path) -> Path:
    """A known_hosts file as every consumer names it (`hosts trust`, paramiko, ssh run from Ansible's run directory
    or its workers): absolute, a relative path taken from this process's working directory, `~` expanded."""
    return Path(path).expanduser().absolute()


def host_key_options(known_hosts, checking: str = "yes") -> list[str]:
    """ssh options that check a host's key against the managed known_hosts alone (`checking`: StrictHostKeyChecking,
    `yes` but for a scan): put first, as ssh takes an option's first value."""
    return ["-o", f"StrictHostKeyChecking={checking}", "-o", f"UserKnownHostsFile={known_hosts_path(known_hosts)}",
            "-o", "GlobalKnownHostsFile=/dev/null"]


def trust_command(target: Target) -> str:
    """The command that shows and records `target`'s key, naming the host the way the operator did (shell-quoted)."""
    q = shlex.quote
    how = (f"-i {q(target.inventory)} --limit {q(target.alias)}" if target.inventory and target.alias
           else q(target.address))
    kh = "" if Path(target.known_hosts) == Path(DEFAULT_KNOWN_HOSTS) else f" --known-hosts {q(str(target.known_hosts))}"
    return f"provision hosts trust {how}{kh}"


class Transport:
    """What every transport offers; see Local and SSH. Nothing proportional to the data goes on a
    command line: agents get their payload on stdin (`run_agent`)."""

    target: Target
    watch: Watch | None = None      # the step the next host commands belong to (apply sets it per step)

    def run(self, argv: list[str], *, stdin: bytes | Iterable[bytes] | None = None, timeout: float | None = None,
            on_line: Callable[[str], None] | None = None, beat: float | None = None) -> Result:
        """Run argv (no shell on Local; quoted by `quote` on SSH) with stdin (bytes, or chunks streamed);
        `on_line` sees stdout lines as they come. `beat`: after stdin, a newline every `beat` seconds until the
        command ends (an agent's heartbeat; not progress)."""
        raise NotImplementedError

    def check(self, argv: list[str], **kw) -> str:
        r = self.run(argv, **kw)
        if r.rc != 0:
            last = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] or [f"exit {r.rc}"]
            raise HostError(f"{argv[0]} failed: {last[0]}", where=self.target.name)
        return r.stdout

    @property
    def python(self) -> str:
        """The host's interpreter for agents: the inventory's ansible_python_interpreter, else python3."""
        return self.target.python

    def run_agent(self, name: str, payload: dict, *, python: str | None = None, env: dict | None = None,
                  timeout: float | None = None, on_event: Callable[[dict], None] | None = None,
                  extra_stdin: Iterable[bytes] | None = None) -> dict:
        """Run host agent `name` on `payload` (one JSON line on stdin; `extra_stdin` streams after it) with
        interpreter `python`; returns the agent's result (its last stdout line). Earlier lines
        {"_event": {...}} go to `on_event` (progress); agent errors become HostError. `python` defaults to
        the host's (`self.python`), which runs stdlib agents only and so starts without site (`-S`).
        The agent hears a heartbeat (`target.heartbeat`); a step stopped at its deadline or cancelled also ends
        the agent's process tree over a fresh session, when closing its own did not (a stopped agent)."""
        from . import agent

        started: dict = {}

        def line(text: str) -> None:
            if text.startswith("{"):
                try:
                    ev = json.loads(text)
                except ValueError:
                    return
                if isinstance(ev, dict) and isinstance(ev.get("_agent"), dict) and not started:
                    started.update(ev["_agent"])
                elif isinstance(ev, dict) and isinstance(ev.get("_event"), dict):
                    if self.watch:
                        self.watch.heard(ev["_event"])
                    if on_event:
                        on_event(ev["_event"])

        beat = self.target.heartbeat
        msg = agent.message(name, payload, env, heartbeat=beat * HEARTBEAT_MISSES)
        try:
            r = self.run(agent.command(python or self.python, site=python is not None),
                         stdin=itertools.chain([msg], extra_stdin) if extra_stdin else msg,
                         timeout=timeout, on_line=line, beat=beat)
        except (StepStalled, Cancelled) as e:
            said = self._end_agent(started)
            if said:
                e.message += f"; {said}"
            raise
        try:
            data = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else None
        except (json.JSONDecodeError, IndexError):
            data = None
        if not isinstance(data, dict) or "_event" in data or "_agent" in data:     # cut off after a progress line
            raise HostError(_no_answer(name, payload, r, data), where=self.target.name)
        if data.get("error"):
            raise HostError(str(data["error"]), where=self.target.name)
        return data

    def put(self, data: bytes, path: str, mode: int = 0o640) -> None:
        """Write `data` to `path` on the host atomically (the path is the only argument)."""
        script = ("import os,sys\np=sys.argv[1]\nos.makedirs(os.path.dirname(p) or '.',mode=0o750,exist_ok=True)\n"
                  "t=p+'.tmp-%d'%os.getpid()\nf=os.open(t,os.O_WRONLY|os.O_CREAT|os.O_TRUNC,int(sys.argv[2],8))\n"
                  "os.write(f,sys.stdin.buffer.read())\nos.close(f)\nos.replace(t,p)\n")
        r = self.run([self.python, "-I", "-c", script, path, oct(mode)[2:]], stdin=data)
        if r.rc != 0:
            why = (r.stderr.strip().splitlines() or [f"exit {r.rc}"])[-1]    # a traceback's last line says it
            raise HostError(f"cannot write {path}: {why}", where=self.target.name)

    def read(self, path: str) -> Iterator[bytes]:
        """The bytes of one file on the host, in chunks as they arrive (the path is the only argument);
        HostError when it cannot be read."""
        raise NotImplementedError

    def hold(self) -> "HeldLock":
        """Take the host's flock for one mutating run; released when the run ends or dies."""
        return HeldLock(self, layout.of(self))

    def _end_agent(self, started: dict) -> str | None:
        """End a stopped step's agent (`started`: the pid and start time it said) and its tree over a fresh
        session, unless it ends by itself within a few seconds; what was done, in words, or None."""
        pid, start = started.get("pid"), started.get("start")
        if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(start, int):
            return None
        watch, self.watch = self.watch, None      # the step's cancel flag and deadline are not this command's
        from .replies import Ended

        try:
            out = Ended.of(self.run_agent("host", {"op": "end", "pid": pid, "start": start, "grace": END_GRACE}),
                           self.target.name)
        except HostError as e:
            return f"its host agent (pid {pid}) could not be ended: {e.message}"
        finally:
            self.watch = watch
        if not out.ended:
            return None
        how = ", stopped" if out.stopped else ""
        return f"its host agent (pid {pid}{how}) did not end with its session: ended it"

    def spawn(self, argv: list[str]):
        """Start a long-running process; returns an object with .send(), .readline(), .close()."""
        raise NotImplementedError

    def close(self) -> None:
        pass


STEP_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}\Z")
END_GRACE = 3.0     # seconds a step's agent has to end by itself once its session is closed, before it is ended


def _no_answer(name: str, payload: dict, r: Result, last) -> str:
    """Why agent `name` gave no result, in one line naming the step it was in (its last progress event's,
    else its op); never the raw event. rc -1: the ssh session closed without an exit status."""
    ev = last.get("_event") if isinstance(last, dict) else None
    step = ev.get("step") if isinstance(ev, dict) else None
    if not (isinstance(step, str) and STEP_RE.match(step)):   # a host's word, checked
        step = payload.get("op") or name
    if r.rc == -1:
        return f"the session to the host dropped during {step} (agent {name}), before it answered"
    err = r.stderr.strip().splitlines()
    return f"agent {name} ended during {step} without answering: {err[-1][:300] if err else f'exit {r.rc}'}"


# Copies one file (argv[1]) to stdout: what `SSH.read` runs on the host.
CAT = "import shutil,sys\nwith open(sys.argv[1],'rb') as f: shutil.copyfileobj(f,sys.stdout.buffer,1<<20)"


class HeldLock:
    """A host flock (the layout's lock file) held by the `host` agent (op hold) whose stdin we keep open, with a
    heartbeat on it that names the step the run is in (the lock file records it)."""

    def __init__(self, transport: Transport, lay: layout.Layout):
        self.transport, self.root, self.path, self.proc = transport, lay.root, lay.lock_file, None
        self.done = threading.Event()

    def __enter__(self):
        from . import agent

        beat = self.transport.target.heartbeat
        self.proc = self.transport.spawn(agent.command(self.transport.python, site=False))
        self.proc.send(agent.message("host", {"op": "hold", "root": self.root}, heartbeat=beat * HEARTBEAT_MISSES))
        line = self.proc.readline()
        if line.startswith('{"_agent"'):     # its pid; the lock file records it
            line = self.proc.readline()
        try:
            state = json.loads(line)
        except json.JSONDecodeError:
            self.proc.close()
            raise HostError(f"cannot take host lock {self.path}", where=self.transport.target.name)
        if state.get("error") or "held" not in state:
            self.proc.close()
            raise HostError(f"cannot take host lock {self.path}: {state.get('error')}",
                            where=self.transport.target.name)
        if not state["held"]:
            self.proc.close()
            by = _printable(state["by"]) if isinstance(state.get("by"), str) else "unknown"
            raise HostLockedError(f"another run holds the host lock {self.path}: {by}; "
                                  "`provision unlock` ends it if its controller is gone",
                                  where=self.transport.target.name)
        threading.Thread(target=self._beat, args=(beat,), name=f"heartbeat {self.transport.target.name}",
                         daemon=True).start()
        return self

    def _beat(self, beat: float) -> None:
        said = None
        while not self.done.wait(beat):
            watch = self.transport.watch
            step = watch.step if watch else None
            try:
                self.proc.send(b"\n" if step == said else json.dumps({"step": step}).encode() + b"\n")
            except Exception:  # noqa: BLE001 - the session is gone: the run's own commands say so
                return
            said = step

    def __exit__(self, *exc):
        self.done.set()
        self.proc.close()


def unlock(transport: Transport) -> dict:
    """Break the host lock when its run is orphaned: its holder has heard no heartbeat from its controller for
    longer than its own bound (the controller is gone or cut off, or the holder is stopped). Then the holder and
    the agents of its run are ended. Returns {state: free | held | broken, holder, heard (seconds since the
    holder last heard its controller), bound, ended (pids), why}; `held`: the lock was left alone."""
    return unlocked(transport.run_agent("host", {"op": "unlock", "root": layout.of(transport).root}),
                    layout.of(transport).lock_file, transport.target.name)


def unlocked(out: dict, lock_file: str, host: str) -> dict:
    """The host agent's unlock reply as `unlock` returns it, read as replies.Unlocked (ReplyError naming `host` for
    one of the wrong shape): the fields it left out left out, its words made printable."""
    from .replies import Unlocked

    r = Unlocked.of(out, host)
    said = {k: getattr(r, k) for k in ("heard", "bound") if getattr(r, k) is not None}
    return {"state": r.state, "lock": lock_file, **said,
            **{k: _printable(getattr(r, k)) for k in ("holder", "why") if getattr(r, k) is not None},
            "ended": r.ended}


def _printable(text: str) -> str:
    """A host's words made safe to print on one line."""
    return "".join(c if c.isprintable() else "?" for c in text)[:300]


class _LocalProc:
    def __init__(self, argv, session: bool = False):
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  start_new_session=session)

    def send(self, data: bytes) -> None:
        self.p.stdin.write(data)
        self.p.stdin.flush()

    def readline(self) -> str:
        return self.p.stdout.readline().decode(errors="replace")

    def close(self):
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.p.kill()


def _drain(stream, on_line, touch=None) -> bytes:
    """Read a binary stream to its end, handing each complete line to `on_line` as it arrives (and telling
    `touch` that the command made progress)."""
    chunks = []
    for raw in iter(stream.readline, b""):
        chunks.append(raw)
        if touch:
            touch()
        if on_line:
            on_line(raw.decode(errors="replace").rstrip("\n"))
    return b"".join(chunks)


def become_argv(target: Target, argv: list[str]) -> list[str]:
    """argv as the host runs it: under `sudo -n -u USER --` when the target becomes another user (never asks)."""
    return ["sudo", "-n", "-u", target.become, "--", *argv] if target.become else list(argv)


SUDO_REFUSED = re.compile(r"^sudo: (a password is required|.*(not in the sudoers|not allowed to))", re.M)


def _sudo_refused(target: Target, r: Result) -> None:
    """HostError when the host's sudo refused to run the command as the become user (it wants a password, or the
    user may not use sudo): one line, naming the host."""
    if target.become and r.rc == 1 and not r.stdout and SUDO_REFUSED.search(r.stderr):
        said = SUDO_REFUSED.search(r.stderr).group(0).removeprefix("sudo: ")
        raise HostError(f"sudo refused to run as {target.become} ({said}): become needs passwordless sudo "
                        "(NOPASSWD) for the login user", where=target.name)


class Local(Transport):
    """This machine, through subprocess (no shell); also the way SSH runs its ssh client."""

    session = False     # whether host commands run in a session of their own (out of reach of the terminal's Ctrl-C)

    def __init__(self, target: Target | None = None):
        self.target = target or Target(host="local")

    def command(self, argv: list[str]) -> list[str]:
        """The local command line that runs argv on the host."""
        return [str(a) for a in become_argv(self.target, argv)]

    def run(self, argv, *, stdin=None, timeout=None, on_line=None, beat=None) -> Result:
        r = self._stream(self.command(argv), stdin=stdin, timeout=timeout, on_line=on_line, beat=beat)
        _sudo_refused(self.target, r)
        return r

    def _stream(self, argv, *, stdin=None, timeout=None, on_line=None, beat=None) -> Result:
        try:
            p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=self.session)
        except FileNotFoundError as e:
            return Result(127, "", str(e))
        ended: list[bool] = []      # we ended it: an ssh master may hold its stderr until the host's side closes
        dog = _Watchdog(self, lambda: (ended.append(True), _end(p)), timeout)
        err_box: list[bytes] = []
        t = threading.Thread(target=lambda: err_box.append(_drain(p.stderr, None, dog.touch)), daemon=True)
        t.start()
        feeder = threading.Thread(target=_feed, args=(p.stdin, stdin, dog.touch, beat, dog.done), daemon=True)
        feeder.start()
        expired: list[bool] = []
        timer = threading.Timer(timeout, lambda: (expired.append(True), ended.append(True), p.kill())) \
            if timeout else None
        if timer:
            timer.start()
        try:
            out = _drain(p.stdout, on_line, dog.touch)
            rc = p.wait()
        except BaseException:      # Ctrl-C: the command's work ends with it, as with a closed ssh channel
            _end(p)
            raise
        finally:
            if timer:
                timer.cancel()
            dog.done.set()
        t.join(5 if ended else None)
        dog.check()
        if expired:
            return Result(124, out.decode(errors="replace"), f"timed out after {timeout}s")
        return Result(rc, out.decode(errors="replace"), (err_box[0] if err_box else b"").decode(errors="replace"))

    def spawn(self, argv):
        return _LocalProc(self.command(argv), self.session)

    def read(self, path):
        if self.target.become:
            yield from self._read_through(path)
            return
        try:
            with open(path, "rb") as f:
                yield from iter(lambda: f.read(1 << 20), b"")
        except OSError as e:
            raise HostError(f"cannot read {path}: {e.strerror or e}", where=self.target.name) from None

    def _read_through(self, path):
        """The file's bytes from the host's own interpreter (as the become user), in chunks as they arrive."""
        p = subprocess.Popen(self.command([self.python, "-I", "-S", "-c", CAT, path]), stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=self.session)
        err_box: list[bytes] = []
        t = threading.Thread(target=lambda: err_box.append(p.stderr.read()), daemon=True)
        t.start()
        try:
            yield from iter(lambda: p.stdout.read1(1 << 20), b"")
            rc = p.wait()
        finally:
            if p.poll() is None:
                _end(p)
        t.join()
        r = Result(rc, "", (err_box[0] if err_box else b"").decode(errors="replace"))
        self._check_read(path, r)

    def _check_read(self, path: str, r: Result) -> None:
        _sudo_refused(self.target, r)
        if r.rc != 0:
            raise HostError(f"cannot read {path}: {(r.stderr.strip().splitlines() or [f'exit {r.rc}'])[-1]}",
                            where=self.target.name)


def _end(p: subprocess.Popen) -> None:
    """End a local host command as a closed ssh channel ends a remote one: SIGTERM lets an agent's guard end
    what it started; SIGKILL if it has not gone within a few seconds."""
    try:
        p.terminate()
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
    except OSError:
        pass


def _chunks(data) -> Iterable[bytes]:
    return [] if data is None else [data] if isinstance(data, (bytes, bytearray)) else data


def _feed(pipe, data, touch=None, beat=None, done=None) -> None:
    try:
        for chunk in _chunks(data):
            pipe.write(chunk)
            if touch:
                touch()
        pipe.flush()
        while beat and not done.wait(beat):     # the heartbeat: not progress
            pipe.write(b"\n")
            pipe.flush()
        pipe.close()
    except (OSError, ValueError):
        pass   # the process exited without reading all of it


def fingerprint(key) -> str:
    """OpenSSH-style SHA256 fingerprint of a paramiko key."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_hosts_name(target: Target) -> str:
    """The name ssh checks the host's key by (`ssh -G` over the host's own command line): its HostKeyAlias, else
    its HostName after the ssh config, with its port when not 22."""
    argv = ssh_command(target, control=None)
    out = subprocess.run([*argv[:-1], "-G", argv[-1]], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                         timeout=30).stdout
    conf = dict(ln.split(" ", 1) for ln in out.splitlines() if " " in ln)
    if conf.get("hostkeyalias", "none") != "none":
        return conf["hostkeyalias"]
    host, port = conf.get("hostname", target.host), int(conf.get("port", target.port))
    return host if port == 22 else f"[{host}]:{port}"


# ------------------------------------------------------------------ the ssh client, as Ansible's ssh connection runs it

PERSIST = 60        # seconds a connection's master outlives its last session (a controller killed before close())
_CONTROL: list[Path] = []                 # this process's ControlPath directory, made on first use
_MASTERS: dict[str, list[str]] = {}       # live masters: ControlPath → the command that stops it
_SOCKETS = itertools.count()
_PLUGIN = threading.Lock()      # Ansible's plugin loader is not safe to enter from several threads at once


def _control_dir() -> Path:
    """A private directory under /tmp for this process's master sockets (a ControlPath must stay under 108
    bytes); the masters still running and the directory go when the process exits."""
    if not _CONTROL:
        import atexit
        import tempfile

        _CONTROL.append(Path(tempfile.mkdtemp(prefix="pv-", dir="/tmp")))
        atexit.register(_stop_all)
    return _CONTROL[0]


def _stop_all() -> None:
    for path in list(_MASTERS):
        _stop_master(path)
    if _CONTROL:
        import shutil

        shutil.rmtree(_CONTROL[0], ignore_errors=True)


def _stop_master(path: str) -> None:
    argv = _MASTERS.pop(path, None)
    if argv:
        subprocess.run(argv, capture_output=True, timeout=10, stdin=subprocess.DEVNULL)


def keepalive_interval(target: Target) -> int:
    """ServerAliveInterval: the target's timeout in whole seconds (ssh takes no fractions), at least 1."""
    return max(1, math.ceil(target.timeout))


ANSIBLE_SSH_ARGS = ["-C", "-o", "ControlMaster=auto", "-o", "ControlPersist=60s"]   # ansible-core's default ssh_args


def ssh_command(target: Target, *, control: str | None, known_hosts: Path | None = None,
                checking: str = "yes", conn=None) -> list[str]:
    """The ssh command line (up to and including the host; the remote command follows) that Ansible's ssh
    connection plugin builds for this host: `conn`, a task's own connection (its options set by Ansible for the
    host), or else one made here from the target's inventory variables (ansible_host, ansible_port, ansible_user,
    ansible_ssh_private_key_file, ansible_ssh_common_args, ansible_ssh_extra_args, ansible_ssh_args) and Ansible's
    settings (ssh_executable, ssh_args, ...): the operator's ~/.ssh/config, ProxyJump, agent and certificates
    apply. Ahead of them (ssh takes the first value given for an option) go ours: host keys checked strictly
    (`checking`) against the managed known_hosts only, never a prompt, keepalives every `keepalive_interval` s
    (KEEPALIVE_COUNT unanswered end the connection), and one master per connection at `control` (None: none) —
    unless `conn` keeps its own master (ControlPersist), which its sessions then share with Ansible's."""
    from ansible.playbook.play_context import PlayContext
    from ansible.plugins.loader import connection_loader

    every = keepalive_interval(target)
    if conn is None:
        with _PLUGIN:
            conn = connection_loader.get("ssh", PlayContext(), None)
        hostvars = {"ansible_host": target.host, **target.ssh_args}
        if target.port != 22:             # else the ssh config's Port for this name holds, as for Ansible
            hostvars["ansible_port"] = target.port
        if target.user:
            hostvars["ansible_user"] = target.user
        if target.key_file:
            hostvars["ansible_ssh_private_key_file"] = target.key_file
        conn.set_options(var_options=hostvars)
        if (conn.get_option("ssh_args") or "").split() == ANSIBLE_SSH_ARGS:   # Ansible's own default, not the
            conn.set_option("ssh_args", "")   # operator's: ours replace its master options, and its -C would cost
        conn.set_option("timeout", every)     # pushed wheels (compressed) half their speed; ConnectTimeout: TCP, banner
    # `_build_command` is the plugin's private builder of exactly this command line (ansible-core's ssh plugin has
    # kept its signature across the range pyproject pins); this is the one place it is called.
    argv = [os.fsdecode(a) for a in conn._build_command(conn.get_option("ssh_executable"), "ssh")]
    ours = [*host_key_options(known_hosts or target.known_hosts, checking), "-o", "BatchMode=yes",
            "-o", f"ServerAliveInterval={every}", "-o", f"ServerAliveCountMax={KEEPALIVE_COUNT}"]
    if not shares_master(argv):
        ours += (["-o", "ControlMaster=auto", "-o", f"ControlPersist={PERSIST}", "-o", f"ControlPath={control}"]
                 if control else ["-o", "ControlMaster=no", "-o", "ControlPath=none"])
    at = argv.index(os.fsdecode(conn.get_option("ssh_executable"))) + 1     # after the binary (and any sshpass)
    return argv[:at] + ours + argv[at:] + [str(conn.get_option("host"))]


def shares_master(argv: list[str]) -> bool:
    """Whether an ssh command line of Ansible's keeps a master of its own (a ControlPersist with its ControlPath)."""
    opts = [(a[2:] if a.startswith("-o") else a).split("=", 1) for a in argv if "=" in a]
    first = {}
    for k, v in opts:
        first.setdefault(k.lower(), v.strip('"'))
    return first.get("controlpersist", "no") not in ("no", "0") and first.get("controlpath", "none") != "none"


class SSH(Local):
    """A remote host through the ssh client, as Ansible's ssh connection plugin runs it (`ssh_command`): host
    commands are local ssh processes streamed as Local streams its own, over one master connection per SSH
    (ControlMaster; made and checked when it is constructed, stopped by `close`). Unknown or changed host keys
    are refused; connecting waits at most `target.timeout` (whole seconds) for TCP and the SSH banner; once
    connected, a host that leaves KEEPALIVE_COUNT keepalives in a row unanswered is disconnected, so no read waits
    on it forever. Host commands run in sessions of their own: a Ctrl-C reaches the controller, which ends them."""

    session = True

    def __init__(self, target: Target, conn=None):
        self.target, self.watch = target, None
        self.control = str(_control_dir() / str(next(_SOCKETS)))
        self.log = Path(self.control + ".log")
        self.ssh = ssh_command(target, control=self.control, conn=conn)
        self.shared = f"ControlPath={self.control}" not in self.ssh   # the master is Ansible's (a task's connection)
        if not self.shared:
            _MASTERS[self.control] = [*self.ssh[:-1], "-O", "exit", self.ssh[-1]]     # how close() stops it
        first = [*self.ssh[:-1], "-E", str(self.log), self.ssh[-1], quote(become_argv(target, ["true"]))]
        limit = 4 * keepalive_interval(target) + 30      # a hang guard: ssh's own ConnectTimeout says it first
        try:    # the master: its errors (and later, why it went) go to its log
            r = subprocess.run(first, stdin=subprocess.DEVNULL, capture_output=True, timeout=limit,
                               start_new_session=True)
        except subprocess.TimeoutExpired:
            self.close()
            raise HostError(f"no SSH connection within {limit:g}s", where=target.name) from None
        self._closed, self._runs, self._count = threading.Event(), 0, threading.Lock()
        if r.returncode != 0:
            said = self._said() + r.stderr.decode(errors="replace")
            self.close()
            result = Result(r.returncode, r.stdout.decode(errors="replace"), said)
            _sudo_refused(target, result)
            raise ssh_error(target, said, r.returncode)
        threading.Thread(target=self._watch, name=f"keepalive {target.name}", daemon=True).start()

    def _watch(self) -> None:
        """While a host command runs: a session through the master every keepalive period, and each the host leaves
        unanswered says that the step waits on the host, for as long as it has answered none (ssh's own keepalives
        say nothing until they give the connection up, after KEEPALIVE_COUNT periods). Said only where the step's
        own notice (`target.notice`) is longer than a period: a shorter one already says the silence as often."""
        period, missed = keepalive_interval(self.target), 0
        while not self._closed.wait(period):
            if not self._runs:
                missed = 0
                continue
            try:
                subprocess.run([*self.ssh, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=period, start_new_session=True)
                missed = 0
            except subprocess.TimeoutExpired:
                missed += 1
                if self._runs and not self._closed.is_set() and self.target.notice > period:
                    self._say_wait(period * missed)

    def _say_wait(self, seconds: float) -> None:
        w = self.watch
        if w and w.on_wait:
            w.on_wait(w.name, seconds)

    def command(self, argv: list[str]) -> list[str]:
        return [*self.ssh, quote(become_argv(self.target, argv))]

    def _said(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def _alive(self) -> bool:
        check = [*self.ssh[:-1], "-O", "check", self.ssh[-1]]
        return subprocess.run(check, capture_output=True, stdin=subprocess.DEVNULL, timeout=30).returncode == 0

    def _unanswered(self) -> bool:
        """Whether the master ended because the host answered none of its keepalives (ssh's log says so)."""
        return "not responding" in self._said()

    def _gone(self) -> HostError:
        lines = [ln.strip() for ln in self._said().splitlines() if ln.strip()]
        last = lines[-1] if lines else "the connection's master ended"
        if self._unanswered():
            last = f"the host answered no keepalive for {keepalive_interval(self.target) * KEEPALIVE_COUNT:g}s"
        during = f" during {self.watch.name}" if self.watch else ""
        return ConnectionLost(f"connection lost{during}: {last}", where=self.target.name)

    def run(self, argv, *, stdin=None, timeout=None, on_line=None, beat=None) -> Result:
        with self._count:
            self._runs += 1
        try:
            r = self._stream(self.command(argv), stdin=stdin, timeout=timeout, on_line=on_line, beat=beat)
        finally:
            with self._count:
                self._runs -= 1
        if r.rc == 255 and not self._alive():     # ssh's own failure: the connection went
            if self._unanswered():
                raise self._gone()    # the keepalives closed it: what came back is not the command's whole answer
            return Result(-1, r.stdout, r.stderr)   # the session closed without an exit status
        _sudo_refused(self.target, r)
        return r

    def read(self, path):
        yield from self._read_through(path)

    def _check_read(self, path: str, r: Result) -> None:
        if r.rc == 255 and not self._alive():
            raise self._gone()
        super()._check_read(path, r)

    def close(self):
        if getattr(self, "_closed", None) is not None:
            self._closed.set()
        _stop_master(self.control)
        self.log.unlink(missing_ok=True)


def ssh_error(target: Target, said: str, rc: int) -> HostError:
    """ssh's failure to connect (its log and stderr, `said`), in one line naming the host."""
    lines = [ln.strip() for ln in said.splitlines() if ln.strip() and not ln.startswith("@")]
    text = "\n".join(lines)
    t = f"{keepalive_interval(target):g}s"
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in said:
        m = re.search(r"The fingerprint for the (\S+) key sent by the remote host is\s+(SHA256:[^\s.]+)", said)
        offered = f"{_key_type(m.group(1))} {m.group(2)}" if m else "another key"
        expects = ", ".join(f"{k.get_name()} {fingerprint(k)}" for k in known_host_keys(target)) or "another key"
        return HostKeyError(f"host key CHANGED: offered {offered}, known_hosts {target.known_hosts} expects "
                            f"{expects}; refusing", where=target.name)
    if "Host key verification failed" in text or "host key is known for" in text:
        try:
            key = scan_host_key(target)
            shown = f" {key.get_name()} {fingerprint(key)}"
        except HostError:
            shown = ""
        return HostKeyError(f"unknown host key{shown}; verify it, then `{trust_command(target)}`",
                            where=target.name)
    if "timed out during banner exchange" in text:
        return HostError(f"no SSH banner within {t}", where=target.name)
    if "Connection closed by" in text and "kex_exchange_identification" in text:
        return HostError("the host closed the connection before its SSH banner", where=target.name)
    m = re.search(r"connect to host .* port \d+: (.*)", text)
    if m:
        why = m.group(1).strip()
        if "timed out" in why:
            return HostError(f"no TCP connection within {t}", where=target.name)
        return HostError(f"cannot connect: {why}", where=target.name)
    if "Could not resolve hostname" in text:
        return HostError(f"cannot connect: {text.split(': ', 1)[-1].splitlines()[0]}", where=target.name)
    last = lines[-1] if lines else f"ssh exited {rc}"
    return HostError(f"ssh: {last[:300]}", where=target.name)


def _key_type(word: str) -> str:
    """ssh's name for a key type in its messages (ED25519, ECDSA, RSA) as a known_hosts key type."""
    return {"ED25519": "ssh-ed25519", "RSA": "ssh-rsa", "ECDSA": "ecdsa-sha2-nistp256"}.get(word, word.lower())


def _paramiko():
    """paramiko, its log silenced: its failures reach us as exceptions, said in one line."""
    import logging

    import paramiko

    log = logging.getLogger("paramiko")
    if not log.handlers:
        log.addHandler(logging.NullHandler())
    return paramiko


def scan_host_key(target: Target):
    """The key a host offers (for showing its fingerprint), without trusting it: the host's own ssh command line
    (its ssh config, its ProxyJump) records what the host offers into a scratch known_hosts and authenticates with
    nothing; HostError when no key came (the host named, the reason in one line)."""
    import tempfile

    paramiko = _paramiko()
    with tempfile.TemporaryDirectory(prefix="pv-scan-") as d:
        kh = Path(d) / "known_hosts"
        argv = ssh_command(target, control=None, known_hosts=kh, checking="accept-new")
        try:
            r = subprocess.run([*argv[:-1], "-o", "PreferredAuthentications=none", argv[-1], "true"],
                               capture_output=True, text=True, stdin=subprocess.DEVNULL,
                               timeout=4 * keepalive_interval(target) + 30, start_new_session=True)
        except subprocess.TimeoutExpired:
            raise HostError("no SSH host key within the timeout", where=target.name) from None
        words = kh.read_text().split() if kh.exists() else []
    if len(words) < 3:
        raise ssh_error(target, r.stderr, r.returncode)
    try:
        return paramiko.PKey.from_type_string(words[1], base64.b64decode(words[2]))
    except (paramiko.SSHException, ValueError) as e:
        raise HostError(f"the host offers a key this tool cannot read ({words[1]}: {e})", where=target.name) from None


def known_host_keys(target: Target) -> list:
    """The keys the managed known_hosts records for this host (any type)."""
    import paramiko

    kh = Path(target.known_hosts)
    if not kh.exists():
        return []
    try:
        found = paramiko.HostKeys(str(kh)).lookup(known_hosts_name(target)) or {}
    except (OSError, paramiko.SSHException, ValueError) as e:
        raise InputError(f"cannot read known_hosts: {e}", where=str(kh)) from None
    return list(found.values())


def key_change(target: Target, key) -> tuple[bool, list]:
    """(trusted, replaced): whether `key` is already the one key recorded for this host, and the recorded keys of
    another type or value that recording it would replace."""
    known = known_host_keys(target)
    replaced = [k for k in known if k.asbytes() != key.asbytes()]
    return len(known) == 1 and not replaced, replaced


def record_host_key(target: Target, key) -> list[str]:
    """Make `key` the one key recorded for this host (others for the same name are removed).

    Returns "type fingerprint" of each different key it replaced."""
    name = known_hosts_name(target)
    replaced = [f"{k.get_name()} {fingerprint(k)}" for k in known_host_keys(target)
                if k.asbytes() != key.asbytes()]
    kh = Path(target.known_hosts)
    kh.parent.mkdir(parents=True, exist_ok=True)
    lines = kh.read_text().splitlines() if kh.exists() else []
    keep = [ln for ln in lines if ln.startswith(("#", "@")) or not ln.strip()
            or name not in ln.split(None, 1)[0].split(",")]
    keep.append(f"{name} {key.get_name()} {key.get_base64()}")
    tmp = kh.with_name(kh.name + ".tmp")
    tmp.write_text("\n".join(keep) + "\n")
    os.replace(tmp, kh)
    return replaced


def trust_host(target: Target) -> tuple[str, str]:
    """Scan the host's key once and record exactly that key; returns (key type, fingerprint)."""
    key = scan_host_key(target)
    record_host_key(target, key)
    return key.get_name(), fingerprint(key)


def connect(target: Target, conn=None) -> Transport:
    """The target's transport; `conn`, an Ansible task's own ssh connection to it, whose command line and master
    its sessions then use."""
    return Local(target) if target.local else SSH(target, conn)
