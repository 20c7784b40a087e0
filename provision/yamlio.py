"""The one place YAML (and a saved plan's JSON) is read: safe loader, bounded size, depth and aliases,
duplicate keys refused at any depth, and line numbers per field.

`load(path)` returns a `Doc`: the plain data plus `line(*path)` for error messages (file:line).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .errors import LockError

MAX_BYTES = 4 * 1024 * 1024
MAX_ALIASES = 64
MAX_NODES = 200_000
MAX_DEPTH = 64


@dataclass
class Doc:
    path: str
    data: object
    lines: dict = field(default_factory=dict)
    scalars: dict = field(default_factory=dict)   # keys path → the scalar's text as written

    def text(self, *keys) -> str | None:
        return self.scalars.get(tuple(keys))

    def line(self, *keys) -> int:
        """Line of the deepest known prefix of `keys` (1-based)."""
        keys = tuple(keys)
        while keys and keys not in self.lines:
            keys = keys[:-1]
        return self.lines.get(keys, 1)

    def where(self, *keys) -> str:
        return f"{self.path}:{self.line(*keys)}"


def _walk(node, path, lines, budget, active=frozenset(), scalars=None):
    budget[0] -= 1
    if budget[0] < 0:
        raise LockError("document too large (node limit)")
    if id(node) in active:
        raise yaml.MarkedYAMLError(problem="recursive alias", problem_mark=node.start_mark)
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.ScalarNode) and scalars is not None:
        scalars[path] = node.value
    if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
        active = active | {id(node)}
    if isinstance(node, yaml.MappingNode):
        seen: dict = {}
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode) or k.tag == "tag:yaml.org,2002:merge":
                raise yaml.MarkedYAMLError(problem="only plain keys are allowed (no complex or merge keys)",
                                           problem_mark=k.start_mark)
            key = k.value
            if key in seen:
                raise yaml.MarkedYAMLError(problem=f"duplicate key {key!r} (first at line {seen[key]})",
                                           problem_mark=k.start_mark)
            seen[key] = k.start_mark.line + 1
            lines[path + (key,)] = k.start_mark.line + 1
            _walk(v, path + (key,), lines, budget, active, scalars)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _walk(v, path + (i,), lines, budget, active, scalars)


def _prescan(text: str, name: str) -> None:
    """Refuse deep nesting and alias bombs from the event stream, before anything recursive runs."""
    aliases = depth = 0
    for e in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(e, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise LockError(f"nested deeper than {MAX_DEPTH} levels", where=f"{name}:{e.start_mark.line + 1}")
        elif isinstance(e, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
        elif isinstance(e, yaml.AliasEvent):
            aliases += 1
            if aliases > MAX_ALIASES:
                raise LockError(f"more than {MAX_ALIASES} YAML aliases", where=f"{name}:{e.start_mark.line + 1}")


def loads(text: str, name: str = "<string>") -> Doc:
    if len(text.encode()) > MAX_BYTES:
        raise LockError(f"file larger than {MAX_BYTES} bytes", where=name)
    try:
        _prescan(text, name)
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return Doc(name, None, {})
            lines: dict = {}
            scalars: dict = {}
            _walk(node, (), lines, [MAX_NODES], scalars=scalars)
            data = loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else 1
        raise LockError(f"invalid YAML: {e.problem or e}", where=f"{name}:{line}") from None
    except LockError as e:
        raise LockError(e.message, where=e.where or name) from None
    except yaml.YAMLError as e:
        raise LockError(f"invalid YAML: {e}", where=name) from None
    return Doc(name, data, lines, scalars)


def load(path: str | Path) -> Doc:
    p = Path(path)
    try:
        if p.stat().st_size > MAX_BYTES:
            raise LockError(f"file larger than {MAX_BYTES} bytes", where=str(p))
        text = p.read_text()
    except OSError as e:
        raise LockError(f"cannot read: {e.strerror}", where=str(p)) from None
    except UnicodeDecodeError:
        raise LockError("not UTF-8 text", where=str(p)) from None
    return loads(text, str(p))


def load_json(path: str | Path, error=LockError):
    """A JSON input file (a saved plan): bounded size and depth, duplicate keys refused; `error` is raised."""
    import json

    p = Path(path)

    def pairs(items):
        out = {}
        for k, v in items:
            if k in out:
                raise ValueError(f"duplicate key {k!r}")
            out[k] = v
        return out

    try:
        if p.stat().st_size > MAX_BYTES:
            raise error(f"file larger than {MAX_BYTES} bytes", where=str(p))
        data = json.loads(p.read_text(), object_pairs_hook=pairs)
    except OSError as e:
        raise error(f"cannot read: {e.strerror}", where=str(p)) from None
    except UnicodeDecodeError:
        raise error("not UTF-8 text", where=str(p)) from None
    except json.JSONDecodeError as e:
        raise error(f"invalid JSON: {e.msg}", where=f"{p}:{e.lineno}") from None
    except ValueError as e:
        raise error(f"invalid JSON: {e}", where=str(p)) from None
    except RecursionError:
        raise error(f"nested deeper than {MAX_DEPTH} levels", where=str(p)) from None
    stack, nodes = [(data, 0)], 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if depth > MAX_DEPTH or nodes > MAX_NODES:
            raise error(f"nested deeper than {MAX_DEPTH} levels" if depth > MAX_DEPTH else "document too large "
                        "(node limit)", where=str(p))
        if isinstance(node, dict):
            stack += [(v, depth + 1) for v in node.values()]
        elif isinstance(node, list):
            stack += [(v, depth + 1) for v in node]
    return data


def dump(data) -> str:
    return yaml.safe_dump(data, sort_keys=False, width=120)
