"""Controller side of provision_pack: `provision.pack.pack` of this host's generation into a wheelhouse here, on the
controller; its progress (files and bytes packed) goes to the task's progress file."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("provision") is None:   # an ansible-playbook from another environment: the package
    sys.path.append(str(Path(__file__).resolve().parents[3]))   # these playbooks ship in, beside this directory

from provision.action import HostStep



class ActionModule(HostStep):
    MODULE, STEP = "provision_pack", "pack"

    def step(self, transport, args, progress):
        from provision import pack as packmod
        from provision.cli.pack import progress_line

        def said(ev: dict) -> None:
            if ev.get("step") == "pack":
                progress(progress_line(ev))
        rep = packmod.pack(transport, Path(args["out"]), args["generation"], allow_drift=args["allow_drift"],
                           base=Path(args["base"]) if args["base"] else None, extra=[Path(p) for p in args["extra"]],
                           name=args["name"], jobs=args["jobs"], force=args["force"], progress=said)
        return dict(rep, check=rep["check"].to_json())

    def verdict(self, value):
        return None if value["check"]["ok"] else f"{value['lock']}: the packed lock does not pass its check"

    def changed(self, value):
        return True
