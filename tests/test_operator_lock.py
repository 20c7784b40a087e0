"""`lock resolve` as uv does it: it writes only the machine's sections (packages, unresolved), keeps
what people wrote with their comments, and `--check` exits non-zero when the lock is stale."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from provision import lock as lockmod
from provision.cli import app
from test_resolve import cache, index, write_lock  # noqa: F401  (fixtures)

PEOPLE = """lock: 1   # reviewed by the platform team
name: t
# what we run
platform:
  python: '3.12'   # the hosts' python
  cuda: {version: '13.0.1', source: none}
indexes:
  local: file://INDEX/simple
requires:
- app==1.0   # the service
packages: []
engine: {kind: none}   # no engine on this stack
probes: {}
"""


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_resolve_keeps_what_people_wrote_and_check_detects_stale(index, tmp_path):
    path = tmp_path / "l.yaml"
    path.write_text(PEOPLE.replace("INDEX", str(index)))
    r = run("lock", "resolve", path, "--check")
    assert r.exit_code == 1 and "+ app==1.0" in r.output and "stale" in r.output

    r = run("lock", "resolve", path)
    assert r.exit_code == 0, r.output
    text = path.read_text()
    for line in PEOPLE.replace("INDEX", str(index)).splitlines():
        if not line.startswith("packages:"):
            assert line in text                          # every people's line, comments included
    assert {p.name for p in lockmod.load(path).packages} == {"app", "lib", "gpu", "gpudep"}

    r = run("lock", "resolve", path, "--check", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["stale"] is False
    before = path.read_text()
    assert run("lock", "resolve", path).exit_code == 0 and path.read_text() == before   # idempotent

    path.write_text(before.replace("- app==1.0   # the service", "- lib==1.0   # the service, later"))
    r = run("lock", "resolve", path, "--check")
    assert r.exit_code == 1 and "- app==1.0" in r.output
    assert path.read_text().count("# the service, later") == 1          # --check wrote nothing


def test_resolve_appends_missing_sections(index, tmp_path):
    path = write_lock(tmp_path / "l.yaml", ["lib==1.0"], {"local": f"file://{index}/simple"})
    assert run("lock", "resolve", path).exit_code == 0
    lk = lockmod.load(path)
    assert [p.name for p in lk.packages] == ["lib"] and lk.raw["unresolved"] == []


def test_template_in_requires_is_one_line_naming_its_line(tmp_path):
    path = tmp_path / "lock.yaml"
    path.write_text(PEOPLE.replace("INDEX", str(tmp_path)).replace("- app==1.0   # the service",
                                                                   "- app==1.0\n- \"{{ lookup('pipe', 'id') }}\""))
    r = run("lock", "check", path)
    assert r.exit_code == 2
    assert r.output.strip() == (f"error: {path}:11: requires.1: invalid requirement "
                                f"\"{{{{ lookup('pipe', 'id') }}}}\": "
                                "Expected package name at the start of dependency specifier")
