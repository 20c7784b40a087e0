"""A verb whose playbook runs without a cancel of its own (history, status, gc, verify, rollback of an inventory)
keeps Ctrl-C: ansible-runner's signal handlers stop the play, then the process's own are back and the Ctrl-C is
the command's "interrupted", exit 130."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

from test_core import ROOT, ctrl_c_as_at_a_terminal


def test_ctrl_c_stops_history_of_an_inventory_waiting_on_a_hung_host(sshd, listener, tmp_path):
    port, accepted = listener
    t = sshd.target
    inv = tmp_path / "inv.yml"
    inv.write_text(f"all:\n  vars: {{ansible_host: {t.host}, ansible_user: {t.user}, "
                   f"ansible_ssh_private_key_file: {t.key_file}}}\n  hosts:\n"
                   f"    up: {{ansible_port: {t.port}, provision_root: {tmp_path / 'root-up'}}}\n"
                   f"    hung: {{ansible_port: {port}, provision_root: {tmp_path / 'root-hung'}}}\n")
    p = subprocess.Popen([sys.executable, "-m", "provision.cli", "history", "-i", str(inv), "--known-hosts",
                          str(t.known_hosts), "--timeout", "60"], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, preexec_fn=ctrl_c_as_at_a_terminal)
    t0 = time.monotonic()
    while not accepted and time.monotonic() - t0 < 30:       # the play is under way: ssh reached the hung port
        time.sleep(0.05)
    assert accepted, "the play never contacted the hung host"
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=40)
    assert p.returncode == 130 and err.splitlines()[-1] == "interrupted", (out, err)
    assert "Traceback" not in err
    assert time.monotonic() - t0 < 40          # long before the hung host's 60 s connect timeout
