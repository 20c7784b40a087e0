"""Shared fixtures: one real sshd on loopback for the session; a fresh host root per test."""
from __future__ import annotations

import copy
import socket
import threading
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from provision.bundled import DEMO_LOCKS  # noqa: E402
from provision.loopback import LoopbackHost  # noqa: E402
from provision.transport import trust_host  # noqa: E402
from loophosts import readable_host  # noqa: E402,F401


@pytest.fixture(scope="session", autouse=True)
def wheelhouse_root(tmp_path_factory):
    """The tests' wheels live under pytest's temporary root and .cache/wheels (the real SGLang wheels): the
    configured wheelhouses a lock's file:// URLs may point into (besides the lock's own folder)."""
    import os

    from provision.lock import WHEELHOUSE_ENV

    base = os.pathsep.join([str(tmp_path_factory.getbasetemp()),
                            str(Path(__file__).resolve().parent.parent / ".cache" / "wheels")])
    old = os.environ.get(WHEELHOUSE_ENV)
    os.environ[WHEELHOUSE_ENV] = base
    yield base
    if old is None:
        os.environ.pop(WHEELHOUSE_ENV, None)
    else:
        os.environ[WHEELHOUSE_ENV] = old


@pytest.fixture(scope="session", autouse=True)
def mutable_stores(tmp_path_factory):
    """At the end, the host stores the tests made lose their immutable attribute, so that pytest can delete
    its old temporary roots as it does every other file."""
    yield
    from provision.agent import store

    for files in Path(tmp_path_factory.getbasetemp()).glob("**/store/files"):
        for entry, _ in store.entries(str(files)):
            try:
                with open(entry, "rb") as f:
                    store.set_immutable(f.fileno(), False)
            except OSError:
                pass


@pytest.fixture(scope="session")
def sshd():
    host = LoopbackHost().start()
    trust_host(host.target)
    yield host
    host.cleanup()


@pytest.fixture
def agent_bundle(monkeypatch):
    """An agent function called in this process starts the agents it needs (ranks, a JIT compile) from the
    bundle, as the agent does on a host, where it came with its message."""
    from provision import agent
    from provision.agent import host

    monkeypatch.setitem(host.MESSAGE, "bundle", agent.bundle())


@pytest.fixture
def target(sshd, tmp_path):
    """A trusted SSH target on the session sshd, with its own empty provision root."""
    t = copy.deepcopy(sshd.target)
    t.root = str(tmp_path / "root")
    return t


@pytest.fixture(scope="session")
def wheels(tmp_path_factory):
    """A wheelhouse of tiny real wheels: alpha 1.0/2.0, beta 1.0, gamma 1.0."""
    from wheelhouse import make_wheel

    d = tmp_path_factory.mktemp("wheelhouse")
    return {f"{n}-{v}": make_wheel(d, n, v) for n, v in
            [("alpha", "1.0"), ("alpha", "2.0"), ("beta", "1.0"), ("gamma", "1.0")]}


@pytest.fixture(scope="session")
def toolkit_generation(sshd, tmp_path_factory):
    """A real apply of provision/lockfiles/demo/cuda13-toolkit.yaml (NVIDIA's CUDA 13.0.1 wheels from PyPI,
    about 300 MB) over SSH, once per session: (target, apply report, lock)."""
    from provision import apply as applymod
    from provision import lock as lockmod
    from provision.transport import connect

    t = copy.deepcopy(sshd.target)
    t.root = str(tmp_path_factory.mktemp("toolkit") / "root")
    lk = lockmod.load(DEMO_LOCKS / "cuda13-toolkit.yaml")
    tr = connect(t)
    try:
        rep = applymod.apply(tr, lk)
    finally:
        tr.close()
    return t, rep, lk


# The files whose tests share the session's toolkit generation (a real 300 MB install): one unit of work under -n.
TOOLKIT_FILES = {"tests/test_core.py", "tests/test_cuda_home.py", "tests/test_probes.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (`-n N`) a test file is one unit of work: its module fixtures (a fleet of hosts, an
    engine server) are made once and its cases run in order on one worker; the files that share the toolkit
    generation go together, so it is installed once. Units are handed out in collection order (tests/engine/
    first), so a worker runs its torch and Triton tests before any test loads Ansible in its process: Ansible's
    patches to the interpreter (sys.intern) break torch._dynamo and Triton's interpreter once loaded."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "toolkit" if path in TOOLKIT_FILES else path

    config.option.loadscopereorder = False
    return ByFile(config, log)


@pytest.fixture
def listener():
    """A TCP port that accepts connections, counts them and never says a word: (port, the connections accepted).
    A host that would be contacted, or an SSH port behind a hung daemon."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    accepted: list[socket.socket] = []

    def accept():
        try:
            while True:
                accepted.append(srv.accept()[0])
        except OSError:       # closed at the end of the test
            pass
    threading.Thread(target=accept, daemon=True).start()
    yield srv.getsockname()[1], accepted
    srv.close()
    for c in accepted:
        c.close()


@pytest.fixture
def silent(listener):
    """The port of a listener that never says a word (an SSH port behind a hung daemon)."""
    return listener[0]


@pytest.fixture(scope="session")
def sudo_user():
    """A user who logs in with a loopback host's client key and may run anything as root through sudo, without a
    password (as on a cloud GPU image); new for this session, removed at the end."""
    from loophosts import sudo_account

    with sudo_account("ALL=(ALL) NOPASSWD: ALL") as name:
        yield name


class BehindJump:
    """A host in a network namespace that only a jump host's namespace reaches, and an ssh config that names it by
    the alias `gpu-behind` with ProxyJump through `bastion`, host keys checked against `known_hosts`."""

    alias = "gpu-behind"

    def __init__(self, d: Path):
        self.jump = LoopbackHost(netns=True).start()
        self.behind = LoopbackHost(behind=self.jump).start()
        self.known_hosts = d / "known_hosts"
        self.known_hosts.write_text("".join(
            f"{h.address} {' '.join((h.dir / 'host_ed25519.pub').read_text().split(' ')[:2])}\n"
            for h in (self.jump, self.behind)))
        self.config = d / "ssh_config"
        self.config.write_text(
            f"Host bastion\n  HostName {self.jump.address}\n  User {self.jump.target.user}\n"
            f"  IdentityFile {self.jump.dir / 'client_ed25519'}\n"
            f"Host {self.alias}\n  HostName {self.behind.address}\n  User {self.behind.target.user}\n"
            f"  IdentityFile {self.behind.dir / 'client_ed25519'}\n  ProxyJump bastion\n"
            f"Host *\n  UserKnownHostsFile {self.known_hosts}\n  StrictHostKeyChecking yes\n  BatchMode yes\n")

    def cleanup(self) -> None:
        self.behind.cleanup()
        self.jump.cleanup()


@pytest.fixture
def behind_jump(tmp_path):
    h = BehindJump(tmp_path)
    yield h
    h.cleanup()
