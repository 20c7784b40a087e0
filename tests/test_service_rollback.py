"""`rollback` restarts the lock's service on the generation it switches to and checks its health (the included
engine's server over HTTP, under a unit of a real systemd as PID 1); `--no-restart` leaves the server alone; a unit
that does not come back is one line and exit 1, the switch itself standing."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from provision import apply as applymod, lock as lockmod
from provision.cli import app
from provision.transport import connect, trust_host
from systemdhost import SystemdHost
from wheelhouse import make_wheel, write_lock

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "provision" / "engine" / "tiny"
UNIT, PORT = "pv-engine.service", 30200
SERVICE = {"unit": UNIT, "url": f"http://127.0.0.1:{PORT}", "health": "completion", "start_deadline": 120,
           "stop_deadline": 30}
ENGINE = (f"[Service]\nEnvironment=PYTHONPATH={REPO}\nExecStart={sys.executable} -m provision.engine.serve "
          f"--model {TINY} --draft {TINY / 'draft'} --port {PORT} --threads 1\n")


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    with SystemdHost(base=tmp_path_factory.mktemp("sd"), binds=[REPO]) as h:
        trust_host(h.target)
        yield h


def cli(h, *args, code=0):
    r = CliRunner().invoke(app, [*args, h.spec, "--key", h.target.key_file, "--known-hosts",
                                 str(h.target.known_hosts), "--root", h.root], env={"COLUMNS": "300"})
    assert r.exit_code == code, r.output
    return r


def main_pid(h) -> int:
    return int(h.systemctl("show", "-p", "MainPID", "--value", UNIT).stdout.strip() or 0)


def test_rollback_restarts_the_service_and_waits_for_its_health(host, tmp_path):
    gens = []
    tr = connect(host.target)
    try:
        for v in ("1.0", "2.0"):
            lk = write_lock(tmp_path / f"{v}.yaml", f"svc-{v}", [make_wheel(tmp_path / "w", "delta", v)],
                            service=SERVICE)
            gens.append(applymod.apply(tr, lockmod.load(lk)).generation)
    finally:
        tr.close()
    (host.units / UNIT).write_text(ENGINE)
    assert host.systemctl("daemon-reload").returncode == 0 and host.systemctl("start", UNIT).returncode == 0
    deadline = time.monotonic() + 30
    while main_pid(host) == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    before = main_pid(host)
    assert before > 0

    out = json.loads(cli(host, "rollback", "--json").stdout)
    assert (out["from"], out["to"], out["switched"]) == (gens[1], gens[0], True), out
    s = out["service"]
    assert (s["unit"], s["healthy"], s["error"]) == (UNIT, True, None), s
    assert s["health"].startswith("a completion in ") and 0 < s["stop_seconds"] <= s["seconds"], s
    assert s["main_pid"] == main_pid(host) != before, (s, before)

    r = cli(host, "rollback", "--no-restart")                 # back to the newer one; the server left alone
    assert f"current {gens[0]} → {gens[1]}" in r.stdout and "restarted" not in r.stdout, r.stdout
    assert main_pid(host) == s["main_pid"]

    r = cli(host, "rollback")
    assert f"current {gens[1]} → {gens[0]}" in r.stdout, r.stdout
    assert f"  restarted {UNIT}: healthy " in r.stdout and "after its stop (a completion in " in r.stdout, r.stdout


def test_a_service_that_does_not_come_back_is_one_line_and_exit_1(host, tmp_path):
    t = host.target
    t.root = host.root + "-broken"
    gens = []
    tr = connect(t)
    try:
        for v in ("1.0", "2.0"):
            lk = write_lock(tmp_path / f"{v}.yaml", f"bad-{v}", [make_wheel(tmp_path / "w", "epsilon", v)],
                            service=dict(SERVICE, unit="pv-broken.service", start_deadline=3))
            gens.append(applymod.apply(tr, lockmod.load(lk)).generation)
    finally:
        tr.close()
    # the other unit's engine still answers on its port: the health it would see is not this unit's
    (host.units / "pv-broken.service").write_text("[Service]\nExecStart=/bin/sleep 600\n")
    assert host.systemctl("daemon-reload").returncode == 0
    r = CliRunner().invoke(app, ["rollback", host.spec, "--key", t.key_file, "--known-hosts", str(t.known_hosts),
                                 "--root", t.root], env={"COLUMNS": "300"})
    assert r.exit_code == 1, r.output
    assert f"current {gens[1]} → {gens[0]}" in r.stdout, r.output               # the switch stands
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert errors == [f"error: {t.name}: switched to {gens[0]}, but pv-broken.service is stopped, but port {PORT} is "
                      "still held by a process outside it: another server answers there"], r.stderr
    assert host.systemctl("stop", UNIT).returncode == 0
    (host.units / "pv-broken.service").write_text("[Service]\nExecStart=/bin/false\n")    # it exits at once
    assert host.systemctl("daemon-reload").returncode == 0
    r = CliRunner().invoke(app, ["rollback", host.spec, "--key", t.key_file, "--known-hosts", str(t.known_hosts),
                                 "--root", t.root, "--to", gens[1]], env={"COLUMNS": "300"})
    assert r.exit_code == 1 and f"current {gens[0]} → {gens[1]}" in r.stdout, r.output
    assert "but pv-broken.service failed to start (loaded, exit-code)" in r.stderr or \
        "but pv-broken.service was not healthy within 3 s of its start (service.start_deadline): GET " in r.stderr, \
        r.stderr
