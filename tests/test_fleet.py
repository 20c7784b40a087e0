"""A fleet from an Ansible inventory: two hosts in their own network namespaces, each with its own
sshd and root; batches (--serial) stop the rollout at the first failing batch."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from provision.loopback import LoopbackHost
from provision.transport import trust_host
from test_core import cli
from wheelhouse import write_lock


@pytest.fixture
def fleet(tmp_path):
    hosts = [LoopbackHost(netns_index=i).start() for i in (31, 32)]
    kh = tmp_path / "known_hosts"
    for h in hosts:
        t = h.target
        t.known_hosts = kh
        trust_host(t)
    yield hosts, kh
    for h in hosts:
        h.cleanup()


def inventory(path: Path, hosts, roots) -> Path:
    lines = ["all:", "  hosts:"]
    for i, (h, root) in enumerate(zip(hosts, roots)):
        lines += [f"    gpu{i}:", f"      ansible_host: {h.address}", f"      ansible_port: {h.port}",
                  "      ansible_user: root", f"      ansible_ssh_private_key_file: {h.dir / 'client_ed25519'}",
                  f"      provision_root: {root}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_fleet_apply_and_failed_batch_stops_rollout(fleet, tmp_path, wheels):
    hosts, kh = fleet
    a = write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]])
    inv = inventory(tmp_path / "inv.yml", hosts, [h.root for h in hosts])
    out = cli("apply", "-i", inv, "--known-hosts", kh, "--lock", a, "--serial", "1", check=0).stdout
    assert "Fleet: 2 applied, 0 noop, 0 failed, 0 not-attempted." in out
    for h in hosts:
        assert os.readlink(Path(h.root) / "current") == "generations/0001-stack-a"

    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the first host's root should be\n")
    inv2 = inventory(tmp_path / "inv2.yml", hosts, [blocked, hosts[1].root + "-2"])
    p = cli("apply", "-i", inv2, "--known-hosts", kh, "--lock", a, "--serial", "1", check=1)
    assert "1 failed, 1 not-attempted" in p.stdout
    assert not Path(hosts[1].root + "-2").exists()
