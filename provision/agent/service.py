"""Host agent (stdlib only): what a systemd unit serves: its state as systemd's manager has it, and the
generations its processes run, read from /proc (their interpreter, the files they map, the paths their command
lines name under <root>/generations). A process started from `<root>/current` maps its files by the generation's
own path, so a server started before the last switch shows the generation it really runs."""
import os

from ..steps.state import Serving
from .systemd import Bus, BusError

RUNNING = ("active", "activating", "reloading", "deactivating")


def generations_run(lay, pids):
    """The generation ids whose files the processes `pids` run, map or name (sorted)."""
    prefix = os.path.join(os.path.realpath(lay.root), "generations") + "/"
    found = set()
    for pid in pids:
        paths = []
        try:
            paths.append(os.readlink("/proc/%d/exe" % pid))
        except OSError:
            pass
        try:
            with open("/proc/%d/maps" % pid) as f:
                paths += [line.split(None, 5)[5].rstrip("\n") for line in f if len(line.split(None, 5)) == 6]
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                paths += [a.decode("utf-8", "replace") for a in f.read().split(b"\0")]
        except OSError:
            continue
        found.update(p[len(prefix):].split("/", 1)[0] for p in paths if p.startswith(prefix))
    return sorted(g for g in found if g)


def serving(lay, unit):
    """The Serving reply for `unit`: its state, and the generations its processes run."""
    try:
        with Bus() as bus:
            st = bus.state(unit)
            pids = bus.processes(unit) if st["active"] in RUNNING else []
    except BusError as e:
        return Serving(unit=unit, error=str(e))
    return Serving(unit=unit, load=st["load"], active=st["active"], sub=st["sub"], main_pid=st["main_pid"],
                   processes=len(pids), generations=generations_run(lay, pids))
