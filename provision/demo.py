"""The demo scenario on a throwaway loopback host: plan → apply A → plan → apply B → plan → rollback → history.

Everything is real (sshd, paramiko, ansible-runner, uv, wheels from the index); output goes
through the callbacks the CLI gives, and the sandbox is removed afterwards.
"""
from __future__ import annotations

from typing import Callable

from . import apply as applymod
from . import lock as lockmod
from .bundled import DEMO_LOCKS
from .loopback import LoopbackHost
from .plan import render_plan
from .transport import connect, trust_host


def run_demo(say: Callable[[str], None], progress, show_history: Callable[[dict, str], None],
             show_probes: Callable[[dict | None], None], keep: bool = False) -> dict:
    a, b = lockmod.load(DEMO_LOCKS / "a.yaml"), lockmod.load(DEMO_LOCKS / "b.yaml")
    host = LoopbackHost().start()
    figures = {}
    try:
        t = host.target
        say(f"## throwaway host {host.spec} (sshd on loopback, root {host.root})")
        kind, fp = trust_host(t)
        say(f"trusted its fresh host key {kind} {fp} (in {t.known_hosts})")
        tr = connect(t)
        try:
            for step, lk in (("plan", a), ("apply", a), ("plan", b), ("apply", b), ("plan", b)):
                say(f"\n## provision {step} {host.spec} --lock {lk.path}")
                if step == "plan":
                    say(render_plan(applymod.plan(tr, lk)))
                else:
                    rep = applymod.apply(tr, lk, progress=progress)
                    show_probes(rep.probes)
                    say(f"Applied {lk.name}: current {rep.previous or '(none)'} → {rep.generation} in {rep.seconds:.1f}s")
                    figures[f"apply_{lk.name}_s"] = rep.seconds
            say(f"\n## provision rollback {host.spec}")
            rb = applymod.rollback(tr)
            figures["rollback_s"] = rb["seconds"]
            say(f"Rolled back: current {rb['from']} → {rb['to']} in {rb['seconds']:.2f}s (nothing reinstalled)")
            say(f"\n## provision history {host.spec}")
            show_history(applymod.history(tr), host.spec)
        finally:
            tr.close()
    finally:
        if keep:
            host.stop()
            say(f"\nsandbox kept at {host.dir}")
        else:
            host.cleanup()
    return figures
