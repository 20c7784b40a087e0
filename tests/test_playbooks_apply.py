"""apply.yml, run with `ansible-playbook` as an operator runs it on a loopback fleet: each host ends on the generation
`provision apply` makes of the same lock (its id, lock digest, seal and probes), and `provision status` and
`history` show it; a second run changes nothing; a batch with a failed probe beyond max_fail_percentage switches
no host (the linear strategy's barrier between the stage and switch tasks) and the later batches never start;
a bad lock fails the task in one line naming its file; check mode only plans."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from provision import apply as applymod, lock as lockmod
from provision.inventory import load_inventory
from provision.loopback import free_port
from test_core import cli
from test_fleet_canary import arm, faulty_smi
from test_playbooks import ansible_playbook, playbook_dir, results
from wheelhouse import write_lock

HOSTS = ["a1", "a2", "a3"]
BY_CLI = "a4"                 # the same lock applied by `provision apply`, for comparison
CANARY = ["c1", "c2", "c3", "c4"]
BAD = "c2"                    # its GPU's driver stops answering: its probes fail (batch 1 of serial 2: c1 c2)
SAME = ("lock_name", "lock_digest", "status", "probes_summary", "skipped_probes", "stack", "python", "installer")


@pytest.fixture(scope="module")
def site(sshd, wheels, tmp_path_factory):
    """Eight inventory hosts on one loopback sshd, each its own root, all on lock A (0001-stack-a); c2's GPU fails
    once armed. (inventory, roots, known_hosts, lock B, c2's nvidia-smi)."""
    d = tmp_path_factory.mktemp("applyplay")
    t = sshd.target
    smi = faulty_smi(d)
    names = HOSTS + [BY_CLI] + CANARY
    roots = {h: d / f"root-{h}" for h in names}
    inv = d / "inv.yml"
    inv.write_text(f"all:\n  vars: {{ansible_host: {t.host}, ansible_port: {t.port}, ansible_user: {t.user}, "
                   f"ansible_ssh_private_key_file: {t.key_file}, ansible_python_interpreter: /usr/bin/python3}}\n"
                   "  hosts:\n" + "".join(f"    {h}: {{provision_root: {roots[h]}"
                                          + (f", provision_nvidia_smi: {smi}" if h == BAD else "") + "}\n"
                                          for h in names))
    a = write_lock(d / "a.yaml", "stack-a", [wheels["alpha-1.0"]])
    b = write_lock(d / "b.yaml", "stack-b", [wheels["alpha-2.0"]])
    run = applymod.apply_fleet(load_inventory(inv, t.known_hosts), lockmod.load(a))
    assert {r.status for r in run.reports} == {"applied"}, [r.error for r in run.reports]
    return inv, roots, t.known_hosts, b, smi


def play(inv: Path, kh: Path, *args: str):
    """apply.yml as an operator runs it, provision's host steps checking host keys against `kh` as Ansible's do."""
    return ansible_playbook(inv, "apply.yml", "-e", f"provision_known_hosts={kh}", *args, known_hosts=kh)


def current(roots, h) -> str:
    return os.readlink(roots[h] / "current").removeprefix("generations/")


def manifest(roots, h, gen: str) -> dict:
    return json.loads((roots[h] / "generations" / gen / "manifest.json").read_text())


def test_apply_playbook_gives_each_host_the_generation_provision_apply_gives(site):
    inv, roots, kh, b, _ = site
    limit = ":".join(HOSTS)
    p = play(inv, kh, "-e", f"lock={b}", "--limit", limit)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    staged, switched = results(p, "stage"), results(p, "switch")
    for h in HOSTS:
        s = staged[h]
        assert (s["status"], s["generation"], s["previous"], s["changed"]) == \
            ("stopped", "0002-stack-b", "0001-stack-a", True), s
        assert s["plan"]["action"] == "build" and s["probes"]["status"] == "pass", s
        assert s["warned"] == [] and "warnings" not in s, s         # Ansible's deprecated result key: not used
        assert [st["name"] for st in s["steps"]] == ["recover", "facts", "plan", "build", "patch", "seal", "probe"]
        assert (switched[h]["from"], switched[h]["to"], switched[h]["changed"]) == \
            ("0001-stack-a", "0002-stack-b", True), switched[h]

    rows = {r["host"]: r["result"] for r in json.loads(
        cli("status", "-i", inv, "--known-hosts", kh, "--limit", limit, "--json", check=0).stdout)}
    assert {h: (rows[h]["current"], rows[h]["lock"]) for h in HOSTS} == {h: ("0002-stack-b", "stack-b") for h in HOSTS}
    for h in HOSTS:
        hist = json.loads(cli("history", h, "-i", inv, "--known-hosts", kh, "--json", check=0).stdout)
        assert hist["current"] == "0002-stack-b", hist
        ev = hist["events"][-1]
        assert (ev["event"], ev["from"], ev["to"], ev["lock"]) == \
            ("apply", "0001-stack-a", "0002-stack-b", "stack-b"), ev        # the play's switch: the apply it completes

    cli("apply", BY_CLI, "-i", inv, "--known-hosts", kh, "--lock", b, check=0)
    theirs = manifest(roots, BY_CLI, "0002-stack-b")
    assert current(roots, BY_CLI) == "0002-stack-b" and theirs["status"] == "ready"
    status = {r["host"]: r["result"] for r in json.loads(
        cli("status", "-i", inv, "--known-hosts", kh, "--limit", f"{limit}:{BY_CLI}", "--json", check=0).stdout)}
    def seen(row: dict) -> tuple:         # what status shows of a host, less times and sizes
        return (row["current"], row["lock"], row["broken"], row["probe"]["status"], row["probe"]["summary"],
                row["verify"]["verdict"], row["verify"]["files"], row["generations"], row["ready"],
                row["last_attempt"])
    assert {h: seen(status[h]) for h in HOSTS} == {h: seen(status[BY_CLI]) for h in HOSTS}
    for h in HOSTS:
        ours = manifest(roots, h, "0002-stack-b")
        assert {k: ours.get(k) for k in SAME} == {k: theirs.get(k) for k in SAME}, h
        assert ours["verify"]["verdict"] == theirs["verify"]["verdict"] == "clean"
        assert ours["stopped"].startswith("staged: ")             # how it was switched: by the play

    history = {h: (roots[h] / "history.jsonl").read_bytes() for h in HOSTS}
    p = play(inv, kh, "-e", f"lock={b}", "--limit", limit)         # again: nothing to do
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    again = results(p, "stage")
    assert {h: (again[h]["status"], again[h]["generation"], again[h]["changed"]) for h in HOSTS} == \
        {h: ("noop", "0002-stack-b", False) for h in HOSTS}
    assert all(line.startswith("skipping:") for line in p.stdout.splitlines() if line.startswith(("skipping:",
                                                                                                   "changed:")))
    assert "changed=0" in p.stdout and "failed=0" in p.stdout
    assert {h: (roots[h] / "history.jsonl").read_bytes() for h in HOSTS} == history
    assert sorted(os.listdir(roots["a1"] / "generations")) == ["0001-stack-a", "0002-stack-b"]


def test_a_failed_probe_in_a_batch_switches_no_host_of_it_and_stops_the_play(site):
    """serial 2,100% (batches c1 c2, then c3 c4), max_fail 0: c2 fails its probes; c1, its partner in batch 1,
    passed its own and keeps `current` (its new generation built, probed, not current); batch 2 (c3 c4) never
    starts; ansible-playbook fails. Run again once the GPU is mended, the play finishes the rollout."""
    inv, roots, kh, b, smi = site
    arm(smi)
    untouched = {h: (roots[h] / "history.jsonl").read_bytes() for h in ("c3", "c4")}
    p = play(inv, kh, "-e", f"lock={b}", "-e", "serial=2,100%", "-e", "max_fail=0", "--limit", ":".join(CANARY))
    assert p.returncode != 0, p.stdout[-3000:]
    staged = results(p, "stage")
    assert set(staged) == {"c1", "c2"}, staged
    assert staged["c1"]["status"] == "stopped" and staged["c1"]["probes"]["status"] == "pass", staged["c1"]
    bad = staged[BAD]
    assert bad["_said"] == "fatal" and bad["status"] == "failed" and bad["failed_step"] == "probe", bad
    assert bad["msg"].startswith(f"{BAD}: probes failed in 0002-stack-b: ") and "\n" not in bad["msg"], bad["msg"]
    assert bad["msg"].endswith("; current left at 0001-stack-a"), bad["msg"]
    assert "TASK [switch]" not in p.stdout, p.stdout[-3000:]
    assert [current(roots, h) for h in CANARY] == ["0001-stack-a"] * 4
    kept = manifest(roots, "c1", "0002-stack-b")
    assert kept["status"] == "ready" and kept["probes_summary"] and kept["stopped"].startswith("staged: "), kept
    assert manifest(roots, BAD, "0002-stack-b")["status"] == "failed"
    for h in ("c3", "c4"):
        assert sorted(os.listdir(roots[h] / "generations")) == ["0001-stack-a"], h
        assert (roots[h] / "history.jsonl").read_bytes() == untouched[h], h

    (smi.parent / "fault").unlink()                   # the GPU mended: the same play again finishes the rollout
    p = play(inv, kh, "-e", f"lock={b}", "-e", "serial=2,100%", "--limit", ":".join(CANARY))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    staged = results(p, "stage")
    assert (staged["c1"]["plan"]["action"], staged["c1"]["generation"], staged["c1"]["changed"]) == \
        ("reuse", "0002-stack-b", False), staged["c1"]                  # the kept one, checked and probed again
    assert [st["name"] for st in staged["c1"]["steps"]] == ["recover", "facts", "plan", "check", "probe"]
    assert {h: staged[h]["generation"] for h in CANARY} == {"c1": "0002-stack-b", "c2": "0003-stack-b",
                                                            "c3": "0002-stack-b", "c4": "0002-stack-b"}
    assert {h: current(roots, h) for h in CANARY} == {h: staged[h]["generation"] for h in CANARY}


def test_apply_playbook_ships_with_its_module_and_action_plugin():
    d = playbook_dir()
    for f in ("apply.yml", "library/provision_apply.py", "action_plugins/provision_apply.py"):
        assert (d / f).is_file(), f
    assert "apply.yml" in cli("playbooks", check=0).stdout


def test_a_bad_lock_fails_the_task_in_one_line_naming_its_file(site, tmp_path):
    inv, roots, kh, b, _ = site
    history = (roots["a1"] / "history.jsonl").read_bytes()
    gone = tmp_path / "gone.yaml"
    p = play(inv, kh, "-e", f"lock={gone}", "--limit", "a1")
    said = results(p, "stage")["a1"]
    assert p.returncode == 2 and said["_said"] == "fatal", p.stdout[-2000:]
    assert said["msg"] == f"{gone}: cannot read: No such file or directory", said

    bad = tmp_path / "bad.yaml"
    bad.write_text(b.read_text().replace("name: stack-b", "name: [stack-b"))
    p = play(inv, kh, "-e", f"lock={bad}", "--limit", "a1")
    said = results(p, "stage")["a1"]
    assert p.returncode == 2 and said["_said"] == "fatal", p.stdout[-2000:]
    assert said["msg"].startswith(f"{bad}:") and "\n" not in said["msg"], said["msg"]
    line = said["msg"].removeprefix(f"{bad}:").split(":")[0]
    assert line.isdigit(), said["msg"]                                   # file:line
    assert (roots["a1"] / "history.jsonl").read_bytes() == history


def test_a_host_not_reached_is_unreachable_and_the_others_go_on(site, tmp_path):
    inv, roots, kh, b, _ = site
    with_dead = tmp_path / "inv.yml"
    with_dead.write_text(inv.read_text() + f"    dead: {{ansible_port: {free_port()}, provision_root: {tmp_path}}}\n")
    p = play(with_dead, kh, "-e", f"lock={b}", "--limit", "a3:dead", "--check")
    assert p.returncode == 4, p.stdout[-3000:] + p.stderr[-3000:]        # Ansible's exit for unreachable hosts
    said = results(p, "stage")
    assert said["dead"]["unreachable"] is True and said["dead"]["msg"].startswith("dead: "), said["dead"]
    assert "\n" not in said["dead"]["msg"] and (said["a3"]["status"], said["a3"]["changed"]) == ("noop", False)
    assert "dead                       : ok=1    changed=0    unreachable=1" in p.stdout, p.stdout[-1000:]  # host keys


def test_check_mode_plans_only(site, wheels, tmp_path):
    inv, roots, kh, b, _ = site
    c = write_lock(tmp_path / "c.yaml", "stack-c", [wheels["alpha-1.0"], wheels["beta-1.0"]])
    history = (roots["a2"] / "history.jsonl").read_bytes()
    p = play(inv, kh, "-e", f"lock={c}", "--limit", "a2", "--check")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    said = results(p, "stage")["a2"]
    assert (said["status"], said["changed"], said["plan"]["action"]) == ("planned", True, "build"), said
    assert said["plan"]["summary"]["add"] >= 1, said["plan"]
    assert "TASK [switch]" in p.stdout and "changed: [a2]" not in p.stdout.split("TASK [switch]")[1]
    assert (roots["a2"] / "history.jsonl").read_bytes() == history
    assert not any("stack-c" in g for g in os.listdir(roots["a2"] / "generations"))

    far = write_lock(tmp_path / "far.yaml", "stack-far", [wheels["alpha-1.0"]], python="3.99")
    p = play(inv, kh, "-e", f"lock={far}", "--limit", "a2", "--check")        # apply would refuse: so does --check
    said = results(p, "stage")["a2"]
    assert p.returncode == 2 and said["_said"] == "fatal" and said["status"] == "planned", said
    assert said["msg"].startswith("a2: host has no working Python 3.99") and "\n" not in said["msg"], said["msg"]
    assert said["msg"].removeprefix("a2: ").split(" (+")[0] == said["plan"]["errors"][0], said


def test_apply_playbook_over_a_local_connection_is_provision_apply_local(wheels, tmp_path):
    """`ansible_connection=local` is `--local`: the host is this machine, its root the inventory's."""
    root = tmp_path / "root"
    inv = tmp_path / "inv"
    inv.write_text(f"gpu ansible_connection=local provision_root={root} ansible_python_interpreter=/usr/bin/python3\n")
    a = write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]])
    p = ansible_playbook(inv, "apply.yml", "-e", f"lock={a}")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (results(p, "stage")["gpu"]["status"], results(p, "switch")["gpu"]["to"]) == ("stopped", "0001-stack-a")
    st = json.loads(cli("status", "--local", "--root", root, "--json", check=0).stdout)[0]["result"]
    assert (st["current"], st["lock"]) == ("0001-stack-a", "stack-a"), st
