#!/usr/bin/python
"""Ansible module: collect a host's old and failed generations and unused cache entries, as `provision gc` does."""

DOCUMENTATION = r"""
module: provision_gc
short_description: Remove old and failed generations of a provision host root and cache entries none needs
description:
  - Under the host lock, removes failed and abandoned generations, runnable ones beyond the newest `keep`, and
    cached wheels no remaining generation needs; never `current` nor the generation a rollback returns to.
  - Check mode names what would go, removing nothing. The controller's own run directories are the CLI's to
    remove (`provision gc`).
extends_documentation_fragment: provision
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

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.provision import spec, step


def main():
    module = AnsibleModule(argument_spec=dict(spec.ROOT, **{"keep": {"type": "int", "default": 3}}),
                           supports_check_mode=True)
    p = module.params
    reply = step.run("state", "gc", {"root": p["root"], "keep": p["keep"], "dry_run": module.check_mode,
                                     "take_lock": not module.check_mode})
    step.finish(module, reply, changed=not module.check_mode and bool(reply.get("generations") or reply.get("cache")))


if __name__ == "__main__":
    main()
