#!/usr/bin/python
"""Ansible module: collect a host's old and failed generations and unused cache entries, as `provision gc` does.
Its work runs in its action plugin, on the controller through provision's own host steps (its progress, a phase
at a time, to the task's progress file); this file declares its arguments and documents its result."""

DOCUMENTATION = r"""
module: provision_gc
short_description: Remove old and failed generations of a provision host root and cache entries none needs
description:
  - Under the host lock, removes failed and abandoned generations, runnable ones beyond the newest `keep`, and
    cached wheels no remaining generation needs; never `current` nor the generation a rollback returns to.
  - Check mode names what would go, removing nothing. The controller's own run directories are the CLI's to
    remove (`provision gc`).
extends_documentation_fragment: provision.step
options:
  keep:
    description: Runnable generations to keep, current and the rollback target included.
    type: int
    default: 3
"""

RETURN = r"""
dry_run: {description: true in check mode (nothing removed), type: bool}
generations: {description: each generation removed (or that would be), with its status and the bytes it frees, type: list}
cache: {description: the cached wheels removed, type: list}
uv_cache: {description: uv's unpacked wheels removed, type: list}
kernels: {description: compiled kernel caches no kept generation uses, removed, type: dict}
bytes: {description: bytes freed (each inode once, only when no link to it is left), type: int}
shared_bytes: {description: bytes that stay, linked from what is kept, type: int}
errors: {description: removals that failed (what was done is reported), type: list}
current: {description: the generation `current` names (kept), type: str}
rollback_target: {description: the generation a rollback returns to (kept), type: str}
seconds: {description: seconds the removal took (not in check mode), type: float}
fs_freed: {description: the filesystem's own figure of space freed (not in check mode), type: int}
recovered: {description: what settling an interrupted run found (not in check mode), type: dict}
agent_warnings: {description: what the host root says is amiss (also the task's warnings), type: list}
"""

ARGUMENT_SPEC = {"keep": {"type": "int", "default": 3}}   # its own; STEP (module_utils) the shared ones


def main():
    from ansible.module_utils.provision.spec import through_plugin

    through_plugin("provision_gc", ARGUMENT_SPEC)


if __name__ == "__main__":
    main()
