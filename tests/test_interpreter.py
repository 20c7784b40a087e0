"""The lock's Python: `--python PATH` on plan and apply, and the usual places (PATH, /usr/bin, /usr/local/bin,
uv-managed Pythons) searched before one line says where it looked. Real interpreters only."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from provision import apply as applymod, lock as lockmod
from provision.facts import gather
from provision.transport import Local, Target
from wheelhouse import write_lock

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, check=0):
    p = subprocess.run([sys.executable, "-m", "provision.cli", *map(str, args)], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    assert "Traceback" not in p.stderr, p.stderr
    if check is not None:     # None: plan's exit code with an error finding is not what these tests are about
        assert p.returncode == check, (p.returncode, p.stdout, p.stderr)
    return p


def host_args(t):
    return [f"{t.user}@{t.host}:{t.port}", "--key", t.key_file, "--known-hosts", t.known_hosts,
            "--root", t.root]


def version_of(python: str) -> str | None:
    p = subprocess.run([python, "-I", "-c", "import sys;print('%d.%d.%d' % sys.version_info[:3])"],
                       capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else None


SSHD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@pytest.fixture(scope="module")
def elsewhere():
    """(minor "3.X", real interpreter, its prefix) for a Python that is neither on sshd's PATH nor in /usr/bin or
    /usr/local/bin: the case `--python` and the uv-managed search are for."""
    usual = {f"3.{m}" for m in range(6, 16) for d in SSHD_PATH.split(":") if os.path.exists(f"{d}/python3.{m}")}
    usual.add(".".join(map(str, sys.version_info[:2])))
    for exe in sorted(glob.glob("/root/.pyenv/versions/3.*/bin/python3.*") + glob.glob("/opt/python*/bin/python3.*")):
        v = version_of(exe) if exe.rsplit("python", 1)[-1].replace(".", "").isdigit() else None
        if v and v.rsplit(".", 1)[0] not in usual and int(v.split(".")[1]) >= 8:
            return v.rsplit(".", 1)[0], exe, str(Path(exe).parent.parent)
    pytest.skip("no Python here whose version is not on sshd's PATH")


def test_python_path_on_plan_and_apply_over_ssh(target, wheels, tmp_path, elsewhere):
    """A lock for a Python sshd's PATH does not have: plan says so in one line naming where it looked and
    exits with the plan's error; `--python PATH` plans and applies it, and the generation runs that Python;
    a wrong --python is named with its version; a relative one is bad input (exit 2)."""
    minor, exe, _ = elsewhere
    lk = write_lock(tmp_path / "l.yaml", "stack-x", [wheels["alpha-1.0"]], python=minor)
    p = cli("plan", *host_args(target), "--lock", lk, "--json", check=None)
    err = json.loads(p.stdout)["errors"]
    assert len(err) == 1 and f"host has no working Python {minor}" in err[0]
    assert f"looked for python{minor} in PATH (" in err[0] and "/usr/bin, /usr/local/bin" in err[0]
    assert "--python PATH" in err[0]

    p = cli("plan", *host_args(target), "--lock", lk, "--python", exe, "--json", check=None)
    assert json.loads(p.stdout)["errors"] == []
    other = sys.executable
    p = cli("plan", *host_args(target), "--lock", lk, "--python", other, "--json", check=None)
    assert json.loads(p.stdout)["errors"] == [f"--python {other} cannot run the lock's Python {minor}: is Python "
                                             f"{version_of(other)}, not {minor}"]
    bad = cli("plan", *host_args(target), "--lock", lk, "--python", "python3; id", check=2).stderr
    assert bad.count("\n") == 1 and "--python" in bad and "absolute path" in bad

    cli("apply", *host_args(target), "--lock", lk, "--python", exe)
    venv_py = Path(target.root) / "current" / "venv" / "bin" / "python"
    assert version_of(str(venv_py)) == version_of(exe)


def test_uv_managed_python_is_found(tmp_path, wheels, elsewhere, monkeypatch):
    """A Python laid out as uv installs it ($XDG_DATA_HOME/uv/python/cpython-3.X.Y-…/bin/python3.X) is found when
    PATH has none, and a build uses it."""
    minor, exe, prefix = elsewhere
    full = version_of(exe)
    uv_dir = tmp_path / "data" / "uv" / "python"
    uv_dir.mkdir(parents=True)
    (uv_dir / f"cpython-{full}-linux-x86_64-gnu").symlink_to(prefix)
    monkeypatch.setenv("PATH", SSHD_PATH)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.delenv("UV_PYTHON_INSTALL_DIR", raising=False)
    tr = Local(Target(host="local", python=sys.executable, root=str(tmp_path / "root")))
    want = uv_dir / f"cpython-{full}-linux-x86_64-gnu" / "bin" / f"python{minor}"
    f = gather(tr, python=minor)
    assert f.pythons[minor] == str(want) and str(uv_dir) in f.pythons_looked_in
    rep = applymod.apply(tr, lockmod.load(write_lock(tmp_path / "l.yaml", "stack-x", [wheels["alpha-1.0"]],
                                                     python=minor)))
    assert rep.status == "applied"
    assert version_of(str(tmp_path / "root" / "current" / "venv" / "bin" / "python")) == full
