#!/usr/bin/python
"""Ansible module provision_gc: remove old and failed generations of a provision host root and cache entries none needs. Its work runs in its action plugin (action_plugins/provision_gc.py), on the controller.
Written from the step's declaration (provision/steps/state.py) by `python -m provision.module_files`:
edit the declaration, not this file."""

DOCUMENTATION = r"""
module: provision_gc
short_description: "Remove old and failed generations of a provision host root and cache entries none needs"
description:
  - "Under the host lock, removes failed and abandoned generations, runnable ones beyond the newest `keep`, and cached wheels no remaining generation needs; never `current` nor the generation a rollback returns to."
  - "Check mode names what would go, removing nothing. The controller's own run directories are the CLI's to remove (`provision gc`)."
extends_documentation_fragment: provision.step
options:
  keep:
    description: "Runnable generations to keep, current and the rollback target included."
    type: int
    default: 3
"""

RETURN = r"""
dry_run: {description: "true in check mode (nothing removed)", type: bool, returned: always}
generations: {description: "each generation removed (or that would be), with its status and the bytes it frees", type: list, elements: dict, returned: always, contains: {id: {description: "the generation", type: str, returned: always}, status: {description: "its status", type: str, returned: always}, bytes: {description: "bytes removing it frees", type: int, returned: always}, shared_bytes: {description: "bytes that stay, linked from what is kept", type: int, returned: always}, removed: {description: "whether it is gone (not in check mode)", type: bool, returned: always}, run_dir: {description: "the controller's run directory of its build", type: str, returned: always}}}
cache: {description: "the cached wheels removed", type: list, returned: always}
uv_cache: {description: "uv's unpacked wheels removed", type: list, returned: always}
kernels: {description: "compiled kernel caches no kept generation uses, removed", type: dict, returned: always, contains: {removed: {description: "the entries removed", type: list, elements: dict, returned: always, contains: {key: {description: "the kernel cache entry", type: str, returned: always}, bytes: {description: "its bytes", type: int, returned: always}}}, kept: {description: "the entries a kept generation uses", type: list, elements: str, returned: always}, bytes: {description: "bytes freed", type: int, returned: always}, errors: {description: "removals that failed", type: list, elements: str, returned: always}}}
store: {description: "store entries no kept generation links, removed, and the bytes they alone held", type: dict, returned: always, contains: {entries: {description: "store entries removed", type: int, returned: always}, bytes: {description: "the bytes they alone held", type: int, returned: always}}}
bytes: {description: "bytes freed (each inode once, only when no link to it is left)", type: int, returned: always}
shared_bytes: {description: "bytes that stay, linked from what is kept", type: int, returned: always}
errors: {description: "removals that failed (what was done is reported)", type: list, elements: str, returned: always}
current: {description: "the generation `current` names (kept)", type: str, returned: always}
rollback_target: {description: "the generation a rollback returns to (kept)", type: str, returned: always}
seconds: {description: "seconds the removal took (not in check mode)", type: float, returned: always}
fs_freed: {description: "the filesystem's own figure of space freed (not in check mode)", type: int, returned: always}
recovered: {description: "what settling an interrupted run found (not in check mode)", type: dict, returned: always, contains: {abandoned: {description: "generations left unfinished, abandoned", type: list, elements: str, returned: always}, repaired: {description: "switches whose records were repaired", type: list, elements: str, returned: always}, settled: {description: "switches not current, settled back", type: list, returned: always}, freed: {description: "failed generations whose venv was removed", type: list, returned: always}, removed_tmp: {description: "temporary files removed", type: list, elements: str, returned: always}, removed_partial: {description: "partial downloads removed", type: list, elements: str, returned: always}, unreadable: {description: "manifests that cannot be read (kept)", type: list, elements: str, returned: always}, errors: {description: "what could not be settled", type: list, elements: str, returned: always}, trash_bytes: {description: "bytes an interrupted gc had set aside, removed", type: int, returned: always}}}
agent_warnings: {description: "what the host root says is amiss", type: list, elements: str, returned: always}
"""

ARGUMENT_SPEC = {'keep': {'type': 'int', 'default': 3}}   # its own; the shared ones in module_utils/provision/spec.py


def main():
    from ansible.module_utils.provision.spec import through_plugin

    through_plugin("provision_gc", ARGUMENT_SPEC)


if __name__ == "__main__":
    main()
