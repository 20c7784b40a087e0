"""verify reaches every file that can run or steer what runs: in an adopted generation 0 the `.pth` files and
modules its venv's creator wrote, bin/, pyvenv.cfg and the bin/python link (recorded at adoption); in every
generation `<gen>/kernels.env`, which an operator's service loads. A generation adopted before adoption records
still verifies and says what it cannot check. Real venvs made by uv, real interpreters, `--local` roots."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from provision import apply as applymod, generations, lock as lockmod
from provision.errors import HostError
from provision.transport import Local, Target
from wheelhouse import make_wheel, write_lock

ROOT = Path(__file__).resolve().parent.parent
CREATOR_PTH = "import _virtualenv\n"                   # what virtualenv (and uv before 0.4) write into site-packages
CREATOR_PY = "# the venv creator's patches of distutils\n"


def cli(root: Path, *args):
    p = subprocess.run([sys.executable, "-m", "provision", args[0], "--local", "--root", str(root), *args[1:]],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    assert "Traceback" not in p.stderr, p.stderr
    return p


def refused(tr, gen: str) -> str:
    with pytest.raises(HostError) as e:
        generations.rollback(tr, to=gen, dry_run=True)
    return str(e.value)


def planted_runs(env: Path) -> str:
    """What the environment's interpreter says of the planted marker."""
    return subprocess.run([str(env / "bin" / "python"), "-c",
                           "import builtins; print(getattr(builtins, 'PLANTED', 0))"],
                          capture_output=True, text=True, cwd="/").stdout.strip()


@pytest.fixture(scope="module")
def reach(tmp_path_factory):
    """A root whose generation 0 is a uv venv (six installed; `_virtualenv.pth` and `_virtualenv.py` as its
    creator wrote them) adopted through the CLI, then two applied generations (1, and 2 current)."""
    tmp = tmp_path_factory.mktemp("reach")
    env = tmp / "env"
    six = make_wheel(tmp / "w", "six", "1.0")
    subprocess.run(["uv", "venv", "-q", "--python", sys.executable, str(env)], check=True)
    subprocess.run(["uv", "pip", "install", "-q", "--offline", "--no-index", "--link-mode", "copy", "--cache-dir",
                    str(tmp / "uv-cache"), "--python", str(env / "bin" / "python"), str(six)], check=True)
    site = next((env / "lib").glob("python3*/site-packages"))
    (site / "_virtualenv.pth").write_text(CREATOR_PTH)
    (site / "_virtualenv.py").write_text(CREATOR_PY)
    root = tmp / "root"
    p = cli(root, "adopt", str(env))
    assert p.returncode == 0, p.stdout + p.stderr
    tr = Local(Target(host="local", root=str(root)))
    gens = [applymod.apply(tr, lockmod.load(write_lock(tmp / f"{n}.yaml", n, [make_wheel(tmp / "w", n, "1.0")])))
            .generation for n in ("alpha", "beta")]
    assert cli(root, "verify", "0").returncode == 0
    yield tr, root, env, site, gens[0]
    tr.close()


def restored(paths):
    """What `paths` hold now (bytes, or a link's target), to put back after a test."""
    return {p: os.readlink(p) if p.is_symlink() else p.read_bytes() for p in paths}


def put_back(saved):
    for path, old in saved.items():
        if path.is_symlink() or path.exists():
            path.unlink()
        if isinstance(old, str):
            path.symlink_to(old)
        else:
            path.write_bytes(old)


@pytest.mark.parametrize("case", ["pth", "creator-module", "activate", "new-bin", "system-site", "interpreter"])
def test_what_an_adopted_generation_runs_outside_record_is_drift(reach, case):
    """Each changed or planted file of the adopted venv that no RECORD lists but that runs (or steers what runs)
    is named by verify (exit 1) and by rollback's check."""
    tr, root, env, site, _ = reach
    pth, mod, cfg, py = site / "_virtualenv.pth", site / "_virtualenv.py", env / "pyvenv.cfg", env / "bin" / "python"
    saved = restored([pth, mod, cfg, py, env / "bin" / "activate"])
    if case == "pth":               # a .pth line that starts with `import` runs at every start
        pth.write_text(CREATOR_PTH + "import builtins; builtins.PLANTED = 1\n")
        assert planted_runs(env) == "1"
        named = "_virtualenv.pth"
    elif case == "creator-module":  # the module the creator's .pth imports at every start
        mod.write_text(CREATOR_PY + "import builtins; builtins.PLANTED = 1\n")
        assert planted_runs(env) == "1"
        named = "_virtualenv.py"
    elif case == "activate":
        with open(env / "bin" / "activate", "a") as f:
            f.write("export LD_PRELOAD=/tmp/planted.so\n")
        named = "bin/activate"
    elif case == "new-bin":
        (env / "bin" / "helper").write_text("#!/bin/sh\necho planted\n")
        os.chmod(env / "bin" / "helper", 0o755)
        named = "bin/helper"
    elif case == "system-site":
        text = cfg.read_text().replace("include-system-site-packages = false", "include-system-site-packages = true")
        assert text != cfg.read_text()
        cfg.write_text(text)
        named = "pyvenv.cfg"
    else:
        py.unlink()
        py.symlink_to("/bin/sh")
        named = "bin/python"
    try:
        assert named in refused(tr, "0")
        p = cli(root, "verify", "0")
        assert p.returncode == 1 and named in p.stdout, p.stdout + p.stderr
    finally:
        (env / "bin" / "helper").unlink(missing_ok=True)
        put_back(saved)
    assert cli(root, "verify", "0").returncode == 0


def test_a_pth_planted_in_an_adopted_venv_is_named(reach):
    """A `.pth` of the creator's name that was not there at adoption: no name is exempt."""
    tr, root, env, site, _ = reach
    saved = restored([site / "_virtualenv.pth"])
    (site / "_virtualenv.pth").unlink()
    assert cli(root, "verify", "0").returncode == 1           # the recorded one is gone: named too
    try:
        (site / "_virtualenv.pth").write_text("import builtins; builtins.PLANTED = 1\n")
        assert planted_runs(env) == "1"
        p = cli(root, "verify", "0")
        assert p.returncode == 1 and "_virtualenv.pth" in p.stdout, p.stdout
    finally:
        put_back(saved)
    assert cli(root, "verify", "0").returncode == 0


@pytest.mark.parametrize("case", ["added-variable", "redirected"])
def test_kernels_env_is_what_the_generations_kernel_record_says(reach, case):
    """`<gen>/kernels.env` (what an operator's service loads with EnvironmentFile=) is compared with what the
    generation's kernels.json gives: a line added or a path sent elsewhere is named by verify and rollback."""
    tr, root, _, _, gen = reach
    env_file = root / "generations" / gen / "kernels.env"
    saved = restored([env_file])
    text = env_file.read_text()
    assert "TRITON_CACHE_DIR=" in text
    if case == "added-variable":
        env_file.write_text(text + "LD_PRELOAD=/tmp/planted.so\n")
    else:
        env_file.write_text("".join("TRITON_CACHE_DIR=/tmp/planted\n" if ln.startswith("TRITON_CACHE_DIR=")
                                    else ln + "\n" for ln in text.splitlines()))
    try:
        assert "kernels.env" in refused(tr, gen)
        p = cli(root, "verify", gen)
        assert p.returncode == 1 and "kernels.env" in p.stdout, p.stdout + p.stderr
    finally:
        put_back(saved)
    assert cli(root, "verify", gen).returncode == 0


def test_an_adoption_without_a_record_verifies_and_says_what_it_cannot_check(reach):
    """A generation 0 adopted by an older version (no record of bin/, pyvenv.cfg, the interpreter link or the
    creator's site-packages files) still verifies, and says plainly which of them it cannot check."""
    tr, root, _, _, _ = reach
    stamp = root / "generations" / "0000-adopted" / "stamp.json"
    assert stamp.is_file()                                   # the adoption's record
    kept = stamp.with_name("stamp.json.kept")
    shutil.move(stamp, kept)
    try:
        p = cli(root, "verify", "0")
        assert p.returncode == 0, p.stdout + p.stderr
        said = p.stderr
        assert "not checked" in said and "adopted before" in said, said
        for what in ("bin/", "pyvenv.cfg", "bin/python", "_virtualenv.pth", "_virtualenv.py"):
            assert what in said, said
        assert generations.rollback(tr, to="0", dry_run=True).check.verdict == "clean"
    finally:
        shutil.move(kept, stamp)
    p = cli(root, "verify", "0")
    assert p.returncode == 0 and "not checked" not in p.stderr, p.stderr
