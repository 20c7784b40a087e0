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

from .. import layout
from ..replies import Unpacked, refuse
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
    lay = layout.of(transport)
    ask = {"op": "unpack", "root": lay.root, "name": name}
    there = unpacked(transport, ask, lay.tool_dir(name))
    if there.complete:
        return there.path
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for rel, data in files:
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            t.addfile(info, io.BytesIO(data))
    out = unpacked(transport, dict(ask, tar=base64.b64encode(buf.getvalue()).decode()), lay.tool_dir(name))
    if not out.complete:
        refuse(transport.target.name, Unpacked.STEP, "complete", "false after unpacking")
    return out.path


def unpacked(transport: Transport, ask: dict, where: str) -> Unpacked:
    """The tool agent's reply to `ask`, whose path must be `where` (the directory the layout names for it)."""
    out = Unpacked.of(transport.run_agent("tool", ask), transport.target.name)
    if out.path != where:
        refuse(transport.target.name, Unpacked.STEP, "path", f"{out.path[:120]!r} is not {where}")
    return out
