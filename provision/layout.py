"""The host layout in one place: the root, its generations, a generation's dir, venv, interpreter,
logs and CUDA home. Computed here once and handed forward (facts → plan → apply → probes → switch).
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_ROOT = "/opt/provision"


def root_of(transport) -> str:
    """The host root named by the target's inventory vars (default /opt/provision)."""
    return transport.target.vars.get("provision_root", DEFAULT_ROOT)


@dataclass(frozen=True)
class Layout:
    """Paths under one host root."""

    root: str

    @property
    def generations(self) -> str:
        return f"{self.root}/generations"

    @property
    def current(self) -> str:
        return f"{self.root}/current"

    @property
    def history(self) -> str:
        return f"{self.root}/history.jsonl"

    @property
    def lock_file(self) -> str:
        return f"{self.root}/.lock"

    @property
    def wheel_cache(self) -> str:
        return f"{self.root}/cache/wheels"

    def gen_dir(self, gen_id: str) -> str:
        return f"{self.generations}/{gen_id}"

    def venv(self, gen_id: str) -> str:
        return f"{self.gen_dir(gen_id)}/venv"

    def python(self, gen_id: str) -> str:
        return f"{self.venv(gen_id)}/bin/python"

    def engine_log(self, gen_id: str) -> str:
        return f"{self.gen_dir(gen_id)}/engine.log"

    def probes_json(self, gen_id: str) -> str:
        return f"{self.gen_dir(gen_id)}/probes.json"


def of(transport) -> Layout:
    return Layout(root_of(transport))


def cuda_home(lock, venv: str) -> str | None:
    """Where a generation built from `lock` finds its CUDA toolkit (recorded in its manifest)."""
    from .toolkit import home

    return home(lock, venv)
