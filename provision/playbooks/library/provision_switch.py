#!/usr/bin/python
"""Ansible module provision_switch: make a staged generation of the host current, recorded as the apply that built it. Its work runs in its action plugin (action_plugins/provision_switch.py), on the controller.
Written from the step's declaration (provision/steps/state.py) by `python -m provision.module_files`:
edit the declaration, not this file."""

DOCUMENTATION = r"""
module: provision_switch
short_description: "Make a staged generation of the host current, recorded as the apply that built it"
description:
  - "Under the host lock, renames `current` to the generation (the commit point) and records the switch in the host's history as an apply of its lock (the event `apply`), as a one-host `provision apply` does."
  - "Refuses a generation that is not runnable (failed, abandoned, still building, without its interpreter)."
  - "The play's `stage` task (provision_apply) builds, seals and probes the generation and stops before this."
extends_documentation_fragment: provision.step
options:
  to:
    description: "The generation to make current (its id, as the stage task returns it)."
    type: str
    required: true
  lock:
    description: "The name of the lock the generation holds, recorded in the history event."
    type: str
  skipped_probes:
    description: "Probes the apply skipped, recorded in the history event."
    type: list
    elements: str
    default: []
  reuse:
    description: "Whether the apply reused an existing generation rather than building one."
    type: bool
    default: false
"""

RETURN = r"""
to: {description: "the generation current now", type: str, returned: always}
from: {description: "the generation current before", type: str, returned: always}
switched: {description: "true once `current` was renamed to `to`", type: bool, returned: always}
switch_seconds: {description: "seconds of the switch itself", type: float, returned: always}
event: {description: "the history event recorded", type: dict, returned: always}
bookkeeping_failed: {description: "records that failed after the switch (it stands; the next run repairs)", type: list, elements: str, returned: always}
"""

ARGUMENT_SPEC = {'to': {'type': 'str', 'required': True},
                 'lock': {'type': 'str'},
                 'skipped_probes': {'type': 'list', 'elements': 'str', 'default': []},
                 'reuse': {'type': 'bool', 'default': False}}   # its own; the shared ones in module_utils/provision/spec.py


def main():
    from ansible.module_utils.provision.spec import through_plugin

    through_plugin("provision_switch", ARGUMENT_SPEC)


if __name__ == "__main__":
    main()
