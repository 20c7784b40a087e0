#!/usr/bin/python
"""Ansible module: a host's generations and history events (read-only), as `provision history` shows them."""

DOCUMENTATION = r"""
module: provision_history
short_description: The generations of a provision host root and its latest history events
description: Reads the host root only; never changes it.
extends_documentation_fragment: provision
options:
  limit:
    description: How many of the latest history events to return.
    type: int
    default: 200
"""

RETURN = r"""
current: {description: the generation `current` names, or null, type: str}
generations: {description: each generation's manifest with its id and number, oldest first, type: list}
events: {description: the latest history events, oldest first, type: list}
agent_warnings: {description: history lines and manifests that could not be read (the task's warnings too), type: list}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.provision import spec, step


def main():
    module = AnsibleModule(argument_spec=dict(spec.ROOT, **{"limit": {"type": "int", "default": 200}}),
                           supports_check_mode=True)
    step.finish(module, step.run("state", "history", {"root": module.params["root"],
                                                      "limit": module.params["limit"]}))


if __name__ == "__main__":
    main()
