"""Controller side of provision_switch: `provision.generations.switch` of this host under its host lock, as
`provision apply` switches at its commit point, over the same connection as the play's stage task (no module of its
own to send and start on the host). A switch under way is one commit: the controller's stop never cuts it."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("provision") is None:   # an ansible-playbook from another environment: the package
    sys.path.append(str(Path(__file__).resolve().parents[3]))   # these playbooks ship in, beside this directory

from provision.action import HostStep  # noqa: E402


class ActionModule(HostStep):
    MODULE, STEP = "provision_switch", "switch"
    STOPPABLE = False

    def step(self, transport, args, progress):
        from provision.generations import switch

        event = {"lock": args["lock"], "skipped_probes": args["skipped_probes"],
                 **({"reuse": True} if args["reuse"] else {})}
        return switch(transport, args["to"], "apply", event, take_lock=True)

    def changed(self, value):
        return value.from_ != value.to
