"""`status` tells the truth about serving, on a host whose PID 1 is a real systemd: the lock's service unit, its
state as systemd's manager has it (over D-Bus, no systemctl line), and the generation its processes really run
(what they map from generations/NNNN), which after a switch without a restart is not the one `current` names."""
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
UNIT = "pv-model.service"
# The served program maps its package's file from the generation it was started in, as a real server maps torch's
# libraries: a process started through <root>/current keeps the generation it resolved then.
SERVE = ("import alpha, mmap, time; f = open(alpha.__file__, 'rb'); "
         "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); time.sleep(1e6)")


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    with SystemdHost(base=tmp_path_factory.mktemp("sd"), binds=[REPO]) as h:
        trust_host(h.target)
        yield h


def status(h) -> dict:
    r = CliRunner().invoke(app, ["status", h.spec, "--key", h.target.key_file, "--known-hosts",
                                 str(h.target.known_hosts), "--root", h.root, "--json"])
    assert r.exit_code == 0, r.output
    [row] = json.loads(r.stdout)
    return row["result"]


def table(h) -> str:
    r = CliRunner().invoke(app, ["status", h.spec, "--key", h.target.key_file, "--known-hosts",
                                 str(h.target.known_hosts), "--root", h.root], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    return r.stdout


def wait_serving(h, gen: str | None, seconds: float = 20) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        s = status(h)
        if s["serving"]["generations"] == ([gen] if gen else []) or time.monotonic() > deadline:
            return s
        time.sleep(0.3)


def test_status_shows_the_unit_and_the_generation_its_processes_run(host, tmp_path):
    service = {"unit": UNIT, "health": "completion"}
    locks = [write_lock(tmp_path / f"{v}.yaml", f"serve-{v}", [make_wheel(tmp_path / "w", "alpha", v,
             body="DATA = %r\n" % ("x" * 4096))], python="%d.%d" % sys.version_info[:2], service=service)
             for v in ("1.0", "2.0")]
    tr = connect(host.target)
    try:
        first = applymod.apply(tr, lockmod.load(locks[0])).generation
        s = status(host)
        assert s["current"] == first and s["serving"]["unit"] == UNIT, s
        assert s["serving"]["load"] == "not-found" and s["serving"]["generations"] == [], s   # no unit file yet

        (host.units / UNIT).write_text(f"[Service]\nExecStart={host.root}/current/venv/bin/python -c \"{SERVE}\"\n")
        assert host.systemctl("daemon-reload").returncode == 0
        assert host.systemctl("start", UNIT).returncode == 0
        s = wait_serving(host, first)
        assert (s["serving"]["active"], s["serving"]["sub"], s["serving"]["generations"]) == \
            ("active", "running", [first]), s
        assert s["serving"]["main_pid"] and s["serving"]["processes"] == 1, s
        assert s["serving"]["healthy"] is False and "/health: " in s["serving"]["health"], s   # it answers no HTTP

        second = applymod.apply(tr, lockmod.load(locks[1])).generation
        s = status(host)                # switched, not restarted: the server still runs the first
        assert s["current"] == second and s["serving"]["generations"] == [first], s
        text = table(host)
        assert f"{second}, serving {first}" in text, text
        assert f"{first} ({UNIT} active (running), unhealthy: GET http://127.0.0.1:30000/health: " in text, text

        assert host.systemctl("restart", UNIT).returncode == 0
        s = wait_serving(host, second)
        assert s["serving"]["generations"] == [second], s
        assert f"{second}, serving" not in table(host)

        assert host.systemctl("stop", UNIT).returncode == 0
        s = status(host)
        assert (s["serving"]["active"], s["serving"]["generations"], s["serving"]["processes"]) == \
            ("inactive", [], 0), s
        assert f"- ({UNIT} inactive (dead))" in table(host)
    finally:
        tr.close()


def test_a_lock_without_a_service_shows_no_serving_column(host, tmp_path):
    lk = write_lock(tmp_path / "plain.yaml", "plain", [make_wheel(tmp_path / "w", "beta", "1.0")])
    root = host.root + "-plain"
    t = host.target
    t.root = root
    tr = connect(t)
    try:
        applymod.apply(tr, lockmod.load(lk))
    finally:
        tr.close()
    r = CliRunner().invoke(app, ["status", host.spec, "--key", t.key_file, "--known-hosts", str(t.known_hosts),
                                 "--root", root, "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)[0]["result"]["serving"] is None, r.output
    r = CliRunner().invoke(app, ["status", host.spec, "--key", t.key_file, "--known-hosts", str(t.known_hosts),
                                 "--root", root], env={"COLUMNS": "300"})
    assert r.exit_code == 0 and "serving" not in r.stdout, r.output


def test_status_checks_the_health_of_the_included_engine_it_serves(host, tmp_path):
    """The included engine's server under the unit: /health, then one real completion over the OpenAI API."""
    lk = write_lock(tmp_path / "engine.yaml", "engine", [make_wheel(tmp_path / "w", "gamma", "1.0")],
                    service={"unit": "pv-engine.service", "url": "http://127.0.0.1:30100", "health": "completion"})
    t = host.target
    t.root = host.root + "-engine"
    tr = connect(t)
    try:
        gen = applymod.apply(tr, lockmod.load(lk)).generation
    finally:
        tr.close()
    tiny = REPO / "provision" / "engine" / "tiny"
    (host.units / "pv-engine.service").write_text(
        f"[Service]\nEnvironment=PYTHONPATH={REPO}\nExecStart={sys.executable} -m provision.engine.serve "
        f"--model {tiny} --draft {tiny / 'draft'} --port 30100 --threads 1\n")
    assert host.systemctl("daemon-reload").returncode == 0
    assert host.systemctl("start", "pv-engine.service").returncode == 0
    args = [host.spec, "--key", t.key_file, "--known-hosts", str(t.known_hosts), "--root", t.root]
    deadline, s = time.monotonic() + 90, None
    while time.monotonic() < deadline:
        r = CliRunner().invoke(app, ["status", *args, "--json"])
        assert r.exit_code == 0, r.output
        s = json.loads(r.stdout)[0]["result"]
        if s["serving"]["healthy"]:
            break
        time.sleep(0.5)
    v = s["serving"]
    assert (v["unit"], v["active"], v["healthy"]) == ("pv-engine.service", "active", True), s
    assert v["health"].startswith("a completion in "), v
    assert s["current"] == gen and v["generations"] == []     # it runs from the checkout, not from the generation
    r = CliRunner().invoke(app, ["status", *args], env={"COLUMNS": "300"})
    assert "- (pv-engine.service active (running), healthy)" in r.stdout, r.stdout
    assert host.systemctl("stop", "pv-engine.service").returncode == 0
