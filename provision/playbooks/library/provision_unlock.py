#!/usr/bin/python
"""Ansible module: break the host lock of a run whose controller is gone, as `provision unlock` does."""

DOCUMENTATION = r"""
module: provision_unlock
short_description: Break the host lock of an orphaned provision run; leave a live one alone
description:
  - The lock's holder hears its controller's heartbeat. A holder that has heard none for longer than its own bound
    is orphaned; then the holder and the agents of its run are ended and the lock is free (C(broken)). A holder that
    still hears its controller is left alone (C(held), with C(why)); the task is then ok and unchanged.
extends_documentation_fragment: provision
"""

RETURN = r"""
state: {description: "free (no run held it), held (left alone) or broken", type: str}
holder: {description: the holder's record (pid, controller, since, step), type: str}
heard: {description: seconds since the holder last heard its controller, type: float}
bound: {description: the holder's own bound on that silence (seconds), type: float}
ended: {description: the pids ended with the holder, type: list}
why: {description: why a held lock was left alone, type: str}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.provision import spec, step


def main():
    module = AnsibleModule(argument_spec=spec.ROOT)
    reply = step.run("host", "unlock", {"root": module.params["root"]})
    step.finish(module, reply, changed=reply.get("state") == "broken")


if __name__ == "__main__":
    main()
