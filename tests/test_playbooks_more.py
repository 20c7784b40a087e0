"""The read-only playbooks on a loopback fleet, each against the CLI verb it stands beside: verify.yml gives
`provision verify`'s verdicts (and fails the drifted host, naming its file), facts.yml the facts `provision` reads
through `Facts.from_reply`, logs.yml the logs `provision logs` shows; and Ansible's own connect timeout ends a
run against a host that never speaks SSH."""
from __future__ import annotations

import copy
import json
import os
import subprocess
from datetime import datetime
from pathlib import Path

from provision import runner
from provision.facts import Facts
from provision.loopback import free_port
from provision.runner import RUNS
from provision.transport import KEEPALIVE_COUNT, TIMEOUT
from test_core import cli
from test_playbooks import HOSTS, ansible_playbook, fleet, results  # noqa: F401 - fleet: the module's fixture

VOLATILE = {"disk_free_bytes"}     # what changes between two readings of one host


def site(root: Path, gen: str) -> Path:
    return next((root / "generations" / gen / "venv" / "lib").glob("python3*/site-packages"))


def test_verify_playbook_fails_the_drifted_host_naming_its_file_as_provision_verify_does(fleet):
    inv, roots, common = fleet
    p = ansible_playbook(inv, "verify.yml", "--check", known_hosts=common[-1])     # read-only: check mode runs it
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    clean = results(p, "verify")
    assert {h: (clean[h]["generation"], clean[h]["verdict"], clean[h]["changed"]) for h in HOSTS} == \
        {h: ("0002-stack-b", "clean", False) for h in HOSTS}

    victim = site(roots["p2"], "0002-stack-b") / "alpha" / "__init__.py"
    text = victim.read_text()
    subprocess.run(["chattr", "-i", str(victim)], check=True)     # root, deliberately: the store's entry
    os.chmod(victim, 0o644)
    victim.write_text(text + "TAMPERED = 1\n")
    try:
        history = (roots["p2"] / "history.jsonl").read_text()
        p = ansible_playbook(inv, "verify.yml", known_hosts=common[-1])
        assert p.returncode == 2, p.stdout[-3000:] + p.stderr[-3000:]
        said = results(p, "verify")
        assert said["p2"]["_said"] == "fatal" and said["p2"]["verdict"] == "drift", said["p2"]
        assert said["p2"]["recorded"] is False and (roots["p2"] / "history.jsonl").read_text() == history
        assert said["p2"]["msg"].startswith("0002-stack-b drifted: alpha 2.0: 1 changed (alpha/__init__.py)") \
            and "\n" not in said["p2"]["msg"], said["p2"]["msg"]
        assert {h: (said[h]["_said"], said[h]["verdict"]) for h in ("p1", "p3")} == \
            {h: ("ok", "clean") for h in ("p1", "p3")}

        p = ansible_playbook(inv, "verify.yml", "-e", "generation=1", "--limit", "p2", known_hosts=common[-1])
        assert p.returncode == 0 and results(p, "verify")["p2"]["generation"] == "0001-stack-a", p.stdout[-2000:]

        cp = cli("verify", *common, "--json", check=1)
        rows = {r["host"]: r["result"] for r in json.loads(cp.stdout)}
        for h in HOSTS:
            assert (rows[h]["generation"], rows[h]["verdict"], rows[h]["rows"], rows[h]["lines"],
                    rows[h]["counts"]) == (said[h]["generation"], said[h]["verdict"], said[h]["rows"],
                                           said[h]["lines"], said[h]["counts"]), h
    finally:
        victim.write_text(text)
        os.chmod(victim, 0o444)
        subprocess.run(["chattr", "+i", str(victim)], check=True)


def test_verify_playbook_names_an_unknown_generation(fleet):
    inv, roots, common = fleet
    p = ansible_playbook(inv, "verify.yml", "-e", "generation=9", "--limit", "p1", known_hosts=common[-1])
    said = results(p, "verify")["p1"]
    assert p.returncode == 2 and said["_said"] == "fatal", p.stdout[-2000:]
    assert said["msg"] == "no generation 9 (have: 0001-stack-a, 0002-stack-b)", said


def test_facts_playbook_reply_is_what_provision_reads(fleet):
    inv, roots, common = fleet
    p = ansible_playbook(inv, "facts.yml", "--check", known_hosts=common[-1])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = results(p, "facts")
    cp = cli("hosts", "facts", *common, "--json", check=0)
    cli_view = {r["host"]: r["result"] for r in json.loads(cp.stdout)}
    for h in HOSTS:
        assert got[h]["changed"] is False and set(got[h]) - {"_said", "changed"} <= {"facts", "invocation"}, got[h]
        facts = Facts.from_reply(got[h]["facts"], h).to_json()     # the module's return, unchanged
        assert facts["current"] == "0002-stack-b" and facts["root"] == str(roots[h])
        assert [g["id"] for g in facts["generations"]] == ["0001-stack-a", "0002-stack-b"]
        assert facts["current_dists"] == {"alpha": "2.0"}, facts["current_dists"]
        ours, theirs = ({k: v for k, v in f.items() if k not in VOLATILE} for f in (facts, cli_view[h]))
        assert ours == theirs, {k: (ours[k], theirs.get(k)) for k in ours if ours[k] != theirs.get(k)}


def test_facts_playbook_refuses_a_bad_python_in_one_line(fleet):
    inv, roots, common = fleet
    p = ansible_playbook(inv, "facts.yml", "-e", "python=three", "--limit", "p1", known_hosts=common[-1])
    said = results(p, "facts")["p1"]
    assert p.returncode == 2 and said["_said"] == "fatal" and said["msg"] == "python must be 3.X, not 'three'", said


def test_logs_playbook_gives_what_provision_logs_gives(fleet):
    inv, roots, common = fleet
    p = ansible_playbook(inv, "logs.yml", "-e", "generation=1", "--limit", "p3", known_hosts=common[-1])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = results(p, "logs")["p3"]
    want = json.loads(cli("logs", "p3", "1", *common, "--json", check=0).stdout)
    assert {k: got[k] for k in want} == want
    assert got["id"] == "0001-stack-a" and "build.log" in got["logs"] and got["logs"]["build.log"]["text"], got
    assert got["changed"] is False

    p = ansible_playbook(inv, "logs.yml", "-e", "tail=40", "--limit", "p3", known_hosts=common[-1])   # the newest
    newest = results(p, "logs")["p3"]
    assert newest["id"] == "0002-stack-b" and 0 < len(newest["logs"]["build.log"]["text"]) <= 40, newest
    assert newest["logs"]["build.log"]["bytes"] > 40


def test_a_host_that_never_speaks_ssh_is_unreachable_within_the_connect_timeout(sshd, silent, tmp_path):
    """A host whose SSH port accepts and then says nothing (a hung daemon): Ansible, run as provision runs it, gives
    up after the target's connect timeout (Ansible's own default is 10 s), and the run's one line names the host.
    The wait is read from the run's own events (task start to unreachable), not from the wall clock around it."""
    t = copy.deepcopy(sshd.target)
    t.port, t.alias, t.timeout = silent, "mute", 2.0
    t.root = str(tmp_path / "root")
    res = runner.run_playbook("status", [t], {}, label="mute")
    assert res.unreachable == ["mute"] and res.rc != 0, res
    assert res.error.startswith("mute unreachable (status): ") and "timed out" in res.error, res.error
    events = [json.loads(f.read_text()) for f in Path(res.run_dir).glob("artifacts/*/job_events/*.json")]
    when = {e["event"]: datetime.fromisoformat(e["created"]) for e in events
            if e["event"] in ("playbook_on_task_start", "runner_on_unreachable")}
    waited = (when["runner_on_unreachable"] - when["playbook_on_task_start"]).total_seconds()
    assert waited < 3 * t.timeout, waited


def test_ansible_keeps_the_transports_keepalives():
    env = runner._env(Path("/tmp/run"), TIMEOUT)
    assert env["ANSIBLE_TIMEOUT"] == f"{TIMEOUT:g}"
    assert f"-o ServerAliveInterval={TIMEOUT:g} -o ServerAliveCountMax={KEEPALIVE_COUNT}" in \
        runner.run_ssh_args("/tmp/socks", env)


def test_provision_verify_of_a_fleet_runs_verify_playbook_and_records_each_verdict(fleet, tmp_path):
    """`provision verify -i INV` runs verify.yml through Ansible (a run directory of the playbook's events is left
    for the post-mortem): each reachable host's verdict is printed and recorded as before, and a host where nothing
    listens is its row, named unreachable, with exit 1."""
    inv, roots, common = fleet
    with_dead = tmp_path / "inv.yml"
    dead_root = tmp_path / "root-dead"
    with_dead.write_text(inv.read_text() + f"    dead: {{ansible_port: {free_port()}, provision_root: {dead_root}}}\n")
    before = set(RUNS.glob("*-verify-verify"))
    p = cli("verify", "-i", with_dead, *common[2:], "--timeout", "3", check=1)
    assert [ln for ln in p.stdout.splitlines() if " on p" in ln] == [
        ln for h in HOSTS for ln in p.stdout.splitlines() if ln.startswith(f"0002-stack-b on {h}: clean")], p.stdout
    assert len([ln for ln in p.stdout.splitlines() if " on p" in ln]) == 3, p.stdout
    said = [ln for ln in p.stderr.splitlines() if not ln.startswith("  p")]        # each host's progress lines
    assert len(said) == 1 and said[0].startswith("dead: unreachable: "), p.stderr
    assert len(set(RUNS.glob("*-verify-verify")) - before) == 1           # one Ansible run for the fleet

    for h in HOSTS:
        hist = json.loads(cli("history", h, *common, "--json", check=0).stdout)
        last = hist["events"][-1]
        assert (last["event"], last["generation"], last["verdict"]) == ("verify", "0002-stack-b", "clean"), last
        assert not list((roots[h] / "tmp").glob("ansible-*")), "Ansible's remote temp dir was left"

    rows = json.loads(cli("verify", "-i", with_dead, *common[2:], "--timeout", "3", "--json", check=1).stdout)
    assert [(r["host"], r.get("result", {}).get("verdict"), r.get("stage")) for r in rows] == \
        [("p1", "clean", None), ("p2", "clean", None), ("p3", "clean", None), ("dead", None, "connect")], rows

    one = json.loads(cli("verify", "p1", "1", *common, "--json", check=0).stdout)   # one host: its result alone
    assert (one["host"], one["generation"], one["verdict"], one["warnings"]) == ("p1", "0001-stack-a", "clean", [])
    bad = cli("verify", "p1", "7", *common, check=2)             # a generation the host lacks: the argument is wrong
    assert bad.stderr == "error: p1: no generation 7 (have: 0001-stack-a, 0002-stack-b)\n", bad.stderr


def test_provision_verify_of_a_fleet_with_unknown_host_keys_says_how_to_trust_them(fleet, tmp_path):
    inv, roots, common = fleet
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    p = cli("verify", "-i", inv, "--known-hosts", empty, "--limit", "p1:p2", check=1)
    lines = p.stderr.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["p1", "p2"] and p.stdout == "", p.stdout + p.stderr
    for h, ln in zip(("p1", "p2"), lines):
        assert "unreachable: " in ln and "Host key verification failed" in ln, ln
        assert ln.endswith(f"then `provision hosts trust -i {inv} --limit {h} --known-hosts {empty}`"), ln
    assert empty.read_text() == ""                                  # nothing trusted behind the operator's back
