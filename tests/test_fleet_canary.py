"""Canary rollouts: batches as Ansible's serial (1,25%,100%), a tolerance per batch (--max-fail), a failing batch
rolled back by itself (--rollback-on-fail), hosts of a failed batch stopped before their switch, and a fleet
view that tells the truth (a failed probe is ✗, per-host progress, unreachable hosts as found, status's last
attempt). Eight inventory hosts share one loopback sshd, each with its own root; the one whose probe fails
has a GPU whose driver stops answering (nvidia-smi's recorded real output, then its error)."""
from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from provision import apply as applymod, lock as lockmod
from provision.fleet import batch_sizes, parse_max_fail, parse_serial
from provision.inventory import load_inventory
from provision.loopback import LoopbackHost
from provision.transport import trust_host
from test_core import cli
from wheelhouse import write_lock

HOSTS = [f"h{i}" for i in range(1, 9)]
BAD = "h3"                                   # batch 2 of 1,25%,100% over 8 hosts: h2 h3
H200 = Path(__file__).parent / "data" / "h200" / "nvidia-smi-query.csv"


def faulty_smi(d: Path) -> Path:
    """nvidia-smi of one H200 (its recorded output). Armed (a file `fault` beside it), the driver stops answering
    once it has been queried: the host's facts list the GPU, and the probes then find nvidia-smi failing. Held (a
    file `hold` beside it), that failing answer waits until a file `go` appears: a test orders it after a partner's
    probes."""
    smi = d / "nvidia-smi"
    smi.write_text("#!/bin/sh\nd=$(dirname \"$0\")\n"
                   "if [ -e \"$d/fault\" ] && [ -e \"$d/queried\" ]; then\n"
                   "  if [ -e \"$d/hold\" ]; then i=0; while [ ! -e \"$d/go\" ] && [ $i -lt 1200 ]; do sleep 0.1; "
                   "i=$((i+1)); done; fi\n"
                   "  echo 'Unable to determine the device handle for GPU 0000:00:06.0: Unknown Error'; exit 255\n"
                   "fi\n[ -e \"$d/fault\" ] && touch \"$d/queried\"\n"
                   f"cat {H200}\n")
    smi.chmod(0o755)
    return smi


def held_smi(d: Path) -> Path:
    """nvidia-smi of one healthy H200 whose second answer (the probes', after the facts') waits until a file `go`
    appears beside it."""
    d.mkdir(parents=True, exist_ok=True)
    smi = d / "nvidia-smi"
    smi.write_text("#!/bin/sh\nd=$(dirname \"$0\")\n"
                   "if [ -e \"$d/queried\" ]; then i=0; while [ ! -e \"$d/go\" ] && [ $i -lt 1200 ]; do sleep 0.1; "
                   "i=$((i+1)); done; fi\ntouch \"$d/queried\"\n"
                   f"cat {H200}\n")
    smi.chmod(0o755)
    return smi


def arm(smi: Path, hold: bool = False) -> None:
    (smi.parent / "fault").touch()
    for f in ("queried", "go", "hold"):
        (smi.parent / f).unlink(missing_ok=True)
    if hold:
        (smi.parent / "hold").touch()


@pytest.fixture(scope="module")
def fleet(sshd, wheels, tmp_path_factory):
    """Eight hosts on lock A (generation 0001-stack-a); (inventory, roots, common options, lock B, the GPU)."""
    d = tmp_path_factory.mktemp("canary")
    t = sshd.target
    smi = faulty_smi(d)
    roots = {h: d / f"root-{h}" for h in HOSTS}
    inv = d / "inv.yml"
    inv.write_text(f"all:\n  vars: {{ansible_host: {t.host}, ansible_port: {t.port}, ansible_user: {t.user}, "
                   f"ansible_ssh_private_key_file: {t.key_file}}}\n  hosts:\n"
                   + "".join(f"    {h}: {{provision_root: {roots[h]}"
                             + (f", provision_nvidia_smi: {smi}" if h == BAD else "") + "}\n" for h in HOSTS))
    a = write_lock(d / "a.yaml", "stack-a", [wheels["alpha-1.0"]])
    b = write_lock(d / "b.yaml", "stack-b", [wheels["alpha-2.0"]])
    run = applymod.apply_fleet(load_inventory(inv, t.known_hosts), lockmod.load(a))
    assert {r.status for r in run.reports} == {"applied"}, [r.error for r in run.reports]
    return inv, roots, ["-i", str(inv), "--known-hosts", str(t.known_hosts)], b, smi


def current(roots, h) -> str:
    return os.readlink(roots[h] / "current").removeprefix("generations/")


def test_serial_and_tolerance_are_ansibles():
    assert batch_sizes(parse_serial("1,25%,100%"), 8) == [1, 2, 5]
    assert batch_sizes(parse_serial("2"), 5) == [2, 2, 1]
    assert batch_sizes(parse_serial("0"), 5) == [5]
    assert batch_sizes(parse_serial("1,10%"), 4) == [1, 1, 1, 1]          # a percentage is at least one host
    assert parse_max_fail("25%") == "25%"
    for bad, says in (("x", "'x'"), ("-1", "'-1'"), ("0%", "'0%'"), ("101%", "'101%'"), ("1,,2", "''")):
        p = cli("apply", "-i", "nowhere.yml", "--lock", "nowhere.yaml", "--serial", bad, check=2)
        assert p.stderr == f"error: --serial: {says} is neither a host count (0 or more) nor a percentage (1% to " \
                           "100%); give e.g. 1,25%,100%\n", p.stderr
    p = cli("apply", "-i", "nowhere.yml", "--lock", "nowhere.yaml", "--max-fail", "120%", check=2)
    assert p.stderr == "error: --max-fail: '120%' is neither a host count (0 or more) nor a percentage (0% to 100%)\n"


def test_failing_batch_goes_back_and_the_rollout_stops(fleet):
    inv, roots, common, b, smi = fleet
    arm(smi)
    opts = ["--lock", str(b), "--serial", "1,25%,100%", "--max-fail", "0", "--rollback-on-fail"]
    p = cli("apply", *common, *opts, check=1)
    err, out = p.stderr, p.stdout
    assert "batch 1/3: h1 (1)" in err and "batch 2/3: h2 h3 (25% of the fleet)" in err and "batch 3/3" not in err
    assert err.index("batch 1/3") < err.index("h1  ✓ switch") < err.index("batch 2/3"), err
    probe = next(line for line in err.splitlines() if line.split()[:3] == [BAD, "✗", "probe"])
    assert "1 fail" in probe, err                                    # a failed probe row is ✗, never ✓

    assert current(roots, "h1") == "0002-stack-b"                    # batch 1 stays switched ...
    for h in ("h2", "h3"):                                            # ... batch 2 is back where it was ...
        assert current(roots, h) == "0001-stack-a", h
    for h in HOSTS[3:]:                                               # ... batches after it are untouched
        assert current(roots, h) == "0001-stack-a" and sorted(os.listdir(roots[h] / "generations")) == \
            ["0001-stack-a"], h
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  h")}
    assert rows["h1"].split()[1:3] == ["applied", "0002-stack-b"]
    assert rows[BAD].split()[1] == "failed" and "nvidia-smi failed: Unable to determine the device handle" in rows[BAD]
    partner = rows["h2"].split()[1]             # h2 waited at the batch's barrier: stopped before its switch
    assert partner == "stopped", rows["h2"]
    assert "Stopped at batch 2/3: 1 of 2 hosts failed (h3), more than --max-fail 0 allows." in out
    assert "  switched: h1\n" in out and "  failed: h3\n" in out and "  not attempted: h4 h5 h6 h7 h8\n" in out
    assert "  stopped before its switch: h2\n" in out

    lines = out.splitlines()
    resume = shlex.split(lines[lines.index("Resume with the hosts not attempted:") + 1])
    assert resume == ["provision", "apply", *common, *opts, "--limit", "h4,h5,h6,h7,h8"]
    back = shlex.split(lines[lines.index("Roll back the hosts that switched:") + 1])
    assert back == ["provision", "rollback", *common, "--limit", "h1"]
    p = cli(*back[1:], check=0)                                       # the printed command does what it says
    assert "Rolled back h1: current 0002-stack-b → 0001-stack-a" in p.stdout
    assert [current(roots, h) for h in HOSTS] == ["0001-stack-a"] * 8

    st = {r["host"]: r["result"] for r in json.loads(cli("status", *common, "--json", check=0).stdout)}
    assert st[BAD]["probe"]["status"] == "pass"                      # the current generation's own probe ...
    assert (st[BAD]["last_attempt"]["generation"], st[BAD]["last_attempt"]["status"]) == ("0002-stack-b", "fail")
    assert st["h5"]["last_attempt"] is None                          # ... and the attempt that did not switch
    table = cli("status", *common, "--limit", BAD, check=0).stdout
    assert "last attempt" in table and "0002-stack-b: probe fail (" in table


@pytest.mark.parametrize("partner,first,back", [("h7", "failure", True), ("h6", "probed", True),
                                                ("h5", "probed", False)])
def test_in_flight_partner_of_a_failed_host(fleet, tmp_path, partner, first, back):
    """A partner of the failing host never switches: one that finishes its probes after the failure stops before
    its switch; one that finishes them first waits at the batch's barrier (Ansible's linear strategy: the switch
    is the play's next task) until the failing host's probe has failed, then stops too, with or without
    --rollback-on-fail. Its generation, probed, is kept for a later apply to reuse. Each host's GPU answers the
    probes only once the other's event is seen, so the order is certain."""
    inv, roots, common, b, smi = fleet
    arm(smi, hold=first == "probed")
    ts = load_inventory(inv, Path(common[-1]), limit=f"{partner}:{BAD}")
    if first == "failure":                  # the partner's GPU answers its probes once BAD's failure is seen
        held = held_smi(tmp_path / "gpu")
        next(t for t in ts if t.name == partner).nvidia_smi = str(held)
    go = (held if first == "failure" else smi).parent / "go"

    def progress_for(host):
        def see(step, state, detail):
            if first == "failure" and host == BAD and (step, state) == ("probe", "fail"):
                go.touch()
            if first == "probed" and host == partner and (step, state) == ("probe", "done"):
                go.touch()
        return see

    run = applymod.apply_fleet(ts, lockmod.load(b), rollback_on_fail=back, progress_for=progress_for)
    rep = {r.host: r for r in run.reports}
    assert go.exists()
    assert rep[BAD].status == "failed" and run.failed_batch == 1 and run.failed_hosts == [BAD]
    assert rep[partner].generation == "0002-stack-b"
    assert current(roots, partner) == "0001-stack-a" and rep[partner].current == "0001-stack-a"
    assert rep[partner].status == "stopped" and not any(s.name == "switch" for s in rep[partner].steps)
    assert rep[partner].error == (f"{partner}: batch 1/1 had failed ({BAD}): stopped before its switch; current "
                                  "left at 0001-stack-a; 0002-stack-b kept (probed, a later apply reuses it)")
    plan = json.loads(cli("plan", *common, "--limit", partner, "--lock", b, "--json", check=0).stdout)
    assert (plan["action"], plan["reuse"]) == ("reuse", "0002-stack-b")    # kept runnable, never current yet
    assert run.resume == [] and run.still_switched == []


def test_tolerance_allows_a_failure(fleet):
    inv, roots, common, b, smi = fleet
    arm(smi)
    p = cli("apply", *common, "--lock", b, "--serial", "1,25%,100%", "--max-fail", "50%", check=1)
    assert "batch 3/3: h4 h5 h6 h7 h8 (100% of the fleet)" in p.stderr
    assert "Stopped at" not in p.stdout and "Resume" not in p.stdout
    assert "1 failed, 0 not-attempted" in p.stdout, p.stdout
    for h in HOSTS:
        assert current(roots, h) == ("0001-stack-a" if h == BAD else "0002-stack-b"), h

    arm(smi)      # again, as one JSON object: hosts already on the lock are unchanged, never rolled back
    p = cli("apply", *common, "--lock", b, "--serial", "1,25%,100%", "--rollback-on-fail", "--json", check=1)
    out = json.loads(p.stdout)
    assert [x["hosts"] for x in out["batches"]] == [["h1"], ["h2", "h3"], HOSTS[3:]]
    assert (out["failed_batch"], out["failed_hosts"], out["max_fail"]) == (2, [BAD], "0")
    assert out["states"] == {"unchanged": ["h1", "h2"], "failed": [BAD], "not attempted": HOSTS[3:]}
    assert (out["resume"], out["roll_back"]) == (HOSTS[3:], [])
    assert [r["status"] for r in out["reports"]] == ["noop", "noop", "failed"] + ["not-attempted"] * 5


def test_unreachable_host_is_named_as_found(sshd, wheels, tmp_path):
    """A host in its own network namespace that stopped answering: shown at once, and named "unreachable" by
    apply and status alike; the other hosts' build progress is shown per host."""
    t = sshd.target
    gone = LoopbackHost(netns=True)
    try:
        gone.start()
        gone.target.known_hosts = t.known_hosts
        trust_host(gone.target)
        gone.stop()
        inv = tmp_path / "inv.yml"
        inv.write_text(f"all:\n  vars: {{ansible_user: {t.user}}}\n  hosts:\n"
                       + "".join(f"    {h}: {{ansible_host: {t.host}, ansible_port: {t.port}, "
                                 f"ansible_ssh_private_key_file: {t.key_file}, provision_root: {tmp_path / h}}}\n"
                                 for h in ("up1", "up2"))
                       + f"    gone: {{ansible_host: {gone.address}, ansible_port: {gone.port}, "
                         f"ansible_ssh_private_key_file: {gone.dir / 'client_ed25519'}, provision_root: /x}}\n")
        a = write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]])
        common = ["-i", inv, "--known-hosts", t.known_hosts, "--timeout", "3"]
        p = cli("apply", *common, "--lock", a, "--max-fail", "1", check=1)
        err = p.stderr.splitlines()
        found = next(i for i, line in enumerate(err) if line.split()[:3] == ["gone", "✗", "unreachable"])
        assert found < min(i for i, line in enumerate(err) if "✓ switch" in line), p.stderr   # before the others end
        for h in ("up1", "up2"):
            assert any(line.split()[:3] == [h, "·", "build"] for line in err), p.stderr      # per-host progress
        row = next(line for line in p.stdout.splitlines() if line.split()[:1] == ["gone"])
        assert row.split()[1] == "unreachable" and "cannot connect" in row, row
        assert "Fleet: 2 applied, 0 noop, 0 failed, 0 not-attempted, 1 unreachable." in p.stdout
        table = cli("status", *common, check=1).stdout
        assert "unreachable" in next(line for line in table.splitlines() if "gone" in line), table
    finally:
        gone.cleanup()


def test_terminal_view_is_one_live_line_per_host(monkeypatch):
    """On a terminal, each host with a step running has one live line holding its latest progress (the lines in
    inventory order); a finished step is printed above them; in logs the same progress is a line per host."""
    import io

    from rich.console import Console

    from provision.cli import core

    screen = io.StringIO()
    monkeypatch.setattr(core, "err_console", Console(file=screen, force_terminal=True, width=120))
    printer = core.FleetPrinter(False, ["h1", "h2"])
    h1, h2 = printer.for_host("h1"), printer.for_host("h2")
    h2("build", "start", "")
    h1("build", "start", "")
    h2("build", "info", "fetch 1/3 · 1.0 MB of ~3.0 MB · 2.0 MB/s, 1s left")
    h1("build", "info", "install: Installed 3 packages")
    frame = screen.getvalue().rsplit("\x1b[2K", 1)[1]                   # the last frame drawn
    assert frame.splitlines() == ["  h1  … build: install: Installed 3 packages",
                                  "  h2  … build: fetch 1/3 · 1.0 MB of ~3.0 MB · 2.0 MB/s, 1s left"], frame
    h1("build", "done", "3 packages with uv")
    frame = screen.getvalue().rsplit("\x1b[2K", 1)[1]                   # printed above the one line left
    assert frame.splitlines() == ["  h1  ✓ build      3 packages with uv",
                                  "  h2  … build: fetch 1/3 · 1.0 MB of ~3.0 MB · 2.0 MB/s, 1s left"], frame
    printer.close()

    screen = io.StringIO()
    monkeypatch.setattr(core, "err_console", Console(file=screen, force_terminal=False, width=120))
    printer = core.FleetPrinter(False, ["h1", "h2"])
    for host in ("h1", "h2"):
        printer.for_host(host)("build", "info", "fetch 1/3")
        printer.for_host(host)("build", "info", "fetch 2/3")            # within a few seconds: not repeated
    assert screen.getvalue().splitlines() == ["  h1  · build      fetch 1/3", "  h2  · build      fetch 1/3"]


def test_a_failed_switch_fails_its_batch_and_the_partner_that_switched_goes_back(fleet, tmp_path, wheels):
    """Both hosts pass their probes; h8's switch then fails (its new generation's venv is moved away once its
    probes are seen done: the switch's check refuses a generation that drifted) while h7's switches. The batch has failed beyond --max-fail 0: with
    --rollback-on-fail, h7 goes back (playbooks/rollback.yml) to the generation it was on."""
    inv, roots, common, b, smi = fleet
    c = write_lock(tmp_path / "c.yaml", "stack-c", [wheels["alpha-1.0"]])
    ts = load_inventory(inv, Path(common[-1]), limit="h7:h8")
    before = {h: current(roots, h) for h in ("h7", "h8")}
    said = []

    def progress_for(host):
        def see(step, state, detail):
            said.append((host, step, state))
            if host == "h8" and (step, state) == ("probe", "done"):
                gen = next(roots["h8"].glob("generations/*-stack-c"))
                os.rename(gen / "venv", gen / "venv.moved")
        return see
    run = applymod.apply_fleet(ts, lockmod.load(c), rollback_on_fail=True, progress_for=progress_for)
    rep = {r.host: r for r in run.reports}
    assert (rep["h8"].status, rep["h8"].failed_step) == ("failed", "switch"), rep["h8"].error
    assert run.failed_batch == 1 and run.failed_hosts == ["h8"]
    assert rep["h7"].status == "rolled-back" and rep["h7"].rollback.to == before["h7"], rep["h7"]
    assert {h: current(roots, h) for h in ("h7", "h8")} == before
    assert ("h7", "switch", "done") in said and ("h7", "rollback", "done") in said, said
    assert run.still_switched == []
