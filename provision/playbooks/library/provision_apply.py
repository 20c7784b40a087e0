#!/usr/bin/python
"""Ansible module: `provision apply` of one host up to its switch. The work runs in this module's action plugin (on
the controller, through provision's own host steps); this file declares its arguments and documents its result."""

DOCUMENTATION = r"""
module: provision_apply
short_description: Build, patch, seal and probe a host's generation for a lock, then stop before the switch
description:
  - What `provision apply` does to the host (recover, facts, plan, then build, patch, seal and probe a new
    generation, or check and probe again one that already holds the lock), run by this module's action plugin on
    the controller; the lock is a file there.
  - It stops before the switch. The new generation is kept complete, probed and runnable, `current` unchanged;
    the play switches to it (C(provision_rollback) with C(to) set to the returned C(generation)) once every host
    of the batch has passed its probes, so a batch that failed beyond the play's C(max_fail_percentage) switches
    no host.
  - A host that already runs the lock is a noop. A failed step fails the task with the one line `provision apply`
    prints; `current` is left as it was.
  - Check mode makes the plan only (the host's facts against the lock); nothing on the host changes. A plan that
    apply would refuse (a fatal preflight finding) fails the task with its line.
  - A host provision's connection cannot reach is unreachable, as Ansible counts it.
options:
  lock:
    description: The lockfile to apply (a path on the controller); required unless C(plan_file) is given.
    type: path
  plan_file:
    description: A saved plan file on the controller (`provision plan --out`); the host applies exactly its own entry
      (by its inventory name), or is refused if it drifted since. Its lock is the plan's.
    type: path
  adopt:
    description: First contact - capture this existing environment (a prefix or bin/python) as generation 0, as
      `provision apply --adopt`.
    type: str
  wheels_from:
    description: host (each host fetches what its store lacks) or controller (fetched once on the controller and
      pushed to the host by hash), as `--wheels-from`.
    type: str
    choices: [host, controller]
  root:
    description: The host root (default the inventory's provision_root, else /opt/provision).
    type: path
  python:
    description: The host's interpreter for the lock's Python (an absolute path), as `provision apply --python`.
    type: str
  skip_probes:
    description: Probes to skip (an emergency; recorded in the generation), as `--skip-probe`.
    type: list
    elements: str
    default: []
  installer:
    description: uv (default; provision brings its own if the host lacks one) or pip.
    type: str
    choices: [uv, pip]
  known_hosts:
    description: The known_hosts file host keys are checked against (default provision's, which
      `provision hosts trust` writes).
    type: path
  step_deadline:
    description: Seconds a step may make no progress before it is stopped (as `--step-deadline`).
    type: float
  wait_notice:
    description: Seconds without progress before a step says what it waits for (as `--wait-notice`).
    type: float
  progress_file:
    description: A file on the controller to which each step event is appended as one JSON line (host, step,
      state - start, info, detail, wait, done or fail - and detail), for the CLI's live view. Before the switch the
      host waits until the controller has read its lines (it writes how far to C(progress_file).read).
    type: path
  cancel_file:
    description: A file on the controller whose appearance (the CLI's Ctrl-C) stops the host's running step and
      every host before its switch; a host not yet started is not attempted.
    type: path
"""

RETURN = r"""
status: {description: "stopped (the generation is staged: probed, kept, not current), noop, failed, unknown or
  interrupted, as `provision apply --json` says; in check mode planned or noop", type: str}
generation: {description: the generation staged (or already current when noop), type: str}
previous: {description: the generation current before (still current), type: str}
plan: {description: "the plan's action (noop, reuse or build), summary (add, change, remove), base, reuse and
  warnings", type: dict}
probes: {description: the probes' verdict (status, summary, failed), type: dict}
steps: {description: each step run (name, status, seconds, detail), type: list}
failed_step: {description: on failure - the step that failed, type: str}
run_dir: {description: the build's run directory on the host, type: str}
seconds: {description: seconds the apply took, type: float}
warned: {description: what the apply warned of (each also shown as an Ansible warning), type: list}
batch: {description: "the hosts of this host's batch (Ansible's ansible_play_batch as the task started), which the
  play's tolerance counts failures against", type: list}
report: {description: "the whole apply report, as `provision apply --json` prints it; in check mode the whole plan,
  as `provision plan --json` prints it (and `--out` saves it)", type: dict}
"""

from ansible.module_utils.basic import AnsibleModule

ARGUMENT_SPEC = {"lock": {"type": "path"},
                 "plan_file": {"type": "path"},
                 "adopt": {"type": "str"},
                 "wheels_from": {"type": "str", "choices": ["host", "controller"]},
                 "step_deadline": {"type": "float"},
                 "wait_notice": {"type": "float"},
                 "progress_file": {"type": "path"},
                 "cancel_file": {"type": "path"},
                 "root": {"type": "path"},
                 "python": {"type": "str"},
                 "skip_probes": {"type": "list", "elements": "str", "default": []},
                 "installer": {"type": "str", "choices": ["uv", "pip"]},
                 "known_hosts": {"type": "path"}}


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, required_one_of=[["lock", "plan_file"]],
                           supports_check_mode=True)
    module.fail_json(msg="provision_apply runs through its action plugin (action_plugins/provision_apply.py beside "
                         "this library): run it from provision's playbooks directory")


if __name__ == "__main__":
    main()
