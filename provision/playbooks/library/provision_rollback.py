#!/usr/bin/python
"""Ansible module: switch a host's `current` back, as `provision rollback` does (the same agent, the same checks)."""

DOCUMENTATION = r"""
module: provision_rollback
short_description: Switch `current` back to the generation current before the last switch, or to a given one
description:
  - Under the host lock, settles what an interrupted run left, checks the target generation against its build's
    stamp and refuses one that drifted (unless force), then renames `current` (the commit point) and records it.
  - Check mode names the target without switching.
extends_documentation_fragment: provision
options:
  to:
    description: The generation to switch to (its number or id); default the one current before the last switch.
    type: str
  force:
    description: Switch to a generation that fails its check.
    type: bool
    default: false
"""

RETURN = r"""
from: {description: the generation current before, type: str}
to: {description: the generation current now (check mode - the one it would be), type: str}
noop: {description: true when `to` already is current (nothing switched), type: bool}
dry_run: {description: true in check mode, type: bool}
switched: {description: true once `current` was renamed to `to`, type: bool}
forward: {description: whether `to` is newer than `from`, type: bool}
check: {description: the target's check against its stamp (verdict, files, figures), type: dict}
switch_seconds: {description: seconds of the switch itself, type: float}
event: {description: the history event recorded, type: dict}
bookkeeping_failed: {description: records that failed after the switch (it stands; the next run repairs), type: list}
recovered: {description: what settling an interrupted run found, type: dict}
agent_warnings: {description: what the host root says is amiss (also the task's warnings), type: list}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.provision import spec, step


def main():
    module = AnsibleModule(argument_spec=dict(spec.ROOT, **{"to": {"type": "str"},
                                                            "force": {"type": "bool", "default": False}}),
                           supports_check_mode=True)
    p = module.params
    reply = step.run("state", "rollback", {"root": p["root"], "to": p["to"], "force": p["force"],
                                           "dry_run": module.check_mode, "take_lock": not module.check_mode})
    step.finish(module, reply, changed=not module.check_mode and reply.get("from") != reply.get("to"))


if __name__ == "__main__":
    main()
