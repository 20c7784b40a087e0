"""The Ansible module files of the declared host steps (playbooks/library/provision_NAME.py), written from their
declarations: DOCUMENTATION (options from the step's Args), RETURN (from its Reply) and ARGUMENT_SPEC. A module
that runs on the host hands its arguments to the step (module_utils/provision/step.py: `main`); one whose work
runs in its action plugin checks them and says where its work runs.

    python -m provision.module_files            write the files
    python -m provision.module_files --check    exit 1 naming each file that differs from its declaration
"""
from __future__ import annotations

import json
import sys
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

LIBRARY = Path(__file__).resolve().parent / "playbooks" / "library"
SCALARS = {"str": "str", "int": "int", "bool": "bool", "float": "float", "dict": "dict", "list": "list"}


def declared_steps():
    from .steps.state import STEPS
    return [s for s in STEPS if s.module]


def _q(text: str) -> str:
    """A YAML scalar that is the text itself (a JSON string is a YAML double-quoted one)."""
    return json.dumps(text)


def _kind(annotation: str, scope: dict):
    """(Ansible's type, its elements' type or None, the dataclass it holds or None) of a field's annotation."""
    a = annotation.removesuffix(" | None")
    if a in scope and is_dataclass(scope[a]):
        return "dict", None, scope[a]
    if a.startswith("list[") or a.startswith("dict["):
        item = a[5:-1].rpartition(", ")[2]
        inner = scope.get(item) if item in scope and is_dataclass(scope.get(item)) else None
        if a.startswith("list["):
            return "list", "dict" if inner else SCALARS.get(item, "raw"), inner
        return "dict", None, None
    return SCALARS[a], None, None


def _default(f):
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def options(step) -> list[tuple[str, dict, str]]:
    """(name, argument spec, description) of each of the step's module options, in declaration order."""
    scope = vars(sys.modules[step.args.__module__])
    out = []
    for f in fields(step.args):
        if f.metadata.get("option", True) is False:
            continue
        kind, elements, _ = _kind(f.type, scope)
        spec = {"type": "path" if f.metadata.get("path") else kind}
        if elements:
            spec["elements"] = elements
        d = _default(f)
        if d is MISSING:
            spec["required"] = True
        elif d is not None:
            spec["default"] = d
        out.append((f.metadata.get("key", f.name), spec, f.metadata["doc"]))
    return out


def _returns(cls, scope: dict) -> list[str]:
    """RETURN's lines: one field a line, in flow style (a dataclass's fields as its `contains`)."""
    return [f"{key}: {entry}" for key, entry in _entries(cls, scope)]


def _entries(cls, scope: dict) -> list[tuple[str, str]]:
    out = []
    for f in fields(cls):
        if f.metadata.get("rest") or f.metadata.get("given"):
            continue
        key = f.metadata.get("key", f.name)
        key = "agent_warnings" if key == "warnings" else key     # Ansible's own key: the task's warnings
        kind, elements, inner = _kind(f.type, scope)
        parts = [f"description: {_q(f.metadata['doc'])}", f"type: {kind}"]
        if elements:
            parts.append(f"elements: {elements}")
        parts.append("returned: always")
        if inner is not None:
            parts.append("contains: {" + ", ".join(f"{k}: {e}" for k, e in _entries(inner, scope)) + "}")
        out.append((key, "{" + ", ".join(parts) + "}"))
    return out


def render(step) -> str:
    """The whole text of the step's module file."""
    scope = vars(sys.modules[step.reply.__module__])
    opts = options(step)
    doc = [f"module: {step.module_name}", f"short_description: {_q(step.summary)}", "description:"]
    doc += [f"  - {_q(d)}" for d in step.description]
    doc.append(f"extends_documentation_fragment: {'provision' if step.module == 'host' else 'provision.step'}")
    if opts:
        doc.append("options:")
        for name, spec, text in opts:
            doc += [f"  {name}:", f"    description: {_q(text)}"]
            doc += [f"    {k}: {v if isinstance(v, str) else json.dumps(v)}" for k, v in spec.items()]
    where = ("runs on the host, in the module" if step.module == "host" else
             "runs in its action plugin (action_plugins/%s.py), on the controller" % step.module_name)
    spec_text = "{" + ",\n                 ".join(f"{n!r}: {s!r}" for n, s, _ in opts) + "}"
    main = (f'    from ansible.module_utils.provision.step import main as run_step\n\n'
            f'    run_step("{step.name}", ARGUMENT_SPEC)\n') if step.module == "host" else \
        (f'    from ansible.module_utils.provision.spec import through_plugin\n\n'
         f'    through_plugin("{step.module_name}", ARGUMENT_SPEC)\n')
    return (f'#!/usr/bin/python\n'
            f'"""Ansible module {step.module_name}: {step.summary[0].lower()}{step.summary[1:]}. Its work {where}.\n'
            f'Written from the step\'s declaration (provision/steps/{step.args.__module__.rsplit(".", 1)[1]}.py) by '
            f'`python -m provision.module_files`:\nedit the declaration, not this file."""\n\n'
            f'DOCUMENTATION = r"""\n' + "\n".join(doc) + '\n"""\n\n'
            f'RETURN = r"""\n' + "\n".join(_returns(step.reply, scope)) + '\n"""\n\n'
            f'ARGUMENT_SPEC = {spec_text}   # its own; the shared ones in module_utils/provision/spec.py\n\n\n'
            f'def main():\n{main}\n\n'
            f'if __name__ == "__main__":\n    main()\n')


def stale() -> list[Path]:
    """The module files that are not what their declarations write."""
    return [LIBRARY / f"{s.module_name}.py" for s in declared_steps()
            if not (LIBRARY / f"{s.module_name}.py").is_file()
            or (LIBRARY / f"{s.module_name}.py").read_text() != render(s)]


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        bad = stale()
        for p in bad:
            print(f"{p}: differs from its step's declaration (python -m provision.module_files writes it)")
        return 1 if bad else 0
    for s in declared_steps():
        (LIBRARY / f"{s.module_name}.py").write_text(render(s))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
