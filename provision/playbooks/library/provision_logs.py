#!/usr/bin/python
"""Ansible module: a generation's build and probe logs (read-only), as `provision logs` shows them."""

DOCUMENTATION = r"""
module: provision_logs
short_description: The tail of each log of a generation, its probe results and why it failed
description: Reads the host root only; never changes it. The same reply as `provision logs --json`.
extends_documentation_fragment: provision
options:
  generation:
    description: The generation (its number or id); default the newest.
    type: str
  tail:
    description: Bytes from the end of each log.
    type: int
    default: 65536
"""

RETURN = r"""
id: {description: the generation, type: str}
dir: {description: its directory on the host, type: str}
status: {description: its status (ready, failed, ...), type: str}
reason: {description: why it failed, or null, type: str}
run_dir: {description: the controller's run directory of its build, or null, type: str}
logs: {description: "each log file's name to {bytes: its size, text: its tail}", type: dict}
probes: {description: each probe's name, status and reason, type: list}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.provision import spec, step


def main():
    module = AnsibleModule(argument_spec=dict(spec.ROOT, **{"generation": {"type": "str"},
                                                            "tail": {"type": "int", "default": 65536}}),
                           supports_check_mode=True)
    p = module.params
    try:
        gen_id = step.generation(p["root"], p["generation"], default="newest")
    except step.AgentError as e:
        module.fail_json(msg=str(e))
    step.finish(module, step.run("state", "logs", {"root": p["root"], "id": gen_id, "tail": p["tail"]}))


if __name__ == "__main__":
    main()
