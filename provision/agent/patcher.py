"""Host agent: applies, checks and reverts unified-diff patch series inside one Python environment.

Stdlib only; payload {op: inspect|run|verify, site_packages?, ...}; returns one JSON object. Exact context, all-or-nothing over every hunk of every patch, idempotent, reversible.
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
import sysconfig
import tempfile

from . import store
from .contracts import check_contract
from .host import AgentError, distribution, locate

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchFailed(AgentError):
    """One line naming the patch, the file and the first failing hunk."""

    def __init__(self, message, patch=None, path=None):
        super().__init__(message)
        self.patch, self.path = patch, path


# ---------------------------------------------------------------- parsing

class Hunk:
    def __init__(self, header, old_start, new_start):
        self.header = header          # "@@ -13,4 +13,12 @@"
        self.old_start = old_start    # 1-based; 0 for an empty old side
        self.new_start = new_start
        self.lines = []               # (tag, text with its line ending) for tag in " -+"

    def old(self):
        return [t for tag, t in self.lines if tag in " -"]

    def new(self):
        return [t for tag, t in self.lines if tag in " +"]

    def reversed(self):
        h = Hunk(self.header, self.new_start, self.old_start)
        h.lines = [({"-": "+", "+": "-"}.get(tag, tag), t) for tag, t in self.lines]
        return h


class FilePatch:
    def __init__(self, path):
        self.path = path              # relative to the environment's site-packages
        self.hunks = []


def _strip(path):
    path = path.split("\t")[0].strip()
    if path == "/dev/null":
        return None
    return path.split("/", 1)[1] if path.startswith(("a/", "b/")) else path


def _check_target(path, where):
    """A target path stays inside the package: relative, plain components, no '..'."""
    if path.startswith("/") or "\\" in path or any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise PatchFailed(f"{where}: target {path!r} must be a plain path relative to site-packages")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise PatchFailed(f"{where}: target {path!r} has an empty, '.' or '..' component; refused")
    return path


def parse(text, name="<patch>"):
    """Unified diff -> [FilePatch]; paths stripped of their a/ b/ prefix (-p1)."""
    lines = text.splitlines(keepends=True)
    files, i = [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new = _strip(line[4:]), _strip(lines[i + 1][4:])
            if old is None or new is None:
                raise PatchFailed(f"{name}:{i + 1}: creating or deleting files is not supported")
            if old != new:
                raise PatchFailed(f"{name}:{i + 1}: renames are not supported ({old} -> {new})")
            files.append(FilePatch(_check_target(new, f"{name}:{i + 1}")))
            i += 2
            continue
        m = _HUNK.match(line)
        if m:
            if not files:
                raise PatchFailed(f"{name}:{i + 1}: hunk before any file header")
            n_old = int(m.group(2)) if m.group(2) is not None else 1
            n_new = int(m.group(4)) if m.group(4) is not None else 1
            hunk = Hunk(line.split(" @@")[0] + " @@", int(m.group(1)), int(m.group(3)))
            i += 1
            seen_old = seen_new = 0
            while i < len(lines) and (seen_old < n_old or seen_new < n_new):
                body = lines[i]
                tag = body[:1]
                if tag == "\\":                           # "\ No newline at end of file"
                    if hunk.lines:
                        t, s = hunk.lines[-1]
                        hunk.lines[-1] = (t, s.rstrip("\r\n"))
                    i += 1
                    continue
                if body in ("\n", "\r\n"):                # an empty context line whose space was eaten
                    tag, body = " ", " " + body
                if tag not in " -+":
                    raise PatchFailed(f"{name}:{i + 1}: hunk {hunk.header} ends early")
                hunk.lines.append((tag, body[1:]))
                seen_old += tag in " -"
                seen_new += tag in " +"
                i += 1
            if seen_old != n_old or seen_new != n_new:
                raise PatchFailed(f"{name}: hunk {hunk.header} in {files[-1].path} has a wrong line count")
            if i < len(lines) and lines[i].startswith("\\"):
                t, s = hunk.lines[-1]
                hunk.lines[-1] = (t, s.rstrip("\r\n"))
                i += 1
            files[-1].hunks.append(hunk)
            continue
        i += 1                                            # commentary between files
    if not files or not any(f.hunks for f in files):
        raise PatchFailed(f"{name}: no hunks found")
    return files


# ---------------------------------------------------------------- applying

def _find(lines, block, hint, start):
    """Index >= start where `block` occurs, nearest to `hint`; None if nowhere."""
    n = len(block)
    last = len(lines) - n
    if last < start:
        return None
    hint = min(max(hint, start), last)
    for delta in range(0, max(hint - start, last - hint) + 1):
        for pos in (hint - delta, hint + delta):
            if start <= pos <= last and lines[pos:pos + n] == block:
                return pos
    return None


def _first_difference(lines, block, hint):
    """Human description of why `block` does not sit at `hint` (its stated line)."""
    for k, want in enumerate(block):
        got = lines[hint + k] if 0 <= hint + k < len(lines) else None
        if got != want:
            shown = "end of file" if got is None else repr(got.rstrip("\r\n"))[:80]
            return f"line {hint + k + 1} is {shown}, expected {repr(want.rstrip(chr(13) + chr(10)))[:80]}"
    return "context not found"


def apply_hunks(lines, hunks):
    """(new lines, total distance from the stated lines) or (None, (n, header, reason)) for the
    first hunk that does not apply."""
    out, cursor, offset, distance = [], 0, 0, 0
    for n, hunk in enumerate(hunks, 1):
        old = hunk.old()
        hint = max(hunk.old_start - 1, 0) + offset
        pos = _find(lines, old, hint, cursor)
        if pos is None:
            return None, (n, hunk.header, _first_difference(lines, old, max(hunk.old_start - 1, 0)))
        out.extend(lines[cursor:pos])
        out.extend(hunk.new())
        cursor = pos + len(old)
        offset = pos - max(hunk.old_start - 1, 0)
        distance += abs(offset)
    out.extend(lines[cursor:])
    return out, distance


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def _read_lines(path):
    with open(path, "rb") as f:
        data = f.read()
    return data.decode("utf-8").splitlines(keepends=True)


def plan(root, series, mode, keep_going=False, state=None, original=None, owned=None):
    """Dry run over every patch of every series, in memory.

    Returns (report_series, new_lines{abs path: lines}, old_lines{abs path: lines}); pass the
    dicts of an earlier call to continue from its results. A patch that neither applies nor is
    already applied (reverting: the reverse) raises PatchFailed, or with keep_going is reported
    as failed and left out of the new contents. `owned`: the files the series' package owns (its
    RECORD, relative to `root`); a patch touching any other file fails.
    """
    state = {} if state is None else state
    original = {} if original is None else original
    reports = []
    for s in series:
        patches = list(s["patches"])
        order = reversed(patches) if mode == "revert" else patches
        rows = {}
        for p in order:
            name = p["name"]
            if p.get("skip"):
                rows[name] = {"name": name, "status": "skipped-by-gate", "reason": p.get("skip_reason", "")}
                continue
            try:
                rows[name] = _plan_patch(root, p, mode, state, original, owned)
            except PatchFailed as e:
                if not keep_going:
                    raise
                rows[name] = {"name": name, "status": "failed", "reason": str(e)}
        upstream = []
        if mode != "revert":
            for u in s.get("upstream", []):
                try:
                    upstream.append(_check_upstream(root, u, state, original, owned))
                except PatchFailed as e:
                    if not keep_going:
                        raise
                    upstream.append({"name": u["name"], "status": "failed", "reason": str(e)})
        reports.append({"name": s["name"], "patches": [rows[p["name"]] for p in patches] + upstream})
    return reports, state, original


def _check_upstream(root, u, state, original, owned=None):
    """A fix the series says this release has upstream: every line of its evidence is in its file."""
    name = u["name"]
    for rel, lines in u["evidence"].items():
        path = _contained(root, rel, f"upstream {name}", owned)
        if path not in state:
            if not os.path.isfile(path):
                raise PatchFailed(f"upstream {name}: {rel}: file not found in {root}", name, rel)
            try:
                state[path] = original[path] = _read_lines(path)
            except UnicodeDecodeError:
                raise PatchFailed(f"upstream {name}: {rel}: not UTF-8 text", name, rel) from None
        have = {line.rstrip("\r\n") for line in state[path]}
        absent = [line for line in lines if line not in have]
        if absent:
            raise PatchFailed(f"upstream {name}: {rel}: the fix is not there (no line {absent[0].strip()!r}); "
                              "this release needs the patch after all", name, rel)
    for arch in u.get("contracts", []):
        report = check_contract(root, arch)
        if not report["ok"]:
            missing = [m["method"] for m in report.get("methods", []) if m["status"] == "missing"]
            why = f"missing {', '.join(missing)}" if missing else report.get("reason", "not found")
            raise PatchFailed(f"upstream {name}: the EAGLE-3 contract of {arch} fails ({why}); "
                              "this release needs the patch after all", name)
    return {"name": name, "status": "upstream", "files": list(u["evidence"])}


def _contained(root, rel, name, owned):
    """The absolute path of `rel` under `root`, refused unless the package owns it and no component
    below `root` is a symbolic link."""
    if owned is not None and rel not in owned:
        raise PatchFailed(f"patch {name}: {rel}: not a file of the series' package (its RECORD does not list it); "
                          "refused", name, rel)
    path = root
    for part in _check_target(rel, f"patch {name}").split("/"):
        path = os.path.join(path, part)
        if os.path.islink(path):
            raise PatchFailed(f"patch {name}: {rel}: {path} is a symbolic link; refused", name, rel)
    top = os.path.realpath(root)
    if not os.path.realpath(path).startswith(top.rstrip(os.sep) + os.sep):
        raise PatchFailed(f"patch {name}: {rel}: resolves outside {root}; refused", name, rel)
    return path


def _plan_patch(root, p, mode, state, original, owned=None):
    """Apply (or revert) one patch to the in-memory `state`; its report row."""
    name = p["name"]
    fps = parse(p["text"], name)
    staged, statuses = {}, []
    for fp in fps:
        path = _contained(root, fp.path, name, owned)
        if path not in state:
            if not os.path.isfile(path):
                raise PatchFailed(f"patch {name}: {fp.path}: file not found in {root}", name, fp.path)
            try:
                state[path] = original[path] = _read_lines(path)
            except UnicodeDecodeError:
                raise PatchFailed(f"patch {name}: {fp.path}: not UTF-8 text", name, fp.path) from None
        cur = staged.get(path, state[path])
        for n, h in enumerate(fp.hunks, 1):
            if cur and not any(tag == " " for tag, _ in h.lines):
                raise PatchFailed(f"patch {name}: {fp.path}: hunk #{n} {h.header} has no context lines; refused "
                                  "on a non-empty file (it could land anywhere)", name, fp.path)
        forward = fp.hunks if mode != "revert" else [h.reversed() for h in fp.hunks]
        backward = [h.reversed() for h in fp.hunks] if mode != "revert" else fp.hunks
        new, fwd = apply_hunks(cur, forward)   # fwd: distance, or why not
        back, bwd = apply_hunks(cur, backward)
        # Both can match when added lines end like their own context (an applied patch then
        # matches again further down): the side that matches nearer its stated lines wins.
        if new is not None and back is not None and fwd == bwd:
            raise PatchFailed(f"patch {name}: {fp.path}: applies both forwards and backwards; "
                              f"cannot tell whether it is applied", name, fp.path)
        if new is not None and (back is None or fwd < bwd):
            staged[path] = new
            statuses.append("change")
        elif back is not None:
            statuses.append("done")
        else:
            n, header, detail = fwd
            verb = "reverse hunk" if mode == "revert" else "hunk"
            raise PatchFailed(f"patch {name}: {fp.path}: {verb} #{n} {header} does not apply ({detail})",
                              name, fp.path)
    if "change" in statuses and "done" in statuses:
        raise PatchFailed(f"patch {name}: partly applied (some files patched, others not)", name)
    state.update(staged)
    if mode == "revert":
        status = "reverted" if "change" in statuses else "not-applied"
    else:
        status = "applied" if "change" in statuses else "already-applied"
    return {"name": name, "status": status, "files": [fp.path for fp in fps]}


def _write_all(changes):
    """Stage every file beside its target, then rename each into place (no half-written file): a file linked
    from the host's store is never written, the generation gets a file of its own in its place."""
    staged = []
    try:
        for path, text in changes.items():
            fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", dir=os.path.dirname(path))
            with os.fdopen(fd, "wb") as f:
                f.write(text.encode("utf-8"))
            os.chmod(tmp, os.stat(path).st_mode & 0o7777)
            staged.append((tmp, path))
    except OSError as e:
        for tmp, _ in staged:
            os.unlink(tmp)
        raise PatchFailed(f"cannot write {e.filename or path}: {e.strerror or e}") from None
    for tmp, path in staged:
        store.replace(tmp, path)
        _drop_bytecode(path)


def _drop_bytecode(path):
    """Remove cached bytecode of a rewritten module so that it can never shadow the new source."""
    cache = os.path.join(os.path.dirname(path), "__pycache__")
    stem = os.path.splitext(os.path.basename(path))[0] + "."
    if os.path.isdir(cache):
        for name in os.listdir(cache):
            if name.startswith(stem) and name.endswith(".pyc"):
                try:
                    store.unlink(os.path.join(cache, name))
                except OSError:
                    pass


def run(payload):
    """payload: {mode: apply|check|revert, site_packages?, series: [{name, package, patches: [...]}]}

    A patch that does not apply is returned as `failed` (with the patch and file), never raised:
    the controller turns it into its own error. Nothing is written unless every patch passes.
    """
    mode = payload["mode"]
    check = mode == "check"
    reports, state, original, rel = [], {}, {}, {}
    for s in payload["series"]:
        dist = distribution(s["package"], payload.get("site_packages"))
        if dist is None:
            return {"mode": mode, "failed": f"{s['package']} is not installed in this environment",
                    "written": False}
        root = os.path.abspath(str(dist.locate_file("")))
        if dist.files is None:
            return {"mode": mode, "failed": f"{s['package']} has no RECORD: cannot tell which files are its own",
                    "written": False}
        owned = {str(f).replace(os.sep, "/") for f in dist.files}
        try:
            rep, _, _ = plan(root, [s], "revert" if mode == "revert" else "apply", check, state, original, owned)
        except PatchFailed as e:
            return {"mode": mode, "failed": str(e), "patch": e.patch, "path": e.path, "written": False}
        rep[0]["site_packages"] = root
        if check:
            for row in rep[0]["patches"]:
                row["status"] = {"applied": "would-apply"}.get(row["status"], row["status"])
        reports += rep
        for path in state:
            rel.setdefault(path, os.path.relpath(path, root))
    changes = {path: "".join(lines) for path, lines in state.items() if lines != original[path]}
    if not check:
        try:
            _write_all(changes)
        except PatchFailed as e:
            return {"mode": mode, "failed": str(e), "written": False}
    files = {}
    for path in sorted(state, key=rel.get):
        if check and path in changes:                 # what the file would hash to
            files[rel[path]] = sha256(changes[path].encode("utf-8"))
        else:
            with open(path, "rb") as f:
                files[rel[path]] = sha256(f.read())
    return {"mode": mode, "series": reports, "files": files,
            "changed": sorted(rel[path] for path in changes), "written": not check and bool(changes)}


# ---------------------------------------------------------------- environment

def site_roots(site_packages=None):
    if site_packages:
        return [os.path.abspath(site_packages)]
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def verify(manifest, site_packages=None):
    """[{path, expected, actual}] for every manifest file whose sha256 differs (actual None: missing)."""
    roots = site_roots(site_packages)
    bad = []
    for rel, want in sorted(manifest.items()):
        cands = [rel] if os.path.isabs(rel) else [os.path.join(r, rel) for r in roots]
        path = next((c for c in cands if os.path.isfile(c)), None)
        got = None
        if path:
            with open(path, "rb") as f:
                got = sha256(f.read())
        if got != want:
            bad.append({"path": rel, "expected": want, "actual": got})
    return bad


def site(a):
    """The payload's site-packages directory (None: this interpreter's own), which must exist."""
    sp = a.get("site_packages")
    if sp and not os.path.isdir(sp):
        raise PatchFailed(f"no such directory: {sp}")
    return sp


def op_inspect(a):
    sp = site(a)
    return {"packages": {p: locate(p, sp) for p in a.get("packages", [])}, "python": sys.executable,
            "site_packages": site_roots(sp)}


def op_run(a):
    site(a)
    return run(a)


def op_verify(a):
    return {"mismatches": verify(a["files"], site(a))}


OPS = {"inspect": op_inspect, "run": op_run, "verify": op_verify}
