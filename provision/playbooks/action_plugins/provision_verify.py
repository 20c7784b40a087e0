"""Controller side of provision_verify: `provision.verify.verify` of this host's generation (the host hashes every
file; its reply is judged here against the generation's lock), so a playbook and `provision verify` give one
verdict; drift fails the task, the verdict kept. Progress (files and bytes hashed) goes to the task's progress
file."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("provision") is None:   # an ansible-playbook from another environment: the package
    sys.path.append(str(Path(__file__).resolve().parents[3]))   # these playbooks ship in, beside this directory

from provision.action import HostStep  # noqa: E402


class ActionModule(HostStep):
    MODULE, STEP = "provision_verify", "verify"
    _supports_check_mode = True

    def step(self, transport, args, progress):
        from provision.cli.pack import progress_line
        from provision.verify import verify

        return verify(transport, args["generation"], baseline=args["baseline"], jobs=args["jobs"],
                      progress=lambda ev: progress(progress_line(ev)),
                      record=args["record"] and not self._task.check_mode)

    def verdict(self, value):
        return None if value["verdict"] == "clean" else f"{value['generation']} drifted: " + "; ".join(value["lines"])

    def changed(self, value):
        return bool(value.get("recorded"))
