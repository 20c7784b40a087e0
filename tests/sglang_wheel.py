"""The real SGLang wheels as test targets: downloaded once into .cache/wheels/, unpacked per test.

`wheel(version)` fetches `sglang==version` with `pip download --no-deps --isolated` (the default
index, ignoring any local pip config); `site_packages(version)` unpacks it once
into .cache/; `copy` makes cheap writable hard-link copies of that for tests that patch.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "wheels"


def wheel(version: str = "0.5.9", dist: str = "sglang") -> Path:
    """A wheel of `dist` (sglang, or e.g. flashinfer-python, ninja) for this interpreter from the index, cached."""
    CACHE.mkdir(parents=True, exist_ok=True)
    name = dist.replace("-", "_")
    with open(CACHE / ".download.lock", "w") as lock:      # parallel test runs download once
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = _cached(name, version)
        if found is None:
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--isolated", "--no-deps",
                                "--only-binary=:all:", "--disable-pip-version-check", "-q", f"{dist}=={version}",
                                "-d", str(CACHE)], capture_output=True, text=True)
            found = _cached(name, version)
            if r.returncode != 0 or found is None:
                raise RuntimeError(f"cannot download {dist}=={version}: {(r.stderr or r.stdout).strip()[-400:]}")
    return found


def _cached(name: str, version: str) -> Path | None:
    """The cached wheel of name==version this interpreter can install (pure Python, or its own tags)."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    mine = set(sys_tags())
    for w in sorted(CACHE.glob(f"{name}-{version}-*.whl")):
        if any(t in mine for t in parse_wheel_filename(w.name)[3]):
            return w
    return None


def unpack(version: str, dest: Path) -> Path:
    """A site-packages directory holding exactly the sglang wheel's files (and its dist-info)."""
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel(version)) as z:
        z.extractall(dest)
    return dest


def site_packages(version: str = "0.5.9") -> Path:
    """The wheel unpacked once into .cache/site-packages/sglang-VERSION/; treat it as read-only."""
    dest = REPO / ".cache" / "site-packages" / f"sglang-{version}"
    stamp = dest / ".complete"
    if not stamp.exists():
        tmp = Path(tempfile.mkdtemp(prefix=f".sglang-{version}-", dir=dest.parent if dest.parent.exists()
                                    else _mkdir(dest.parent)))
        unpack(version, tmp)
        (tmp / ".complete").write_text(wheel(version).name + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        try:
            tmp.rename(dest)
        except OSError:                       # another run got there first
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def copy(src: Path, dest: Path) -> Path:
    """A writable copy made of hard links: the patcher replaces files by rename, so the source's
    files are never written through it. Tests that edit a file in place must use `rewrite`."""
    def link(a, b):
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)
    shutil.copytree(src, dest, copy_function=link, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(".complete"))
    return dest


def rewrite(path: Path, text: str) -> None:
    """Change a file of a `copy` without touching the file it is linked to."""
    path.unlink()
    path.write_text(text)
