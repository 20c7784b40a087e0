#!/usr/bin/python
"""Ansible module: capture a live environment of the host as lock data (what `provision lock capture` writes).
Its work runs in its action plugin, on the controller through provision's own host steps; this file declares its
arguments and documents its result."""

DOCUMENTATION = r"""
module: provision_capture
short_description: Capture a live environment of the host as lock data (names and versions, no hashes)
description:
  - "What `provision lock capture` does: the environment of C(python) (an interpreter or an environment prefix) is
    read on the host and described as a lock - its platform and each distribution's name and version. A record to
    roll back to (what `apply --adopt` captures as generation 0), not something `apply` can rebuild: installed
    files have no wheel hashes."
  - Reads only. A host provision's connection cannot reach is unreachable, as Ansible counts it; a step that fails
    fails the task with the one line `provision` prints, its error type in C(error_type).
extends_documentation_fragment: provision.step
options:
  python:
    description: The interpreter, or the environment prefix, to capture.
    type: str
    default: python3
  name:
    description: The captured lock's name.
    type: str
    default: adopted
"""

RETURN = r"""
lock: {description: the lock data (name, platform, packages with name and version), type: dict}
"""

ARGUMENT_SPEC = {"python": {"type": "str", "default": "python3"},
                 "name": {"type": "str", "default": "adopted"}}   # its own; STEP (module_utils) the shared ones


def main():
    from ansible.module_utils.provision.spec import through_plugin

    through_plugin("provision_capture", ARGUMENT_SPEC)


if __name__ == "__main__":
    main()
