"""Controller side of provision_contract: `provision.patches.check_contract` of an architecture in this host's SGLang
(static: it is never imported)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("provision") is None:   # an ansible-playbook from another environment: the package
    sys.path.append(str(Path(__file__).resolve().parents[3]))   # these playbooks ship in, beside this directory

from provision.action import HostStep



class ActionModule(HostStep):
    MODULE, STEP = "provision_contract", "contract"
    _supports_check_mode = True

    def step(self, transport, args, progress):
        from provision import patches as patchmod

        python = patchmod.env_python(transport, args["python"], args["site_packages"])
        return patchmod.check_contract(transport, args["arch"], python, site_packages=args["site_packages"])

    def verdict(self, value):
        return None if value.get("ok") else f"{value['arch']}: the EAGLE-3 contract fails"
