#!/usr/bin/python
"""Ansible module: the EAGLE-3 interface contract of an architecture in the host's installed SGLang.
Its work runs in its action plugin, on the controller through provision's own host steps; this file declares its
arguments and documents its result."""

DOCUMENTATION = r"""
module: provision_contract
short_description: The EAGLE-3 interface contract of an architecture in the host's installed SGLang
description:
  - "What `provision contract` checks, statically (SGLang is never imported): the methods the EAGLE-3 worker calls,
    found on the architecture's class, inherited, or reachable through a member. Reads the host only."
  - "The task fails when a required method is missing, with the report kept."
  - A host provision's connection cannot reach is unreachable, as Ansible counts it; a step that fails fails the task
    with the one line `provision` prints, its error type in C(error_type).
extends_documentation_fragment: provision.step
options:
  arch:
    description: The architecture's name, or a model's config.json on the host.
    type: str
    required: true
  python:
    description: The target environment's interpreter (default <root>/current/venv/bin/python).
    type: str
  site_packages:
    description: Act on this site-packages folder of the host instead.
    type: str
"""

RETURN = r"""
host: {description: the host, type: str}
arch: {description: the architecture, type: str}
found: {description: whether its class was found, type: bool}
ok: {description: whether every required method is present, type: bool}
methods: {description: "each required method: status (defined, inherited, missing), where, via", type: list}
"""

ARGUMENT_SPEC = {"arch": {"type": "str", "required": True},
                 "python": {"type": "str"},
                 "site_packages": {"type": "str"}}   # its own; STEP (module_utils) the shared ones


def main():
    from ansible.module_utils.provision.spec import through_plugin

    through_plugin("provision_contract", ARGUMENT_SPEC)


if __name__ == "__main__":
    main()
