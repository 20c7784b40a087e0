"""The built wheel is the product: it holds every file the package needs at run time."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

from provision import bundled, lock as lockmod

PKG = Path(bundled.__file__).parent


def test_wheel_holds_every_file_of_the_package(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--disable-pip-version-check",
                    "-w", str(tmp_path), str(PKG.parent)], check=True, capture_output=True)
    (whl,) = tmp_path.glob("provision-*.whl")
    shipped = {n for n in zipfile.ZipFile(whl).namelist() if n.startswith("provision/")}
    present = {f"provision/{p.relative_to(PKG).as_posix()}" for p in PKG.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")}
    assert present - shipped == set()
    for needed in ("provision/playbooks/build.yml", "provision/patches/sglang-0.5.9/series.yaml",
                   "provision/lockfiles/demo/a.yaml", "provision/engine/tiny/draft/model.safetensors"):
        assert needed in shipped


def test_lock_outside_the_checkout_finds_the_shipped_series(tmp_path):
    data = yaml.safe_load((bundled.DEMO_LOCKS / "a.yaml").read_text())
    data["patches"] = ["patches/sglang-0.5.9"]
    path = tmp_path / "lock.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    lk = lockmod.load(path)
    assert lk.resolve_path(lk.patches[0]) == bundled.PATCHES / "sglang-0.5.9"
    assert bundled.find("../pyproject.toml") is None and bundled.find("/etc/passwd") is None
