#!/usr/bin/python
"""Ansible module: pack a generation of the host into a hashed wheelhouse on the controller.
Its work runs in its action plugin, on the controller through provision's own host steps; this file declares its
arguments and documents its result."""

DOCUMENTATION = r"""
module: provision_pack
short_description: Pack a generation of the host into a hashed wheelhouse on the controller
description:
  - "What `provision pack` does: one wheel per distribution, rebuilt from the generation's installed files, each
    checked against its RECORD as it is read (drift refuses the pack unless C(allow_drift)), and C(out)/lock.yaml
    naming each by sha256; a host with no index rebuilds the generation from it exactly."
  - "C(out) is a folder on the controller. The task fails when the written lock does not pass `provision lock check`."
  - A host provision's connection cannot reach is unreachable, as Ansible counts it; a step that fails fails the task
    with the one line `provision` prints, its error type in C(error_type).
extends_documentation_fragment: provision.step
options:
  generation:
    description: The generation (its number or id); default the current one.
    type: str
  out:
    description: The wheelhouse folder on the controller (empty unless C(force)).
    type: path
    required: true
  allow_drift:
    description: Pack files that no longer match their RECORD as they are, recorded in the lock.
    type: bool
    default: false
  base:
    description: Take platform, requires, overrides, patches, engine and probes from this lock (a controller path).
    type: path
  extra:
    description: Wheel files (controller paths) to add; each replaces a packed distribution of the same name.
    type: list
    elements: path
    default: []
  name:
    description: The packed lock's name (default the source's).
    type: str
  jobs:
    description: Worker processes on the host (default one per core).
    type: int
  force:
    description: Pack into C(out) even when it is not empty.
    type: bool
    default: false
"""

RETURN = r"""
host: {description: the host packed, type: str}
generation: {description: the generation packed, type: str}
out: {description: the wheelhouse folder, type: str}
lock: {description: the lock written there, type: str}
distributions: {description: wheels written, type: int}
files: {description: files read and checked, type: int}
bytes: {description: bytes read, type: int}
wheel_bytes: {description: bytes of wheels written, type: int}
drift: {description: "each drifted distribution's changed files (with allow_drift)", type: dict}
check: {description: "`provision lock check` of the written lock (ok, errors, warnings, findings)", type: dict}
seconds: {description: "the phases' seconds (plan, pack, read, fetch, total)", type: dict}
"""

ARGUMENT_SPEC = {"generation": {"type": "str"},
                 "out": {"type": "path", "required": True},
                 "allow_drift": {"type": "bool", "default": False},
                 "base": {"type": "path"},
                 "extra": {"type": "list", "elements": "path", "default": []},
                 "name": {"type": "str"},
                 "jobs": {"type": "int"},
                 "force": {"type": "bool", "default": False}}   # its own; STEP (module_utils) the shared ones


def main():
    from ansible.module_utils.provision.spec import through_plugin

    through_plugin("provision_pack", ARGUMENT_SPEC)


if __name__ == "__main__":
    main()
