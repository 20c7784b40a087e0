"""Transports to a host: Local (subprocess) and SSH (paramiko, verified host keys only).

Both offer run / run_python / put / get / hold; remote command lines are quoted here and
nowhere else (`shlex.join`). Hosts are named `[user@]host[:port]` or `local`.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shlex
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .errors import HostError, HostKeyError, HostLockedError, InputError

DEFAULT_KNOWN_HOSTS = Path(os.environ.get("PROVISION_HOME", Path.home() / ".provision")) / "known_hosts"
HOST_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9._-]{0,252})\Z")
IPV6_RE = re.compile(r"^[0-9A-Fa-f:.]{2,45}\Z")
USER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}\Z")


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
    """Where to run: `local`, or an SSH `user@host:port` with its key and known_hosts."""

    host: str
    user: str | None = None
    port: int = 22
    key_file: str | None = None
    known_hosts: Path = DEFAULT_KNOWN_HOSTS
    vars: dict = field(default_factory=dict)   # inventory host vars (root, python, ...)
    alias: str | None = None                   # the host's inventory name, when it comes from one

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


class Transport:
    """What every transport offers; see Local and SSH."""

    target: Target

    def run(self, argv: list[str], *, stdin: bytes | None = None, env: dict | None = None,
            timeout: float | None = None) -> Result:
        raise NotImplementedError

    def check(self, argv: list[str], **kw) -> str:
        r = self.run(argv, **kw)
        if r.rc != 0:
            last = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] or [f"exit {r.rc}"]
            raise HostError(f"{argv[0]} failed: {last[0]}", where=self.target.name)
        return r.stdout

    def run_python(self, source: str, args: list[str] | None = None, *, python: str = "python3",
                   env: dict | None = None, timeout: float | None = None) -> Result:
        """Run a stdlib-only script (its source sent on stdin) with the host's interpreter, isolated (-I: no
        PYTHONPATH, user site or working directory on its path)."""
        return self.run([python, "-I", "-", *(args or [])], stdin=source.encode(), env=env, timeout=timeout)

    def run_agent(self, source: str, args: list[str] | None = None, **kw) -> dict:
        """Run an agent script that prints one JSON object; agent errors become HostError."""
        r = self.run_python(source, args, **kw)
        try:
            data = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else None
        except (json.JSONDecodeError, IndexError):
            data = None
        if not isinstance(data, dict):
            detail = (r.stderr.strip() or r.stdout.strip() or f"exit {r.rc}").splitlines()[-1]
            raise HostError(f"host agent failed: {detail}", where=self.target.name)
        if data.get("error"):
            raise HostError(data["error"], where=self.target.name)
        return data

    def put(self, data: bytes, path: str, mode: int = 0o644) -> None:
        script = ("import base64,os,sys\np=sys.argv[1]\nos.makedirs(os.path.dirname(p) or '.',exist_ok=True)\n"
                  "t=p+'.tmp'\nopen(t,'wb').write(base64.b64decode(sys.stdin.buffer.read()))\n"
                  "os.chmod(t,int(sys.argv[2],8))\nos.replace(t,p)\n")
        r = self.run(["python3", "-c", script, path, oct(mode)[2:]], stdin=base64.b64encode(data))
        if r.rc != 0:
            raise HostError(f"cannot write {path}: {r.stderr.strip()}", where=self.target.name)

    def get(self, path: str) -> bytes:
        r = self.run(["python3", "-c", "import base64,sys;sys.stdout.write(base64.b64encode("
                      "open(sys.argv[1],'rb').read()).decode())", path])
        if r.rc != 0:
            raise HostError(f"cannot read {path}", where=self.target.name)
        return base64.b64decode(r.stdout)

    def hold(self, lock_path: str) -> "HeldLock":
        """Take the host's flock for one mutating run; released when the run ends or dies."""
        return HeldLock(self, lock_path)

    def spawn(self, argv: list[str], env: dict | None = None):
        """Start a long-running process; returns an object with .stdin, .stdout, .close()."""
        raise NotImplementedError

    def close(self) -> None:
        pass


_LOCK_SCRIPT = r"""
import fcntl, json, os, sys, time
p = sys.argv[1]
os.makedirs(os.path.dirname(p), exist_ok=True)
f = open(p, "a+")
try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
except OSError:
    f.seek(0)
    print(json.dumps({"held": False, "by": f.read().strip()}), flush=True)
    sys.exit(0)
f.seek(0); f.truncate(); f.write(json.dumps({"pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})); f.flush()
print(json.dumps({"held": True}), flush=True)
sys.stdin.read()   # hold until the controller closes stdin or its connection dies
"""


class HeldLock:
    """A host flock held by a helper process whose stdin we keep open."""

    def __init__(self, transport: Transport, path: str):
        self.transport, self.path, self.proc = transport, path, None

    def __enter__(self):
        self.proc = self.transport.spawn(["python3", "-c", _LOCK_SCRIPT, self.path])
        line = self.proc.readline()
        try:
            state = json.loads(line)
        except json.JSONDecodeError:
            self.proc.close()
            raise HostError(f"cannot take host lock {self.path}", where=self.transport.target.name)
        if not state["held"]:
            self.proc.close()
            raise HostLockedError(f"another run holds the host lock {self.path} ({state['by'] or 'unknown'})",
                                  where=self.transport.target.name)
        return self

    def __exit__(self, *exc):
        self.proc.close()


class _LocalProc:
    def __init__(self, argv, env):
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, env=env, text=True)

    def readline(self) -> str:
        return self.p.stdout.readline()

    def close(self):
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.p.kill()


class Local(Transport):
    """This machine, through subprocess (no shell)."""

    def __init__(self, target: Target | None = None):
        self.target = target or Target(host="local")

    def _env(self, env):
        return {**os.environ, **env} if env else None

    def run(self, argv, *, stdin=None, env=None, timeout=None) -> Result:
        try:
            p = subprocess.run([str(a) for a in argv], input=stdin, capture_output=True,
                               env=self._env(env), timeout=timeout)
        except FileNotFoundError as e:
            return Result(127, "", str(e))
        except subprocess.TimeoutExpired:
            return Result(124, "", f"timed out after {timeout}s")
        return Result(p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace"))

    def spawn(self, argv, env=None):
        return _LocalProc([str(a) for a in argv], self._env(env))


def fingerprint(key) -> str:
    """OpenSSH-style SHA256 fingerprint of a paramiko key."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_hosts_name(target: Target) -> str:
    return target.host if target.port == 22 else f"[{target.host}]:{target.port}"


class _SSHProc:
    def __init__(self, chan):
        self.chan = chan
        self.f = chan.makefile("r")

    def readline(self) -> str:
        return self.f.readline()

    def close(self):
        try:
            self.chan.shutdown_write()
            self.chan.close()
        except Exception:  # noqa: BLE001 - connection may already be gone
            pass


class SSH(Transport):
    """A remote host through paramiko; unknown or changed host keys are refused."""

    def __init__(self, target: Target, connect_timeout: float = 10.0):
        import paramiko

        self.target = target
        self.client = paramiko.SSHClient()
        kh = Path(target.known_hosts)
        if kh.exists():
            self.client.load_host_keys(str(kh))
        self.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            self.client.connect(target.host, port=target.port, username=target.user or _whoami(),
                                key_filename=target.key_file, timeout=connect_timeout,
                                allow_agent=target.key_file is None, look_for_keys=target.key_file is None)
        except paramiko.BadHostKeyException as e:
            raise HostKeyError(f"host key CHANGED: offered {e.key.get_name()} {fingerprint(e.key)}, "
                               f"known_hosts {kh} expects {fingerprint(e.expected_key)}; refusing",
                               where=target.name) from None
        except paramiko.SSHException as e:
            if "not found in known_hosts" in str(e):
                key = scan_host_key(target)
                raise HostKeyError(f"unknown host key {key.get_name()} {fingerprint(key)}; verify it, then "
                                   f"`provision hosts trust {target.address}`", where=target.name) from None
            raise HostError(f"ssh: {e}", where=target.name) from None
        except OSError as e:
            raise HostError(f"cannot connect: {e.strerror or e}", where=target.name) from None

    def run(self, argv, *, stdin=None, env=None, timeout=None) -> Result:
        cmd = quote(argv)
        if env:
            cmd = quote(["env", *[f"{k}={v}" for k, v in env.items()]]) + " " + cmd
        try:
            chan = self.client.get_transport().open_session()
            chan.settimeout(timeout)
            chan.exec_command(cmd)
            if stdin:
                chan.sendall(stdin)
            chan.shutdown_write()
            err_box: list[bytes] = []
            t = threading.Thread(target=lambda: err_box.append(chan.makefile_stderr("rb").read()), daemon=True)
            t.start()
            out = chan.makefile("rb").read()
            t.join(timeout)
            rc = chan.recv_exit_status()
            err = err_box[0] if err_box else b""
            chan.close()
        except Exception as e:  # noqa: BLE001 - paramiko raises many kinds when a host vanishes
            raise HostError(f"connection lost: {e or type(e).__name__}", where=self.target.name) from None
        return Result(rc, out.decode(errors="replace"), err.decode(errors="replace"))

    def spawn(self, argv, env=None):
        chan = self.client.get_transport().open_session()
        cmd = quote(argv)
        if env:
            cmd = quote(["env", *[f"{k}={v}" for k, v in env.items()]]) + " " + cmd
        chan.exec_command(cmd)
        return _SSHProc(chan)

    def close(self):
        self.client.close()


def _whoami() -> str:
    import getpass
    return getpass.getuser()


def scan_host_key(target: Target):
    """The key a host offers (for showing its fingerprint), without trusting it."""
    import paramiko
    import socket

    try:
        sock = socket.create_connection((target.host, target.port), timeout=10)
    except OSError as e:
        raise HostError(f"cannot connect: {e.strerror or e}", where=target.name) from None
    t = paramiko.Transport(sock)
    try:
        t.start_client(timeout=10)
        return t.get_remote_server_key()
    except paramiko.SSHException as e:
        raise HostError(f"ssh handshake failed: {e}", where=target.name) from None
    finally:
        t.close()


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


def connect(target: Target) -> Transport:
    return Local(target) if target.local else SSH(target)
