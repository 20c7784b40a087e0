"""Controller side of provision_capture: `provision.facts.capture_lock` of an environment on this host, reached as the
inventory names it; the lock data is the task's result (the controller writes and checks the file)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("provision") is None:   # an ansible-playbook from another environment: the package
    sys.path.append(str(Path(__file__).resolve().parents[3]))   # these playbooks ship in, beside this directory

from provision.action import HostStep  # noqa: E402


class ActionModule(HostStep):
    MODULE, STEP = "provision_capture", "capture"
    _supports_check_mode = True

    def step(self, transport, args, progress):
        from provision.facts import capture_lock

        return {"lock": capture_lock(transport, args["python"], name=args["name"])}
