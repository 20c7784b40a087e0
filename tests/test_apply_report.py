"""What apply and its fleet summary say of each host is the host's state, on real sshd hosts and real plays: a switch
whose history line was lost, a rollout stopped by Ctrl-C or by its play killed, and what --json leaves on stderr."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from provision import generations
from provision import lock as lockmod
from provision.transport import connect
from test_core import cli, host_args
from test_faults import applied, assert_settled, host_state
from wheelhouse import write_lock


@pytest.fixture
def stacks_ab(tmp_path, wheels):
    """Lock files A (alpha) and B (alpha, beta)."""
    return (write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]]),
            write_lock(tmp_path / "b.yaml", "stack-b", [wheels["alpha-1.0"], wheels["beta-1.0"]]))


def test_a_switch_whose_history_line_is_lost_is_said_with_what_to_run(target, stacks_ab):
    """History cannot be appended (chattr +i) through a whole apply: `current` switches (the rename commits), and the
    command says so with a warning that names the host, the record that failed and what records it; the same apply
    again is a no-op that records the switch once."""
    a, b = stacks_ab
    ga = applied(target, lockmod.load(a)).generation
    hist = Path(target.vars["provision_root"]) / "history.jsonl"
    subprocess.run(["chattr", "+i", str(hist)], check=True)
    try:
        p = cli("apply", *host_args(target), "--lock", b, check=0)
    finally:
        subprocess.run(["chattr", "-i", str(hist)], check=True)
    gb = host_state(target)["current"]
    assert gb != ga and f"current {ga} → {gb}" in p.stdout, p.stdout
    warned = [line for line in p.stderr.splitlines() if line.startswith(f"warning: {target.name}: switched to {gb}")]
    assert len(warned) == 1 and "recording it failed (history: " in warned[0], p.stderr
    assert "Operation not permitted" in warned[0] and "the same apply again" in warned[0], warned
    again = json.loads(cli("apply", *host_args(target), "--lock", b, "--json", check=0).stdout)
    assert again["status"] == "noop" and gb in again["recovered"]["repaired"], again
    tr = connect(target)
    try:
        switches = [e for e in generations.history(tr)["events"] if e["event"] == "apply" and e["to"] == gb]
    finally:
        tr.close()
    assert [e.get("repaired") for e in switches] == [True], switches
    assert_settled(target, gb)
