"""Agent replies are read through their declared shape (provision/replies.py): a host whose agent answers with a
field of the wrong type, or without one, is refused in one line naming the host, the step and the field, through
the library and through the CLI. The hostile host runs the real agents; its interpreter rewrites one reply."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from packaging.specifiers import SpecifierSet

from provision import apply as applymod, generations, lock as lockmod, pack as packmod, patches, verify as verifymod
from provision import probes as probesmod
from provision.errors import HostError
from provision.probes.ship import ship_tool
from provision.replies import (Contract, Ended, History, Inspected, Mismatches, PatchRun, ProbesRun, ReplyError,
                               Rollback, Status, Unlocked, Unpacked)
from provision.transport import Local, Target, unlock
from wheelhouse import write_lock

ROOT = Path(__file__).resolve().parent.parent

WRAPPER = r'''#!{python}
"""A host's python3 that runs the real one and rewrites its agent's reply as RULES (agent:op -> code on `r`) say;
run with no arguments (a module Ansible pipes in), it rewrites the module's result as RULES' "module" says."""
import json, subprocess, sys, threading

with open({rules!r}) as f:
    rules = json.load(f)
if len(sys.argv) == 1:
    p = subprocess.run([{python!r}], input=sys.stdin.buffer.read(), stdout=subprocess.PIPE)
    out = p.stdout
    if rules.get("module"):
        r = json.loads(out)
        exec(rules["module"], {{"r": r}})
        out = json.dumps(r).encode()
    sys.stdout.buffer.write(out)
    sys.exit(p.returncode)
first = sys.stdin.buffer.readline()
msg = json.loads(first)
said = "%s:%s" % (msg.get("agent"), (msg.get("input") or {{}}).get("op"))
rule, on_event = rules.get(said), rules.get(said + ":event")
child = subprocess.Popen([{python!r}] + sys.argv[1:], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
child.stdin.write(first)
child.stdin.flush()


def pump():
    try:
        for chunk in iter(lambda: sys.stdin.buffer.read1(65536), b""):
            child.stdin.write(chunk)
            child.stdin.flush()
        child.stdin.close()
    except OSError:
        pass


threading.Thread(target=pump, daemon=True).start()
last = None
for line in child.stdout:          # each line as it comes; the last held back where a rule rewrites it
    if on_event and line.startswith(b'{{"_event"'):
        ev = json.loads(line)
        exec(on_event, {{"r": ev["_event"]}})
        line = (json.dumps(ev) + "\n").encode()
    if last is not None:
        sys.stdout.buffer.write(last)
        sys.stdout.flush()
    last = line
    if rule is None:
        sys.stdout.buffer.write(last)
        sys.stdout.flush()
        last = None
child.wait()
if last is not None and rule is not None:
    r = json.loads(last)
    exec(rule, {{"r": r}})
    last = (json.dumps(r) + "\n").encode()
sys.stdout.buffer.write(last or b"")
sys.exit(child.returncode)
'''


class Hostile:
    """A loopback host whose python3 answers what the test chooses (`answer(agent, op, code)`), else the truth."""

    def __init__(self, tmp_path: Path, root: Path):
        self.bin = tmp_path / "hostile-bin"
        self.bin.mkdir()
        self.rules = tmp_path / "rules.json"
        self.rules.write_text("{}")
        py = self.bin / "python3"
        py.write_text(WRAPPER.format(python=sys.executable, rules=str(self.rules)))
        py.chmod(0o755)
        self.inventory = tmp_path / "inv.ini"
        self.inventory.write_text(f"h ansible_connection=local provision_root={root} ansible_python_interpreter={py}\n")
        self.root = root
        self.transport = Local(Target(host="h", root=str(root), python=str(py)))

    def answer(self, agent: str, op: str, code: str) -> None:
        """The agent's reply to `op` rewritten by `code`; agent "module": a module's result (its op unused)."""
        self.rules.write_text(json.dumps({"module" if agent == "module" else f"{agent}:{op}": code}))

    def cli(self, *args: str, inventory: bool = False) -> subprocess.CompletedProcess:
        """`provision ARGS` on this host: --local, or with `inventory` as an inventory's host (through its play)."""
        env = dict(os.environ, PATH=f"{self.bin}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(ROOT))
        where = ["-i", str(self.inventory)] if inventory else ["--local", "--root", str(self.root)]
        return subprocess.run([sys.executable, "-m", "provision.cli", *args, *where],
                              capture_output=True, text=True, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, wheels):
    """Two generations applied (a, then b current) on an honest host, then the same root behind a hostile python3
    (one for the module: each test leaves the host runnable, though perhaps rolled back)."""
    tmp_path = tmp_path_factory.mktemp("hostile")
    root = tmp_path / "root"
    honest = Local(Target(host="h", root=str(root)))
    for name, ws in (("a", [wheels["alpha-1.0"]]), ("b", [wheels["alpha-2.0"]])):
        applymod.apply(honest, lockmod.load(write_lock(tmp_path / f"{name}.yaml", name, ws)))
    return Hostile(tmp_path, root)


@pytest.fixture
def host(hostile):
    hostile.rules.write_text("{}")          # honest until the test says otherwise
    return hostile


CASES = [   # (agent, op, what the host does to its reply, the call, the field and why the line names)
    ("state", "status", "r['current'] = ['0002-b']", lambda t: generations.status(t),
     "status reply is malformed: current: expected a string, not list"),
    ("state", "rollback", "del r['to']", lambda t: generations.rollback(t),
     "rollback reply is malformed: to: missing"),
    ("state", "rollback", "r['check'] = {'verdict': 'fine'}", lambda t: generations.rollback(t, dry_run=True),
     "rollback reply is malformed: check.verdict: 'fine' is not clean or drift"),
    ("state", "history", "r['generations'][0]['number'] = '1'", lambda t: generations.history(t),
     "history reply is malformed: generations[0].number: expected a whole number, not str"),
    ("state", "history", "r['current'] = '../../etc'", lambda t: generations.resolve(t, "1"),
     "history reply is malformed: current: '../../etc' is not a generation id"),
    ("state", "gc", "r['generations'] = [{'id': '0001-a', 'run_dir': 7}]", lambda t: generations.gc(t, 1, True),
     "gc reply is malformed: generations[0].run_dir: expected a string, not int"),
    ("state", "logs", "r['logs'] = {'build.log': {'bytes': 'many', 'text': ''}}", lambda t: generations.logs(t),
     "logs reply is malformed: logs['build.log'].bytes: expected a whole number, not str"),
    ("state", "recover", "r['abandoned'] = '0001-a'", lambda t: generations.recover(t),
     "recover reply is malformed: abandoned: expected a list, not str"),
    ("state", "switch", "r['to'] = None", lambda t: generations.switch(t, "0001-a"),
     "switch reply is malformed: to: missing"),
    ("state", "read", "r['lock_text'] = ['lock: 1']", lambda t: generations.diff(t, "1"),
     "read reply is malformed: lock_text: expected a string, not list"),
    ("verify", "quick", "r['verdict'] = 'fine'", lambda t: verifymod.check(t, "0001-a"),
     "check reply is malformed: verdict: 'fine' is not clean or drift"),
    ("verify", "verify", "r['dists'] = []", lambda t: verifymod.verify(t),
     "verify reply is malformed: dists: expected an object, not list"),
    ("verify", "verify", "r['dists']['alpha']['changed'] = [1]", lambda t: verifymod.verify(t),
     "verify reply is malformed: dists['alpha'].changed[0]: expected a string, not int"),
    ("tool", "unpack", "r['complete'] = 'yes'", lambda t: ship_tool(t),
     "unpack reply is malformed: complete: expected true or false, not str"),
    ("host", "unlock", "r['state'] = 'gone'", lambda t: unlock(t),
     "unlock reply is malformed: state: 'gone' is not free, held or broken"),
    ("host", "unlock", "r['ended'] = ['1']", lambda t: unlock(t),
     "unlock reply is malformed: ended[0]: expected a whole number, not str"),
]


def sp_of(t) -> str:
    return str(next(Path(t.target.root).glob("generations/0002-b/venv/lib/python*/site-packages")))


def patch_none(t):
    """An empty series for alpha, applied in generation 0002-b's site-packages by the host's python3."""
    series = patches.Series(name="alpha-2", path=Path("/nonexistent"), package="alpha", specifier=SpecifierSet(">=1"))
    return patches.apply_series(t, [series], python=t.target.python, site_packages=sp_of(t))


def probe_packages(t):
    """The probes agent's packages probe, run by the host's python3 in its own environment."""
    return probesmod._run_host(t, ["packages"], {"packages": {}, "packages_source": "test"}, t.target.python,
                               600)


# the agents a step runs in a named interpreter: the host's python3, on generation 0002-b's site-packages
NAMED = [
    ("patcher", "inspect", "r['packages']['alpha']['root'] = 'alpha'",
     lambda t: patches.installed(t, ["alpha"], python=t.target.python, site_packages=sp_of(t)),
     "inspect reply is malformed: packages['alpha'].root: 'alpha' is not an absolute path"),
    ("patcher", "run", "r['series'][0]['name'] = 'beta-1'", patch_none,
     "patch reply is malformed: series[0].name: 'beta-1' is not a series asked for"),
    ("patcher", "run", "r['files'] = {'alpha/__init__.py': 'abc'}", patch_none,
     "patch reply is malformed: files['alpha/__init__.py']: 'abc' is not a sha256"),
    ("patcher", "verify", "r['mismatches'][0]['expected'] = 5",
     lambda t: patches.verify_manifest(t, {"alpha/x.py": "0" * 64}, t.target.python, site_packages=sp_of(t)),
     "patch verify reply is malformed: mismatches[0].expected: expected a string, not int"),
    ("contracts", "check", "r['found'] = True",
     lambda t: patches.check_contract(t, "LlamaForCausalLMEagle3", t.target.python, site_packages=sp_of(t)),
     "contract reply is malformed: package: missing"),
    ("probes", "run", "r['results'][0]['status'] = 'great'", probe_packages,
     "probe reply is malformed: results[0].status: 'great' is not pass, fail, skip or warn"),
    ("probes", "run", "r['results'][0]['name'] = 'patches'", probe_packages,
     "probe reply is malformed: results[0].name: 'patches' was not asked for"),
    ("probes", "run", "r['kernels'] = 'warm'", probe_packages,
     "probe reply is malformed: kernels: expected an object, not str"),
]
CASES += NAMED


@pytest.mark.parametrize("agent,op,code,call,says", CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_a_reply_of_the_wrong_shape_is_one_line_naming_host_step_and_field(host, agent, op, code, call, says):
    call(host.transport)                   # the honest answer reads
    host.answer(agent, op, code)
    with pytest.raises(ReplyError) as e:
        call(host.transport)
    assert str(e.value) == f"h: the host's {says}"


def test_the_tool_is_refused_where_the_host_says_it_lies_outside_its_root(host):
    """The tool agent's `path` is where the engine is run from: one outside <root>/tool/<digest> is refused."""
    assert ship_tool(host.transport).startswith(f"{host.root}/tool/")
    host.answer("tool", "unpack", "r['path'] = '/tmp'")
    with pytest.raises(ReplyError, match=rf"^h: the host's unpack reply is malformed: path: '/tmp' is not "
                                         rf"{host.root}/tool/[0-9a-f]{{16}}$"):
        ship_tool(host.transport)


def test_pack_refuses_a_wheel_name_outside_its_folder(host, tmp_path):
    host.answer("pack", "pack", "r['wheels'][0]['filename'] = '../../evil.whl'")
    with pytest.raises(ReplyError, match=r"^h: the host's pack reply is malformed: wheels\[0\]\.filename: "
                                         r"'\.\./\.\./evil\.whl' is not a wheel file name$"):
        packmod.pack(host.transport, tmp_path / "out")
    assert not (tmp_path / "evil.whl").exists()


def test_a_build_whose_figures_have_the_wrong_shape_fails_its_step_in_one_line(host, tmp_path, wheels):
    host.answer("build", "build", "r['fetched'] = 'many'")
    with pytest.raises(HostError, match="^h: the host's build reply is malformed: fetched: expected a whole number, "
                                        "not str$"):
        applymod.apply(host.transport, lockmod.load(write_lock(tmp_path / "c.yaml", "c", [wheels["beta-1.0"]])))
    host.answer("build", "build:event", "if r.get('step') == 'fetch' and r.get('summary'): r['bytes'] = 'lots'")
    with pytest.raises(HostError, match="^h: the host's build progress reply is malformed: bytes: expected a whole "
                                        "number, not str$"):
        applymod.apply(host.transport, lockmod.load(write_lock(tmp_path / "e.yaml", "e", [wheels["beta-1.0"]])))
    host.answer("cache", "have", "r['missing'] = [5]")
    with pytest.raises(HostError, match=r"^h: the host's have reply is malformed: missing: not indexes of the 1 "
                                        r"files asked about$"):
        applymod.apply(host.transport, lockmod.load(write_lock(tmp_path / "d.yaml", "d", [wheels["gamma-1.0"]])))


@pytest.mark.parametrize("verb,agent,op,code,says", [      # agent "module": the verb's module task's result
    (["status"], "module", "status", "r['current'] = ['0002-b']", "status reply is malformed: current"),
    (["rollback"], "module", "rollback", "del r['to']", "rollback reply is malformed: to: missing"),
    (["history"], "module", "history", "r['generations'] = {}", "history reply is malformed: generations"),
    (["gc", "--dry-run"], "state", "gc", "r['bytes'] = '1'", "gc reply is malformed: bytes"),
    (["verify"], "verify", "verify", "r['dists'] = []", "verify reply is malformed: dists"),
    (["logs"], "module", "logs", "r['probes'] = [{'name': 1, 'status': 'pass'}]", "logs reply is malformed: probes[0]"),
    (["logs"], "module", "logs", "del r['logs']", "logs reply is malformed: logs: missing"),
])
def test_the_cli_says_one_line_for_a_reply_of_the_wrong_shape(host, verb, agent, op, code, says):
    """--local through the verb's play (`connection: local`): the module's result, or the agent's reply to the
    action plugin's step, of the wrong shape is one line naming the host, exit 1."""
    host.answer(agent, op, code)
    p = host.cli(*verb)
    assert p.returncode == 1 and "Traceback" not in p.stderr, (p.stdout, p.stderr)
    lines = [x for x in p.stderr.strip().splitlines()          # gc's and verify's progress lines
             if not x.lstrip().startswith(("local: gc ", "local  · verify"))]
    assert len(lines) == 1 and f"local: the host's {says}" in lines[0], p.stderr


@pytest.mark.parametrize("verb,rule,code,says", [
    (["status"], "module", "r['current'] = ['0002-b']", "status reply is malformed: current: expected a string, not list"),
    (["history"], "module", "r['generations'] = {}",
     "history reply is malformed: generations: expected a list, not dict"),
    (["verify"], "verify:verify", "r['dists'] = []", "verify reply is malformed: dists: expected an object, not list"),
    (["logs"], "module", "r['probes'] = [{'name': 1, 'status': 'pass'}]",
     "logs reply is malformed: probes[0].name: expected a string, not int"),
])
def test_an_inventory_host_whose_module_answers_the_wrong_shape_is_one_line(host, verb, rule, code, says):
    """The same hostile host as an inventory's (its play's module result, or its step's agent reply, rewritten):
    one line naming it, exit 1."""
    host.rules.write_text(json.dumps({rule: code}))
    p = host.cli(*verb, inventory=True)
    assert p.returncode == 1 and "Traceback" not in p.stderr, (p.stdout, p.stderr)
    lines = [x for x in p.stderr.strip().splitlines() if not x.lstrip().startswith("h  · verify")]   # progress
    assert len(lines) == 1 and lines[0].removeprefix("error: ").startswith(f"h: the host's {says}"), p.stderr


def test_a_read_reply_keeps_what_the_host_sent_and_the_checked_fields():
    """`to_json` gives the reply back as it came (keys no dataclass declares included), so renderers see it whole."""
    raw = {"current": "0002-b", "generations": [{"id": "0002-b", "number": 2, "status": "ready", "verify": {"x": 1}}],
           "events": [], "warnings": ["w"], "more": 1}
    h = History.of(raw, "h")
    assert h.current == "0002-b" and h.generations[0].number == 2 and h.to_json() == raw
    s = Status.of({"generations": 2, "ready": 2, "disk_bytes": 10, "probe": None, "root": "/r"}, "h")
    assert s.probe is None and s.to_json()["probe"] is None
    with pytest.raises(ReplyError, match="^h: the host's rollback reply is malformed: rollback: expected an object, "
                                         "not list$"):
        Rollback.of([], "h")


@pytest.mark.parametrize("cls,data,says", [
    (Ended, {"ended": "yes"}, "end reply is malformed: ended: expected true or false, not str"),
    (Unpacked, {"path": "tool/x", "complete": True}, "unpack reply is malformed: path: 'tool/x' is not an absolute "
                                                     "path"),
    (Unlocked, {"state": "held", "heard": "long"}, "unlock reply is malformed: heard: expected a number, not str"),
    (ProbesRun, {"python": "/usr/bin/python3"}, "probe reply is malformed: results: missing"),
    (ProbesRun, {"results": [{"name": "nccl", "status": "pass", "reason": "", "figures": []}]},
     "probe reply is malformed: results[0].figures: expected an object, not list"),
    (Inspected, {"packages": {"sglang": {"name": "sglang", "version": "0.5.9", "root": "/x/../etc"}}},
     "inspect reply is malformed: packages['sglang'].root: '/x/../etc' is not an absolute path"),
    (PatchRun, {"mode": "apply", "written": True, "files": {}, "changed": [],
                "series": [{"name": "s", "site_packages": "/s", "patches": [{"name": "p"}]}]},
     "patch reply is malformed: series[0].patches[0].status: missing"),
    (PatchRun, {"mode": "apply", "series": []}, "patch reply is malformed: written: missing"),
    (Mismatches, {"mismatches": [{"path": "a.py"}]},
     "patch verify reply is malformed: mismatches[0].expected: missing"),
    (Contract, {"arch": "A", "found": True, "ok": True, "package": {"name": "sglang", "version": "1", "root": "/s"},
                "module": "m", "class": "C", "at": "m.py:1", "mro": ["C"], "required_source": "derived",
                "methods": [{"method": "f", "status": "gone"}]},
     "contract reply is malformed: methods[0].status: 'gone' is not defined, inherited or missing"),
    (Contract, {"arch": "A", "found": True, "ok": True, "package": {"name": "sglang", "version": "1", "root": "/s"},
                "module": "m", "class": "C", "at": "m.py:1", "mro": ["C"], "required_source": "derived",
                "methods": [{"method": "f", "status": "inherited", "at": "b.py:3"}]},
     "contract reply is malformed: methods[0].from: missing (inherited)"),
    (Contract, {"arch": "A", "found": "no"}, "contract reply is malformed: found: expected true or false, not str"),
])
def test_each_reply_is_checked_field_by_field(cls, data, says):
    """The reader itself, on a reply of the wrong shape: one line naming the host, the step and the field."""
    with pytest.raises(ReplyError) as e:
        cls.of(data, "h1")
    assert str(e.value) == f"h1: the host's {says}"
