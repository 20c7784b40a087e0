"""The host steps, each declared once: what it is given (an `Args` dataclass), what it answers (a `Reply` dataclass),
and the `Step` that names them, its host operation and its Ansible module. Standard library only: the host builds
its replies from these classes and the controller reads them back through the same classes (`check`).

A field's metadata says what it means (`doc`, the text of the module's DOCUMENTATION and RETURN) and what its value
must be: `path` (an absolute host path), `pattern` (with `what` it is), `key` (its JSON name when that is not a
Python name), `given` (set by the controller, never sent by the host), `rest` (a dict field that holds every key
the class does not declare: what the host wrote that no field names, kept as written), `option=False` (an
argument that is not its module's option)."""
from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, field, fields, is_dataclass

GENERATION_RE = re.compile(r"^\d{4}-[A-Za-z0-9][A-Za-z0-9._+-]{0,99}\Z")   # NNNN-<lock name>, as the store makes it
VERDICT_RE = re.compile(r"^(clean|drift)\Z")


def doc(text, **meta):
    """A field's metadata: its description, and what its value must be (see the module's docstring)."""
    return dict(meta, doc=text)


def gen_id(text, **meta):
    """A field that names a generation (NNNN-<lock name>)."""
    return doc(text, pattern=GENERATION_RE, what="a generation id", **meta)


def clean_or_drift(text, **meta):
    """A field that holds a verify verdict: clean or drift."""
    return doc(text, pattern=VERDICT_RE, what="clean or drift", **meta)


def host_path(path):
    """An absolute path on the host that no shell or path join could read otherwise: no NUL, newline or `..`."""
    return (isinstance(path, str) and path.startswith("/") and not {"\0", "\n"} & set(path)
            and ".." not in path.split("/"))


class Shape:
    """A declared Args or Reply: `given(data)` reads one from JSON (an operation's input, a record the host
    keeps), each field checked (ValueError naming the field); `as_json` gives it back, each field under its key."""

    @classmethod
    def given(cls, data):
        def bad(name, why):
            raise ValueError("%s: %s" % (name, why))
        return check(cls, data, bad, top=cls.__name__)

    def as_json(self):
        return as_json(self)


class Reply(Shape):
    """A host step's reply. `of(data, host)` reads one on the controller (provision.replies: a reply of the wrong
    shape is one ReplyError line naming the host, the step and the field); STEP names the step in that line."""

    STEP = "agent"

    @classmethod
    def of(cls, data, host):
        import importlib        # the controller's reader (by name: the host never ships it)
        return importlib.import_module("provision.replies").read(cls, data, host, cls.STEP)

    def to_json(self):
        return as_json(self)


class Args(Shape):
    """A host step's arguments, as the controller sends them and the host reads them (`Args.given`). A field
    whose metadata says `option=False` is not one of its module's options (e.g. `dry_run`: the task's check
    mode)."""


@dataclass(frozen=True)
class Step:
    """One host step: its name, the agent operation that runs it (`agent`, `op`), what it is given and answers,
    and its Ansible module (`module`: "host", run in the module on the host; "plugin", run by its action plugin on
    the controller; None, no module), described by `summary` and `description` (the module's DOCUMENTATION)."""
    name: str
    agent: str
    op: str
    args: type
    reply: type
    summary: str
    description: tuple = ()
    module: str | None = "host"
    check_mode: str = "reads"        # "reads": check mode changes nothing; "dry_run": it is the step's dry run

    @property
    def module_name(self):
        return "provision_" + self.name


# ---------------------------------------------------------------- one checked reader, both sides

def check(cls, data, bad, given=None, raw=False, top="reply"):
    """An instance of dataclass `cls` from `data`, each field checked against its annotation (str, int, float,
    bool, list[X], dict[str, X], X | None, a dataclass of `cls`'s module) and its metadata; a field without a
    default must be there. `bad(name, why)` is called (and must raise) for the first field that is wrong. `given`
    fields are set, not read. `raw`: each instance keeps the object it was read from (as `_raw`); `top` names
    the whole in `bad` (when it is not an object)."""
    import sys
    if not isinstance(data, dict):
        bad(top, "expected an object, not %s" % type(data).__name__)
    return _read(cls, data, "", bad, vars(sys.modules[cls.__module__]), given or {}, raw)


def _read(cls, data, name, bad, scope, given, raw=False):
    if not isinstance(data, dict):
        bad(name or "reply", "expected an object, not %s" % type(data).__name__)
    out = dict(given)
    known = set()
    rest = None
    for f in fields(cls):
        key = f.metadata.get("key", f.name)
        known.add(key)
        if f.metadata.get("rest"):
            rest = f.name
            continue
        if f.metadata.get("given") or f.name in given or data.get(key) is None:
            if f.name not in given and f.default is MISSING and f.default_factory is MISSING:
                bad("%s.%s" % (name, key) if name else key, "missing")
            continue
        out[f.name] = _value(f.type, data[key], "%s.%s" % (name, key) if name else key, bad, f.metadata, scope,
                             raw)
    if rest:
        out[rest] = {k: v for k, v in data.items() if k not in known}
    made = cls(**out)
    if raw:
        object.__setattr__(made, "_raw", data)
    return made


KINDS = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float)}
SAYS = {"str": "a string", "int": "a whole number", "bool": "true or false", "float": "a number"}


def _value(kind, v, name, bad, meta, scope, raw):
    if v is None and kind.endswith(" | None"):
        return None
    kind = kind[:-len(" | None")] if kind.endswith(" | None") else kind
    if kind in scope and is_dataclass(scope[kind]):
        return _read(scope[kind], v, name, bad, scope, {}, raw)
    if kind.startswith(("list", "dict")):
        typ = dict if kind.startswith("dict") else list
        item = kind[5:-1].rpartition(", ")[2]            # list[X], dict[str, X]
        if not isinstance(v, typ):
            bad(name, "expected %s, not %s" % ("a list" if typ is list else "an object", type(v).__name__))
        if not item:
            return v
        if typ is list:
            return [_value(item, x, "%s[%d]" % (name, i), bad, meta, scope, raw) for i, x in enumerate(v)]
        return {k: _value(item, x, "%s[%r]" % (name, k), bad, meta, scope, raw) for k, x in v.items()}
    if type(v) not in KINDS[kind]:
        bad(name, "expected %s, not %s" % (SAYS[kind], type(v).__name__))
    if meta.get("path") and not host_path(v):
        bad(name, "%r is not an absolute path" % v[:120])
    if meta.get("pattern") and not meta["pattern"].match(v):
        bad(name, "%r is not %s" % (v[:120], meta["what"]))
    return v


def as_json(value):
    """A declared value as JSON: each field under its key (a `rest` field's keys spread beside them). A value the
    controller read (`check(raw=True)`) is given back as the host sent it, keys no class declares kept, each field
    the reader checked in its checked form, and the fields the controller set (`given`) added."""
    if is_dataclass(value) and not isinstance(value, type):
        raw = getattr(value, "_raw", None)
        out = dict(raw) if raw is not None else {}
        for f in fields(value):
            v = getattr(value, f.name)
            if f.metadata.get("rest"):
                for k, x in (v or {}).items() if raw is None else ():
                    out.setdefault(k, x)
                continue
            key = f.metadata.get("key", f.name)
            if raw is None or f.metadata.get("given") or out.get(key) is not None:
                out[key] = as_json(v)
        return out
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    return value


__all__ = ["Args", "Reply", "Shape", "Step", "as_json", "check", "dataclass", "doc", "field", "gen_id", "host_path", "clean_or_drift"]
