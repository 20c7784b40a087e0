"""Fleets the Ansible way, on the session's loopback sshd (one root per inventory host): group and host
vars, group_vars/ and host_vars/, --limit, inventory names, unreachable hosts as rows, saved fleet plans,
status, diff, rollback --dry-run and forward switches."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from provision.errors import HostError
from provision.inventory import load_inventory
from provision.loopback import free_port
from test_core import cli
from wheelhouse import write_lock


@pytest.fixture
def fleet(sshd, tmp_path):
    """An INI inventory: connection vars from [gpu:vars], provision_root from host_vars/ and group_vars/."""
    t = sshd.target
    d = tmp_path / "inventory"
    (d / "host_vars").mkdir(parents=True)
    (d / "group_vars").mkdir()
    (d / "hosts.ini").write_text(
        "[gpu]\ngpu-a\ngpu-b\n\n[spare]\ngpu-c\n\n"
        f"[all:vars]\nansible_host={t.host}\n\n"
        f"[gpu:vars]\nansible_port={t.port}\nansible_user={t.user}\n")
    (d / "group_vars" / "all.yml").write_text(f"ansible_ssh_private_key_file: {t.key_file}\n"
                                              f"ansible_port: {t.port}\nansible_user: {t.user}\n")
    roots = {}
    for name in ("gpu-a", "gpu-b", "gpu-c"):
        roots[name] = tmp_path / f"root-{name}"
        (d / "host_vars" / f"{name}.yml").write_text(f"provision_root: {roots[name]}\n")
    return d / "hosts.ini", roots, ["--known-hosts", str(t.known_hosts)]


def test_inventory_vars_come_from_ansible(fleet, sshd):
    inv, roots, _ = fleet
    ts = load_inventory(inv, known_hosts=Path("kh"))
    assert [t.name for t in ts] == ["gpu-a", "gpu-b", "gpu-c"]
    assert {(t.host, t.port, t.user, t.key_file) for t in ts} == {
        (sshd.target.host, sshd.target.port, sshd.target.user, sshd.target.key_file)}
    assert [t.root for t in ts] == [str(roots[n]) for n in ("gpu-a", "gpu-b", "gpu-c")]
    assert [t.name for t in load_inventory(inv, Path("kh"), limit="gpu:!gpu-b")] == ["gpu-a"]


def test_fleet_plan_saved_and_applied_then_status_diff_rollback(fleet, tmp_path, wheels):
    inv, roots, kh = fleet
    a = write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]])
    b = write_lock(tmp_path / "b.yaml", "stack-b", [wheels["alpha-2.0"], wheels["beta-1.0"]])
    gpu = ["-i", inv, "--limit", "gpu", *kh]

    p = cli("plan", *gpu, "--lock", a, "--out", tmp_path / "plan.json", check=0)
    assert "Plan for gpu-a" in p.stdout and "Plan for gpu-b" in p.stdout and "gpu-c" not in p.stdout
    assert len(json.loads((tmp_path / "plan.json").read_text())) == 2
    p = cli("apply", *gpu, "--plan", tmp_path / "plan.json", check=0)
    assert "Fleet: 2 applied, 0 noop, 0 failed, 0 not-attempted." in p.stdout
    assert "gpu-a" in p.stderr and "✓ switch" in p.stderr          # live per-host progress
    for n in ("gpu-a", "gpu-b"):
        assert os.readlink(roots[n] / "current") == "generations/0001-stack-a"
    assert not roots["gpu-c"].exists()                                # --limit kept it out
    cli("apply", *gpu, "--lock", b, check=0)

    rows = json.loads(cli("status", *gpu, "--json", check=0).stdout)
    assert [(r["host"], r["result"]["current"], r["result"]["lock"], r["result"]["generations"]) for r in rows] == [
        ("gpu-a", "0002-stack-b", "stack-b", 2), ("gpu-b", "0002-stack-b", "stack-b", 2)]
    assert all(r["result"]["disk_bytes"] > 0 and r["result"]["probe"]["status"] == "pass" for r in rows)
    table = cli("status", "-i", inv, *kh, check=0).stdout
    assert "0002-stack-b" in table and "gpu-c" in table and "(none)" in table

    d = cli("diff", "gpu-a", "1", "2", "-i", inv, *kh, check=0).stdout
    assert "Diff on gpu-a: 0001-stack-a → 0002-stack-b" in d and "+ beta" in d and "alpha" in d and "1.0 → 2.0" in d

    dry = cli("rollback", *gpu, "--dry-run", check=0).stdout
    assert "Would roll back gpu-a: current 0002-stack-b → 0001-stack-a" in dry
    assert os.readlink(roots["gpu-a"] / "current") == "generations/0002-stack-b"
    back = cli("rollback", *gpu, "--serial", "1", check=0).stdout
    assert "Rolled back gpu-a" in back and "Rolled back gpu-b" in back
    fwd = cli("rollback", "-i", inv, "--limit", "gpu-b", *kh, "--to", "2", check=0).stdout
    assert "Switched forward gpu-b: current 0001-stack-a → 0002-stack-b" in fwd
    assert os.readlink(roots["gpu-a"] / "current") == "generations/0001-stack-a"

    h = cli("history", *gpu, check=0).stdout
    assert "generations on gpu-a" in h and "generations on gpu-b" in h


def test_unreachable_host_is_a_row_not_an_abort(fleet, tmp_path, wheels):
    inv, roots, kh = fleet
    with open(inv, "a") as f:
        f.write(f"\n[gone]\ngpu-gone ansible_port={free_port()}\n")
    a = write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]])
    p = cli("plan", "-i", inv, *kh, "--lock", a, check=1)
    assert p.stdout.count("Plan for gpu-") == 3 and "gpu-gone: unreachable: cannot connect" in p.stderr
    rows = json.loads(cli("plan", "-i", inv, *kh, "--lock", a, "--json", check=1).stdout)
    assert rows[-1]["host"] == "gpu-gone" and rows[-1]["stage"] == "connect" and "cannot connect" in rows[-1]["error"]
    assert "gpu-gone" in cli("status", "-i", inv, *kh, check=1).stdout


@pytest.mark.parametrize("line,says", [
    ("bad ansible_port=99999", "port 99999 is out of range"),
    ("bad ansible_port=ssh", "bad port 'ssh'"),
    ("bad ansible_host='{{ lookup(\"pipe\", \"id\") }}'", "ansible_host is a template"),
])
def test_bad_inventory_values_are_one_line(tmp_path, line, says):
    inv = tmp_path / "hosts.ini"
    inv.write_text(f"[gpu]\n{line}\n")
    p = cli("history", "-i", inv, check=2)
    assert says in p.stderr and f"{inv}: host bad" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_inventory_mistakes_are_named(fleet, tmp_path):
    inv, _, kh = fleet
    dup = tmp_path / "dup.yml"
    dup.write_text("all:\n  hosts:\n    one: {ansible_host: 10.1.1.1}\n    two: {ansible_host: 10.1.1.1}\n")
    with pytest.raises(HostError, match="hosts one and two are the same host"):
        load_inventory(dup, Path("kh"))
    p = cli("status", "-i", inv, "--limit", "nomatch", *kh, "--json", check=2)
    assert "matches no host" in json.loads(p.stdout)["error"]
    assert "give -i INVENTORY" in cli("history", "somehost", "--limit", "x", check=2).stderr
