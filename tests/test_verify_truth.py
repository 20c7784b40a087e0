"""`verify` and rollback's check judge a generation by one rule: whatever can run and differs from what the build
sealed is drift — bytecode planted where the interpreter never writes it or forged in its cache, files RECORD
lists without a hash, bin/, pyvenv.cfg, the interpreter link. A bad generation argument is exit 2. Real venvs
built by uv on `--local` roots, real interpreters."""
from __future__ import annotations

import importlib.util
import json
import marshal
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from provision import apply as applymod, generations, lock as lockmod
from provision.errors import HostError
from provision.transport import Local, Target
from wheelhouse import _record_hash, make_wheel, write_lock

ROOT = Path(__file__).resolve().parent.parent


def unhashed_wheel(outdir: Path) -> Path:
    """A real wheel whose RECORD lists `plain/data.py` without a hash (as some build backends write it)."""
    files = {"plain/__init__.py": b"from .data import VALUE\n", "plain/data.py": b"VALUE = 1\n",
             "plain-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: plain\nVersion: 1.0\n",
             "plain-1.0.dist-info/WHEEL":
                 b"Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    rows = "".join(f"{p},{'' if p == 'plain/data.py' else _record_hash(d)},{len(d)}\n" for p, d in files.items())
    files["plain-1.0.dist-info/RECORD"] = (rows + "plain-1.0.dist-info/RECORD,,\n").encode()
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / "plain-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, d in files.items():
            z.writestr(zipfile.ZipInfo(p, date_time=(2020, 1, 1, 0, 0, 0)), d)
    return path


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """A local root with two generations: `old` (six, plain) and the current `new`, both sealed."""
    tmp = tmp_path_factory.mktemp("truth")
    six = make_wheel(tmp / "w", "six", "1.0", body="WHO = 'source'\n")
    old = lockmod.load(write_lock(tmp / "old.yaml", "old", [six, unhashed_wheel(tmp / "w")]))
    new = lockmod.load(write_lock(tmp / "new.yaml", "new", [make_wheel(tmp / "w", "alpha", "1.0")]))
    root = tmp / "root"
    tr = Local(Target(host="local", root=str(root)))
    gens = [applymod.apply(tr, lk).generation for lk in (old, new)]
    yield tr, root, gens[0]
    tr.close()


def cli(root: Path, *args):
    p = subprocess.run([sys.executable, "-m", "provision.cli", args[0], "--local", "--root", str(root), *args[1:]],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    assert "Traceback" not in p.stderr, p.stderr
    return p


def venv(root: Path, gen: str) -> Path:
    return root / "generations" / gen / "venv"


def site(root: Path, gen: str) -> Path:
    return next((venv(root, gen) / "lib").glob("python3*/site-packages"))


def python(root: Path, gen: str, code: str) -> str:
    """What the generation's interpreter prints running `code` (bytecode written as usual)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return subprocess.run([str(venv(root, gen) / "bin" / "python"), "-c", code], capture_output=True, text=True,
                          env=env, cwd="/", check=True).stdout.strip()


def refused(tr, gen: str) -> str:
    with pytest.raises(HostError) as e:
        generations.rollback(tr, to=gen, dry_run=True)
    return str(e.value)


def writable(path: Path) -> Path:
    if path.exists() and not path.is_symlink():
        os.chmod(path, 0o644)
    return path


def test_planted_sitecustomize_pyc_runs_and_is_drift(host):
    tr, root, gen = host
    planted = site(root, gen) / "sitecustomize.pyc"
    code = compile("import builtins; builtins.PLANTED = 1\n", "sitecustomize.py", "exec")
    planted.write_bytes(importlib.util.MAGIC_NUMBER + bytes(12) + marshal.dumps(code))
    try:
        assert python(root, gen, "import builtins; print(getattr(builtins, 'PLANTED', 0))") == "1"   # it runs
        p = cli(root, "verify", gen)
        assert p.returncode == 1 and "files no RECORD lists (sitecustomize.pyc)" in p.stdout, p.stdout + p.stderr
        assert "sitecustomize.pyc not installed by the build" in refused(tr, gen)
    finally:
        planted.unlink()
    assert cli(root, "verify", gen).returncode == 0


def test_forged_cache_bytecode_runs_and_is_drift_the_interpreters_own_is_not(host):
    tr, root, gen = host
    src = site(root, gen) / "six" / "__init__.py"
    assert python(root, gen, "import six; print(six.WHO)") == "source"     # the interpreter writes its own cache
    own = src.parent / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc"
    assert own.exists()
    p = cli(root, "verify", gen, "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["verdict"] == "clean", p.stdout
    assert generations.rollback(tr, to=gen, dry_run=True).check.verdict == "clean"
    st = src.stat()
    code = compile("WHO = 'forged'\n", str(src), "exec")
    header = importlib.util.MAGIC_NUMBER + bytes(4) + int(st.st_mtime).to_bytes(4, "little") + \
        st.st_size.to_bytes(4, "little")
    writable(own).write_bytes(header + marshal.dumps(code))            # the source's mtime and size: it is used
    try:
        assert python(root, gen, "import six; print(six.WHO)") == "forged"
        p = cli(root, "verify", gen)
        assert p.returncode == 1, p.stdout + p.stderr
        assert "(bytecode): 1 not the interpreter's compile of their source (six/__pycache__/" in p.stdout
        assert "six/__pycache__/__init__." in refused(tr, gen)
    finally:
        own.unlink()
    assert python(root, gen, "import six; print(six.WHO)") == "source"
    assert cli(root, "verify", gen).returncode == 0


@pytest.mark.parametrize("case", ["unhashed-row", "new-bin", "system-site", "interpreter"])
def test_what_rollback_refuses_verify_calls_drift(host, case):
    tr, root, gen = host
    v = venv(root, gen)
    data, cfg, py = site(root, gen) / "plain" / "data.py", v / "pyvenv.cfg", v / "bin" / "python"
    saved = {p: (p.read_bytes() if not p.is_symlink() else os.readlink(p)) for p in (data, cfg, py)}
    if case == "unhashed-row":
        writable(data).write_text("VALUE = 2\n")
        named = "plain/data.py"
    elif case == "new-bin":
        (v / "bin" / "helper").write_text("#!/bin/sh\necho hi\n")
        os.chmod(v / "bin" / "helper", 0o755)
        named = "bin/helper"
    elif case == "system-site":
        text = cfg.read_text().replace("include-system-site-packages = false", "include-system-site-packages = true")
        assert text != cfg.read_text()
        writable(cfg).write_text(text)
        named = "pyvenv.cfg"
    else:
        py.unlink()
        py.symlink_to("/bin/sh")
        named = "bin/python"
    try:
        assert named in refused(tr, gen)
        p = cli(root, "verify", gen)
        assert p.returncode == 1 and named in p.stdout and "(venv)" in p.stdout, p.stdout + p.stderr
    finally:
        (v / "bin" / "helper").unlink(missing_ok=True)
        for path, old in saved.items():
            if isinstance(old, str):
                path.unlink()
                path.symlink_to(old)
            else:
                writable(path).write_bytes(old)
    assert cli(root, "verify", gen).returncode == 0


@pytest.mark.parametrize("arg", ["99", "abc", "../x"])
def test_a_bad_generation_argument_is_exit_2_naming_it(host, arg):
    _, root, _ = host
    p = cli(root, "verify", arg)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and arg in lines[0], p.stderr
    assert "no generation 99 (have: " in lines[0] if arg == "99" else "not a generation number or id" in lines[0]


def test_timing_line_says_what_it_measured(host):
    _, root, gen = host
    p = cli(root, "verify", gen)
    assert p.returncode == 0 and "read and hashed in" in p.stdout, p.stdout          # without --baseline: no read
    assert "--baseline times a first read of the same bytes" in p.stdout                # time of its own to compare
    p = cli(root, "verify", gen, "--baseline")
    assert p.returncode == 0 and "a first read of the same bytes without hashing took" in p.stdout, p.stdout
    assert "the page cache dropped per file first" in p.stdout and "x a first read" in p.stdout, p.stdout
    assert len(re.findall(r"\d+ files,", p.stdout)) == 1, p.stdout                     # one count of files
    v = json.loads(cli(root, "verify", gen, "--baseline", "--json").stdout)
    assert v["read_bytes"] == v["bytes"] > 0 and v["ratio"] == v["seconds"] / v["read_seconds"]   # the same bytes
    assert "first_read_seconds" not in v and v["cache"].startswith("the page cache dropped")
