#!/usr/bin/python
"""Ansible module: run provision's probes inside a generation of the host and record the verdict.
Its work runs in its action plugin, on the controller through provision's own host steps; this file declares its
arguments and documents its result."""

DOCUMENTATION = r"""
module: provision_probe
short_description: Run provision's probes inside a generation of the host and record the verdict
description:
  - "What `provision probe` does: the probes (driver, toolkit, versions, kernels, the engine ...) run in the
    generation's own interpreter, isolated; the report is recorded in the generation and in the host's history."
  - "The task fails when a required probe fails, with the report kept in the result."
  - A host provision's connection cannot reach is unreachable, as Ansible counts it; a step that fails fails the task
    with the one line `provision` prints, its error type in C(error_type).
extends_documentation_fragment: provision.step
options:
  generation:
    description: The generation (its number or id); default the current one.
    type: str
  only:
    description: Run only these probes.
    type: list
    elements: str
    default: []
  lock:
    description: The lock whose expectations the probes check (a path on the controller); default the
      generation's own lock.
    type: path
"""

RETURN = r"""
status: {description: pass or fail, type: str}
generation: {description: the generation probed, type: str}
lock: {description: the lock whose expectations were checked, type: str}
results: {description: "each probe: name, status (pass, fail, skip, warn), reason, seconds, required", type: list}
summary: {description: how many probes passed, failed, were skipped or warned, type: dict}
step_failed: {description: the required probes that failed (`failed` in `provision probe --json`), type: list}
seconds: {description: seconds the probes took, type: float}
"""

ARGUMENT_SPEC = {"generation": {"type": "str"},
                 "only": {"type": "list", "elements": "str", "default": []},
                 "lock": {"type": "path"}}   # its own; STEP (module_utils) the shared ones


def main():
    from ansible.module_utils.provision.spec import through_plugin

    through_plugin("provision_probe", ARGUMENT_SPEC)


if __name__ == "__main__":
    main()
