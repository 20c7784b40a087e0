"""The one place YAML is read: safe loader, bounded size and aliases, and line numbers per field.

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


@dataclass
class Doc:
    path: str
    data: object
    lines: dict = field(default_factory=dict)

    def line(self, *keys) -> int:
        """Line of the deepest known prefix of `keys` (1-based)."""
        keys = tuple(keys)
        while keys and keys not in self.lines:
            keys = keys[:-1]
        return self.lines.get(keys, 1)

    def where(self, *keys) -> str:
        return f"{self.path}:{self.line(*keys)}"


def _walk(node, path, lines, budget, active=frozenset()):
    budget[0] -= 1
    if budget[0] < 0:
        raise LockError("document too large (node limit)")
    if id(node) in active:
        raise yaml.MarkedYAMLError(problem="recursive alias", problem_mark=node.start_mark)
    lines[path] = node.start_mark.line + 1
    if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
        active = active | {id(node)}
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else str(k.start_mark.line)
            lines[path + (key,)] = k.start_mark.line + 1
            _walk(v, path + (key,), lines, budget, active)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _walk(v, path + (i,), lines, budget, active)


def loads(text: str, name: str = "<string>") -> Doc:
    if len(text.encode()) > MAX_BYTES:
        raise LockError(f"file larger than {MAX_BYTES} bytes", where=name)
    try:
        aliases = sum(isinstance(e, yaml.AliasEvent) for e in yaml.parse(text, Loader=yaml.SafeLoader))
        if aliases > MAX_ALIASES:
            raise LockError(f"{aliases} YAML aliases (limit {MAX_ALIASES})", where=name)
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return Doc(name, None, {})
            lines: dict = {}
            _walk(node, (), lines, [MAX_NODES])
            data = loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else 1
        raise LockError(f"invalid YAML: {e.problem or e}", where=f"{name}:{line}") from None
    except LockError as e:
        raise LockError(e.message, where=name) from None
    except yaml.YAMLError as e:
        raise LockError(f"invalid YAML: {e}", where=name) from None
    return Doc(name, data, lines)


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


def dump(data) -> str:
    return yaml.safe_dump(data, sort_keys=False, width=120)
