#!/usr/bin/python
"""Ansible module provision_logs: the tail of each log of a generation, its probe results and why it failed. Its work runs on the host, in the module.
Written from the step's declaration (provision/steps/state.py) by `python -m provision.module_files`:
edit the declaration, not this file."""

DOCUMENTATION = r"""
module: provision_logs
short_description: "The tail of each log of a generation, its probe results and why it failed"
description:
  - "Reads the host root only; never changes it. The same reply as `provision logs --json`."
extends_documentation_fragment: provision
options:
  generation:
    description: "The generation (its number or id); default the newest."
    type: str
  tail:
    description: "Bytes from the end of each log."
    type: int
    default: 65536
"""

RETURN = r"""
id: {description: "the generation", type: str, returned: always}
dir: {description: "its directory on the host", type: str, returned: always}
logs: {description: "each log file's name to {bytes: its size, text: its tail}", type: dict, returned: always}
probes: {description: "each probe's name, status and reason", type: list, elements: dict, returned: always, contains: {name: {description: "the probe", type: str, returned: always}, status: {description: "its verdict", type: str, returned: always}, reason: {description: "why it failed or was skipped", type: str, returned: always}}}
status: {description: "its status (ready, failed, ...)", type: str, returned: always}
reason: {description: "why it failed, or null", type: str, returned: always}
run_dir: {description: "the controller's run directory of its build, or null", type: str, returned: always}
"""

ARGUMENT_SPEC = {'generation': {'type': 'str'},
                 'tail': {'type': 'int', 'default': 65536}}   # its own; the shared ones in module_utils/provision/spec.py


def main():
    from ansible.module_utils.provision.step import main as run_step

    run_step("logs", ARGUMENT_SPEC)


if __name__ == "__main__":
    main()
