"""The included EAGLE-3 engine: a Llama target, its EAGLE-3 draft, tree speculation, an HTTP API.

Torch, the standard library and provision/errors.py only; it travels to hosts with that module and runs
from a generation via PYTHONPATH."""
from pathlib import Path

from .errors import EngineError

TINY_DIR = Path(__file__).parent / "tiny"

__all__ = ["EngineError", "TINY_DIR"]
