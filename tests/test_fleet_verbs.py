"""probe, adopt, diff, logs, pack, patches and contract of an inventory run their playbooks through Ansible, one run
for the fleet: each host's result is what the same verb gives for that host alone, a host whose port is closed is
its own row (named unreachable), and a long step's progress reaches the CLI through the file its plugin appends to.
Two inventory hosts share the session's loopback sshd, each with its own root, on a second generation."""
from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest

from provision import apply as applymod, lock as lockmod
from provision.action import HEARTBEAT, Progress, append_event
from provision.inventory import load_inventory
from provision.loopback import free_port
from provision.plays import tail
from test_core import cli
from test_fleet_play import alone, plays
from test_playbooks import ansible_playbook, results
from test_reach import sudo_host  # noqa: F401 - the module's fixture
from loophosts import write_inventory
from wheelhouse import write_lock

HOSTS = ["v1", "v2"]


@pytest.fixture(scope="module")
def fleet(sshd, wheels, tmp_path_factory):
    """(inventory, roots, --known-hosts, the session's target, an inventory with a dead host first, scratch)."""
    d = tmp_path_factory.mktemp("fleetverbs")
    t = sshd.target
    roots = {h: d / f"root-{h}" for h in HOSTS}
    inv = write_inventory(d / "inv.yml", t, roots)
    for lk in (write_lock(d / "a.yaml", "stack-a", [wheels["alpha-1.0"]]),
               write_lock(d / "b.yaml", "stack-b", [wheels["alpha-2.0"], wheels["beta-1.0"]])):
        run = applymod.apply_fleet(load_inventory(inv, t.known_hosts), lockmod.load(lk))
        assert {r.status for r in run.reports} == {"applied"}, [r.error for r in run.reports]
    dead = d / "with-dead.yml"
    dead.write_text(inv.read_text().replace("  hosts:\n", "  hosts:\n    dead: {ansible_port: "
                                            f"{free_port()}, provision_root: {d / 'root-dead'}}}\n", 1))
    return inv, roots, ["--known-hosts", str(t.known_hosts)], t, dead, d


def one_play(name: str, root, args: list) -> tuple:
    """`provision ARGS` (exit code, stdout, stderr), asserting that it made exactly one Ansible run of NAME.yml."""
    before = plays(name, root)
    p = cli(*args)
    assert len(plays(name, root) - before) == 1, (name, p.stdout, p.stderr)
    return p.returncode, p.stdout, p.stderr


def test_probe_of_an_inventory_is_each_hosts_probe_through_one_play(fleet):
    inv, roots, kh, t, dead, _ = fleet
    code, out, err = one_play("probe", roots["v1"], ["probe", "-i", inv, *kh, "--json"])
    rows = json.loads(out)
    assert code == 0 and [r["host"] for r in rows] == HOSTS, (out, err)
    for r in rows:
        one = json.loads(cli("probe", *alone(t, roots[r["host"]]), "--json", check=0).stdout)
        got = r["result"]
        assert (got["status"], got["generation"], got["failed"], got["summary"]) == \
            (one["status"], one["generation"], one["failed"], one["summary"]) == ("pass", "0002-stack-b", [],
                                                                                  one["summary"]), (got, one)
        assert [(x["name"], x["status"]) for x in got["results"]] == [(x["name"], x["status"]) for x in one["results"]]
    code, out, err = one_play("probe", roots["v1"], ["probe", "-i", inv, *kh, "-g", "1"])
    assert code == 0 and [ln.split(" (")[0] for ln in out.splitlines() if ln.startswith("000")] == \
        [f"0001-stack-a on {h}: pass" for h in HOSTS], out

    code, out, err = one_play("probe", dead.parent / "root-dead", ["probe", "-i", dead, *kh, "--timeout", "3"])
    said = [ln for ln in err.splitlines() if not ln.startswith("  ")]     # progress lines are indented
    assert code == 1 and len(said) == 1 and said[0].startswith("dead: unreachable: "), err
    assert all(re.search(r" · probe (running|[a-z-]+) \(", ln) for ln in err.splitlines() if ln.startswith("  ")), err
    assert [ln.split(" (")[0] for ln in out.splitlines() if ln.startswith("000")] == \
        [f"0002-stack-b on {h}: pass" for h in HOSTS], out


def test_facts_and_unlock_of_an_inventory_are_each_hosts_through_one_play(fleet):
    """`hosts facts -i` and `unlock -i` run facts.yml and unlock.yml, one Ansible run each: each host's row is what
    the verb gives for that host alone; a host whose port is closed is its own row."""
    inv, roots, kh, t, dead, _ = fleet
    code, out, err = one_play("facts", roots["v1"], ["hosts", "facts", "-i", inv, *kh, "--json"])
    rows = json.loads(out)
    assert code == 0 and [r["host"] for r in rows] == HOSTS, (out, err)
    for r in rows:
        one = json.loads(cli("hosts", "facts", *alone(t, roots[r["host"]]), "--json", check=0).stdout)
        for k in ("root", "current", "os", "pythons", "gpus"):
            assert r["result"][k] == one[k], k
        assert [g["id"] for g in r["result"]["generations"]] == [g["id"] for g in one["generations"]] == \
            ["0001-stack-a", "0002-stack-b"]
    code, out, err = one_play("unlock", roots["v1"], ["unlock", "-i", inv, *kh, "--json"])
    assert code == 0 and json.loads(out) == [{"host": h, "result": {"state": "free", "lock": f"{roots[h]}/.lock",
                                                                    "ended": []}} for h in HOSTS], (out, err)
    code, out, err = one_play("unlock", dead.parent / "root-dead", ["unlock", "-i", dead, *kh, "--timeout", "3"])
    assert code == 1 and err.startswith("dead: unreachable: "), err
    assert out.splitlines() == [f"{h}: {roots[h]}/.lock is not held" for h in HOSTS], out


def test_probe_of_an_unknown_generation_is_each_hosts_error_through_the_play(fleet):
    inv, roots, kh, t, _, d = fleet
    code, out, err = one_play("probe", roots["v1"], ["probe", "-i", inv, *kh, "--lock", d / "a.yaml", "--json"])
    rows = json.loads(out)                  # a failed verdict is the host's report, the task failed by it
    one = json.loads(cli("probe", *alone(t, roots["v1"]), "--lock", d / "a.yaml", "--json", check=1).stdout)
    assert code == 1 and [(r["result"]["status"], r["result"]["failed"]) for r in rows] == \
        [("fail", one["failed"])] * 2 and "packages" in one["failed"], (rows, one)
    code, out, err = one_play("probe", roots["v1"], ["probe", "-i", inv, *kh, "-g", "9", "--json"])
    rows = json.loads(out)
    assert code == 1 and [r["host"] for r in rows] == HOSTS, out
    p = cli("probe", *alone(t, roots["v1"]), "-g", "9", "--json")
    assert rows[0]["error"] == json.loads(p.stdout)["error"] and rows[0]["exit_code"] == p.returncode, (rows, p)


def test_an_unknown_host_key_says_how_to_trust_it_naming_the_inventory_host(fleet, tmp_path):
    inv, roots, _, t, _, _ = fleet
    kh = tmp_path / "known_hosts"
    code, out, err = one_play("probe", roots["v1"], ["probe", "v1", "-i", inv, "--known-hosts", kh, "--json"])
    said = json.loads(out)["error"]
    assert code == 1 and said.startswith("Host key verification failed (unknown host key ssh-ed25519 SHA256:"), said
    assert said.endswith(f"then `provision hosts trust -i {inv} --limit v1 --known-hosts {kh}`"), said


def test_adopt_diff_and_logs_of_an_inventory_through_their_plays(fleet):
    inv, roots, kh, t, _, _ = fleet
    code, out, _ = one_play("adopt", roots["v1"], ["adopt", "all", "-i", inv, *kh, "/nonexistent/env"])
    one = cli("adopt", *alone(t, roots["v1"]), "/nonexistent/env", check=0).stdout
    assert code == 0 and out.splitlines() == [one.replace(alone(t, "")[0], h).strip() for h in HOSTS], (out, one)
    assert "host is already managed" in one

    code, out, _ = one_play("diff", roots["v2"], ["diff", "v2", "-i", inv, *kh, "1", "--json"])
    one = cli("diff", *alone(t, roots["v2"]), "1", "--json", check=0).stdout
    assert code == 0 and json.loads(out) == dict(json.loads(one), host="v2"), (out, one)
    code, out, _ = one_play("diff", roots["v2"], ["diff", "v2", "-i", inv, *kh, "1"])
    assert code == 0 and out.startswith("Diff on v2: 0001-stack-a → 0002-stack-b"), out

    code, out, _ = one_play("logs", roots["v1"], ["logs", "v1", "-i", inv, *kh, "1", "--json"])
    one = cli("logs", *alone(t, roots["v1"]), "1", "--json", check=0).stdout
    assert code == 0 and json.loads(out) == json.loads(one) and json.loads(out)["id"] == "0001-stack-a"
    code, out, err = one_play("logs", roots["v1"], ["logs", "v1", "-i", inv, *kh, "7"])
    assert code == 1 and err.startswith("error: v1: no generation 7") and len(err.splitlines()) == 1, err


def test_pack_of_an_inventory_host_through_its_play_writes_here_what_pack_of_the_host_writes(fleet):
    inv, roots, kh, t, _, d = fleet
    code, out, err = one_play("pack", roots["v2"], ["pack", "v2", "-i", inv, *kh, "1", "--out", d / "via-play",
                                                    "--json"])
    rep = json.loads(out)
    one = json.loads(cli("pack", *alone(t, roots["v2"]), "1", "--out", d / "direct", "--json", check=0).stdout)
    assert code == 0 and rep["check"]["ok"] and rep["generation"] == one["generation"] == "0001-stack-a", (out, err)
    assert (d / "via-play" / "lock.yaml").read_text().replace(str(d / "via-play"), "") == \
        (d / "direct" / "lock.yaml").read_text().replace(str(d / "direct"), "").replace(alone(t, "")[0], "v2")
    assert sorted(p.name for p in (d / "via-play").iterdir()) == sorted(p.name for p in (d / "direct").iterdir())
    code, out, err = one_play("pack", roots["v2"], ["pack", "v2", "-i", inv, *kh, "1", "--out", d / "via-play"])
    assert code == 2 and "not empty" in err and len(err.splitlines()) == 1, err     # the play's InputError, exit 2


def test_patch_verbs_of_an_inventory_through_their_plays(fleet):
    inv, roots, kh, t, _, _ = fleet
    code, out, err = one_play("patches", roots["v1"], ["patches", "check", "-i", inv, *kh])
    one = cli("patches", "check", *alone(t, roots["v1"]))
    assert code == one.returncode == 1 and err == one.stderr.replace(alone(t, "")[0], "v1"), (err, one.stderr)
    code, out, err = one_play("contract", roots["v1"], ["contract", "LlamaForCausalLMEagle3", "-i", inv, *kh])
    one = cli("contract", "LlamaForCausalLMEagle3", *alone(t, roots["v1"]))
    assert code == one.returncode == 1 and out == "".join(one.stdout.replace(alone(t, "")[0], h).replace(
        str(roots["v1"]), str(roots[h])) for h in HOSTS), (out, one.stdout)


def test_a_silent_step_says_it_runs_at_least_every_few_seconds(tmp_path):
    """A step that reports nothing still reaches the CLI's tail with a line a host every HEARTBEAT seconds."""
    path, seen = tmp_path / "progress.jsonl", []
    with tail(path, lambda host, ev: seen.append((time.monotonic(), host, ev))):
        def silent(host: str) -> None:
            with Progress(str(path), host, "probe"):
                time.sleep(2.5 * HEARTBEAT)
        threads = [threading.Thread(target=silent, args=(h,)) for h in HOSTS]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert not path.exists()
    for h in HOSTS:
        mine = [(at, ev) for at, host, ev in seen if host == h]
        assert len(mine) >= 2 and all(ev["step"] == "probe" and ev["detail"].startswith("running (")
                                      for _, ev in mine), mine
        gaps = [b["seconds"] - a["seconds"] for (_, a), (_, b) in zip(mine, mine[1:])]    # as the step wrote them
        assert max(gaps) < HEARTBEAT + 1.5, gaps


def test_every_step_says_its_progress_in_one_line_shape_and_the_tail_says_how_far_it_read(tmp_path):
    """A HostStep's progress and a fleet apply's step event are one shape of line (`append_event`'s); `tail`'s
    `after` hears the offset up to the last whole line read, the one a fleet apply's gate waits for."""
    path, seen, read = tmp_path / "progress.jsonl", [], []
    with tail(path, lambda host, ev: seen.append((host, ev)), every=0.02, after=read.append):
        with Progress(str(path), "v1", "probe") as say:
            say("checking")
        end = append_event(str(path), "v2", "build", "start", "", 0.04)
        with open(path, "ab") as f:
            f.write(b'{"host": "v2", "step": "bu')      # a line still being written is not read yet
        until = time.monotonic() + 5
        while not (read and read[-1] == end) and time.monotonic() < until:
            time.sleep(0.02)
        assert read and read[-1] == end, (read, end)
    assert [(h, sorted(ev), ev["state"]) for h, ev in seen] == \
        [("v1", ["detail", "host", "seconds", "state", "step"], "info"),
         ("v2", ["detail", "host", "seconds", "state", "step"], "start")]


def test_operators_run_the_probe_and_pack_playbooks_themselves(fleet):
    """`ansible-playbook -i INV probe.yml` gives each host the verdict `provision probe` gives; pack.yml writes the
    wheelhouse on the controller as `provision pack` does."""
    inv, roots, kh, t, _, d = fleet
    p = ansible_playbook(inv, "probe.yml", "-e", "generation=1", "-e", f"provision_known_hosts={t.known_hosts}")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    said = results(p, "probe")
    assert {h: (said[h]["generation"], said[h]["status"], said[h]["step_failed"]) for h in HOSTS} == \
        {h: ("0001-stack-a", "pass", []) for h in HOSTS}
    p = ansible_playbook(inv, "probe.yml", "-e", "generation=9", "--limit", "v1",
                         "-e", f"provision_known_hosts={t.known_hosts}")
    assert p.returncode == 2 and results(p, "probe")["v1"]["msg"].startswith("no generation 9"), p.stdout[-2000:]

    p = ansible_playbook(inv, "pack.yml", "--limit", "v1", "-e", f"out={d / 'operator-pack'}",
                         "-e", f"provision_known_hosts={t.known_hosts}")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    packed = results(p, "pack")["v1"]
    assert packed["generation"] == "0002-stack-b" and packed["check"]["ok"] and packed["changed"] is True
    assert (d / "operator-pack" / "lock.yaml").is_file() and packed["distributions"] == 2


def test_each_step_module_declares_and_documents_its_arguments():
    """Every module's DOCUMENTATION reads in `ansible-doc` (the options modules share from the `provision` doc
    fragment); an action plugin's module documents its ARGUMENT_SPEC, type for type, and RETURN says what it
    returns."""
    import ast
    import subprocess
    import sys

    import yaml

    from provision.action import spec_of
    from provision.bundled import PLAYBOOKS

    names = sorted(p.stem for p in (PLAYBOOKS / "action_plugins").glob("provision_*.py")
                   if "HostStep" in p.read_text())
    assert len(names) >= 6, names
    every = sorted(p.stem for p in (PLAYBOOKS / "library").glob("provision_*.py"))
    doc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ansible-doc"), "-t", "module", "-M",
                          str(PLAYBOOKS / "library"), "--json", *every], capture_output=True, text=True,
                         env={**os.environ, "ANSIBLE_NOCOLOR": "1",      # the options they share: one fragment
                              "ANSIBLE_DOC_FRAGMENT_PLUGINS": str(PLAYBOOKS / "doc_fragments")})
    assert doc.returncode == 0 and "ERROR" not in doc.stderr, doc.stderr
    docs = json.loads(doc.stdout)
    assert sorted(docs) == every
    for name in every:       # every module's root: the fragment's, as its spec has it
        assert docs[name]["doc"]["options"]["root"]["type"] == "path", name
    for name in names:
        spec, options = spec_of(name), docs[name]["doc"]["options"]
        assert set(options) == set(spec), name
        assert {k: options[k].get("type") for k in spec} == {k: v["type"] for k, v in spec.items()}, name
        assert docs[name]["return"], name
        module = ast.parse((PLAYBOOKS / "library" / f"{name}.py").read_text())
        assert ast.get_docstring(module) and yaml.safe_load(docs[name]["doc"]["short_description"])
        plays = [p.read_text() for p in PLAYBOOKS.glob("*.yml") if f" {name}:" in p.read_text()]
        assert plays and all(p.startswith("# provision ") for p in plays), name    # a task of a documented play


def test_a_step_of_an_inventory_becomes_root_as_the_inventory_says(sudo_host, sudo_user, wheels, tmp_path):
    """A non-root login user with sudo, `ansible_become=true` in the inventory: the probe plugin's host commands run
    as root, so the verdict is recorded in root's history; the same user without become cannot record it."""
    t = sudo_host.target
    root = tmp_path / "root"
    lk = write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]])
    cli("apply", f"{sudo_user}@{t.host}:{t.port}", "--key", t.key_file, "--known-hosts", t.known_hosts,
        "--root", root, "--lock", lk, "--become", check=0)
    line = (f"gpu ansible_host={t.host} ansible_port={t.port} ansible_user={sudo_user} "
            f"ansible_ssh_private_key_file={t.key_file} provision_root={root}")
    inv = tmp_path / "inv.ini"
    inv.write_text(line + "\n")
    code, out, err = one_play("probe", root, ["probe", "-i", inv, "--known-hosts", t.known_hosts])
    assert code == 1 and "Permission denied" in err, (out, err)
    inv.write_text(line + " ansible_become=true\n")
    code, out, err = one_play("probe", root, ["probe", "-i", inv, "--known-hosts", t.known_hosts])
    assert code == 0 and "0001-stack-a on gpu: pass" in out, (out, err)
    events = [json.loads(ln) for ln in (root / "history.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "probe" and os.stat(root / "history.jsonl").st_uid == 0, events[-1]


def test_pack_playbook_refuses_several_hosts_into_one_folder(fleet):
    inv, _, _, t, _, d = fleet
    p = ansible_playbook(inv, "pack.yml", "-e", f"out={d / 'two'}", "-e", f"provision_known_hosts={t.known_hosts}")
    assert p.returncode == 2 and "name that host with --limit HOST" in p.stdout and not (d / "two").exists(), \
        p.stdout[-2000:]


def test_ctrl_c_stops_a_probe_of_an_inventory(fleet, tmp_path):
    """Ctrl-C while the play runs (each host's probe waiting on an nvidia-smi that hangs, as the inventory names
    it): exit 130, "interrupted", long before the hosts would have answered."""
    import signal
    import subprocess
    import sys

    from test_core import ctrl_c_as_at_a_terminal

    inv, roots, kh, t, _, _ = fleet
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nsleep 60\n")
    smi.chmod(0o755)
    hung = tmp_path / "hung.yml"
    hung.write_text(inv.read_text().replace("provision_root:", f"provision_nvidia_smi: {smi}, provision_root:"))
    progress = []
    p = subprocess.Popen([sys.executable, "-m", "provision.cli", "probe", "-i", str(hung), *kh], text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=ctrl_c_as_at_a_terminal)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60 and len(progress) < 2:      # the hosts are at work: their progress says so
        progress.append(p.stderr.readline())
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130 and err.splitlines()[-1] == "interrupted", (progress, out, err)
    assert all(re.search(r" · probe (running|driver) \(", ln) for ln in progress), progress  # the probe by name
    assert time.monotonic() - t0 < 45
