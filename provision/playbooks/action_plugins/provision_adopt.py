"""Controller side of provision_adopt: `provision.apply.adopt_host` on this host (under its lock), reached as the
inventory names it: the environment captured as generation 0."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("provision") is None:   # an ansible-playbook from another environment: the package
    sys.path.append(str(Path(__file__).resolve().parents[3]))   # these playbooks ship in, beside this directory

from provision.action import HostStep



class ActionModule(HostStep):
    MODULE, STEP = "provision_adopt", "adopt"

    def step(self, transport, args, progress):
        from provision import apply as applymod

        return applymod.adopt_host(transport, args["path"])

    def changed(self, value):
        return bool(value.get("id"))
