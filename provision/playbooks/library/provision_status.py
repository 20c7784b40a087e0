#!/usr/bin/python
"""Ansible module: a host's provision status (read-only), as `provision status` shows it."""

DOCUMENTATION = r"""
module: provision_status
short_description: The current generation of a provision host root, its lock, last probe and disk use
description: Reads the host root only; never changes it. The same reply as `provision status --json`.
extends_documentation_fragment: provision
"""

RETURN = r"""
root: {description: the host root read, type: str}
current: {description: the generation `current` names, or null, type: str}
broken: {description: what is wrong with `current` (its link, directory or interpreter), or null, type: str}
lock: {description: its lock's name, type: str}
since: {description: when it became current (UTC), type: str}
probe: {description: its last probe (status, time, summary), type: dict}
verify: {description: its last verification, type: dict}
last_attempt: {description: the last probe of a generation that did not stay current, type: dict}
generations: {description: how many generations the root keeps, type: int}
ready: {description: how many of them are runnable, type: int}
disk_bytes: {description: bytes under the root, each hard-linked file once, type: int}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.provision import spec, step


def main():
    module = AnsibleModule(argument_spec=spec.ROOT,
                           supports_check_mode=True)
    step.finish(module, step.run("state", "status", {"root": module.params["root"]}))


if __name__ == "__main__":
    main()
