"""The real SGLang wheels as test targets: downloaded once into .cache/wheels/, unpacked per test.

`wheel(version)` fetches `sglang==version` with `pip download --no-deps --isolated` (the default
index, ignoring this machine's pip config); `unpack(version, dest)` makes a site-packages from it.
"""
from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "wheels"


def wheel(version: str = "0.5.9") -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    pattern = f"sglang-{version}-py3-none-any.whl"
    with open(CACHE / ".download.lock", "w") as lock:      # parallel test runs download once
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = CACHE / pattern
        if not found.exists():
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--isolated", "--no-deps",
                                "--disable-pip-version-check", "-q", f"sglang=={version}", "-d", str(CACHE)],
                               capture_output=True, text=True)
            if r.returncode != 0 or not found.exists():
                raise RuntimeError(f"cannot download sglang=={version}: {(r.stderr or r.stdout).strip()[-400:]}")
    return found


def unpack(version: str, dest: Path) -> Path:
    """A site-packages directory holding exactly the sglang wheel's files (and its dist-info)."""
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel(version)) as z:
        z.extractall(dest)
    return dest


def copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest
