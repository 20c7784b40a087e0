"""Host agent: the EAGLE-3 interface contract of a target architecture, read statically with `ast`.

Never imports SGLang (runs on any host, GPU or not). Stdlib only; payload {op: check, architecture,
site_packages?}; also importable (`check_contract`).
"""
from __future__ import annotations

import ast
import glob
import json
import os
import sys

from .host import locate

PACKAGE = "sglang"
# Used only when the installed EAGLE worker cannot be scanned (layout changed): what 0.5.9 calls.
KNOWN_REQUIRED = ["get_embed_and_head", "set_eagle3_layers_to_capture"]
TARGET_MODEL = "target_worker.model_runner.model"


class Cls:
    """A class found in SGLang's sources."""

    def __init__(self, module, node):
        self.module, self.node = module, node
        self.name = node.name
        self.qualname = f"{module.name}.{node.name}"
        self.members = {}              # name -> line, for everything bound in the class body
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.members[stmt.name] = stmt.lineno
            elif isinstance(stmt, ast.Assign):
                for t in stmt.targets:
                    if isinstance(t, ast.Name):
                        self.members[t.id] = stmt.lineno
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value:
                self.members[stmt.target.id] = stmt.lineno


class Module:
    def __init__(self, name, path, rel, tree):
        self.name, self.path, self.rel = name, path, rel
        self.classes, self.imports, self.aliases = {}, {}, {}
        self.entry = None              # the EntryClass expression, if any
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for stmt in tree.body:
            if isinstance(stmt, ast.ClassDef):
                self.classes[stmt.name] = stmt
            elif isinstance(stmt, ast.ImportFrom):
                base = stmt.module or ""
                if stmt.level:
                    parts = package.split(".")
                    parts = parts[:len(parts) - (stmt.level - 1)] if stmt.level > 1 else parts
                    base = ".".join(parts + ([stmt.module] if stmt.module else []))
                for a in stmt.names:
                    self.imports[a.asname or a.name] = (base, a.name)
            elif isinstance(stmt, ast.Import):
                for a in stmt.names:
                    if a.asname:
                        self.imports[a.asname] = (a.name, None)
                    else:
                        head = a.name.split(".")[0]
                        self.imports[head] = (head, None)
            elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                target = stmt.targets[0].id
                if target == "EntryClass":
                    self.entry = stmt.value
                elif isinstance(stmt.value, (ast.Name, ast.Attribute)):
                    self.aliases[target] = stmt.value
        # try/except imports and `if TYPE_CHECKING` blocks at module level
        for stmt in tree.body:
            if isinstance(stmt, (ast.Try, ast.If)):
                for sub in ast.walk(stmt):
                    if isinstance(sub, ast.ImportFrom) and sub.module and not sub.level:
                        for a in sub.names:
                            self.imports.setdefault(a.asname or a.name, (sub.module, a.name))


class Index:
    """Lazily parsed modules of one installed package, addressed by dotted name."""

    def __init__(self, root):
        self.root = root
        self.modules = {}
        self.skipped = []              # files this interpreter could not parse
        self.models = None             # {path: source} of sglang/srt/models, read on first use

    def file_of(self, name):
        base = os.path.join(self.root, *name.split("."))
        for cand in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(cand):
                return cand
        return None

    def module(self, name):
        if name in self.modules:
            return self.modules[name]
        mod = None
        path = self.file_of(name) if name.split(".")[0] == PACKAGE else None
        if path:
            try:
                with open(path, "rb") as f:
                    tree = ast.parse(f.read(), path)
                mod = Module(name, path, os.path.relpath(path, self.root), tree)
            except (SyntaxError, ValueError) as e:
                self.skipped.append(f"{os.path.relpath(path, self.root)}: {e}")
        self.modules[name] = mod
        return mod

    def resolve(self, module, expr, depth=0):
        """A Cls, or the dotted name of something outside SGLang (str)."""
        dotted = _dotted(expr)
        if dotted is None or depth > 12:
            return ast.unparse(expr) if hasattr(ast, "unparse") else "?"
        head, _, rest = dotted.partition(".")
        if not rest:
            if head in module.classes:
                return Cls(module, module.classes[head])
            if head in module.aliases:
                return self.resolve(module, module.aliases[head], depth + 1)
            if head in module.imports:
                mod_name, attr = module.imports[head]
                return self._lookup(mod_name, attr, depth)
            return head                      # a builtin such as object
        if head in module.imports:
            mod_name, attr = module.imports[head]
            full = f"{mod_name}.{attr}" if attr else mod_name
            path, _, name = f"{full}.{rest}".rpartition(".")
            return self._lookup(path, name, depth)
        return dotted

    def _lookup(self, mod_name, attr, depth):
        if attr is None:
            return mod_name
        mod = self.module(mod_name)
        if mod is None:
            sub = self.module(f"{mod_name}.{attr}")
            return sub.name if sub else f"{mod_name}.{attr}"
        if attr in mod.classes:
            return Cls(mod, mod.classes[attr])
        if attr in mod.aliases:
            return self.resolve(mod, mod.aliases[attr], depth + 1)
        if attr in mod.imports:                  # re-exported
            m, a = mod.imports[attr]
            return self._lookup(m, a, depth + 1)
        return f"{mod_name}.{attr}"

    def bases(self, cls):
        return [self.resolve(cls.module, b) for b in cls.node.bases]

    def mro(self, cls):
        """C3 linearisation over SGLang classes; names outside SGLang are leaves."""
        def key(c):
            return c.qualname if isinstance(c, Cls) else c

        def lin(c, seen):
            if not isinstance(c, Cls) or key(c) in seen:
                return [c]
            bases = self.bases(c)
            seqs = [lin(b, seen | {key(c)}) for b in bases] + [list(bases)]
            out = [c]
            seqs = [s for s in seqs if s]
            while seqs:
                for s in seqs:
                    cand = s[0]
                    if not any(key(cand) in [key(x) for x in t[1:]] for t in seqs):
                        break
                else:                            # inconsistent hierarchy: depth-first fallback
                    for s in seqs:
                        for x in s:
                            if key(x) not in [key(y) for y in out]:
                                out.append(x)
                    return out
                out.append(cand)
                seqs = [[x for x in s if key(x) != key(cand)] for s in seqs]
                seqs = [s for s in seqs if s]
            return out

        return lin(cls, frozenset())


def _dotted(expr):
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if isinstance(expr, ast.Subscript):          # Generic[T] and friends
        return _dotted(expr.value)
    if not isinstance(expr, ast.Name):
        return None
    parts.append(expr.id)
    return ".".join(reversed(parts))


def _rel(index, path, line):
    return f"{os.path.relpath(path, index.root)}:{line}"


def required_methods(index):
    """{method: [file:line, ...]} the installed EAGLE worker calls on the target model, and the source.

    Read from the EAGLE worker modules (calls on `...target_worker.model_runner.model`), the
    SGLang speculative modules they import (calls on a `target_model` argument), and the model
    runner with its components (calls on `self.model` / `model` inside an `if` about eagle). A call
    guarded by `hasattr(receiver, "method")` is optional and not required; so is a method no
    SGLang model defines (torch.nn.Module's own, such as named_modules).
    """
    found = {}
    srt = os.path.join(index.root, PACKAGE, "srt")
    workers = sorted(glob.glob(os.path.join(srt, "speculative", "eagle_worker*.py")))
    imported = set()
    for path in workers:
        tree = _parse(path)
        _calls(index, path, tree, lambda d: d.endswith(TARGET_MODEL), found)
        for stmt in tree.body:
            if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith(f"{PACKAGE}.srt.speculative."):
                module = index.file_of(stmt.module)
                if module and module not in workers:
                    imported.add(module)
    for path in sorted(imported):
        _calls(index, path, _parse(path), lambda d: d == "target_model", found)
    runners = [os.path.join(srt, "model_executor", "model_runner.py")] + \
        sorted(glob.glob(os.path.join(srt, "model_executor", "model_runner_components", "*.py")))
    for path in runners:
        if not os.path.isfile(path):
            continue
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.If) and "eagle" in ast.dump(node.test).lower():
                for stmt in node.body:
                    _calls(index, path, stmt, lambda d: d in ("self.model", "model"), found)
    found = {m: at for m, at in found.items() if _model_defines(index, m)}
    if found:
        return found, "derived"
    return {m: [] for m in KNOWN_REQUIRED}, "fallback"


def _calls(index, path, tree, receiver, found):
    """Add to `found` each call `<receiver>.method(...)` in `tree` not under `if hasattr(<receiver>, "method")`."""
    optional = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            guarded = {(_dotted(c.args[0]), c.args[1].value) for c in _positive(node.test)
                       if isinstance(c, ast.Call) and _dotted(c.func) == "hasattr" and len(c.args) == 2
                       and isinstance(c.args[1], ast.Constant)}
            for stmt in node.body:
                for sub in ast.walk(stmt):
                    if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
                            and (_dotted(sub.func.value), sub.func.attr) in guarded):
                        optional.add(id(sub))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and id(node) not in optional
                and receiver(_dotted(node.func.value) or "")):
            found.setdefault(node.func.attr, []).append(_rel(index, path, node.lineno))


def _positive(test):
    """The sub-expressions of an `if` test that hold when it holds (through `and`, not `not`/`or`)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return [x for v in test.values for x in _positive(v)]
    return [test]


def _model_defines(index, method):
    """Whether any SGLang model defines `method` (the model interface, as against torch.nn.Module's)."""
    needle = f"def {method}(".encode()
    return any(needle in src for src in model_sources(index).values())


def model_sources(index):
    """{path: bytes} of every file under sglang/srt/models, read once per index."""
    if index.models is None:
        index.models = {}
        models = os.path.join(index.root, PACKAGE, "srt", "models")
        for path in sorted(glob.glob(os.path.join(models, "**", "*.py"), recursive=True)):
            with open(path, "rb") as f:
                index.models[path] = f.read()
    return index.models


def _parse(path):
    try:
        with open(path, "rb") as f:
            return ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return ast.Module(body=[], type_ignores=[])


def find_arch(index, arch):
    """(Cls, module) of the EntryClass entry named `arch`, or None."""
    contents = model_sources(index)
    files = list(contents)
    # the arch's own name usually sits in the file that lists it; look there first
    ordered = ([p for p in files if arch.encode() in contents[p]]
               + [p for p in files if arch.encode() not in contents[p]])
    for path in ordered:
        if b"EntryClass" not in contents[path]:
            continue
        name = os.path.relpath(path, index.root)[:-3].replace(os.sep, ".")
        if name.endswith(".__init__"):
            name = name[:-9]
        mod = index.module(name)
        if mod is None or mod.entry is None:
            continue
        for n in ast.walk(mod.entry):
            if isinstance(n, (ast.Name, ast.Attribute)) and isinstance(getattr(n, "ctx", None), ast.Load):
                c = index.resolve(mod, n)
                if isinstance(c, Cls) and c.name == arch:
                    return c, mod
    return None


def composed_members(index, cls, mro):
    """{attribute: Cls} for every `self.X = SomeClass(...)` in the class or its SGLang bases."""
    out = {}
    for c in mro:
        if not isinstance(c, Cls):
            continue
        for node in ast.walk(c.node):
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            if not isinstance(value, ast.Call):
                continue
            for t in targets:
                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                        and t.attr not in out):
                    member_cls = index.resolve(c.module, value.func)
                    if isinstance(member_cls, Cls):
                        out[t.attr] = member_cls
    return out


def lookup(index, cls, method, mro=None):
    """(status, owner Cls) for `method` on `cls`: defined / inherited / missing."""
    if method in cls.members:
        return "defined", cls
    for c in (mro or index.mro(cls))[1:]:
        if isinstance(c, Cls) and method in c.members:
            return "inherited", c
    return "missing", None


def architecture_of(arch):
    """An architecture name, or the first of `architectures` in a model's config.json."""
    if arch.endswith(".json") or os.path.isdir(arch):
        path = os.path.join(arch, "config.json") if os.path.isdir(arch) else arch
        with open(path) as f:
            names = json.load(f).get("architectures") or []
        if not names:
            raise ValueError(f"{path} lists no architectures")
        return names[0]
    return arch


def check_contract(site_packages, arch):
    """The contract report for `arch` against the SGLang installed in `site_packages` (None: this
    interpreter's environment)."""
    dist = locate(PACKAGE, site_packages)
    if dist is None:
        where = site_packages or sys.executable
        return {"arch": arch, "ok": False, "found": False, "reason": f"{PACKAGE} is not installed ({where})"}
    arch = architecture_of(arch)
    index = Index(dist["root"])
    report = {"arch": arch, "package": dist, "found": False, "ok": False}
    hit = find_arch(index, arch)
    if hit is None:
        report["reason"] = f"no EntryClass in {PACKAGE}/srt/models names {arch}"
        return report
    cls, mod = hit
    mro = index.mro(cls)
    required, source = required_methods(index)
    members = None
    rows = []
    for method in sorted(required):
        status, owner = lookup(index, cls, method, mro)
        row = {"method": method, "status": status, "called_at": required[method]}
        if owner is not None:
            row["from"] = owner.name
            row["at"] = _rel(index, owner.module.path, owner.members[method])
        else:
            members = composed_members(index, cls, mro) if members is None else members
            for attr, mcls in members.items():
                mstatus, mowner = lookup(index, mcls, method)
                if mowner is not None:
                    row["via"] = {"member": attr, "class": mcls.name, "status": mstatus, "from": mowner.name,
                                  "at": _rel(index, mowner.module.path, mowner.members[method])}
                    break
        rows.append(row)
    report.update({
        "found": True,
        "ok": all(r["status"] != "missing" for r in rows),
        "module": mod.name,
        "class": cls.name,
        "at": _rel(index, cls.module.path, cls.node.lineno),
        "mro": [c.qualname if isinstance(c, Cls) else c for c in mro],
        "required_source": source,
        "methods": rows,
    })
    if index.skipped:
        report["unparsed"] = index.skipped
    return report


def op_check(a):
    """{architecture, site_packages?} -> the EAGLE-3 contract of that architecture in the installed SGLang."""
    sp = a.get("site_packages")
    if sp and not os.path.isdir(sp):
        return {"error": f"no such directory: {sp}"}
    return check_contract(sp, a["architecture"])


OPS = {"check": op_check}
