"""What provision hands Ansible as variables reaches a task as the very string it was: never rendered as a
template, never re-read as another YAML type (ansible-core 2.19 reads `!unsafe "0013"` as the int 11)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from provision import apply as applymod, lock as lockmod
from provision.runner import write_vars
from provision.transport import Local, Target
from wheelhouse import make_wheel, write_lock

ROOT = Path(__file__).resolve().parent.parent
TRICKY = ["0013", "0x13", "1.10", "1e3", "true", "no", "null", "~", "", "2026-12-07", "{{ lookup('env','HOME') }}",
          "{% raw %}x", "{# c #}", "a: b", "- x", "=", "<<", "13"]


def test_every_string_reaches_a_real_play_as_itself(tmp_path):
    values = {f"v{i}": s for i, s in enumerate(TRICKY)}
    path = write_vars(tmp_path / "vars.yml", dict(values, nested={"list": TRICKY}))
    out = tmp_path / "seen.json"
    play = tmp_path / "play.yml"
    play.write_text("- hosts: localhost\n  gather_facts: false\n  tasks:\n"
                    "    - ansible.builtin.copy:\n        dest: " + json.dumps(str(out)) + "\n"
                    "        content: \"{{ {'values': [" + ", ".join(f"v{i}" for i in range(len(TRICKY)))
                    + "], 'types': [" + ", ".join(f"v{i} | type_debug" for i in range(len(TRICKY)))
                    + "], 'nested': nested.list} | to_json }}\"\n")
    p = subprocess.run(["ansible-playbook", "-i", "localhost,", "-c", "local", str(play), "-e", f"@{path}",
                        "-e", f"ansible_python_interpreter={sys.executable}"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    seen = json.loads(out.read_text())
    assert seen["values"] == TRICKY and seen["nested"] == TRICKY
    assert set(seen["types"]) <= {"str", "AnsibleUnsafeText", "_AnsibleTaggedStr"}, seen["types"]


def test_rollback_to_a_number_written_with_leading_zeros_is_that_generation(tmp_path):
    """`rollback --to 0010` (how the tool prints generation numbers) goes to generation 10, not 8 (octal 0010)."""
    root = tmp_path / "root"
    tr = Local(Target(host="local", root=str(root)))
    ids = [applymod.apply(tr, lockmod.load(write_lock(tmp_path / f"l{i}.yaml", f"l{i}",
                                                      [make_wheel(tmp_path / "wh", f"pkg{i}", "1.0")]))).generation
           for i in range(1, 12)]
    assert ids[9].startswith("0010-") and ids[7].startswith("0008-")
    p = subprocess.run([sys.executable, "-m", "provision.cli", "rollback", "--local", "--root", str(root),
                        "--to", "0010", "--json"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (root / "current").resolve().name == ids[9], (root / "current").resolve().name
