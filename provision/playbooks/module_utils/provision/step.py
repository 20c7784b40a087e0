"""One host step inside an Ansible module: an agent operation on its payload, in this process. What the agent says
as progress goes to a scratch file, never to the module's stdout, which carries only the module's result."""
import contextlib
import os
import sys
import tempfile

from .layout import Layout, pick_generation
from .agent import facts, host, state
from .agent.host import AgentError

AGENTS = {"state": state.OPS, "facts": facts.OPS, "host": {"unlock": host.op_unlock}}
STARTS_AGENTS = {("facts", "gather")}     # operations that start an agent in another interpreter (a generation's)


def run(agent, op, payload):
    """The agent's reply to `payload` (a dict), `op` given; its progress events are dropped (a module answers once).
    A refusal is the reply's one-line `error`, as the agent's own loader reports it."""
    if (agent, op) in STARTS_AGENTS and "bundle" not in host.MESSAGE:
        host.MESSAGE["bundle"] = _bundle()
    with tempfile.TemporaryFile() as sink, _stdout_to(sink):
        try:
            return AGENTS[agent][op](dict(payload, op=op))
        except AgentError as e:
            return {"error": str(e)}


def generation(root, name=None, default="current"):
    """A generation's id under `root` from its id or number (None: `current`, or with default "newest" the newest),
    the CLI's rule; AgentError naming what the root holds when none matches."""
    denied = state.root_unreadable(root)
    if denied:
        raise AgentError(denied)
    lay = Layout(root)
    try:
        return pick_generation([(n, i) for n, i, _ in host.generations(lay)], host.current(lay), name, default)
    except LookupError as e:
        raise AgentError({"none": "no generations under %s: adopt or apply first" % root,
                          "no current": "no current generation under %s; name one (generation=N)" % root}
                         .get(str(e), str(e))) from None


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
