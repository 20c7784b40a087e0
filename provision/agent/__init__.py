"""Stdlib-only scripts that run ON the host (sent as source on stdin); `source(name)` reads one."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=None)
def source(name: str) -> str:
    return (Path(__file__).parent / f"{name}.py").read_text()
