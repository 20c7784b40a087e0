"""Controller side of provision_patches: `provision.patches.apply_series` (check, apply or revert) in an environment of
this host; the series are read here, on the controller."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("provision") is None:   # an ansible-playbook from another environment: the package
    sys.path.append(str(Path(__file__).resolve().parents[3]))   # these playbooks ship in, beside this directory

from provision.action import HostStep



class ActionModule(HostStep):
    MODULE, STEP = "provision_patches", "patches"

    def step(self, transport, args, progress):
        from provision import patches as patchmod

        loaded, matching = patchmod.chosen_series([Path(p) for p in args["series"]] or None)
        python = patchmod.env_python(transport, args["python"], args["site_packages"])
        return patchmod.apply_series(transport, loaded, python=python, check_only=args["mode"] == "check",
                                     revert=args["mode"] == "revert", site_packages=args["site_packages"],
                                     matching=matching)

    def verdict(self, value):
        return None if value["ok"] else f"{value['host']}: a patch did not {value.get('mode') or 'apply'}"

    def changed(self, value):
        return bool(value.get("written"))
