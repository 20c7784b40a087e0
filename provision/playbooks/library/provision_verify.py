#!/usr/bin/python
"""Ansible module: check a generation's files on the host, as `provision verify` does. Its work runs in its action
plugin, on the controller through provision's own host steps (the host hashes; the controller judges the reply
against the generation's lock; progress to the task's progress file); this file declares its arguments and
documents its result."""

DOCUMENTATION = r"""
module: provision_verify
short_description: Every file of a generation against its RECORD hash, its seal and its lock (read-only)
description:
  - On the host, every file of the generation's venv is hashed and compared with its RECORD (patched files with
    the hashes their series produced) and with the stamp its build sealed; the controller (this module's action
    plugin) judges that against the generation's lock, as `provision verify GEN` does, in the same code.
  - "A generation that drifted fails the task, naming the changed files. Reads only unless C(record) is set (as
    `provision verify -i` sets it): then the verdict is recorded in the generation's manifest and the host's
    history, as `provision verify` records it; check mode never records."
extends_documentation_fragment: provision.step
options:
  generation:
    description: The generation to check (its number or id); default the current one.
    type: str
  jobs:
    description: Hashing threads on the host (default 2 per core, at most 32).
    type: int
  baseline:
    description: Also time plain reads of the same bytes, before and after hashing (hashing's yardstick).
    type: bool
    default: false
  record:
    description: Record the verdict (manifest C(verify), history event C(verify)), as `provision verify` does.
    type: bool
    default: false
"""

RETURN = r"""
generation: {description: the generation checked, type: str}
verdict: {description: clean or drift, type: str}
rows: {description: one per drifted distribution (dist, version, what, files), type: list}
lines: {description: the same rows as the lines `provision verify` prints, type: list}
counts: {description: changed, missing and extra files; missing, extra and other-version distributions, type: dict}
files: {description: files hashed, type: int}
bytes: {description: bytes hashed, type: int}
seconds: {description: seconds the check took on the host, type: float}
recorded: {description: whether the verdict was recorded (C(record) set, not check mode), type: bool}
agent_warnings: {description: "why a verdict to record was not (a root mounted read-only), and what the host root says is amiss", type: list}
error_type: {description: "on failure - provision's error type (InputError - the generation named is not on the host)", type: str}
"""

ARGUMENT_SPEC = {"generation": {"type": "str"},
                 "jobs": {"type": "int"},
                 "baseline": {"type": "bool", "default": False},
                 "record": {"type": "bool", "default": False}}   # its own; STEP (module_utils) the shared ones


def main():
    from ansible.module_utils.provision.spec import through_plugin

    through_plugin("provision_verify", ARGUMENT_SPEC)


if __name__ == "__main__":
    main()
