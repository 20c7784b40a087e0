#!/usr/bin/python
"""Ansible module provision_rollback: switch `current` back to the generation current before the last switch, or to a given one. Its work runs on the host, in the module.
Written from the step's declaration (provision/steps/state.py) by `python -m provision.module_files`:
edit the declaration, not this file."""

DOCUMENTATION = r"""
module: provision_rollback
short_description: "Switch `current` back to the generation current before the last switch, or to a given one"
description:
  - "Under the host lock, settles what an interrupted run left, checks the target generation against its build's stamp and refuses one that drifted (unless force), then renames `current` (the commit point) and records it; where the generation's lock names a service, restarts its unit and waits for its health (unless restart is false)."
  - "Check mode names the target without switching."
extends_documentation_fragment: provision
options:
  to:
    description: "The generation to switch to (its number or id); default the one current before the last switch."
    type: str
  force:
    description: "Switch to a generation that fails its check."
    type: bool
    default: false
  restart:
    description: "Restart the service the generation's lock names (service.unit) once switched, and check its health; false leaves the server alone."
    type: bool
    default: true
"""

RETURN = r"""
to: {description: "the generation current now (check mode - the one it would be)", type: str, returned: always}
from: {description: "the generation current before", type: str, returned: always}
noop: {description: "true when `to` already is current (nothing switched)", type: bool, returned: always}
forward: {description: "whether `to` is newer than `from`", type: bool, returned: always}
dry_run: {description: "true in check mode", type: bool, returned: always}
switched: {description: "true once `current` was renamed to `to`", type: bool, returned: always}
switch_seconds: {description: "seconds of the switch itself", type: float, returned: always}
check: {description: "the target's check against its stamp (verdict, files, figures)", type: dict, returned: always, contains: {verdict: {description: "clean or drift", type: str, returned: always}, files: {description: "files checked", type: int, returned: always}, hashed: {description: "files hashed (their stat had changed)", type: int, returned: always}, seconds: {description: "seconds the check took", type: float, returned: always}, how: {description: "what it compared", type: str, returned: always}, named: {description: "the files that drifted, named", type: str, returned: always}}}
event: {description: "the history event recorded", type: dict, returned: always}
recovered: {description: "what settling an interrupted run found", type: dict, returned: always, contains: {abandoned: {description: "generations left unfinished, abandoned", type: list, elements: str, returned: always}, repaired: {description: "switches whose records were repaired", type: list, elements: str, returned: always}, settled: {description: "switches not current, settled back", type: list, returned: always}, freed: {description: "failed generations whose venv was removed", type: list, returned: always}, removed_tmp: {description: "temporary files removed", type: list, elements: str, returned: always}, removed_partial: {description: "partial downloads removed", type: list, elements: str, returned: always}, unreadable: {description: "manifests that cannot be read (kept)", type: list, elements: str, returned: always}, errors: {description: "what could not be settled", type: list, elements: str, returned: always}, trash_bytes: {description: "bytes an interrupted gc had set aside, removed", type: int, returned: always}}}
bookkeeping_failed: {description: "records that failed after the switch (it stands; the next run repairs)", type: list, elements: str, returned: always}
agent_warnings: {description: "what the host root says is amiss", type: list, elements: str, returned: always}
service: {description: "the service restarted on `to`, where its lock names one and restart is on", type: dict, returned: always, contains: {unit: {description: "the unit (service.unit of the generation's lock)", type: str, returned: always}, healthy: {description: "whether it answered its health check within the deadline", type: bool, returned: always}, health: {description: "what the last health check did, or why it failed", type: str, returned: always}, stop_seconds: {description: "from the stop until its processes were gone", type: float, returned: always}, seconds: {description: "from the stop to healthy (the server's downtime), or to the failure", type: float, returned: always}, main_pid: {description: "its main process after the start", type: int, returned: always}, generations: {description: "the generations its processes run", type: list, elements: str, returned: always}, error: {description: "why it is not serving healthy, in one line, or null", type: str, returned: always}}}
"""

ARGUMENT_SPEC = {'to': {'type': 'str'},
                 'force': {'type': 'bool', 'default': False},
                 'restart': {'type': 'bool', 'default': True}}   # its own; the shared ones in module_utils/provision/spec.py


def main():
    from ansible.module_utils.provision.step import main as run_step

    run_step("rollback", ARGUMENT_SPEC)


if __name__ == "__main__":
    main()
