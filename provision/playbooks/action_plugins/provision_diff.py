"""Controller side of provision_diff: `provision.generations.diff` of two generations of this host, each read from its
own lock (parsed here, by provision's reader)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("provision") is None:   # an ansible-playbook from another environment: the package
    sys.path.append(str(Path(__file__).resolve().parents[3]))   # these playbooks ship in, beside this directory

from provision.action import HostStep



class ActionModule(HostStep):
    MODULE, STEP = "provision_diff", "diff"
    _supports_check_mode = True

    def step(self, transport, args, progress):
        from dataclasses import asdict

        from provision import generations

        d = generations.diff(transport, args["a"], args["b"])
        return dict(d, changes=[asdict(c) for c in d["changes"]])
