"""Tiny real wheels and a PEP 503 index for lock tests (stdlib zip writer, no network)."""
from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def make_wheel(folder: Path, name: str, version: str, requires=(), extras=(), tag: str = "py3-none-any") -> Path:
    """Write `name-version-tag.whl` with METADATA (Requires-Dist), WHEEL and RECORD."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    meta = [f"Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Provides-Extra: {e}" for e in extras]
    meta += [f"Requires-Dist: {r}" for r in requires]
    files = {f"{dist}/__init__.py": f"__version__ = {version!r}\n",
             f"{info}/METADATA": "\n".join(meta) + "\n",
             f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: provision-tests\nRoot-Is-Purelib: true\nTag: {tag}\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = "\n".join(record) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{dist}-{version}-{tag}.whl"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for path, text in files.items():
            z.writestr(path, text)
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_index(root: Path, wheels: list[Path]) -> Path:
    """A PEP 503 simple index under `root` (files in root/files, pages root/simple/<name>/)."""
    from packaging.utils import canonicalize_name, parse_wheel_filename

    files = root / "files"
    files.mkdir(parents=True, exist_ok=True)
    by_name: dict[str, list[Path]] = {}
    for w in wheels:
        dest = files / w.name
        if dest != w:
            dest.write_bytes(w.read_bytes())
        by_name.setdefault(canonicalize_name(parse_wheel_filename(w.name)[0]), []).append(dest)
    simple = root / "simple"
    simple.mkdir(parents=True, exist_ok=True)
    names = []
    for name, ws in sorted(by_name.items()):
        page = simple / name
        page.mkdir(exist_ok=True)
        links = "".join(f'<a href="../../files/{w.name}#sha256={sha256(w)}">{w.name}</a><br>\n' for w in ws)
        (page / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
        names.append(f'<a href="{name}/">{name}</a><br>')
    (simple / "index.html").write_text("<!DOCTYPE html><html><body>" + "".join(names) + "</body></html>\n")
    return simple
