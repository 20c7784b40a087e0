"""One host step inside an Ansible module: an agent operation on its payload, in this process. What the agent says
as progress goes to a scratch file, never to the module's stdout, which carries only the module's result."""
import contextlib
import os
import tempfile

from .agent import state

AGENTS = {"state": state.OPS}


def run(agent, op, payload):
    """The agent's reply to `payload` (a dict), `op` given; its progress events are dropped (a module answers once)."""
    with tempfile.TemporaryFile() as sink, _stdout_to(sink):
        return AGENTS[agent][op](dict(payload, op=op))


@contextlib.contextmanager
def _stdout_to(f):
    """fd 1 (and sys.stdout with it) into `f` for the duration: also what a thread or child process writes."""
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(f.fileno(), 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def finish(module, reply, changed=False):
    """exit_json with the agent's reply, or fail_json with its one-line error."""
    if reply.get("error"):
        module.fail_json(msg=str(reply["error"]), **{k: v for k, v in reply.items() if k not in ("error", "msg")})
    module.exit_json(changed=changed, **{k: v for k, v in reply.items() if k not in ("changed", "failed")})
