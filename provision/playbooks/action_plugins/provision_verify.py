"""Controller side of provision_verify: the host's check judged against the generation's lock by provision's own
reader (`provision.verify.verdict_of`), so a playbook and `provision verify` give one verdict; drift fails the task."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from ansible.module_utils.parsing.convert_bool import boolean
from ansible.plugins.action import ActionBase

if importlib.util.find_spec("provision") is None:   # an ansible-playbook from another environment: the package
    sys.path.append(str(Path(__file__).resolve().parents[3]))   # these playbooks ship in, beside this directory


class ActionModule(ActionBase):
    _supports_check_mode = True
    _supports_async = False

    def run(self, tmp=None, task_vars=None):
        from provision.errors import ProvisionError
        from provision.lock import loads
        from provision.verify import event_of, verdict_of

        result = super().run(tmp, task_vars)
        reply = self._execute_module(module_name="provision_verify", module_args=self._task.args,
                                     task_vars=task_vars)
        if reply.get("failed") or reply.get("unreachable") or "found" not in reply:
            return dict(result, **reply)
        host, gen_id = (task_vars or {}).get("inventory_hostname", "host"), str(reply["generation"])
        if not reply.get("lock_text"):
            return dict(result, failed=True, generation=gen_id, msg=f"generation {gen_id} has no lock.yaml")
        try:
            lock = loads(str(reply["lock_text"]), f"{host}:{gen_id}/lock.yaml")
            out = verdict_of(reply["found"], lock, reply.get("installer"), gen_id, host)
        except ProvisionError as e:      # the lock, or the host's reply, is not what it should be: one line
            return dict(result, failed=True, generation=gen_id, msg=e.message if e.where == host else str(e))
        result.update(out, changed=False, recorded=False)
        if boolean(self._task.args.get("record", False), strict=False) and not self._task.check_mode:
            args = {k: v for k, v in self._task.args.items() if k == "root"}
            done = self._execute_module(module_name="provision_verify", task_vars=task_vars, module_args=dict(
                args, generation=gen_id, verdict=out["record"], event=event_of(out["record"])))
            if done.get("failed") or done.get("unreachable"):
                done["not_recorded"] = done.get("msg") or "no answer"
            result.update(changed=bool(done.get("recorded")), recorded=bool(done.get("recorded")),
                          not_recorded=done.get("not_recorded"))
        if out["verdict"] != "clean":
            result.update(failed=True, msg=f"{gen_id} drifted: " + "; ".join(out["lines"]))
        return result
