"""The declared host steps' Ansible modules: each file is what its step's declaration writes, Ansible reads its
options and RETURN as declared, and what the host answers is what RETURN documents."""
import json
import os
import subprocess
import sys
from dataclasses import fields

from provision import module_files
from provision.bundled import PLAYBOOKS
from provision.steps import as_json
from provision.steps.state import STEPS


def test_each_declared_steps_module_file_is_what_its_declaration_writes():
    assert [s.name for s in module_files.declared_steps()] == ["status", "history", "logs", "rollback", "switch",
                                                                "gc"]
    assert module_files.stale() == []


def test_a_changed_declaration_is_a_stale_module_file(monkeypatch, tmp_path):
    """The check fails when a declaration and its file part: a field's description changed in the declaration."""
    for s in module_files.declared_steps():
        (tmp_path / f"{s.module_name}.py").write_text((PLAYBOOKS / "library" / f"{s.module_name}.py").read_text())
    monkeypatch.setattr(module_files, "LIBRARY", tmp_path)
    assert module_files.stale() == []
    text = (tmp_path / "provision_status.py").read_text()
    (tmp_path / "provision_status.py").write_text(text.replace("each hard-linked file once", "each file"))
    assert module_files.stale() == [tmp_path / "provision_status.py"]
    assert module_files.main(["--check"]) == 1
    assert module_files.main([]) == 0 and module_files.stale() == []


def test_ansible_reads_each_declared_module_as_its_step_declares_it():
    """ansible-doc parses each generated module; its options are the step's Args (type, default, required) beside
    the shared `root`, and its RETURN keys are the step's Reply fields (warnings as Ansible's agent_warnings)."""
    names = [s.module_name for s in module_files.declared_steps()]
    doc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ansible-doc"), "-t", "module", "-M",
                          str(PLAYBOOKS / "library"), "--json", *names], capture_output=True, text=True,
                         env={**os.environ, "ANSIBLE_NOCOLOR": "1",
                              "ANSIBLE_DOC_FRAGMENT_PLUGINS": str(PLAYBOOKS / "doc_fragments")})
    assert doc.returncode == 0 and "ERROR" not in doc.stderr, doc.stderr
    docs = json.loads(doc.stdout)
    for s in module_files.declared_steps():
        d = docs[s.module_name]
        opts = {k: v for k, v in d["doc"]["options"].items() if k not in ("root", "known_hosts", "progress")}
        declared = {name: spec for name, spec, _ in module_files.options(s)}
        assert set(opts) == set(declared), s.name
        for name, spec in declared.items():
            assert opts[name]["type"] == spec["type"], (s.name, name)
            assert opts[name].get("default") == spec.get("default"), (s.name, name)
            assert bool(opts[name].get("required")) == bool(spec.get("required")), (s.name, name)
        want = {("agent_warnings" if f.metadata.get("key", f.name) == "warnings" else f.metadata.get("key", f.name))
                for f in fields(s.reply) if not f.metadata.get("rest") and not f.metadata.get("given")}
        assert set(d["return"]) == want, s.name


def test_what_the_host_answers_is_what_return_documents(tmp_path):
    """The state agent's replies on a real root carry exactly the keys their steps declare."""
    from provision.agent import state

    root = str(tmp_path / "root")
    os.makedirs(root)
    for step, payload in ((STEPS[0], {}), (STEPS[1], {"limit": 5})):
        out = state.OPS[step.op](dict(payload, op=step.op, root=root))
        assert "error" not in out, out
        assert set(out) == set(as_json(step.reply.given(out))), step.name
        assert step.reply.of(out, "h").as_json() == out
