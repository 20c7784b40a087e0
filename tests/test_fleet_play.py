"""status, gc and rollback of an inventory run their playbooks through Ansible, one run for the fleet: each host's
result is what the same verb gives for that host alone, a gc --dry-run is the play's check mode and removes nothing,
and a rollback goes on past a host whose port is closed, naming it. Three inventory hosts share the session's
loopback sshd, each with its own root, on a third generation (stack-c) with two before it."""
from __future__ import annotations

import json
import os
import re

import pytest

from provision import apply as applymod, lock as lockmod
from provision.inventory import load_inventory
from provision.loopback import free_port
from provision.runner import RUNS
from test_core import cli
from loophosts import write_inventory
from wheelhouse import write_lock

HOSTS = ["f1", "f2", "f3"]


@pytest.fixture(scope="module")
def fleet(sshd, wheels, tmp_path_factory):
    d = tmp_path_factory.mktemp("fleetplay")
    t = sshd.target
    roots = {h: d / f"root-{h}" for h in HOSTS}
    inv = write_inventory(d / "inv.yml", t, roots)
    locks = [write_lock(d / "a.yaml", "stack-a", [wheels["alpha-1.0"]]),
             write_lock(d / "b.yaml", "stack-b", [wheels["alpha-2.0"]]),
             write_lock(d / "c.yaml", "stack-c", [wheels["alpha-2.0"], wheels["beta-1.0"]])]
    for lk in locks:
        run = applymod.apply_fleet(load_inventory(inv, t.known_hosts), lockmod.load(lk))
        assert {r.status for r in run.reports} == {"applied"}, [r.error for r in run.reports]
    return inv, roots, ["--known-hosts", str(t.known_hosts)], t


def alone(t, root) -> list:
    """The same host reached as one host (user@host:port), without the inventory."""
    return [f"{t.user}@{t.host}:{t.port}", "--key", t.key_file, "--known-hosts", t.known_hosts, "--root", root]


def plays(name: str, root) -> set:
    """This fleet's Ansible runs of playbook `name` (other tests run theirs meanwhile): those whose inventory
    names `root`."""
    def ours(d) -> bool:
        try:
            return str(root) in (d / "inventory" / "hosts.yml").read_text()
        except OSError:
            return False
    return {d for d in RUNS.glob(f"*-{name}-{name}") if ours(d)}


def current(roots, h) -> str:
    return os.readlink(roots[h] / "current").removeprefix("generations/")


def test_a_fleet_applys_switch_is_recorded_as_the_apply_it_completes(fleet):
    """Each host's history says what its switches were: the applies of stack-a, -b and -c, each with its lock, as a
    one-host apply records them (the play's switch task), never as a rollback."""
    inv, roots, kh, t = fleet
    for h in HOSTS:
        events = [json.loads(ln) for ln in (roots[h] / "history.jsonl").read_text().splitlines()]
        switches = [e for e in events if e.get("event") in ("apply", "switch", "rollback")][:3]
        assert [(e["event"], e["from"], e["to"], e["lock"]) for e in switches] == [
            ("apply", None, "0001-stack-a", "stack-a"), ("apply", "0001-stack-a", "0002-stack-b", "stack-b"),
            ("apply", "0002-stack-b", "0003-stack-c", "stack-c")], events


def test_status_of_an_inventory_is_each_hosts_status_through_one_play(fleet):
    inv, roots, kh, t = fleet
    before = plays("status", roots["f1"])
    rows = json.loads(cli("status", "-i", inv, *kh, "--json", check=0).stdout)
    assert len(plays("status", roots["f1"]) - before) == 1                   # one Ansible run for the fleet
    assert [r["host"] for r in rows] == HOSTS
    for r in rows:
        one = json.loads(cli("status", *alone(t, roots[r["host"]]), "--json", check=0).stdout)
        assert len(one) == 1, one
        fleet_disk, alone_disk = r["result"].pop("disk_bytes"), one[0]["result"].pop("disk_bytes")
        assert r["result"] == one[0]["result"], (r, one)
        # the root's bytes move between the two calls with what runs beside them (each run's own scratch under the
        # root, a previous run's being removed): the same root within a MiB
        assert fleet_disk > 0 and abs(fleet_disk - alone_disk) <= 1 << 20, (fleet_disk, alone_disk)
        assert r["result"]["current"] == "0003-stack-c" and r["result"]["generations"] == 3
    table = cli("status", "-i", inv, *kh, check=0).stdout
    assert all(f"{h} " in table for h in HOSTS) and table.count("0003-stack-c") == 3, table

    h = json.loads(cli("history", "-i", inv, *kh, "--json", check=0).stdout)
    one = json.loads(cli("history", *alone(t, roots["f2"]), "--json", check=0).stdout)
    assert h[1]["host"] == "f2" and h[1]["result"] == one, (h[1], one)


def test_one_host_without_an_inventory_and_local_run_the_verbs_playbook(fleet, tmp_path):
    """A host named without -i, and --local, go through the verb's playbook as an inventory's hosts do: one Ansible
    run each, on an inventory of that one host (`connection: local` for --local)."""
    inv, roots, kh, t = fleet
    before = plays("status", roots["f1"])
    one = json.loads(cli("status", *alone(t, roots["f1"]), "--json", check=0).stdout)
    assert len(plays("status", roots["f1"]) - before) == 1 and one[0]["result"]["current"] == "0003-stack-c"
    local = tmp_path / "local-root"
    before = plays("history", local)
    h = json.loads(cli("history", "--local", "--root", local, "--json", check=0).stdout)
    (run,) = plays("history", local) - before
    hosts = (run / "inventory" / "hosts.yml").read_text()
    assert re.search(r"ansible_connection: \"local\"", hosts) and "ansible_host" not in hosts, hosts
    assert h["current"] is None and h["generations"] == [], h


def test_gc_dry_run_of_an_inventory_is_the_plays_check_says_each_hosts_progress_and_changes_nothing(fleet):
    inv, roots, kh, t = fleet
    kept = {h: sorted(os.listdir(roots[h] / "generations")) for h in HOSTS}
    history = {h: (roots[h] / "history.jsonl").read_text() for h in HOSTS}
    p = cli("gc", "-i", inv, *kh, "--keep", "1", "--dry-run", check=0)
    for h in HOSTS:
        assert f"{h}: would remove 1 generations," in p.stdout and "kept current 0003-stack-c and rollback target " \
            "0002-stack-b" in p.stdout, p.stdout
    assert p.stdout.count("- 0001-stack-a") == 3, p.stdout + p.stderr
    assert all(f"{h}: gc survey" in p.stderr for h in HOSTS), p.stderr       # each host's progress as it collects
    before = plays("gc", roots["f1"])
    p = cli("gc", "-i", inv, *kh, "--keep", "1", "--dry-run", "--json", check=0)
    rows = json.loads(p.stdout)
    assert len(plays("gc", roots["f1"]) - before) == 1
    assert all(f"{h}: gc survey" in p.stderr for h in HOSTS), p.stderr       # --json: the progress on stderr too
    for r in rows:
        one = json.loads(cli("gc", *alone(t, roots[r["host"]]), "--keep", "1", "--dry-run", "--json",
                             check=0).stdout)
        assert [g["id"] for g in r["result"]["generations"]] == ["0001-stack-a"], r
        assert {k: r["result"][k] for k in one} == one and set(r["result"]) == set(one), (r, one)
    assert {h: sorted(os.listdir(roots[h] / "generations")) for h in HOSTS} == kept
    assert {h: (roots[h] / "history.jsonl").read_text() for h in HOSTS} == history


def test_rollback_of_an_inventory_goes_past_a_closed_port_naming_it(fleet, tmp_path):
    inv, roots, kh, t = fleet
    with_dead = tmp_path / "with-dead.yml"
    with_dead.write_text(inv.read_text().replace("  hosts:\n", "  hosts:\n"
                                                 f"    dead: {{ansible_port: {free_port()}, provision_root: "
                                                 f"{tmp_path / 'root-dead'}}}\n", 1))
    before = plays("rollback", tmp_path / 'root-dead')
    p = cli("rollback", "-i", with_dead, *kh, "--timeout", "3", "--dry-run", check=1)
    assert len(plays("rollback", tmp_path / 'root-dead') - before) == 1                 # one Ansible run, in check mode
    would = "current 0003-stack-c → 0002-stack-b (dry run: nothing changed)."
    assert sorted(ln for ln in p.stdout.splitlines() if ln) == [f"Would roll back {h}: {would}" for h in HOSTS], \
        p.stdout                         # each host's row as it finished
    assert p.stderr.startswith("dead: unreachable: ") and len(p.stderr.splitlines()) == 1, p.stderr
    assert [current(roots, h) for h in HOSTS] == ["0003-stack-c"] * 3

    p = cli("rollback", "-i", with_dead, *kh, "--timeout", "3", "--json", check=1)
    rows = json.loads(p.stdout)                                   # one JSON document: a row per host
    assert [r["host"] for r in rows] == ["dead", *HOSTS]
    assert rows[0]["stage"] == "connect" and rows[0]["exit_code"] == 1 and "result" not in rows[0], rows[0]
    for r in rows[1:]:
        res = r["result"]
        assert (res["from"], res["to"], res["switched"], res["warnings"]) == \
            ("0003-stack-c", "0002-stack-b", True, []), res
        assert res["seconds"] > 0 and res["check"]["verdict"] == "clean", res
    assert [current(roots, h) for h in HOSTS] == ["0002-stack-b"] * 3
    assert not (tmp_path / "root-dead").exists()


def test_plan_and_apply_of_an_inventory_are_one_play_each_and_a_saved_plan_is_applied_exactly(fleet, tmp_path, wheels):
    """plan -i is apply.yml in check mode (one run): each host's plan is the one `plan` gives that host alone. A saved
    fleet plan goes to apply.yml as a file, each host applying its own entry: a host that changed since is refused,
    the others switch (one run)."""
    inv, roots, kh, t = fleet
    a = write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]])
    before = {d for d in RUNS.glob("*-apply-apply")}
    rows = json.loads(cli("plan", "-i", inv, *kh, "--lock", a, "--json", check=0).stdout)
    assert len({d for d in RUNS.glob("*-apply-apply")
                if str(roots["f1"]) in (d / "inventory" / "hosts.yml").read_text()} - before) == 1
    assert [r["host"] for r in rows] == HOSTS
    for r in rows:
        one = json.loads(cli("plan", *alone(t, roots[r["host"]]), "--lock", a, "--json", check=0).stdout)
        assert {k: v for k, v in r["result"].items() if k != "host"} == {k: v for k, v in one.items() if k != "host"}
        assert (r["result"]["host"], r["result"]["action"], r["result"]["reuse"]) == (r["host"], "reuse",
                                                                                      "0001-stack-a")
    saved = tmp_path / "plans.json"
    cli("plan", "-i", inv, *kh, "--lock", a, "--out", saved, check=0)
    was = current(roots, "f2")
    cli("rollback", *alone(t, roots["f2"]), "--to", "3", check=0)       # f2 changes after its plan was made
    before = plays("apply", roots["f1"]) | {d for d in RUNS.glob("*-apply-fleet")}
    out = json.loads(cli("apply", "-i", inv, *kh, "--plan", saved, "--max-fail", "1", "--json", check=1).stdout)
    assert len({d for d in RUNS.glob("*-apply-fleet")
                if str(roots["f1"]) in (d / "inventory" / "hosts.yml").read_text()} - before) == 1
    rep = {r["host"]: r for r in out["reports"]}
    assert rep["f2"]["status"] == "failed" and "the host changed since this plan was made" in rep["f2"]["error"]
    assert current(roots, "f2") == "0003-stack-c" != was
    for h in ("f1", "f3"):
        assert (rep[h]["status"], current(roots, h)) == ("reused", "0001-stack-a"), rep[h]
