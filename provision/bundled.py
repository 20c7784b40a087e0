"""Files that ship inside the package: the build playbooks, the patch series and the demo locks.

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
