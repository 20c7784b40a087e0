"""A host that never answers costs at most --timeout per SSH stage and is named in one line; a fleet verb reports it
as its row while the other hosts report; a session whose host stops answering is closed by the keepalives."""
from __future__ import annotations

import copy
import json
import os
import signal
import threading

from provision.errors import HostError
from provision.loopback import LoopbackHost
from provision.transport import connect, trust_host
from test_core import cli


def test_a_host_that_never_speaks_ssh_is_one_line_within_the_timeout(silent, tmp_path):
    spec = f"127.0.0.1:{silent}"
    for verb in (["history", spec], ["hosts", "trust", spec]):
        p = cli(*verb, "--known-hosts", tmp_path / "known_hosts", "--timeout", "1", check=1)
        assert p.stderr.strip().splitlines() == [f"error: {spec}: no SSH banner within 1s"], p.stderr


def test_fleet_status_reports_the_others_and_the_silent_host_as_its_row(sshd, silent, tmp_path):
    t = sshd.target
    inv = tmp_path / "inv.yml"
    inv.write_text(f"all:\n  vars: {{ansible_host: {t.host}, ansible_user: {t.user}, "
                   f"ansible_ssh_private_key_file: {t.key_file}}}\n  hosts:\n"
                   f"    gpu0: {{ansible_port: {t.port}, provision_root: {tmp_path / 'r0'}}}\n"
                   f"    hung: {{ansible_port: {silent}, provision_root: {tmp_path / 'rh'}}}\n"
                   f"    gpu1: {{ansible_port: {t.port}, provision_root: {tmp_path / 'r1'}}}\n")
    p = cli("status", "-i", inv, "--known-hosts", t.known_hosts, "--timeout", "1", "--json", check=1)
    rows = {r["host"]: r for r in json.loads(p.stdout)}
    assert list(rows) == ["gpu0", "hung", "gpu1"]
    assert rows["hung"]["error"] == "no SSH banner within 1s" and rows["hung"]["stage"] == "connect", rows["hung"]
    for h, root in (("gpu0", "r0"), ("gpu1", "r1")):
        assert "error" not in rows[h] and rows[h]["result"]["root"] == str(tmp_path / root), rows[h]


def test_a_stalled_session_is_closed_by_the_keepalives(tmp_path):
    host = LoopbackHost().start()
    try:
        t = copy.deepcopy(host.target)
        trust_host(t)
        t.timeout = 0.5
        tr = connect(t)
        started, out = threading.Event(), {}

        def work():
            try:
                out["result"] = tr.run(["sh", "-c", "echo started; sleep 120"],
                                       on_line=lambda line: started.set())
            except HostError as e:
                out["error"] = str(e)
        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        assert started.wait(30)
        stopped = host.sessions()
        for pid in stopped:           # the host's sshd stops answering; TCP stays up
            os.kill(pid, signal.SIGSTOP)
        worker.join(120)              # a hang guard, not a speed target: without keepalives it never returns
        assert not worker.is_alive(), "the controller still waits on a host that stopped answering"
        # ssh's keepalive period is whole seconds: 0.5 s is 1 s, and 3 unanswered close it
        assert out == {"error": f"{t.name}: connection lost: the host answered no keepalive for 3s"}, out
        tr.close()
    finally:
        host.vanish()
        host.cleanup()
