"""A throwaway SSH host on loopback (real OpenSSH sshd, fresh keys, sandbox root) for demo and tests.

Needs `openssh-server` (/usr/sbin/sshd). Keys live in a temp dir, so `StrictModes no` and
`UsePAM no` are set; nothing outside the temp dir is touched except /run/sshd (privsep dir).
"""
from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .errors import ProvisionError
from .transport import Target

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LoopbackHost:
    """`with LoopbackHost() as h:` → h.target (not yet trusted), h.root, h.dir; stops sshd on exit."""

    def __init__(self, base: str | Path | None = None, netns_index: int | None = None, login_rc: bool = False,
                 netns: bool = False, sshd_config: str = "", behind: "LoopbackHost | None" = None):
        """`netns=True` puts the host in a network namespace of its own, pv-host-i, reached over a veth
        pair at 10.203.i.2: i is the first index free when it starts (or `netns_index`), so concurrent runs
        never share one (the namespace is the run's own; nothing outside the local host is involved).
        Sessions get an empty HOME, so the login shell reads no rc file: a fresh host's sessions, whatever
        the local user's shell startup does (a startup that a killed session can leave stalled, such as a
        version manager's rehash lock). `login_rc=True` keeps the user's HOME and its rc files.
        `sshd_config`: more sshd settings (one a line). `behind=jump` (a started host in a namespace): this
        host's namespace, pv-behind-i at 10.204.i.2, is wired to jump's namespace alone, so only jump reaches it
        (a host behind a bastion)."""
        self.dir = Path(tempfile.mkdtemp(prefix="provision-host-", dir=base))
        self._index = netns_index
        self.behind = behind
        self.netns_wanted = netns or netns_index is not None or behind is not None
        self.netns: str | None = None
        self.address = "127.0.0.1"
        self.port = 22 if self.netns_wanted else free_port()
        self.login_rc, self.extra_config = login_rc, sshd_config
        self.root = str(self.dir / "root")
        self.proc: subprocess.Popen | None = None

    def _keygen(self, path: Path) -> None:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True,
                       stdin=subprocess.DEVNULL)

    def prepare(self) -> None:
        """Its keys, its network namespace (where it has one) and its sshd_config: what any way of starting its
        sshd needs."""
        if not (self.dir / "host_ed25519").exists():
            self._keygen(self.dir / "host_ed25519")
        if not (self.dir / "client_ed25519").exists():
            self._keygen(self.dir / "client_ed25519")
            shutil.copy(self.dir / "client_ed25519.pub", self.dir / "authorized_keys")
        if self.netns_wanted and self.netns is None:    # first: it names the address sshd listens on
            self._make_netns()
        (self.dir / "sshd_config").write_text(
            f"Port {self.port}\nListenAddress {self.address}\nHostKey {self.dir}/host_ed25519\n"
            f"AuthorizedKeysFile {self.dir}/authorized_keys\nPidFile {self.dir}/sshd.pid\n"
            "UsePAM no\nStrictModes no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "PubkeyAuthentication yes\nPermitRootLogin yes\nMaxSessions 64\nMaxStartups 64\n"
            "Subsystem sftp internal-sftp\nLogLevel ERROR\n"
            + ("" if self.login_rc else f"SetEnv HOME={self.dir / 'home'}\n") + self.extra_config)
        if not self.login_rc:
            (self.dir / "home").mkdir(mode=0o700, exist_ok=True)

    def start(self) -> "LoopbackHost":
        if not Path(SSHD).exists():
            raise ProvisionError("sshd not found: install openssh-server (apt-get install openssh-server)")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        self.prepare()
        argv = [SSHD, "-D", "-e", "-f", str(self.dir / "sshd_config")]
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=open(self.dir / "sshd.log", "wb"))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ProvisionError(f"sshd exited: {(self.dir / 'sshd.log').read_text().strip()[-300:]}")
            if self._listening():
                return self
            time.sleep(0.05)
        raise ProvisionError("sshd did not start listening within 10s")

    def _listening(self) -> bool:
        """Whether sshd accepts connections yet (asked from inside its own namespace when it is behind a jump)."""
        if self.behind:
            probe = f"import socket; socket.create_connection(({self.address!r}, {self.port}), timeout=0.5).close()"
            return subprocess.run(["ip", "netns", "exec", self.netns, sys.executable, "-I", "-c", probe],
                                  capture_output=True).returncode == 0
        try:
            socket.create_connection((self.address, self.port), timeout=0.5).close()
            return True
        except OSError:
            return False

    def rekey(self) -> None:
        """Restart on the same port with a new host key (a reinstalled host, or a man in the middle)."""
        self.stop()
        for f in ("host_ed25519", "host_ed25519.pub"):
            (self.dir / f).unlink()
        self.start()

    @property
    def target(self) -> Target:
        return Target(host=self.address, user=getpass.getuser(), port=self.port,
                      key_file=str(self.dir / "client_ed25519"), known_hosts=self.dir / "known_hosts",
                      root=self.root)

    @property
    def spec(self) -> str:
        return f"{getpass.getuser()}@{self.address}:{self.port}"

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def _make_netns(self) -> None:
        """Claim a namespace (`ip netns add` fails when it exists: another run's), then wire its veth pair."""
        kind, net = ("pv-behind", "10.204") if self.behind else ("pv-host", "10.203")
        outer = ["ip", "-n", self.behind.netns] if self.behind else ["ip"]     # where the veth's other end lives
        start = self._index if self._index is not None else os.getpid() % 250 + 1
        candidates = [start] if self._index is not None else [(start + k) % 250 + 1 for k in range(250)]
        for i in candidates:
            r = subprocess.run(["ip", "netns", "add", f"{kind}-{i}"], capture_output=True, text=True)
            if r.returncode == 0:
                break
        else:
            raise ProvisionError(f"cannot make a network namespace {kind}-{candidates[-1]}: {r.stderr.strip()}")
        self._index, self.netns, self.address = i, f"{kind}-{i}", f"{net}.{i}.2"
        veth = f"pvh{i}"
        for cmd in (["ip", "-n", self.netns, "link", "set", "lo", "up"],
                    [*outer, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", self.netns],
                    [*outer, "addr", "add", f"{net}.{i}.1/30", "dev", veth], [*outer, "link", "set", veth, "up"],
                    ["ip", "-n", self.netns, "addr", "add", f"{net}.{i}.2/30", "dev", "eth0"],
                    ["ip", "-n", self.netns, "link", "set", "eth0", "up"],
                    # behind: nothing here reaches it (not even by this machine's default route), only jump
                    *([["ip", "route", "add", "unreachable", f"{net}.{i}.0/30"]] if self.behind else [])):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                self._drop_netns()
                raise ProvisionError(f"cannot make network namespace {kind}-{i}: {' '.join(cmd)}: {r.stderr.strip()}")

    def sessions(self) -> list[int]:
        """Pids of every process this host's sshd forked (its sessions and what they run), from /proc."""
        found, frontier = [], [self.proc.pid] if self.proc else []
        while frontier:
            parent = frontier.pop()
            for stat in Path("/proc").glob("[0-9]*/stat"):
                try:
                    fields = stat.read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[1]) == parent:
                    found.append(int(stat.parent.name))
                    frontier.append(int(stat.parent.name))
        return found

    def drop_sessions(self) -> None:
        """Every ssh session dies (SIGKILL, by pid); the listening sshd stays."""
        for pid in self.sessions():
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass

    def vanish(self) -> None:
        """The host goes away mid-run: kill sshd and every session it forked (SIGKILL, by pid)."""
        if not self.proc:
            return
        for pid in [self.proc.pid, *self.sessions()]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def cleanup(self) -> None:
        from .agent import store

        self.stop()
        self._drop_netns()
        try:
            store.rmtree(str(self.dir))        # the host root's store links are immutable: rmtree alone fails
        except OSError:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _drop_netns(self) -> None:
        if self.netns:
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)
            if self.behind:           # a pair whose ends are both in namespaces goes with them
                subprocess.run(["ip", "route", "del", "unreachable", f"10.204.{self._index}.0/30"],
                               capture_output=True)
            else:
                subprocess.run(["ip", "link", "del", f"pvh{self._index}"], capture_output=True)
            self.netns = None

    def __enter__(self) -> "LoopbackHost":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()
