"""Rollback follows history: a plain `rollback` returns to the generation that was current before the last switch
(an apply that reused an older generation included), skipping ones no longer runnable; gc keeps that one."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wheelhouse import write_lock

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, check=0):
    p = subprocess.run([sys.executable, "-m", "provision.cli", *map(str, args)], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == check, (p.returncode, p.stdout, p.stderr)
    return p


def host_args(t):
    return [f"{t.user}@{t.host}:{t.port}", "--key", t.key_file, "--known-hosts", t.known_hosts,
            "--root", t.root]


def current(t) -> str:
    return os.readlink(Path(t.root) / "current").rsplit("/", 1)[-1]


@pytest.fixture
def locks(tmp_path, wheels):
    return [write_lock(tmp_path / f"{n}.yaml", f"stack-{n}", ws) for n, ws in
            (("a", [wheels["alpha-1.0"]]), ("b", [wheels["alpha-2.0"]]), ("c", [wheels["beta-1.0"]]))]


def test_rollback_after_a_reuse_returns_to_the_generation_left(target, locks):
    """apply a, b, c, then a again (a reuse: 0003 → 0001): rollback goes back to 0003, the one just left, not to
    'the runnable generation below 0001' (there is none); gc's dry run names 0003 and keeps it; a second rollback
    returns to 0001, as an undo of the undo."""
    a, b, c = locks
    for lk in (a, b, c):
        cli("apply", *host_args(target), "--lock", lk)
    out = cli("apply", *host_args(target), "--lock", a).stdout
    assert "Switched to the existing stack-a" in out and "0003-stack-c → 0001-stack-a" in out

    dry = json.loads(cli("gc", *host_args(target), "--keep", "1", "--dry-run", "--json").stdout)
    assert (dry["current"], dry["rollback_target"]) == ("0001-stack-a", "0003-stack-c")
    assert [g["id"] for g in dry["generations"]] == ["0002-stack-b"]
    text = cli("gc", *host_args(target), "--keep", "1", "--dry-run").stdout
    assert "rollback target 0003-stack-c" in text

    said = cli("rollback", *host_args(target), "--dry-run").stdout
    assert "Would roll back" in said and "0001-stack-a → 0003-stack-c" in said and current(target) == "0001-stack-a"
    rb = json.loads(cli("rollback", *host_args(target), "--json").stdout)
    assert (rb["from"], rb["to"], rb["forward"]) == ("0001-stack-a", "0003-stack-c", True)
    assert current(target) == "0003-stack-c"
    rb = json.loads(cli("rollback", *host_args(target), "--json").stdout)
    assert (rb["from"], rb["to"]) == ("0003-stack-c", "0001-stack-a")
    cli("rollback", *host_args(target), "--to", "2")                        # --to: any runnable one, as before
    assert current(target) == "0002-stack-b"


def test_rollback_skips_generations_no_longer_runnable(target, locks):
    """a → b → c: rollback from c goes to b; with b's interpreter gone it goes to a (the one current before b);
    with a removed by gc too, it refuses in one line naming what history held and why each was skipped."""
    a, b, c = locks
    for lk in (a, b, c):
        cli("apply", *host_args(target), "--lock", lk)
    gens = Path(target.root) / "generations"
    assert json.loads(cli("rollback", *host_args(target), "--dry-run", "--json").stdout)["to"] == "0002-stack-b"
    (gens / "0002-stack-b" / "venv" / "bin" / "python").unlink()
    assert json.loads(cli("rollback", *host_args(target), "--dry-run", "--json").stdout)["to"] == "0001-stack-a"
    out = json.loads(cli("gc", *host_args(target), "--keep", "1", "--json").stdout)
    assert out["rollback_target"] == "0001-stack-a" and [g["id"] for g in out["generations"]] == ["0002-stack-b"]
    cli("rollback", *host_args(target))
    assert current(target) == "0001-stack-a"
    out = json.loads(cli("gc", *host_args(target), "--keep", "1", "--json").stdout)
    assert out["rollback_target"] == "0003-stack-c" and out["generations"] == []
    from provision.agent import store
    store.rmtree(str(gens / "0003-stack-c"))        # gone by hand (its links to the immutable store included)
    err = cli("rollback", *host_args(target), check=1).stderr
    assert err.count("\n") == 1 and "no earlier runnable generation to roll back to from 0001-stack-a" in err
    assert "0003-stack-c (removed)" in err and "0002-stack-b (removed)" in err
    assert current(target) == "0001-stack-a"
