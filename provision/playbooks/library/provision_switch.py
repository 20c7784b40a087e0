#!/usr/bin/python
"""Ansible module: make a staged generation current, as `provision apply` does at its commit point (the same agent,
the same checks), recorded in the host's history as the apply it completes."""

DOCUMENTATION = r"""
module: provision_switch
short_description: Make a staged generation of the host current, recorded as the apply that built it
description:
  - Under the host lock, renames `current` to the generation (the commit point) and records the switch in the
    host's history as an apply of its lock (the event `apply`), as a one-host `provision apply` does.
  - Refuses a generation that is not runnable (failed, abandoned, still building, without its interpreter).
  - The play's `stage` task (provision_apply) builds, seals and probes the generation and stops before this.
extends_documentation_fragment: provision
options:
  to:
    description: The generation to make current (its id, as the stage task returns it).
    type: str
    required: true
  lock:
    description: The name of the lock the generation holds, recorded in the history event.
    type: str
  skipped_probes:
    description: Probes the apply skipped, recorded in the history event.
    type: list
    elements: str
    default: []
  reuse:
    description: Whether the apply reused an existing generation rather than building one.
    type: bool
    default: false
"""

RETURN = r"""
from: {description: the generation current before, type: str}
to: {description: the generation current now, type: str}
switched: {description: true once `current` was renamed to `to`, type: bool}
switch_seconds: {description: seconds of the switch itself, type: float}
event: {description: the history event recorded, type: dict}
bookkeeping_failed: {description: records that failed after the switch (it stands; the next run repairs), type: list}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.provision import spec, step


def main():
    module = AnsibleModule(argument_spec=dict(spec.ROOT, **{
        "to": {"type": "str", "required": True}, "lock": {"type": "str"},
        "skipped_probes": {"type": "list", "elements": "str", "default": []},
        "reuse": {"type": "bool", "default": False}}))
    p = module.params
    event = {"lock": p["lock"], "skipped_probes": p["skipped_probes"], **({"reuse": True} if p["reuse"] else {})}
    reply = step.run("state", "switch", {"root": p["root"], "id": p["to"], "kind": "apply", "event": event,
                                         "take_lock": True})
    step.finish(module, reply, changed=reply.get("from") != reply.get("to"))


if __name__ == "__main__":
    main()
