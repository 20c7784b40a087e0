"""Files that ship inside the package: the playbooks (with their modules and module_utils), the patch series and the
demo locks.

A lock names a series as `patches/<name>`; a path not found beside the lock is looked up here.
"""
from __future__ import annotations

from pathlib import Path

PKG = Path(__file__).resolve().parent
PLAYBOOKS = PKG / "playbooks"
PATCHES = PKG / "patches"
DEMO_LOCKS = PKG / "lockfiles" / "demo"


def find(rel: str) -> Path | None:
    """A relative path among the shipped files (e.g. `patches/sglang-0.5.9`), contained in the package."""
    p = (PKG / rel).resolve()
    if p != PKG and PKG in p.parents and p.exists():
        return p
    return None


def playbooks() -> list[tuple[str, str]]:
    """(file name, its first comment line) of each playbook operators can run themselves."""
    out = []
    for f in sorted(PLAYBOOKS.glob("*.yml")):
        first = next((ln[1:].strip() for ln in f.read_text().splitlines() if ln.startswith("#")), "")
        out.append((f.name, first))
    return out
