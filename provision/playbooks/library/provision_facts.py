#!/usr/bin/python
"""Ansible module: the facts a plan is made from (read-only), as `provision hosts facts` gathers them."""

DOCUMENTATION = r"""
module: provision_facts
short_description: What a provision plan is made from - the host's OS, Pythons, GPUs, toolkits and generations
description:
  - Reads the host only; never changes it. The same reply as the facts agent gives `provision hosts facts`
    and `provision plan`, under one key (C(facts)), which provision's typed reader (Facts.from_reply) accepts as it is.
extends_documentation_fragment: provision
options:
  python:
    description: The Python version a lock asks for (3.X); only interpreters of that version are looked for.
    type: str
  interpreter:
    description: The one interpreter to try (an absolute path on the host), as `--python PATH`.
    type: path
  adopt:
    description: An unmanaged environment's interpreter to read the distributions of (as `apply --adopt`).
    type: path
  nvidia_smi:
    description: The nvidia-smi to run (the inventory's provision_nvidia_smi); default the one on PATH.
    type: str
"""

RETURN = r"""
facts:
  description:
    - root, os (id, version_id, pretty, kernel, arch, glibc), pythons (X.Y to a path) and python_versions, uv,
      user, cached_wheels, disk_free_bytes, gpus (index, name, uuid, driver, compute_cap, memory, pci), driver,
      toolkits, nvcc_on_path, generations (each one's manifest summary), current, current_dists, managed, adopt
      and lock_file; the fields of provision.facts.Facts.
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.provision import spec, step


def main():
    module = AnsibleModule(argument_spec=dict(spec.ROOT, **{"python": {"type": "str"},
                                                            "interpreter": {"type": "path"},
                                                            "adopt": {"type": "path"},
                                                            "nvidia_smi": {"type": "str"}}),
                           supports_check_mode=True)
    p = module.params
    reply = step.run("facts", "gather", {k: p[k] for k in ("root", "python", "interpreter", "adopt", "nvidia_smi")})
    if reply.get("error"):
        module.fail_json(msg=str(reply["error"]))
    module.exit_json(changed=False, facts=reply)


if __name__ == "__main__":
    main()
