"""Adversarial inputs: each case is a valid input (tests/adversarial/) with exactly one defect.

Every case must be refused with one line naming file:line (or the argument), exit 2, no traceback,
nothing written, and no host contacted. The valid inputs themselves are checked to pass first.
"""
from __future__ import annotations

import json
import os
import socket
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from provision import lock as lockmod
from provision.cli import app
from provision.plan import PLAN_FORMAT, Change, Plan, load_plans
from wheelhouse import make_wheel, sha256

HERE = Path(__file__).parent / "adversarial"


@dataclass
class World:
    dir: Path
    lock_text: str
    sp: Path
    host: socket.socket
    spec: str           # user@127.0.0.1:PORT of a listening socket no case may contact

    def host_args(self) -> list[str]:
        return [self.spec, "--known-hosts", str(self.dir / "known_hosts"), "--root", str(self.dir / "root")]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    wheel = make_wheel(d / "wheels", "alpha", "1.0")
    text = (HERE / "lock.yaml").read_text().replace("WHEEL_URL", wheel.as_uri()).replace("WHEEL_SHA", sha256(wheel))
    sp = d / "sp"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(sp)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.setblocking(False)
    w = World(d, text, sp, srv, f"corpus@127.0.0.1:{srv.getsockname()[1]}")
    yield w
    srv.close()


def snapshot(d: Path) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*")) if p.is_file()}


def check_refused(world: World, args: list, where: str, expect: str) -> None:
    """Run the CLI; assert exit 2, one `error:` line with `where` and `expect`, no traceback, no side effect."""
    before = snapshot(world.dir)
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exc_info is None or r.exc_info[0] is SystemExit, "".join(__import__("traceback").format_exception(
        *r.exc_info))
    out = r.output
    assert r.exit_code == 2, (args, r.exit_code, out)
    errors = [line for line in out.splitlines() if line.startswith(("error:", "Error:"))]   # ours, or click's usage
    assert len(errors) == 1, out
    assert "Traceback" not in out
    assert where in errors[0], (where, errors[0])
    assert expect in errors[0], (expect, errors[0])
    assert snapshot(world.dir) == before, "a refused input changed files"
    with pytest.raises(BlockingIOError):
        world.host.accept()[0].close()      # nobody connected to the host


def first_diff_line(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a.splitlines(), b.splitlines()), 1):
        if x != y:
            return i
    return min(len(a.splitlines()), len(b.splitlines())) + 1


# ---------------------------------------------------------------- locks
# (id, text replaced, replacement, what the error says); the error names the file and the changed line.
LOCK_CASES = [
    ("unknown-top-key", "probes:\n", "probez: {}\nprobes:\n", "unknown field 'probez'"),
    ("unknown-platform-key", "  os: ubuntu-24.04\n", "  os: ubuntu-24.04\n  kernel: '6.8'\n", "unknown field 'kernel'"),
    ("unknown-package-key", "  index: pypi\n", "  index: pypi\n  post_install: touch /tmp/x\n",
     "unknown field 'post_install'"),
    ("unknown-speculative-key", "num_draft_tokens: 4}", "num_draft_tokens: 4, eagle: 1}", "unknown field 'eagle'"),
    ("unknown-probes-key", "  timeout: 600\n", "  timeout: 600\n  min_speedupp: 2\n", "unknown field 'min_speedupp'"),
    ("unknown-cuda-key", "    source: wheels\n", "    source: wheels\n    url: x\n", "unknown field 'url'"),
    ("duplicate-top-key", "name: corpus\n", "name: corpus\nname: other\n", "duplicate key 'name'"),
    ("duplicate-nested-key", "  version: '1.0'\n", "  version: '1.0'\n  version: '9.9'\n", "duplicate key 'version'"),
    ("duplicate-engine-key", "  tp: 1\n", "  tp: 1\n  tp: 8\n", "duplicate key 'tp'"),
    ("lock-true", "lock: 1\n", "lock: true\n", "lock: expected a number, got True"),
    ("lock-2", "lock: 1\n", "lock: 2\n", "unsupported lock schema 2"),
    ("python-unquoted", "  python: '3.11'\n", "  python: 3.10\n", 'quote it ("3.10")'),
    ("python-not-a-version", "  python: '3.11'\n", "  python: '3.x'\n", "is not a minor version"),
    ("name-template", "name: corpus\n", "name: \"{{ lookup('pipe','touch /tmp/x') }}\"\n", "is not a valid name"),
    ("package-name-template", "- name: alpha\n", "- name: \"{{ lookup('pipe','id') }}\"\n",
     "is not a valid project name"),
    ("package-name-newline", "- name: alpha\n", "- name: \"alpha\\n--index-url=http://evil\"\n",
     "control characters"),
    ("version-invalid", "  version: '1.0'\n", "  version: '1.0-evil!'\n", "invalid version"),
    ("version-number", "  version: '1.0'\n", "  version: 1.10\n", 'quote it ("1.10")'),
    ("filename-traversal", "  filename: alpha-1.0-py3-none-any.whl\n",
     "  filename: ../../alpha-1.0-py3-none-any.whl\n", "plain file name"),
    ("filename-other-package", "  filename: alpha-1.0-py3-none-any.whl\n",
     "  filename: numpy-1.0-py3-none-any.whl\n", "is a wheel of numpy"),
    ("filename-other-version", "  filename: alpha-1.0-py3-none-any.whl\n",
     "  filename: alpha-2.0-py3-none-any.whl\n", "is a wheel of alpha 2.0"),
    ("filename-sdist", "  filename: alpha-1.0-py3-none-any.whl\n", "  filename: alpha-1.0.tar.gz\n",
     "not a wheel file name"),
    ("sha256-short", "  sha256: ", "  sha256: 0", "64 lowercase hex"),
    ("sha256-upper", "  sha256: ", "  sha256: " + "ABCDEF0123456789" * 4 + "\n  #", "64 lowercase hex"),
    ("url-http-remote", "  url: file://", "  url: http://files.example.com/alpha-1.0-py3-none-any.whl\n  #",
     "must be https://"),
    ("url-file-outside", "  url: file://", "  url: file:///etc/alpha-1.0-py3-none-any.whl\n  #",
     "outside the lock's folder"),
    ("url-file-passwd", "  url: file://", "  url: file:///etc/passwd\n  #", "outside the lock's folder"),
    ("url-ftp", "  url: file://", "  url: ftp://example.com/alpha-1.0-py3-none-any.whl\n  #", "must be https://"),
    ("url-credentials", "  url: file://", "  url: https://user:secret@example.com/alpha-1.0-py3-none-any.whl\n  #",
     "credentials in a URL"),
    ("url-other-file", "  url: file://", "  url: https://example.com/evil-9.9-py3-none-any.whl\n  #",
     "is not the lock's filename"),
    ("index-http", "  pypi: https://pypi.org/simple\n", "  pypi: http://pypi.example.com/simple\n",
     "must be https://"),
    ("index-file-outside", "  pypi: https://pypi.org/simple\n", "  pypi: file:///etc/simple\n",
     "outside the lock's folder"),
    ("index-name-template", "  pypi: https://pypi.org/simple\n",
     "  pypi: https://pypi.org/simple\n  \"{{x}}\": https://pypi.org/simple\n", "is not a valid name"),
    ("index-undeclared", "  index: pypi\n", "  index: cu130\n", "is not declared under indexes"),
    ("requires-direct-url", "- alpha==1.0\n", "- alpha @ https://evil.example.com/alpha.whl\n",
     "direct URL requirements are refused"),
    ("requires-invalid", "- alpha==1.0\n", "- alpha[==1.0\n", "invalid requirement"),
    ("requires-number", "- alpha==1.0\n", "- 1.0\n", "expected a string"),
    ("override-short-reason", "  reason: a deliberate deviation, verified by the probes before the switch\n",
     "  reason: because\n", "needs a real reason"),
    ("override-unknown-key", "  use: beta==2.0\n", "  use: beta==2.0\n  force: true\n", "unknown field 'force'"),
    ("patches-absolute", "- patches/sglang-0.5.9\n", "- /etc/sglang-0.5.9\n", "relative path inside the repository"),
    ("patches-dotdot", "- patches/sglang-0.5.9\n", "- ../../etc\n", "relative path inside the repository"),
    ("patches-inner-dotdot", "- patches/sglang-0.5.9\n", "- patches/../../../x\n",
     "relative path inside the repository"),
    ("launch-shell-string", "  launch: [python, -m, sglang.launch_server, --port, '30000']\n",
     "  launch: python -m sglang.launch_server; rm -rf ~\n", "expected the command as a non-empty list"),
    ("launch-empty", "  launch: [python, -m, sglang.launch_server, --port, '30000']\n", "  launch: []\n",
     "expected the command as a non-empty list"),
    ("launch-number-item", "--port, '30000']", "--port, 30000]", "expected a string, got the number"),
    ("launch-newline", "--port, '30000']", "--port, \"30000\\nrm -rf ~\"]", "control characters"),
    ("engine-kind", "  kind: sglang\n", "  kind: vllm\n", "expected one of none, included, sglang"),
    ("engine-port-high", "  port: 30000\n", "  port: 99999\n", "out of range (1–65535)"),
    ("engine-port-zero", "  port: 30000\n", "  port: 0\n", "out of range (1–65535)"),
    ("engine-tp-negative", "  tp: 1\n", "  tp: -1\n", "out of range"),
    ("speculative-steps-negative", "steps: 3,", "steps: -1,", "out of range (1–64)"),
    ("speculative-topk-zero", "topk: 1,", "topk: 0,", "out of range (1–64)"),
    ("speculative-tokens-huge", "num_draft_tokens: 4}", "num_draft_tokens: 100000}", "out of range (1–1024)"),
    ("speculative-steps-string", "steps: 3,", "steps: 'three',", "expected int"),
    ("engine-model-option", "  model: org/model\n", "  model: --trust-remote-code\n", "not starting with '-'"),
    ("engine-architecture-path", "  architecture: LlamaForCausalLM\n", "  architecture: ../../etc/passwd\n",
     "Python class name"),
    ("engine-device", "  tp: 1\n", "  tp: 1\n  device: cuda;reboot\n", "cpu, cuda or cuda:N"),
    ("min-speedup-negative", "  min_speedup: 1.0\n", "  min_speedup: -1\n", "expected a positive number"),
    ("min-speedup-nan", "  min_speedup: 1.0\n", "  min_speedup: .nan\n", "expected a positive number"),
    ("timeout-inf", "  timeout: 600\n", "  timeout: .inf\n", "out of range"),
    ("max-tokens-bool", "  max_tokens: 32\n", "  max_tokens: true\n", "expected a number"),
    ("cuda-source", "    source: wheels\n", "    source: curl\n", "expected one of wheels"),
    ("cuda-home-relative", "    source: wheels\n", "    source: wheels\n    home: cuda\n", "absolute path"),
    ("cuda-home-dotdot", "    source: wheels\n", "    source: wheels\n    home: /usr/../etc\n", "without '..'"),
    ("driver-injection", "    min: 580.65.06\n", "    min: 580; reboot\n", "not a driver version"),
    ("cc-unquoted", "['12.0']", "[12.0]", "expected a string, got the number"),
    ("yaml-python-tag", "  os: ubuntu-24.04\n", "  os: !!python/object/apply:os.system ['id']\n", "invalid YAML"),
    ("yaml-merge-key", "  tp: 1\n", "  tp: 1\n  <<: {port: 1}\n", "only plain keys"),
    ("yaml-complex-key", "  tp: 1\n", "  tp: 1\n  ? [a, b]\n  : 1\n", "only plain keys"),
    ("yaml-syntax", "  tp: 1\n", "  tp: [1\n", "invalid YAML", 40),       # where the parser finds the list unclosed
    ("service-unknown-key", "  health: generate\n", "  health: generate\n  exec_start: /bin/sh\n",
     "unknown field 'exec_start'"),
    ("service-unit-shell", "  unit: sglang.service\n", "  unit: 'sglang.service; reboot'\n",
     "is not a systemd service unit name"),
    ("service-unit-template", "  unit: sglang.service\n", "  unit: \"{{ lookup('pipe','id') }}.service\"\n",
     "is not a systemd service unit name"),
    ("service-unit-option", "  unit: sglang.service\n", "  unit: --user.service\n", "is not a systemd service unit name"),
    ("service-unit-path", "  unit: sglang.service\n", "  unit: ../../etc/x.service\n",
     "is not a systemd service unit name"),
    ("service-unit-not-service", "  unit: sglang.service\n", "  unit: sglang.socket\n",
     "is not a systemd service unit name"),
    ("service-url-path", "  url: http://127.0.0.1:30000\n", "  url: http://127.0.0.1:30000/v1?x=1\n",
     "is not an http(s) URL of a server"),
    ("service-url-scheme", "  url: http://127.0.0.1:30000\n", "  url: file:///etc/passwd\n",
     "is not an http(s) URL of a server"),
    ("service-url-user", "  url: http://127.0.0.1:30000\n", "  url: http://root@127.0.0.1:30000\n",
     "is not an http(s) URL of a server"),
    ("service-url-port", "  url: http://127.0.0.1:30000\n", "  url: http://127.0.0.1:70000\n", "out of range"),
    ("service-health-kind", "  health: generate\n", "  health: curl\n", "expected one of generate, completion"),
    ("service-deadline-zero", "  start_deadline: 900\n", "  start_deadline: 0\n", "out of range"),
    ("service-deadline-string", "  start_deadline: 900\n", "  start_deadline: soon\n", "expected int/float"),
    ("service-concurrency-empty", "concurrency: [1, 4]", "concurrency: []", "at least one concurrency level"),
    ("service-concurrency-zero", "concurrency: [1, 4]", "concurrency: [1, 0]", "out of range"),
    ("service-gate-ratio", "min_tok_s_ratio: 0.95", "min_tok_s_ratio: -1", "out of range"),
    ("service-gateway-worker", "worker: 'http://10.0.0.5:30000'", "worker: 'http://10.0.0.5:30000/workers;x'",
     "is not an http(s) URL of a server"),
]


@pytest.mark.parametrize("case", LOCK_CASES, ids=[c[0] for c in LOCK_CASES])
def test_lock_case(world, case):
    name, old, new, expect, *at = case
    assert old in world.lock_text
    text = world.lock_text.replace(old, new, 1)
    path = world.dir / "locks" / f"{name}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    line = at[0] if at else first_diff_line(world.lock_text, text)
    check_refused(world, ["lock", "check", "--offline", path], f"{path}:{line}:", expect)


def test_bad_lock_refused_before_any_host_is_contacted(world):
    path = world.dir / "locks" / "plan-bad.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(world.lock_text.replace("  port: 30000\n", "  port: 99999\n"))
    line = first_diff_line(world.lock_text, path.read_text())
    out = world.dir / "plan.json"
    for verb in (["plan", *world.host_args(), "--lock", path, "--out", out],
                 ["apply", *world.host_args(), "--lock", path],
                 ["lock", "resolve", path]):
        check_refused(world, verb, f"{path}:{line}:", "out of range")
    assert not out.exists()


def test_base_lock_is_valid_and_shows_launch(world):
    path = world.dir / "locks" / "base.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(world.lock_text)
    r = CliRunner().invoke(app, ["lock", "check", "--offline", str(path)])
    assert r.exit_code == 0, r.output
    assert "engine.launch is a command that will run on the host" in r.output
    assert "python -m sglang.launch_server --port 30000" in r.output


# Whole-document defects: where is the file (and the line when there is one).
def _deep(n: int) -> str:
    return "lock: 1\nname: x\nplatform: {python: '3.11'}\nprobes: " + "[" * n + "]" * n + "\n"


DOC_CASES = [
    ("deep-flow", lambda: _deep(100_000), 4, "nested deeper than 64 levels"),
    ("deep-block", lambda: "lock: 1\nx:\n" + "".join("  " * i + "- \n" for i in range(1, 200)), 66,
     "nested deeper than 64 levels"),
    ("alias-bomb", lambda: "a: &a [x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n" + "".join(
        f"c{i}: [*b, *b, *b, *b, *b, *b, *b, *b]\n" for i in range(9)), None, "YAML aliases"),
    ("not-a-mapping", lambda: "- lock: 1\n", 1, "expected a lock (a YAML mapping), got a list"),
    ("empty", lambda: "", 1, "expected a lock (a YAML mapping), got nothing"),
    ("too-large", lambda: "lock: 1\n" + "# padding\n" * 500_000, None, "file larger than"),
]


@pytest.mark.parametrize("case", DOC_CASES, ids=[c[0] for c in DOC_CASES])
def test_document_case(world, case):
    name, make, line, expect = case
    path = world.dir / "locks" / f"{name}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(make())
    check_refused(world, ["lock", "check", "--offline", path], f"{path}:{line}:" if line else f"{path}:", expect)


def test_lock_read_back_from_a_host_is_not_judged_against_this_folder(world, monkeypatch):
    """A generation's lock.yaml (text from the host) is never built from: its file:// URLs are checked for
    form only, so probes of a generation built from wheels beside its lock still read it."""
    monkeypatch.delenv(lockmod.WHEELHOUSE_ENV)
    text = world.lock_text.replace(world.lock_text.split("  url: ")[1].split("\n")[0],
                                   "file:///srv/locks/wheels/alpha-1.0-py3-none-any.whl")
    assert lockmod.loads(text, "0001-corpus/lock.yaml").packages[0].url.startswith("file:///srv/")
    with pytest.raises(lockmod.LockError, match="must be an absolute path without '..'"):
        lockmod.loads(text.replace("file:///srv/", "file:///srv/../"), "0001-corpus/lock.yaml")


def test_not_utf8(world):
    path = world.dir / "locks" / "latin1.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(world.lock_text.replace("corpus", "corp\xe9s").encode("latin-1"))
    check_refused(world, ["lock", "check", "--offline", path], f"{path}:", "not UTF-8")


# ---------------------------------------------------------------- saved plans

def base_plan(world) -> dict:
    lk = lockmod.loads(world.lock_text, str(world.dir / "locks" / "base.yaml"))
    p = Plan(host="corpus-host", lock=lk.raw, lock_name=lk.name, lock_digest=lk.digest, facts_digest="0" * 64,
             base=None, changes=[Change("package", "alpha", "add", None, "1.0")])
    return json.loads(json.dumps(p.to_json()))


def _edit(key, value):
    def f(d):
        d[key] = value
        return json.dumps(d)
    return f


def _lock_edit(fn):
    def f(d):
        fn(d["lock"])
        return json.dumps(d)
    return f


def _trailing_comma(d) -> str:
    text = json.dumps(d, indent=1)
    return text[:-2] + ",\n}"          # `"format": 1,\n}` on the last two lines


PLAN_CASES = [
    ("syntax", _trailing_comma, "invalid JSON", True),
    ("duplicate-key", lambda d: json.dumps(d)[:-1] + ', "host": "other"}', "duplicate key 'host'", False),
    ("unknown-field", _edit("run_before", "touch /tmp/x"), "run_before: unknown field", False),
    ("format-future", _edit("format", PLAN_FORMAT + 1), f"unsupported plan format {PLAN_FORMAT + 1}", False),
    ("format-true", _edit("format", True), "unsupported plan format True", False),
    ("digest-not-hex", _edit("lock_digest", "z" * 64), "lock_digest: not a sha256 digest", False),
    ("noop-string", _edit("noop", "no"), "noop: wrong type", False),
    ("change-unknown-action", _edit("changes", [{"category": "package", "name": "a", "action": "exec"}]),
     "unknown category or action", False),
    ("change-missing-name", _edit("changes", [{"category": "package", "action": "add"}]), "changes[0]", False),
    ("lock-edited", _lock_edit(lambda lk: lk.update(description="edited after the plan")), "edited after planning",
     False),
    ("lock-template", _lock_edit(lambda lk: lk.update(name="{{ lookup('pipe','id') }}")), "is not a valid name",
     False),
    ("lock-unknown-key", _lock_edit(lambda lk: lk["engine"].update(pre_launch="id")), "unknown field 'pre_launch'",
     False),
    ("lock-file-url-outside", _lock_edit(lambda lk: lk["packages"][0].update(
        url="file:///etc/alpha-1.0-py3-none-any.whl")), "outside the lock's folder", False),
    ("not-an-object", lambda d: json.dumps([d, "plan"]), "expected a JSON object", False),
    ("empty-fleet", lambda d: "[]", "holds no host's plan", False),
    ("deep", lambda d: "[" * 100_000 + "]" * 100_000, "nested deeper than 64 levels", False),
]


def test_base_plan_is_valid(world):
    path = world.dir / "plans" / "base.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(base_plan(world)))
    assert [p.lock_name for p in load_plans(path)] == ["corpus"]


@pytest.mark.parametrize("case", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_saved_plan_case(world, case):
    name, make, expect, has_line = case
    path = world.dir / "plans" / f"{name}.json"
    path.parent.mkdir(exist_ok=True)
    text = make(base_plan(world))
    path.write_text(text)
    where = f"{path}:{len(text.splitlines())}:" if has_line else f"{path}:"
    check_refused(world, ["apply", *world.host_args(), "--plan", path], where, expect)


# ---------------------------------------------------------------- patch series

def series_dir(world, name: str, series_text: str, patch_text: str, patch_name: str = "0001-alpha.patch") -> Path:
    d = world.dir / "series" / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "series.yaml").write_text(series_text)
    (d / patch_name).write_text(patch_text)
    return d


BASE_SERIES = (HERE / "series.yaml").read_text()
BASE_PATCH = (HERE / "0001-alpha.patch").read_text()
SERIES_CASES = [
    # (id, series.yaml (old, new), patch (old, new), where: "series" line or "patch", expect)
    ("unknown-key", ("package: alpha\n", "package: alpha\npost_apply: id\n"), None, "series",
     "unknown field 'post_apply'"),
    ("duplicate-key", ("package: alpha\n", "package: alpha\npackage: numpy\n"), None, "series", "duplicate key"),
    ("series-true", ("series: 1\n", "series: true\n"), None, "series", "`series: 1`"),
    ("package-invalid", ("package: alpha\n", "package: \"alpha; id\"\n"), None, "series", "not a valid project name"),
    ("version-invalid", ('version: "==1.0"\n', 'version: "=>1.0"\n'), None, "series", "invalid version specifier"),
    ("file-traversal", ("  - file: 0001-alpha.patch\n", "  - file: ../0001-alpha.patch\n"), None, "series",
     "plain file name"),
    ("patch-unknown-key", ("    applies_to: alpha==1.0\n", "    applies_to: alpha==1.0\n    run: id\n"), None,
     "series", "unknown field 'run'"),
    ("applies-to-invalid", ("    applies_to: alpha==1.0\n", "    applies_to: alpha=1.0\n"), None, "series",
     "invalid requirement"),
    ("target-dotdot", None, ("--- a/alpha/__init__.py\n+++ b/alpha/__init__.py\n",
                             "--- a/alpha/../../../../etc/profile\n+++ b/alpha/../../../../etc/profile\n"), "patch",
     "'..' component"),
    ("target-absolute", None, ("--- a/alpha/__init__.py\n+++ b/alpha/__init__.py\n",
                               "--- /etc/profile\n+++ /etc/profile\n"), "patch", "relative to site-packages"),
    ("target-create", None, ("--- a/alpha/__init__.py\n", "--- /dev/null\n"), "patch", "creating or deleting"),
    ("target-rename", None, ("+++ b/alpha/__init__.py\n", "+++ b/alpha/other.py\n"), "patch", "renames"),
    ("hunk-count", None, ("@@ -1 +1,2 @@\n", "@@ -1 +1,3 @@\n"), "patch", "wrong line count"),
]


def test_base_series_is_valid(world):
    d = series_dir(world, "base", BASE_SERIES, BASE_PATCH)
    r = CliRunner().invoke(app, ["patches", "check", "--series", str(d), "--site-packages", str(world.sp)])
    assert r.exit_code == 0, r.output
    assert "would-apply" in r.output and "alpha/__init__.py" in r.output       # the files each patch touches


@pytest.mark.parametrize("case", SERIES_CASES, ids=[c[0] for c in SERIES_CASES])
def test_series_case(world, case):
    name, s_edit, p_edit, where, expect = case
    s_text, p_text = BASE_SERIES, BASE_PATCH
    if s_edit:
        assert s_edit[0] in s_text
        s_text = s_text.replace(*s_edit, 1)
    if p_edit:
        assert p_edit[0] in p_text
        p_text = p_text.replace(*p_edit, 1)
    d = series_dir(world, name, s_text, p_text)
    if where == "series":
        at = f"{d / 'series.yaml'}:{first_diff_line(BASE_SERIES, s_text)}:"
    else:
        at = f"{d / 'series.yaml'}:7:"           # the `file:` entry naming the broken diff
    check_refused(world, ["patches", "check", *world.host_args(), "--series", d, "--site-packages", world.sp], at, expect)


def test_series_file_symlinked_outside_refused(world, tmp_path):
    outside = tmp_path / "elsewhere.patch"
    outside.write_text(BASE_PATCH)
    d = world.dir / "series" / "symlink"
    d.mkdir(parents=True, exist_ok=True)
    (d / "series.yaml").write_text(BASE_SERIES)
    if not (d / "0001-alpha.patch").is_symlink():
        os.symlink(outside, d / "0001-alpha.patch")
    check_refused(world, ["patches", "check", "--series", d, "--site-packages", world.sp], f"{d / 'series.yaml'}:7:",
            "no path, no link")


# ---------------------------------------------------------------- CLI arguments

ARG_CASES = [
    ("port-high", ["hosts", "trust", "h:99999", "--known-hosts", "KH"], "host 'h:99999'", "out of range (1–65535)"),
    ("port-zero", ["plan", "u@127.0.0.1:0", "--lock", "LOCK", "--known-hosts", "KH"], "host 'u@127.0.0.1:0'",
     "out of range"),
    ("port-text", ["hosts", "trust", "h:abc", "--known-hosts", "KH"], "host 'h:abc'", "bad port 'abc'"),
    ("port-empty", ["hosts", "trust", "h:", "--known-hosts", "KH"], "host 'h:'", "bad port ''"),
    ("port-markup", ["hosts", "trust", "x:[/x]", "--known-hosts", "KH"], "host 'x:[/x]'", "bad port '[/x]'"),
    ("port-ipv6-high", ["hosts", "trust", "[::1]:70000", "--known-hosts", "KH"], "host '[::1]:70000'",
     "out of range"),
    ("port-unicode-digits", ["hosts", "trust", "h:２２", "--known-hosts", "KH"], "host 'h:２２'", "bad port"),
    ("host-shell", ["plan", "h;reboot", "--lock", "LOCK", "--known-hosts", "KH"], "host 'h;reboot'",
     "bad host name"),
    ("host-option", ["plan", "u@-oProxyCommand=id", "--lock", "LOCK", "--known-hosts", "KH"],
     "host 'u@-oProxyCommand=id'", "bad host name"),
    ("host-space-user", ["plan", "a b@h", "--lock", "LOCK", "--known-hosts", "KH"], "host 'a b@h'", "bad user name"),
    ("host-template", ["hosts", "trust", "{{x}}", "--known-hosts", "KH"], "host '{{x}}'", "bad host name"),
    ("lock-markup-path", ["plan", "local", "--lock", "[six==1.17.0]"], "[six==1.17.0]", "cannot read"),
    ("lock-closing-tag", ["lock", "check", "[/x].yaml"], "[/x].yaml", "cannot read"),
    ("lock-emoji-path", ["lock", "check", "host:abc:"], "host:abc:", "cannot read"),
    ("plan-missing", ["apply", "local", "--plan", "/nonexistent/plan.json"], "/nonexistent/plan.json",
     "cannot read"),
    ("installer", ["apply", "local", "--lock", "LOCK", "--installer", "curl|sh"], "--installer", "'curl|sh'"),
    ("root-relative", ["history", "local", "--root", "relative/root"], "--root", "must be an absolute path"),
    ("root-dotdot", ["plan", "local", "--lock", "LOCK", "--root", "/opt/../etc"], "--root", "without '..'"),
    ("root-slash", ["rollback", "local", "--root", "/"], "--root", "other than /"),
    ("no-host", ["rollback"], "HOST", "name a host"),
    ("plan-out-unwritable", ["plan", "local", "--lock", "LOCK", "--root", "ROOT", "--out", "/nonexistent/plan.json"],
     "/nonexistent/plan.json", "No such file or directory"),
]


@pytest.mark.parametrize("case", ARG_CASES, ids=[c[0] for c in ARG_CASES])
def test_argument_case(world, case):
    name, args, where, expect = case
    good = world.dir / "locks" / "base.yaml"
    good.parent.mkdir(exist_ok=True)
    good.write_text(world.lock_text)
    subst = {"LOCK": str(good), "KH": str(world.dir / "known_hosts"), "ROOT": str(world.dir / "no-root")}
    check_refused(world, [subst.get(a, a) for a in args], where, expect)


# ---------------------------------------------------------------- inventories (what provision itself parses)

BASE_INVENTORY = "[gpus]\ngpu1 ansible_host=127.0.0.1 ansible_port=PORT ansible_user=corpus\n"
INVENTORY_CASES = [
    ("port-high", ("ansible_port=PORT", "ansible_port=99999"), "ansible_port: port 99999 is out of range"),
    ("port-zero", ("ansible_port=PORT", "ansible_port=0"), "ansible_port: port 0 is out of range"),
    ("port-text", ("ansible_port=PORT", "ansible_port=ssh"), "ansible_port: bad port 'ssh'"),
    ("host-option", ("ansible_host=127.0.0.1", "ansible_host=-oProxyCommand=id"), "bad host name"),
    ("user-option", ("ansible_user=corpus", "ansible_user=-oProxyCommand=id"), "bad user name"),
]


def inventory(world, name: str, text: str) -> Path:
    path = world.dir / "inventories" / f"{name}.ini"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text.replace("PORT", str(world.host.getsockname()[1])))
    return path


def test_base_inventory_is_valid(world):
    from provision.inventory import load_inventory

    [t] = load_inventory(inventory(world, "base", BASE_INVENTORY), known_hosts=world.dir / "known_hosts")
    assert (t.host, t.port, t.user) == ("127.0.0.1", world.host.getsockname()[1], "corpus")


@pytest.mark.parametrize("case", INVENTORY_CASES, ids=[c[0] for c in INVENTORY_CASES])
def test_inventory_case(world, case):
    name, (old, new), expect = case
    path = inventory(world, name, BASE_INVENTORY.replace(old, new))
    good = world.dir / "locks" / "base.yaml"
    good.parent.mkdir(exist_ok=True)
    good.write_text(world.lock_text)
    check_refused(world, ["plan", "-i", path, "--lock", good, "--known-hosts", world.dir / "known_hosts"],
            f"{path}: host gpu1", expect)


# ---------------------------------------------------------------- what ships passes the same checks

def test_shipped_locks_and_series_pass_the_strict_schema():
    from provision import patches
    from provision.bundled import DEMO_LOCKS, PATCHES

    repo = Path(__file__).resolve().parent.parent
    locks = sorted((repo / "lockfiles").glob("*.yaml")) + sorted(DEMO_LOCKS.glob("*.yaml"))
    assert len(locks) >= 6
    for path in locks:
        lk = lockmod.load(path)
        for rel in lk.patches:
            assert patches.load_series(lk.resolve_path(rel)).patches
    shipped = [s.name for s in map(patches.load_series, patches.discover_series(PATCHES))]
    assert shipped == ["sglang-0.5.23", "sglang-0.5.9"]
