"""Damaged state on real host roots (loopback sshd or `--local`): a cut-off manifest or history line, `current`
pointing outside the generations, a read-only root, a full disk; and a stale override beside unreadable
metadata. Each case is told in one line and costs no good generation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from wheelhouse import make_wheel, sha256, write_lock

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, check=None):
    p = subprocess.run([sys.executable, "-m", "provision.cli", *map(str, args)], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    assert "Traceback" not in p.stderr, p.stderr
    if check is not None:
        assert p.returncode == check, (p.returncode, p.stdout, p.stderr)
    return p


def host_args(t):
    return [f"{t.user}@{t.host}:{t.port}", "--key", t.key_file, "--known-hosts", t.known_hosts,
            "--root", t.vars["provision_root"]]


def test_stale_override_warned_beside_unreadable_metadata(tmp_path):
    """An override of a package the lock lacks is named even when its `use` names a package left unresolved and
    another package's METADATA cannot be read."""
    w = make_wheel(tmp_path / "w", "app", "1.0", [])
    missing = tmp_path / "lib-1.0-py3-none-any.whl"
    data = {"lock": 1, "name": "t", "platform": {"python": "3.12", "cuda": {"source": "none"}},
            "requires": ["app==1.0", "lib==1.0"],
            "packages": [{"name": "app", "version": "1.0", "filename": w.name, "url": w.resolve().as_uri(),
                          "sha256": sha256(w)},
                         {"name": "lib", "version": "1.0", "filename": missing.name, "url": missing.as_uri(),
                          "sha256": "0" * 64}],
            "unresolved": [{"name": "torch", "requirement": "torch==2.9.1", "reason": "no reachable index serves it"}],
            "overrides": [{"package": "gone", "pins": "torch==2.9.0", "use": "torch==2.9.1",
                           "reason": "the upstream pin is older than the stack"}]}
    lk = tmp_path / "l.yaml"
    lk.write_text(yaml.safe_dump(data, sort_keys=False))
    out = cli("lock", "check", lk, check=1).stdout
    assert "[metadata] lib: cannot read its METADATA" in out
    assert "[override] gone: override for gone, which is not in the closure  (%s:" % lk in out
