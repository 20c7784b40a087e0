"""A batch is a barrier (Ansible's linear strategy): two failures in one batch beyond --max-fail, and no partner
switches, even one whose probes passed first; a fleet rollback goes on past a dead host and a hung one. Four
inventory hosts share the session's loopback sshd, each with its own root; a failing host's GPU driver stops
answering after its first query (nvidia-smi's recorded real output, then its error)."""
from __future__ import annotations

import os

import pytest

from provision import apply as applymod, lock as lockmod
from provision.inventory import load_inventory
from provision.loopback import free_port
from test_core import cli
from test_fleet_canary import arm, faulty_smi
from wheelhouse import write_lock

HOSTS = ["c1", "c2", "c3", "c4"]
BAD = ("c2", "c4")


@pytest.fixture(scope="module")
def quad(sshd, wheels, tmp_path_factory):
    """Four hosts on lock A (0001-stack-a); c2 and c4 each with a GPU that fails once armed."""
    d = tmp_path_factory.mktemp("barrier")
    t = sshd.target
    smi = {}
    for h in BAD:
        (d / f"gpu-{h}").mkdir()
        smi[h] = faulty_smi(d / f"gpu-{h}")
    roots = {h: d / f"root-{h}" for h in HOSTS}
    inv = d / "inv.yml"
    inv.write_text(f"all:\n  vars: {{ansible_host: {t.host}, ansible_port: {t.port}, ansible_user: {t.user}, "
                   f"ansible_ssh_private_key_file: {t.key_file}}}\n  hosts:\n"
                   + "".join(f"    {h}: {{provision_root: {roots[h]}"
                             + (f", provision_nvidia_smi: {smi[h]}" if h in BAD else "") + "}\n" for h in HOSTS))
    a = write_lock(d / "a.yaml", "stack-a", [wheels["alpha-1.0"]])
    b = write_lock(d / "b.yaml", "stack-b", [wheels["alpha-2.0"]])
    run = applymod.apply_fleet(load_inventory(inv, t.known_hosts), lockmod.load(a))
    assert {r.status for r in run.reports} == {"applied"}, [r.error for r in run.reports]
    return d, inv, roots, t.known_hosts, b, smi


def current(roots, h) -> str:
    return os.readlink(roots[h] / "current").removeprefix("generations/")


def test_two_failures_in_a_batch_and_no_partner_switches(quad):
    """--max-fail 1 over one batch of four: c2 and c4 fail their probes only after c1 and c3 have passed theirs
    (each failing host's GPU answers its probes once both partners' probes are seen done), so without the barrier
    c1 and c3 would switch."""
    d, inv, roots, kh, b, smi = quad
    for s in smi.values():
        arm(s, hold=True)
    probed = set()

    def progress_for(host):
        def step(name, state, detail):
            if host not in BAD and (name, state) == ("probe", "done"):
                probed.add(host)
                if probed == {"c1", "c3"}:
                    for s in smi.values():
                        (s.parent / "go").touch()
        return step

    run = applymod.apply_fleet(load_inventory(inv, kh), lockmod.load(b), max_fail="1", progress_for=progress_for)
    assert probed == {"c1", "c3"}
    rep = {r.host: r for r in run.reports}
    assert run.failed_batch == 1 and sorted(run.failed_hosts) == list(BAD)
    for h in BAD:
        assert rep[h].status == "failed" and rep[h].failed_step == "probe", rep[h].error
    for h in ("c1", "c3"):
        assert rep[h].probes["status"] == "pass"
        assert rep[h].status == "stopped" and not any(s.name == "switch" for s in rep[h].steps), rep[h].error
        assert rep[h].error.startswith(f"{h}: batch 1/1 had failed (")
    assert [current(roots, h) for h in HOSTS] == ["0001-stack-a"] * 4
    assert run.still_switched == []


def test_fleet_rollback_goes_past_a_dead_and_a_hung_host(quad, silent, wheels):
    d, inv, roots, kh, b, smi = quad
    for s in smi.values():                            # every host on a second generation to go back from
        (s.parent / "fault").unlink(missing_ok=True)
    run = applymod.apply_fleet(load_inventory(inv, kh), lockmod.load(b))
    assert {r.status for r in run.reports} <= {"applied", "reused"}, [r.error for r in run.reports]
    on_b = {h: current(roots, h) for h in HOSTS}
    assert {g.split("-", 1)[1] for g in on_b.values()} == {"stack-b"}
    with_dead = d / "with-dead.yml"
    with_dead.write_text(inv.read_text().replace("  hosts:\n", "  hosts:\n"
                                                 f"    dead: {{ansible_port: {free_port()}, provision_root: /x}}\n"
                                                 f"    hung: {{ansible_port: {silent}, provision_root: /x}}\n", 1))
    for dry in (True, False):
        p = cli("rollback", "-i", with_dead, "--known-hosts", kh, "--timeout", "3", *(["--dry-run"] if dry else []),
                check=1)
        for h in HOSTS:
            said = "Would roll back" if dry else "Rolled back"
            assert f"{said} {h}: current {on_b[h]} → 0001-stack-a" in p.stdout, p.stdout
        for h in ("dead", "hung"):
            assert f"{h}: unreachable" in p.stderr, p.stderr
        assert "had failed" not in p.stdout + p.stderr
    assert [current(roots, h) for h in HOSTS] == ["0001-stack-a"] * 4
