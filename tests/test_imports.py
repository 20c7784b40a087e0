"""No import runs back up: the modules of `provision/` and the imports between them, read with ast (at module
level and inside functions alike), form no cycle."""
from __future__ import annotations

import ast
from pathlib import Path

import provision

PKG = Path(provision.__file__).resolve().parent


def modules(pkg: Path = PKG) -> dict[str, tuple[Path, bool]]:
    """Dotted name → (file, is a package) for every .py file under `pkg`."""
    out = {}
    for f in sorted(pkg.rglob("*.py")):
        parts = list(f.relative_to(pkg.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def imports(name: str, f: Path, is_pkg: bool, known) -> set[tuple[str, int]]:
    """(module of `known`, line) for each import in `f`, wherever it stands: `from . import x` counts as x when x
    is a module, else as the package; `import a.b.c` as the deepest known module it names."""
    here = name if is_pkg else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(f.read_text(), str(f))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in names:
            while target not in known and "." in target:
                target = target.rpartition(".")[0]
            if target in known and target != name:
                out.add((target, node.lineno))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def import_graph(pkg: Path = PKG) -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    mods = modules(pkg)
    graph, lines = {}, {}
    for name, (f, is_pkg) in mods.items():
        graph[name] = set()
        for target, line in imports(name, f, is_pkg, mods):
            graph[name].add(target)
            lines.setdefault((name, target), line)
    return graph, lines


def test_no_import_cycle():
    graph, lines = import_graph()
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100      # it read the package
    found = cycles(graph)
    where = [[f"{a}:{lines[a, b]} imports {b}" for a in comp for b in sorted(graph[a]) if b in comp]
             for comp in found]
    assert not found, where


def test_the_scan_sees_a_cycle_at_function_level(tmp_path):
    """The scan finds what it is for: a function-level import that closes a loop, through `from . import x`."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n    return a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph, lines = import_graph(pkg)
    assert graph["pkg.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]
    assert lines["pkg.sub.b", "pkg.a"] == 2
    (pkg / "sub" / "b.py").write_text("def f():\n    return 1\n")
    assert cycles(import_graph(pkg)[0]) == []
