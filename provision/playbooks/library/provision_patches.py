#!/usr/bin/python
"""Ansible module: check, apply or revert SGLang source patch series in an environment of the host.
Its work runs in its action plugin, on the controller through provision's own host steps; this file declares its
arguments and documents its result."""

DOCUMENTATION = r"""
module: provision_patches
short_description: Check, apply or revert SGLang source patch series in an environment of the host
description:
  - "What `provision patches check|apply|revert` does: every hunk of every patch is checked before any file is written
    (all or nothing); an applied patch is left alone; each touched file's sha256 is returned."
  - "C(mode=check) writes nothing; a patch that would fail fails the task with the report kept."
  - A host provision's connection cannot reach is unreachable, as Ansible counts it; a step that fails fails the task
    with the one line `provision` prints, its error type in C(error_type).
extends_documentation_fragment: provision.step
options:
  mode:
    description: check, apply or revert.
    type: str
    choices: [check, apply, revert]
    default: check
  series:
    description: Series folders on the controller; default every series shipped with provision, each where it
      matches the installed release.
    type: list
    elements: path
    default: []
  python:
    description: The target environment's interpreter (default <root>/current/venv/bin/python).
    type: str
  site_packages:
    description: Act on this site-packages folder of the host instead.
    type: str
"""

RETURN = r"""
host: {description: the host, type: str}
ok: {description: whether every patch did what was asked, type: bool}
written: {description: whether files were written, type: bool}
series: {description: "each series: package, version, site_packages, and each patch's status and files", type: list}
files: {description: each touched or vouched-for file's sha256 afterwards, type: dict}
step_changed: {description: the files written (`changed` in `provision patches --json`), type: list}
"""

ARGUMENT_SPEC = {"mode": {"type": "str", "choices": ["check", "apply", "revert"], "default": "check"},
                 "series": {"type": "list", "elements": "path", "default": []},
                 "python": {"type": "str"},
                 "site_packages": {"type": "str"}}   # its own; STEP (module_utils) the shared ones


def main():
    from ansible.module_utils.provision.spec import through_plugin

    through_plugin("provision_patches", ARGUMENT_SPEC)


if __name__ == "__main__":
    main()
