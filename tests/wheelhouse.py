"""Test helper: build tiny but real wheels (METADATA, WHEEL, RECORD) and locks that point at them."""
from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import yaml


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(outdir: Path, name: str, version: str, requires: list[str] = (), body: str = "",
               tag: str = "py3-none-any", extra: dict[str, bytes] | None = None,
               wheel_tags: list[str] | None = None) -> Path:
    """A real wheel of `name`, its file name tagged `tag`; `extra`: more files, by their path in the wheel;
    `wheel_tags`: WHEEL's Tag lines, in this order (default: `tag`)."""
    mod = name.replace("-", "_")
    dist = f"{mod}-{version}.dist-info"
    files = {
        **(extra or {}),
        f"{mod}/__init__.py": (body or f"__version__ = {version!r}\n").encode(),
        f"{dist}/METADATA": ("Metadata-Version: 2.1\n" f"Name: {name}\nVersion: {version}\n"
                             + "".join(f"Requires-Dist: {r}\n" for r in requires)).encode(),
        f"{dist}/WHEEL": ("Wheel-Version: 1.0\nGenerator: provision-tests\nRoot-Is-Purelib: true\n"
                          + "".join(f"Tag: {t}\n" for t in wheel_tags or [tag])).encode(),
    }
    record = "".join(f"{p},{_record_hash(d)},{len(d)}\n" for p, d in files.items()) + f"{dist}/RECORD,,\n"
    files[f"{dist}/RECORD"] = record.encode()
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / f"{mod}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, d in files.items():
            z.writestr(zipfile.ZipInfo(p, date_time=(2020, 1, 1, 0, 0, 0)), d)
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_lock(path: Path, name: str, wheels: list[Path], python: str | None = None, **extra) -> Path:
    import sys

    pkgs = []
    for w in wheels:
        n, v = w.name.split("-")[:2]
        pkgs.append({"name": n.replace("_", "-"), "version": v, "filename": w.name,
                     "url": w.resolve().as_uri(), "sha256": sha256(w)})
    data = {"lock": 1, "name": name,
            "platform": {"python": python or "%d.%d" % sys.version_info[:2], "cuda": {"source": "none"}},
            "requires": [f"{p['name']}=={p['version']}" for p in pkgs], "packages": pkgs,
            "patches": [], "engine": {}, "probes": {}}
    data.update(extra)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
