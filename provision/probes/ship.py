"""Ship the tool's host-side code to a host, content-addressed: `<root>/tool/<digest>/provision/…`
(unpacked by the `build` agent; host agents themselves travel with every call, see `agent/__init__.py`).

That directory goes on PYTHONPATH so a generation's interpreter runs `python -m provision.engine.serve`
without anything being installed into the generation.
"""
from __future__ import annotations

import base64
import hashlib
import io
import tarfile
from pathlib import Path

from ..layout import root_of
from ..transport import Transport

PKG = Path(__file__).resolve().parent.parent          # the local `provision` package



def bundle_files() -> list[tuple[str, bytes]]:
    """(path relative to the tool dir, content) for provision/__init__.py, provision/errors.py (the engine's
    error derives from it) and provision/engine/**."""
    files = [(f"provision/{rel}", (PKG / rel).read_bytes()) for rel in ("__init__.py", "errors.py")]
    for p in sorted((PKG / "engine").rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo"):
            files.append((f"provision/{p.relative_to(PKG).as_posix()}", p.read_bytes()))
    return files


def digest(files: list[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for rel, data in files:
        h.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()[:16]


def ship_tool(transport: Transport) -> str:
    """Make sure the engine is on the host; returns the directory to put on PYTHONPATH."""
    files = bundle_files()
    name = digest(files)
    ask = {"op": "unpack", "root": root_of(transport.target), "name": name}
    there = transport.run_agent("tool", ask)
    if there["complete"]:
        return there["path"]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for rel, data in files:
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            t.addfile(info, io.BytesIO(data))
    out = transport.run_agent("tool", dict(ask, tar=base64.b64encode(buf.getvalue()).decode()))
    return out["path"]
