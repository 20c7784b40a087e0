"""Controller side of provision_probe: `provision.probes.run_probes` on this host, reached as the inventory names it
(the probe bundle travels from here); a failed required probe fails the task, the report kept."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("provision") is None:   # an ansible-playbook from another environment: the package
    sys.path.append(str(Path(__file__).resolve().parents[3]))   # these playbooks ship in, beside this directory

from provision.action import HostStep



class ActionModule(HostStep):
    MODULE, STEP = "provision_probe", "probe"

    def step(self, transport, args, progress):
        from provision import lock as lockmod
        from provision.probes import run_probes

        lock = lockmod.load(args["lock"]) if args["lock"] else None
        return run_probes(transport, lock, generation=args["generation"], only=args["only"] or None)

    def verdict(self, value):
        if value["status"] == "pass":
            return None
        return f"{value['generation']}: required probes failed: {', '.join(value['failed'])}"
