#!/usr/bin/python
"""Ansible module: capture an existing, unmanaged environment of the host as generation 0.
Its work runs in its action plugin, on the controller through provision's own host steps; this file declares its
arguments and documents its result."""

DOCUMENTATION = r"""
module: provision_adopt
short_description: Capture an existing, unmanaged environment of the host as generation 0
description:
  - "What `provision adopt` does, under the host lock: the environment at C(path) is captured into a lock (its
    distributions, its interpreter) and recorded as generation 0, left where it is, so a first rollback returns to it."
  - "A host that is already managed is left alone (C(detail) says so)."
  - A host provision's connection cannot reach is unreachable, as Ansible counts it; a step that fails fails the task
    with the one line `provision` prints, its error type in C(error_type).
extends_documentation_fragment: provision.step
options:
  path:
    description: The environment's prefix or its bin/python on the host.
    type: str
    required: true
"""

RETURN = r"""
id: {description: the generation recorded (null when nothing was adopted), type: str}
detail: {description: why nothing was adopted (the host is already managed, ...), type: str}
"""

ARGUMENT_SPEC = {"path": {"type": "str", "required": True}}   # its own; STEP (module_utils) the shared ones


def main():
    from ansible.module_utils.provision.spec import through_plugin

    through_plugin("provision_adopt", ARGUMENT_SPEC)


if __name__ == "__main__":
    main()
