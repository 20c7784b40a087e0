"""A step that makes no progress is said ("waiting for HOST: STEP (no progress for N s)") and stopped at the step
deadline, its host work ended and the host left on its generation; Ctrl-C stops a run before its switch (a switch
under way completes) and says where each host is, with --json too and in a fleet apply (exit 130)."""
from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from provision import apply as applymod
from provision import lock as lockmod
from provision.transport import connect
from test_core import ctrl_c_as_at_a_terminal
from test_faults import ROOT, StalledWheel, applied, assert_settled, host_state, gone, lock_free
from wheelhouse import make_wheel, write_lock

def env() -> dict:
    return {**os.environ, "PYTHONPATH": "", "COLUMNS": "200"}


@pytest.fixture
def stalled(target, wheels, tmp_path):
    """The host on generation A (alpha 1.0), and lock B whose second wheel comes from a download that stalls
    half-way until released: (lock A's report, lock B's path, the stalled server)."""
    a = applied(target, lockmod.load(write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]])))
    wheel = make_wheel(tmp_path / "slow", "slowpkg", "1.0", body="x = %r\n" % ("y" * 50000))
    slow = StalledWheel(wheel)
    lk = write_lock(tmp_path / "b.yaml", "stack-b", [wheels["alpha-1.0"], wheel])
    lk.write_text(lk.read_text().replace(wheel.resolve().as_uri(), slow.url))
    yield a, lk, slow
    slow.close()


def host_args(t) -> list[str]:
    return [f"{t.user}@{t.host}:{t.port}", "--key", t.key_file, "--known-hosts", str(t.known_hosts),
            "--root", t.root]


def settled_without_work(target, gen: str) -> None:
    """The host on `gen`, complete; the host lock free and nothing the stopped run started still running."""
    root = target.root
    lock_free(root)
    gone(root, "settled")
    assert_settled(target, gen)


def test_a_stalled_download_is_said_then_stopped_at_the_step_deadline(target, stalled):
    a, lk, slow = stalled
    p = subprocess.run([sys.executable, "-m", "provision.cli", "apply", *host_args(target), "--lock", str(lk),
                        "--wait-notice", "1", "--step-deadline", "4"],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=200)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert not slow.release.is_set()           # the download was still stalled: the deadline stopped the step
    assert f"waiting for {target.name}: fetch (no progress for 1 s)" in lines, p.stderr
    assert f"waiting for {target.name}: fetch (no progress for 2 s)" in lines, p.stderr
    assert lines[-1] == (f"error: {target.name}: fetch made no progress for 4 s (the step deadline): stopped; "
                         f"current left at {a.generation}"), p.stderr
    settled_without_work(target, a.generation)
    assert [g["status"] for g in host_state(target)["generations"].values()] == ["ready", "failed"]


def test_ctrl_c_mid_fetch_with_json_prints_one_object_and_says_where_the_host_is(target, stalled):
    a, lk, slow = stalled
    p = subprocess.Popen([sys.executable, "-m", "provision.cli", "apply", *host_args(target), "--lock", str(lk),
                          "--json"], cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=ctrl_c_as_at_a_terminal)
    try:
        assert slow.requested.wait(120), "the host never asked for the slow wheel"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"still running 120 s after Ctrl-C; it said: {out[-1500:]} {err[-1500:]}") from None
    finally:
        p.kill()
    assert p.returncode == 130 and "Traceback" not in err, err
    rep = json.loads(out)                      # one JSON object, the run's report
    assert rep["status"] == "interrupted" and rep["current"] == a.generation, rep
    says = f"{target.name}: interrupted during build: current left at {a.generation}"
    assert rep["error"] == says and err.strip().splitlines()[-1] == f"error: {says}", (rep, err)
    settled_without_work(target, a.generation)


def test_ctrl_c_during_the_switch_lets_it_complete_and_says_so(target, stacks_ab):
    """SIGINT arrives as the switch starts: the switch is one commit, so it completes; the run then stops
    (exit 130) saying that the host is on the new generation, never that the switch was interrupted."""
    lock_a, lock_b = stacks_ab
    a = applied(target, lock_a)

    def progress(step, state, detail):
        if (step, state) == ("switch", "start"):
            signal.raise_signal(signal.SIGINT)

    tr = connect(target)
    try:
        with pytest.raises(applymod.Interrupted) as e:
            applymod.apply(tr, lock_b, progress=progress)
    finally:
        tr.close()
    rep = e.value.report
    assert e.value.exit_code == 130 and rep.status == "applied", rep
    assert str(e.value) == (f"{target.name}: interrupted after the switch: current is {rep.generation} "
                            f"(was {a.generation})")
    assert [(s.name, s.status) for s in rep.steps][-1] == ("switch", "done")
    assert_settled(target, rep.generation, rep)


@pytest.fixture
def stacks_ab(tmp_path, wheels):
    return [lockmod.load(write_lock(tmp_path / f"{c}.yaml", f"stack-{c}", ws)) for c, ws in
            (("a", [wheels["alpha-1.0"]]), ("b", [wheels["alpha-1.0"], wheels["beta-1.0"]]))]


@pytest.fixture
def two_hosts(target, tmp_path):
    """Two hosts (roots) on the session sshd."""
    out = []
    for i in range(2):
        t = copy.deepcopy(target)
        t.root = str(tmp_path / f"root{i}")
        t.alias = f"gpu{i}"
        out.append(t)
    return out


def test_a_cancelled_fleet_stops_every_host_before_its_switch(two_hosts, stacks_ab):
    """The fleet's cancel flag (what Ctrl-C sets) is raised once both hosts' probes are seen done: neither
    switches (the one at its gate stops there, the one staged first is not switched by the play); each report says it stopped before its switch and where the host is; the new, probed generations
    are kept runnable for a later apply to reuse."""
    lock_a, lock_b = stacks_ab
    before = [applied(t, lock_a).generation for t in two_hosts]
    cancel, probed = threading.Event(), set()

    def progress_for(host):
        def progress(step, state, detail):
            if (step, state) == ("probe", "done"):
                probed.add(host)
                if len(probed) == 2:        # both probed: a host passes its gate only once its lines are read
                    cancel.set()
        return progress

    fleet = applymod.apply_fleet(two_hosts, lock_b, forks=2, progress_for=progress_for, cancel=cancel)
    assert fleet.interrupted and not fleet.ok
    for t, gen, r in zip(two_hosts, before, fleet.reports):
        assert (r.host, r.status, r.current) == (t.name, "stopped", gen), r
        assert r.error.startswith(f"{t.name}: interrupted (Ctrl-C): stopped before its switch; current left at "
                                  f"{gen}"), r.error
        assert "switch" not in [s.name for s in r.steps]
        assert_settled(t, gen)
        assert host_state(t)["generations"][r.generation]["status"] == "ready"


def test_ctrl_c_in_a_fleet_apply_stops_the_hosts_and_prints_the_summary(two_hosts, stalled, tmp_path):
    a, lk, slow = stalled
    t0 = two_hosts[0]
    inv = tmp_path / "inv.yml"
    inv.write_text("all:\n  vars: {ansible_host: %s, ansible_user: %s, ansible_port: %d, "
                   "ansible_ssh_private_key_file: %s}\n  hosts:\n" % (t0.host, t0.user, t0.port, t0.key_file)
                   + "".join(f"    {t.alias}: {{provision_root: {t.root}}}\n" for t in two_hosts))
    gens = [applied(t, lockmod.load(lk.with_name("a.yaml"))).generation for t in two_hosts]
    p = subprocess.Popen([sys.executable, "-m", "provision.cli", "apply", "-i", str(inv), "--lock", str(lk),
                          "--known-hosts", str(t0.known_hosts)], cwd=ROOT, env=env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_as_at_a_terminal)
    try:
        assert slow.requested.wait(120), "no host asked for the slow wheel"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130 and "Traceback" not in err, err
    rows = out.strip().splitlines()
    assert "Fleet: 0 applied, 0 noop, 0 failed, 0 not-attempted, 2 interrupted." in rows, out
    assert f"  interrupted, not switched: {' '.join(t.name for t in two_hosts)}" in rows, out
    for t, gen, row in zip(two_hosts, gens, rows):
        assert row.split()[:2] == [t.name, "interrupted"] and f"current left at {gen}" in row, out
        settled_without_work(t, gen)


def test_ctrl_c_during_probes_is_an_interruption_not_a_failure(two_hosts, stacks_ab, tmp_path):
    """The cancel flag (what Ctrl-C sets) is raised while the probes run (nvidia-smi hangs once the facts have
    been read): each host is "interrupted", the batch has no failure, and the unproven generation is recorded as
    abandoned by an interruption, never as failed by its probes."""
    lock_a, lock_b = stacks_ab
    before = [applied(t, lock_a).generation for t in two_hosts]
    hosts = []
    for i, t in enumerate(two_hosts):         # each host's own GPU: its driver hangs once it has been queried
        smi = tmp_path / f"gpu{i}" / "nvidia-smi"
        smi.parent.mkdir()
        smi.write_text("#!/bin/sh\nd=$(dirname \"$0\")\nif [ -e \"$d/queried\" ]; then sleep 120; fi\n"
                       f"touch \"$d/queried\"\ncat {Path(__file__).parent / 'data' / 'h200' / 'nvidia-smi-query.csv'}\n")
        smi.chmod(0o755)
        t = copy.deepcopy(t)
        t.nvidia_smi = str(smi)
        hosts.append(t)
    cancel = threading.Event()

    def progress_for(host):
        def progress(step, state, detail):
            if (step, state) == ("probe", "start"):
                threading.Timer(2, cancel.set).start()
        return progress

    fleet = applymod.apply_fleet(hosts, lock_b, forks=2, progress_for=progress_for, cancel=cancel)
    assert fleet.interrupted and fleet.failed_batch is None and fleet.failed_hosts == []
    for t, gen, r in zip(hosts, before, fleet.reports):
        assert (r.status, r.current) == ("interrupted", gen), (r.status, r.error)
        assert "fail" not in (r.probes or {}).get("status", ""), r.probes
        assert_settled(t, gen)
        man = json.loads((Path(t.root) / "generations" / r.generation / "manifest.json").read_text())
        assert man["status"] == "abandoned" and "cancelled" in man["reason"], man
