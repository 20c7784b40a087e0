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
options:
  root:
    description: The host root (the inventory's provision_root).
    type: path
    default: /opt/provision
  keep:
    description: Runnable generations to keep, current and the rollback target included.
    type: int
    default: 3
"""

RETURN = r"""
generations: {description: each generation removed (or that would be), with its status and the bytes it frees, type: list}
cache: {description: the cached wheels removed, type: list}
bytes: {description: bytes freed (each inode once, only when no link to it is left), type: int}
current: {description: the generation `current` names (kept), type: str}
rollback_target: {description: the generation a rollback returns to (kept), type: str}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.provision import step


def main():
    module = AnsibleModule(argument_spec={"root": {"type": "path", "default": "/opt/provision"},
                                          "keep": {"type": "int", "default": 3}},
                           supports_check_mode=True)
    p = module.params
    reply = step.run("state", "gc", {"root": p["root"], "keep": p["keep"], "dry_run": module.check_mode,
                                     "take_lock": not module.check_mode})
    step.finish(module, reply, changed=not module.check_mode and bool(reply.get("generations") or reply.get("cache")))


if __name__ == "__main__":
    main()
