"""One host step inside an Ansible module: an agent operation on its payload, in this process. What the agent says
as progress goes to a scratch file, never to the module's stdout, which carries only the module's result."""
import contextlib
import os
import sys
import tempfile

from .agent import host
from .agent.host import AgentError

STARTS_AGENTS = {("facts", "gather")}     # operations that start an agent in another interpreter (a generation's)


def run(agent, op, payload):
    """The agent's reply to `payload` (a dict), `op` given; its progress events are dropped (a module answers once).
    A refusal is the reply's one-line `error`, as the agent's own loader reports it."""
    ops = _ops(agent)
    if (agent, op) in STARTS_AGENTS and "bundle" not in host.MESSAGE:
        host.MESSAGE["bundle"] = _bundle()      # of the modules loaded now, the agent's among them
    with tempfile.TemporaryFile() as sink, _stdout_to(sink):
        try:
            return ops[op](dict(payload, op=op))
        except AgentError as e:
            return {"error": str(e)}


def _ops(agent):
    """The operations of `agent`, its module imported only now: a step's module loads the one agent it runs."""
    if agent == "state":
        from .agent import state
        return state.OPS
    if agent == "facts":
        from .agent import facts
        return facts.OPS
    return {"unlock": host.op_unlock}


def main(name, own):
    """main() of the module of declared step `name` that runs on the host (steps/state.py; `own`: its options,
    as its module file declares them): the options and the root to the step, the task's check mode as the step's
    dry run where it has one; the reply as the task's result, changed when the step switched `current`."""
    from ansible.module_utils.basic import AnsibleModule
    from . import spec
    from .steps.state import STEPS

    declared = {s.name: s for s in STEPS}[name]
    module = AnsibleModule(argument_spec=dict(spec.ROOT, **own), supports_check_mode=True)
    payload = {k: module.params[k] for k in own}
    payload["root"] = module.params["root"]
    if declared.check_mode == "dry_run":
        payload.update(dry_run=module.check_mode, take_lock=not module.check_mode)
    reply = run(declared.agent, declared.op, payload)
    finish(module, reply, changed=bool(reply.get("switched")))


def _bundle():
    """This module's provision sources as the agents' bundle (what an agent started in another interpreter, e.g. a
    generation's, imports from memory): the files Ansible shipped with the module, read back from its payload."""
    pkg = __name__.rsplit(".", 1)[0]         # ansible.module_utils.provision
    files = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == pkg or name.startswith(pkg + ".")) or name.endswith(".step"):
            continue
        try:
            source = mod.__loader__.get_source(name)
        except (AttributeError, ImportError, OSError):
            continue
        rel = name[len(pkg):].lstrip(".").replace(".", "/")
        is_pkg = hasattr(mod, "__path__")
        files["provision/" + (rel + "/__init__.py" if is_pkg and rel else "__init__.py" if is_pkg else rel + ".py")] = \
            source or ""
    files["provision/agent/__init__.py"] = '"""Host-side agents."""\n'
    return host.bundle_of(files)


@contextlib.contextmanager
def _stdout_to(f):
    """fd 1 (and sys.stdout with it) into `f` for the duration: also what a thread or child process writes."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(f.fileno(), 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


RESERVED = ("changed", "failed", "error", "msg", "warnings", "deprecations")   # keys Ansible gives a meaning


def finish(module, reply, changed=False):
    """exit_json with the agent's reply, or fail_json with its one-line error; the agent's warnings become the
    module's own (module.warn), under `agent_warnings` in the result too (as the agent gave them, none too)."""
    for w in reply.get("warnings") or []:
        module.warn(str(w))
    rest = {k: v for k, v in reply.items() if k not in RESERVED}
    if "warnings" in reply:
        rest["agent_warnings"] = reply["warnings"]
    if reply.get("error"):
        module.fail_json(msg=str(reply["error"]), **rest)
    module.exit_json(changed=changed, **rest)
