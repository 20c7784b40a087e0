#!/usr/bin/python
"""Ansible module: the stack changes between two generations of the host, read from their locks.
Its work runs in its action plugin, on the controller through provision's own host steps; this file declares its
arguments and documents its result."""

DOCUMENTATION = r"""
module: provision_diff
short_description: The stack changes between two generations of the host, read from their locks
description:
  - "What `provision diff` shows: each package, toolkit, patch, probe and engine change from generation C(a) to C(b),
    as plan shows them. Reads the host only; never changes it."
  - A host provision's connection cannot reach is unreachable, as Ansible counts it; a step that fails fails the task
    with the one line `provision` prints, its error type in C(error_type).
extends_documentation_fragment: provision.step
options:
  a:
    description: From this generation (its number or id).
    type: str
    required: true
  b:
    description: To this generation (default the current one).
    type: str
"""

RETURN = r"""
host: {description: the host, type: str}
from: {description: the generation diffed from, type: str}
to: {description: the generation diffed to, type: str}
changes: {description: "each change: category, name, action (add, change, remove), old, new", type: list}
summary: {description: how many adds, changes and removals, type: dict}
"""

ARGUMENT_SPEC = {"a": {"type": "str", "required": True},
                 "b": {"type": "str"}}   # its own; STEP (module_utils) the shared ones


def main():
    from ansible.module_utils.provision.spec import through_plugin

    through_plugin("provision_diff", ARGUMENT_SPEC)


if __name__ == "__main__":
    main()
