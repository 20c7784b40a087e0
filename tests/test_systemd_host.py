"""The systemd test host (tests/systemdhost.py) and the agent's D-Bus client of systemd's manager
(provision/agent/systemd.py), against a real systemd as PID 1 in namespaces of its own."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from provision.agent import systemd as agent_systemd
from systemdhost import SystemdHost

# run inside the host from its own directory: the agent's client as a file of its own (stdlib only)
CLIENT = """import json, sys, time
sys.path.insert(0, sys.argv[1])
from systemd import Bus, BusError


def until(bus, name, state):
    for _ in range(100):
        if bus.state(name)["active"] == state:
            break
        time.sleep(0.05)
    return bus.state(name)


out = {}
with Bus() as b:
    out["direct"] = b.direct
    out["sshd"] = b.state("pv-sshd.service")
    out["missing"] = b.state("pv-missing.service")
    out["missing_pids"] = b.processes("pv-missing.service")
    b.reload()
    b.start("pv-sleep.service")
    out["started"] = until(b, "pv-sleep.service", "active")
    out["pids"] = b.processes("pv-sleep.service")
    b.stop("pv-sleep.service")
    out["stopped"] = until(b, "pv-sleep.service", "inactive")
    for name in ("pv-missing.service", "a b.service"):
        try:
            b.start(name)
        except BusError as e:
            out.setdefault("refused", []).append([e.name, str(e)])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    with SystemdHost(base=tmp_path_factory.mktemp("sd")) as h:
        yield h


def test_the_host_boots_systemd_as_its_pid_1_on_a_root_of_its_own(host):
    marker = Path(tempfile.gettempdir()) / f"pv-marker-{os.getpid()}"
    marker.write_text("kept")
    try:
        assert host.run(["cat", "/proc/1/comm"]).stdout.strip() == "systemd"
        assert host.run(["hostname"]).stdout.strip() == f"pv-sd-{host._index}"
        assert host.systemctl("is-active", "pv-sshd.service").stdout.strip() == "active"
        assert host.run(["sh", "-c", "echo inside > /tmp/pv-inside"]).returncode == 0
        assert not Path("/tmp/pv-inside").exists() and host.path("/tmp/pv-inside").read_text() == "inside\n"
        assert marker.read_text() == "kept"                      # the machine's /tmp is not the host's
        assert Path(host.root).parent == host.dir and host.path(str(host.dir / "sshd_config")).is_file()
    finally:
        marker.unlink()


def test_the_agent_speaks_to_systemd_over_dbus(host):
    (host.units / "pv-sleep.service").write_text("[Service]\nExecStart=/bin/sleep 600\n")
    shutil.copy(agent_systemd.__file__, host.dir / "systemd.py")
    (host.dir / "client.py").write_text(CLIENT)
    r = host.run([sys.executable, "-I", str(host.dir / "client.py"), str(host.dir)])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["direct"] is True                                  # PID 1's private socket, as root
    assert (out["sshd"]["load"], out["sshd"]["active"], out["sshd"]["sub"]) == ("loaded", "active", "running")
    assert out["sshd"]["main_pid"] > 1
    assert (out["missing"]["load"], out["missing"]["active"], out["missing_pids"]) == ("not-found", "inactive", [])
    assert out["started"]["active"] == "active" and out["pids"] == [out["started"]["main_pid"]]
    assert out["stopped"]["active"] == "inactive" and out["stopped"]["main_pid"] is None
    names = [n for n, _ in out["refused"]]
    assert names[0] == "org.freedesktop.systemd1.NoSuchUnit" and names[1].startswith("org.freedesktop."), out
    assert all("\n" not in text for _, text in out["refused"])


def test_stopping_the_host_ends_every_process_and_cgroup_it_made(tmp_path):
    h = SystemdHost(base=tmp_path)
    h.start()
    init, cgroups = h.init, list(h.cgroups)
    assert cgroups and all(d.is_dir() for d in cgroups)
    h.cleanup()
    assert not Path(f"/proc/{init}").exists()
    assert not any(d.exists() for d in cgroups) and not h.dir.exists()
