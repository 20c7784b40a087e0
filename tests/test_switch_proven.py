"""Every switch is proven: apply of a lock an existing generation holds probes that generation again, inside it,
before `current` moves; a failing probe leaves `current` where it was (one host, and a fleet rollout)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from provision import apply as applymod, lock as lockmod
from provision.inventory import load_inventory
from provision.transport import connect
from test_core import cli, current_link, host_args
from wheelhouse import write_lock


def toolkit_lock(path: Path, name: str, wheel: Path, home: Path) -> Path:
    """A lock that takes CUDA 13.0 from the host's toolkit at `home` (none there yet: its nvcc probe skips)."""
    platform = {"python": "%d.%d" % sys.version_info[:2], "cuda": {"version": "13.0", "source": "host",
                                                                   "home": str(home)}}
    return write_lock(path, name, [wheel], platform=platform)


def break_toolkit(home: Path) -> None:
    """A half-installed toolkit appears where the lock takes CUDA from: bin/nvcc is not a program."""
    (home / "bin").mkdir(parents=True, exist_ok=True)
    (home / "bin" / "nvcc").write_text("")


def test_reuse_is_probed_before_the_switch(target, tmp_path, wheels):
    home = tmp_path / "cuda"
    a = toolkit_lock(tmp_path / "a.yaml", "stack-a", wheels["alpha-1.0"], home)
    b = write_lock(tmp_path / "b.yaml", "stack-b", [wheels["alpha-2.0"]])
    tr = connect(target)
    try:
        assert applymod.apply(tr, lockmod.load(a)).generation == "0001-stack-a"
        assert applymod.apply(tr, lockmod.load(b)).generation == "0002-stack-b"
    finally:
        tr.close()
    break_toolkit(home)     # the host changed since 0001-stack-a was proven

    p = cli("plan", *host_args(target), "--lock", a, check=0)
    assert "reuse (probe): generation 0001-stack-a already holds this lock" in p.stdout, p.stdout

    p = cli("apply", *host_args(target), "--lock", a, check=1)
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "probes failed in 0001-stack-a: nvcc (" in last, p.stderr
    assert last.endswith("current left at 0002-stack-b"), last
    assert "probes in 0001-stack-a" in p.stdout and any(                                  # the probe table
        "fail" in line.split("nvcc")[0] and "--version failed" in line for line in p.stdout.splitlines()), p.stdout
    assert current_link(target) == "generations/0002-stack-b"
    stored = json.loads((Path(target.root) / "generations/0001-stack-a/probes.json").read_text())
    assert stored["during_apply"] and stored["failed"] == ["nvcc"]

    (home / "bin" / "nvcc").unlink()      # the broken toolkit is gone again: the lock's probes hold
    p = cli("apply", *host_args(target), "--lock", a, check=0)
    assert "Switched to the existing stack-a" in p.stdout and "0002-stack-b → 0001-stack-a" in p.stdout, p.stdout
    assert "(reuse probed in " in p.stdout, p.stdout
    assert current_link(target) == "generations/0001-stack-a"
    stored = json.loads((Path(target.root) / "generations/0001-stack-a/probes.json").read_text())
    assert stored["status"] == "pass" and stored["during_apply"]


def test_fleet_rollout_probes_each_reused_generation(sshd, tmp_path, wheels):
    t = sshd.target
    roots = {"gpu0": tmp_path / "root0", "gpu1": tmp_path / "root1"}
    inv = tmp_path / "inv.yml"
    inv.write_text(f"all:\n  vars: {{ansible_host: {t.host}, ansible_port: {t.port}, ansible_user: {t.user}, "
                   f"ansible_ssh_private_key_file: {t.key_file}}}\n  hosts:\n"
                   + "".join(f"    {h}: {{provision_root: {r}}}\n" for h, r in roots.items()))
    home = tmp_path / "cuda"
    a = toolkit_lock(tmp_path / "a.yaml", "stack-a", wheels["alpha-1.0"], home)
    b = write_lock(tmp_path / "b.yaml", "stack-b", [wheels["beta-1.0"]])
    ts = load_inventory(inv, t.known_hosts)
    for lk in (a, b):
        assert {r.status for r in applymod.apply_fleet(ts, lockmod.load(lk)).reports} == {"applied"}
    break_toolkit(home)

    args = ["-i", inv, "--known-hosts", t.known_hosts, "--lock", a, "--serial", "2"]
    p = cli("apply", *args, check=1)
    assert "Fleet: 0 applied, 0 noop, 2 failed, 0 not-attempted." in p.stdout, p.stdout
    for host, root in roots.items():
        row = next(line for line in p.stdout.splitlines() if line.split()[:1] == [host])
        assert "failed" in row and "probes failed in 0001-stack-a: nvcc (" in row, row
        assert os.readlink(root / "current") == "generations/0002-stack-b"

    (home / "bin" / "nvcc").unlink()
    p = cli("apply", *args, check=0)
    assert "Fleet: 0 applied, 0 noop, 0 failed, 0 not-attempted, 2 reused." in p.stdout, p.stdout
    for host, root in roots.items():
        row = next(line for line in p.stdout.splitlines() if line.split()[:1] == [host])
        assert row.split()[1:3] == ["reused", "0001-stack-a"] and "(reuse probed in " in row, row
        assert os.readlink(root / "current") == "generations/0001-stack-a"
