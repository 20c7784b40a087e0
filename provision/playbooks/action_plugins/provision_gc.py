"""Controller side of provision_gc: `provision.generations.gc` of this host (under its host lock; check mode names
what would go), then the controller's run directories of what it removed. Progress (each phase, and how far it
is) goes to the task's progress file."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("provision") is None:   # an ansible-playbook from another environment: the package
    sys.path.append(str(Path(__file__).resolve().parents[3]))   # these playbooks ship in, beside this directory

from provision.action import HostStep  # noqa: E402


class ActionModule(HostStep):
    MODULE, STEP = "provision_gc", "gc"
    _supports_check_mode = True

    def step(self, transport, args, progress):
        from provision.generations import gc, gc_progress

        return gc(transport, keep=args["keep"], dry_run=self._task.check_mode,
                  on_event=lambda ev: progress(gc_progress(ev)))

    def changed(self, value):
        return not value.dry_run and bool(value.generations or value.cache)
