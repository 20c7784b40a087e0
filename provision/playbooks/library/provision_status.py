#!/usr/bin/python
"""Ansible module provision_status: the current generation of a provision host root, its lock, last probe and disk use. Its work runs on the host, in the module.
Written from the step's declaration (provision/steps/state.py) by `python -m provision.module_files`:
edit the declaration, not this file."""

DOCUMENTATION = r"""
module: provision_status
short_description: "The current generation of a provision host root, its lock, last probe and disk use"
description:
  - "Reads the host root only; never changes it. The same reply as `provision status --json`."
extends_documentation_fragment: provision
"""

RETURN = r"""
generations: {description: "how many generations the root keeps", type: int, returned: always}
ready: {description: "how many of them are runnable", type: int, returned: always}
disk_bytes: {description: "bytes under the root, each hard-linked file once", type: int, returned: always}
root: {description: "the host root read", type: str, returned: always}
current: {description: "the generation `current` names, or null", type: str, returned: always}
lock: {description: "its lock's name", type: str, returned: always}
since: {description: "when it became current (UTC)", type: str, returned: always}
broken: {description: "what is wrong with `current` (its link, directory or interpreter), or null", type: str, returned: always}
probe: {description: "its last probe (status, time, summary)", type: dict, returned: always, contains: {status: {description: "pass, fail or stopped", type: str, returned: always}, time: {description: "when it ran (UTC)", type: str, returned: always}, summary: {description: "how many probes ended each way (pass, fail, skip, warn)", type: dict, returned: always}, generation: {description: "the generation it probed (the last attempt only)", type: str, returned: always}}}
verify: {description: "its last verification", type: dict, returned: always, contains: {verdict: {description: "clean or drift", type: str, returned: always}, time: {description: "when it ran (UTC)", type: str, returned: always}, how: {description: "what it compared", type: str, returned: always}}}
last_attempt: {description: "the last probe of a generation that did not stay current", type: dict, returned: always, contains: {status: {description: "pass, fail or stopped", type: str, returned: always}, time: {description: "when it ran (UTC)", type: str, returned: always}, summary: {description: "how many probes ended each way (pass, fail, skip, warn)", type: dict, returned: always}, generation: {description: "the generation it probed (the last attempt only)", type: str, returned: always}}}
serving: {description: "the service unit and what it runs, where the current generation's lock names one", type: dict, returned: always, contains: {unit: {description: "the unit (the current generation's lock names it: service.unit)", type: str, returned: always}, load: {description: "systemd's LoadState: loaded, not-found \u2026", type: str, returned: always}, active: {description: "its ActiveState: active, inactive, failed, activating \u2026", type: str, returned: always}, sub: {description: "its SubState: running, dead, exited \u2026", type: str, returned: always}, main_pid: {description: "its main process, or null", type: int, returned: always}, processes: {description: "how many processes its cgroup holds", type: int, returned: always}, generations: {description: "the generations its processes run: their interpreter, mapped libraries or named files under generations/", type: list, elements: str, returned: always}, healthy: {description: "whether its health check passed (service.health, at service.url), null where it is not active", type: bool, returned: always}, health: {description: "what the health check did, or why it failed", type: str, returned: always}, error: {description: "why systemd's manager could not be asked, or null", type: str, returned: always}}}
"""

ARGUMENT_SPEC = {}   # its own; the shared ones in module_utils/provision/spec.py


def main():
    from ansible.module_utils.provision.step import main as run_step

    run_step("status", ARGUMENT_SPEC)


if __name__ == "__main__":
    main()
