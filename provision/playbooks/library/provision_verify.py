#!/usr/bin/python
"""Ansible module: check a generation's files on the host, as `provision verify` does; its action plugin (controller
side) judges the reply against the generation's lock."""

DOCUMENTATION = r"""
module: provision_verify
short_description: Every file of a generation against its RECORD hash, its seal and its lock (read-only)
description:
  - On the host, every file of the generation's venv is hashed and compared with its RECORD (patched files with
    the hashes their series produced) and with the stamp its build sealed; the controller (this module's action
    plugin) judges that against the generation's lock, as `provision verify GEN` does.
  - "A generation that drifted fails the task, naming the changed files. Reads only unless C(record) is set (as
    `provision verify -i` sets it): then the verdict is recorded in the generation's manifest and the host's
    history, as `provision verify` records it; check mode never records."
extends_documentation_fragment: provision
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
  verdict:
    description: Set by this module's action plugin, not by a play - the judged verdict to record (with C(event));
      the module then records it and checks nothing.
    type: dict
  event:
    description: Set by this module's action plugin with C(verdict) - the history event to append.
    type: dict
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
record: {description: what `provision verify` records of the verdict in the manifest, type: dict}
recorded: {description: whether the verdict was recorded (C(record) set, not check mode), type: bool}
not_recorded: {description: why a verdict to record was not (a root mounted read-only), type: str}
unresolved: {description: on failure - the generation named is not on the host, type: bool}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.provision import spec, step


def main():
    module = AnsibleModule(argument_spec=dict(spec.ROOT, **{"generation": {"type": "str"},
                                                            "jobs": {"type": "int"},
                                                            "baseline": {"type": "bool", "default": False},
                                                            "record": {"type": "bool", "default": False},
                                                            "verdict": {"type": "dict"},
                                                            "event": {"type": "dict"}}),
                           required_together=[("verdict", "event")],
                           supports_check_mode=True)
    p = module.params
    try:
        gen_id = step.generation(p["root"], p["generation"])
    except step.AgentError as e:
        module.fail_json(msg=str(e), unresolved=p["generation"] is not None)
    if p["verdict"] is not None:
        if module.check_mode:
            module.exit_json(changed=False, recorded=False)
        done = step.run("state", "mark", {"root": p["root"], "id": gen_id, "fields": {"verify": p["verdict"]},
                                          "event": p["event"]})
        module.exit_json(changed=not done.get("error"), recorded=not done.get("error"),
                         not_recorded=done.get("error"))
    found = step.run("verify", "verify", {"root": p["root"], "id": gen_id, "jobs": p["jobs"],
                                          "baseline": p["baseline"]})
    if found.get("error"):
        module.fail_json(msg=found["error"], generation=gen_id)
    info = step.run("state", "read", {"root": p["root"], "id": gen_id})
    if info.get("error"):
        module.fail_json(msg=info["error"], generation=gen_id)
    step.finish(module, {"generation": gen_id, "found": found, "lock_text": info.get("lock_text"),
                         "installer": (info.get("manifest") or {}).get("installer")})


if __name__ == "__main__":
    main()
