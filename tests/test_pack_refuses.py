"""`provision pack` refuses, in one line naming the distribution and its path, what it cannot pack truthfully: an
editable install (PEP 660, or its finder alone), a legacy development install (`.egg-link`), a distribution
without RECORD; nothing is written. `verify` names an editable install's code outside the generation rather than
calling it clean. Real venvs, real pip and setuptools, `--local` roots."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from wheelhouse import make_wheel

ROOT = Path(__file__).resolve().parent.parent


def cli(root: Path, *args):
    p = subprocess.run([sys.executable, "-m", "provision", args[0], "--local", "--root", str(root), *args[1:]],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    assert "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    return p


def said(p) -> list[str]:
    """stderr's lines less the progress lines."""
    return [x for x in p.stderr.strip().splitlines() if not x.lstrip().startswith("local  · ")]


def site_of(env: Path) -> Path:
    return next((env / "lib").glob("python3*/site-packages"))


def project(top: Path, name: str, setup_py: bool = False) -> Path:
    """A tiny local project with one package, built by setuptools."""
    src = top / f"{name}-src"
    (src / name).mkdir(parents=True)
    (src / name / "__init__.py").write_text("WHO = 'the source tree'\n")
    if setup_py:
        (src / "setup.py").write_text(f"from setuptools import setup\nsetup(name={name!r}, version='0.1', "
                                      f"packages=[{name!r}])\n")
    else:
        (src / "pyproject.toml").write_text(f'[build-system]\nrequires = ["setuptools>=64"]\n'
                                            f'build-backend = "setuptools.build_meta"\n'
                                            f'[project]\nname = "{name}"\nversion = "0.1"\n')
    return src


def editable_env(tmp: Path) -> tuple[Path, Path]:
    """A venv with `pip install -e` of a PEP 660 project (pip and setuptools from this interpreter's own site,
    offline), then cut off from that site: (venv, source tree)."""
    if subprocess.run([sys.executable, "-c", "import setuptools, pip"], capture_output=True).returncode:
        pytest.skip("this interpreter has no pip and setuptools to install an editable project with")
    env, src = tmp / "env", project(tmp, "tiny")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(env)], check=True)
    subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
                    "--no-index", "-e", str(src)], check=True, cwd=tmp)
    cfg = env / "pyvenv.cfg"
    cfg.write_text(cfg.read_text().replace("include-system-site-packages = true",
                                           "include-system-site-packages = false"))
    return env, src


def runs_from(env: Path) -> str:
    return subprocess.run([str(env / "bin" / "python"), "-c", "import tiny; print(tiny.__file__)"],
                          capture_output=True, text=True, cwd="/", check=True).stdout.strip()


def adopt(env: Path, root: Path) -> None:
    p = cli(root, "adopt", str(env))
    assert p.returncode == 0, p.stdout + p.stderr


def refused_by_pack(root: Path, out: Path, *names: str) -> str:
    p = cli(root, "pack", "--out", str(out))
    lines = said(p)
    assert p.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: local: "), p.stdout + p.stderr
    for n in names:
        assert n in lines[0], lines[0]
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())     # nothing that looks like a wheelhouse
    return lines[0]


def test_an_editable_install_is_refused_by_pack_and_named_by_verify(tmp_path):
    env, src = editable_env(tmp_path)
    assert runs_from(env) == str(src / "tiny" / "__init__.py")        # its code is the source tree's
    root = tmp_path / "root"
    adopt(env, root)
    line = refused_by_pack(root, tmp_path / "house", "tiny 0.1", str(site_of(env) / "tiny-0.1.dist-info"), str(src))
    assert "editable" in line
    p = cli(root, "verify")
    assert p.returncode == 1 and "tiny 0.1" in p.stdout and str(src) in p.stdout, p.stdout + p.stderr
    assert "outside the generation" in p.stdout


def test_an_editable_finder_without_direct_url_is_refused(tmp_path):
    """Without direct_url.json (another installer, or removed), the `__editable__` finder still says where the
    code lives."""
    env, src = editable_env(tmp_path)
    info = site_of(env) / "tiny-0.1.dist-info"
    (info / "direct_url.json").unlink()
    rec = info / "RECORD"
    rec.write_text("".join(ln for ln in rec.read_text().splitlines(True) if "direct_url.json" not in ln))
    root = tmp_path / "root"
    adopt(env, root)
    refused_by_pack(root, tmp_path / "house", "tiny 0.1", "__editable___tiny_0_1_finder.py", str(src / "tiny"))
    p = cli(root, "verify")
    assert p.returncode == 1 and str(src / "tiny") in p.stdout, p.stdout


def test_a_development_egg_link_is_refused(tmp_path):
    """`setup.py develop` (setuptools' legacy editable install): an .egg-link and an easy-install.pth line that
    put the source tree on the path; no dist-info at all."""
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)            # ensurepip: pip, setuptools
    if subprocess.run([str(env / "bin" / "python"), "-c", "import setuptools.command.develop"],
                      capture_output=True).returncode:
        pytest.skip("this interpreter's ensurepip brings no setuptools with a develop command")
    src = project(tmp_path, "tiny", setup_py=True)
    subprocess.run([str(env / "bin" / "python"), "setup.py", "-q", "develop"], check=True, cwd=src,
                   capture_output=True)
    link = site_of(env) / "tiny.egg-link"
    assert link.is_file() and runs_from(env) == str(src / "tiny" / "__init__.py")
    root = tmp_path / "root"
    adopt(env, root)
    refused_by_pack(root, tmp_path / "house", "tiny", str(link), str(src))
    p = cli(root, "verify")
    assert p.returncode == 1 and "tiny.egg-link" in p.stdout and str(src) in p.stdout, p.stdout


def test_a_distribution_without_record_is_refused(tmp_path, wheels):
    env = tmp_path / "env"
    subprocess.run(["uv", "venv", "-q", "--python", sys.executable, str(env)], check=True)
    subprocess.run(["uv", "pip", "install", "-q", "--offline", "--no-index", "--link-mode", "copy", "--cache-dir",
                    str(tmp_path / "uv-cache"), "--python", str(env / "bin" / "python"), str(wheels["alpha-1.0"]),
                    str(make_wheel(tmp_path / "w", "beta", "1.0"))], check=True)
    info = site_of(env) / "beta-1.0.dist-info"
    (info / "RECORD").unlink()
    root = tmp_path / "root"
    adopt(env, root)
    line = refused_by_pack(root, tmp_path / "house", "beta 1.0", str(info))
    assert "no RECORD" in line and "alpha" not in line
