#!/usr/bin/python
"""Ansible module provision_history: the generations of a provision host root and its latest history events. Its work runs on the host, in the module.
Written from the step's declaration (provision/steps/state.py) by `python -m provision.module_files`:
edit the declaration, not this file."""

DOCUMENTATION = r"""
module: provision_history
short_description: "The generations of a provision host root and its latest history events"
description:
  - "Reads the host root only; never changes it."
extends_documentation_fragment: provision
options:
  limit:
    description: "How many of the latest history events to return."
    type: int
    default: 200
"""

RETURN = r"""
current: {description: "the generation `current` names, or null", type: str, returned: always}
generations: {description: "each generation's manifest with its id and number, oldest first", type: list, elements: dict, returned: always, contains: {id: {description: "the generation", type: str, returned: always}, number: {description: "its number", type: int, returned: always}, status: {description: "ready, adopted, failed, ...", type: str, returned: always}, lock_name: {description: "its lock's name", type: str, returned: always}, created: {description: "when it was made (UTC)", type: str, returned: always}, skipped_probes: {description: "probes its apply skipped", type: list, elements: str, returned: always}, probes_summary: {description: "how many of its probes ended each way", type: dict, returned: always}, verify: {description: "its last verification", type: dict, returned: always, contains: {verdict: {description: "clean or drift", type: str, returned: always}, time: {description: "when it ran (UTC)", type: str, returned: always}, how: {description: "what it compared", type: str, returned: always}}}, reason: {description: "why it failed", type: str, returned: always}, run_dir: {description: "the controller's run directory of its build", type: str, returned: always}}}
events: {description: "the latest history events, oldest first", type: list, elements: dict, returned: always}
agent_warnings: {description: "history lines and manifests that could not be read (the task's warnings too)", type: list, elements: str, returned: always}
"""

ARGUMENT_SPEC = {'limit': {'type': 'int', 'default': 200}}   # its own; the shared ones in module_utils/provision/spec.py


def main():
    from ansible.module_utils.provision.step import main as run_step

    run_step("history", ARGUMENT_SPEC)


if __name__ == "__main__":
    main()
