"""Host agent (stdlib only): a generation against what it was built from. `seal` (the build's last step: files
read-only, a stamp of every file, a full check), `verify` (every file against its RECORD hash, patched files
against the hashes their series produced) and `quick` (rollback's check: every file's stat against the stamp).
"""
import json
import os
import re
import stat
import time
from concurrent.futures import ThreadPoolExecutor

from ..layout import Layout
from . import record
from .host import AgentError, inside, read_json


def generation(lay, gen_id):
    """The paths of one generation (layout.Generation), contained under the root's generations. Its stamp.json,
    beside the venv: {venv, files: {path under the venv: [size, mtime_ns, ctime_ns, ino, digest]}}."""
    if not isinstance(gen_id, str) or "/" in gen_id or gen_id in ("", ".", ".."):
        raise AgentError("bad generation id %r" % (gen_id,))
    gen = lay.gen(gen_id)
    inside(lay.generations, gen.dir)
    if not os.path.isdir(gen.dir):
        raise AgentError("no generation %s under %s" % (gen_id, lay.root))
    return gen


def walk(venv):
    """(path under the venv, lstat) of every file and symlink in the venv; bytecode the interpreter writes at
    run time (__pycache__, *.pyc) is not installed content and is left out."""
    stack = [(venv, "")]
    while stack:
        d, prefix = stack.pop()
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    if e.name != "__pycache__":
                        stack.append((e.path, prefix + e.name + "/"))
                    continue
                if e.name.endswith(record.SKIP_SUFFIXES):
                    continue
                yield prefix + e.name, e.stat(follow_symlinks=False)
            except OSError:
                continue


def read_only(venv):
    """Clear every installed file's write bits (as a Nix store is read-only); directories stay writable so the
    patcher can still replace a file by rename. Returns {files, shared}: `shared` counts files whose inode has
    another link (uv hardlinked it from its cache or another venv: a write through it would reach them)."""
    files = shared = 0
    for rel, st in walk(venv):
        if not stat.S_ISREG(st.st_mode):
            continue
        files += 1
        if st.st_nlink > 1:
            shared += 1
        if st.st_mode & 0o222:
            os.chmod(os.path.join(venv, rel), stat.S_IMODE(st.st_mode) & ~0o222)
    return {"files": files, "shared": shared}


def patched_files(gen):
    """{path relative to site-packages: sha256 hex} the generation's patch series produced (its manifest)."""
    man = read_json(gen.manifest, {}) or {}
    files = (man.get("patches") or {}).get("files") or {}
    return {k: v for k, v in files.items() if isinstance(k, str) and isinstance(v, str)}


def _signature(st):
    """What the stamp compares cheaply: size, mtime, ctime (no call can set it back) and inode."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _digest(full, st):
    if stat.S_ISLNK(st.st_mode):
        return "->" + os.readlink(full)
    return record.hash_file(full)[0]


def op_seal(lay, a):
    """After the build (which made the files read-only) and its patches (which keep a file's mode): a full check
    (RECORD and patch hashes, the distributions installed), then the stamp of every file that rollback's quick
    check compares with."""
    gen = generation(lay, a["id"])
    venv = gen.venv
    t0 = time.monotonic()
    out = full(venv, patched_files(gen), a.get("jobs"), digests=True)
    digests = out.pop("digests")
    files, todo = {}, []
    for rel, st in walk(venv):
        full_path = os.path.join(venv, rel)
        files[rel] = _signature(st) + [digests.get(full_path)]
        if files[rel][4] is None:
            todo.append((rel, full_path, st))
    with ThreadPoolExecutor(max_workers=a.get("jobs") or record.jobs_default()) as ex:
        for (rel, full_path, st), d in zip(todo, ex.map(lambda x: _safe_digest(x[1], x[2]), todo)):
            files[rel][4] = d
    tmp = "%s.tmp-%d" % (gen.stamp, os.getpid())
    with open(tmp, "w") as f:
        f.write(json.dumps({"venv": venv, "files": files}, separators=(",", ":")))
    os.replace(tmp, gen.stamp)
    out.update(stamped=len(files), seal_seconds=time.monotonic() - t0)
    return out


def _safe_digest(full_path, st):
    try:
        return _digest(full_path, st)
    except OSError:
        return None


def full(venv, patched, jobs=None, baseline=False, digests=False):
    """record.check of the venv with the patched files' hashes in place of RECORD's, as one JSON-able result:
    {dists: {name: {version, files, bytes, changed, missing, outside, overwritten, patched}}, extra, unclaimed_patches,
    files, bytes, seconds, read_seconds?}."""
    res = record.check(venv, jobs=jobs, expect=patched, baseline=baseline, digests=digests)
    dists = {name: {"version": d["version"], "files": d["files"], "bytes": d["bytes"], "changed": d["changed"],
                    "missing": d["missing"], "outside": d["outside"], "overwritten": d["overwritten"],
                    "patched": d["overridden"]}
             for name, d in res["dists"].items()}
    out = {"site": res["site"], "dists": dists, "extra": res["extra"], "unclaimed_patches": res["unclaimed"],
           "files": res["files"], "bytes": res["bytes"], "seconds": res["seconds"]}
    for k in ("first_read_seconds", "read_seconds", "read_bytes", "digests"):
        if k in res:
            out[k] = res[k]
    return out


def op_verify(lay, a):
    """Every file of the generation against its RECORD (patched files against their recorded hashes), and the
    time to merely read the same bytes (`baseline`)."""
    gen = generation(lay, a["id"])
    if not os.path.isdir(gen.venv):
        raise AgentError("generation %s has no venv (removed when it failed or was abandoned)" % a["id"])
    man = read_json(gen.manifest, {}) or {}
    out = full(gen.venv, patched_files(gen), a.get("jobs"), baseline=bool(a.get("baseline")))
    out.update(id=a["id"], installer=man.get("installer"), jobs=a.get("jobs") or record.jobs_default())
    return out


def quick(lay, gen_id, jobs=None):
    """Rollback's check of one generation: every file's stat against the stamp its build wrote; a file whose stat
    differs is hashed and compared with the stamp's digest (a touched but unchanged file is clean). A generation
    without a stamp (adopted, or built before stamps) gets the full RECORD check instead. The last `verify`'s
    drift counts too. Returns {verdict: clean|drift, how: stamp|record, changed, missing, extra, files, hashed,
    seconds}."""
    t0 = time.monotonic()
    gen = generation(lay, gen_id)
    venv = gen.venv
    stamp = read_json(gen.stamp, None)
    changed, missing, extra, hashed = [], [], [], 0
    if not os.path.isdir(venv):
        how, files, missing = "record", 0, ["venv"]
    elif stamp is None or stamp.get("venv") != venv or not isinstance(stamp.get("files"), dict):
        try:
            res = full(venv, patched_files(gen), jobs)
        except OSError as e:
            res = {"dists": {}, "extra": [], "unclaimed_patches": [str(e)], "files": 0}
        for name, d in sorted(res["dists"].items()):
            changed += d["changed"] + d["outside"]
            missing += d["missing"]
        extra, missing, how, files = res["extra"], missing + res["unclaimed_patches"], "record", res["files"]
        hashed = res["files"]
    else:
        want, suspects = stamp["files"], []
        seen = set()
        for rel, st in walk(venv):
            seen.add(rel)
            w = want.get(rel)
            if w is None:
                extra.append(rel)
            elif _signature(st) != w[:4]:
                suspects.append((rel, st, w[4]))
        missing = sorted(set(want) - seen)
        with ThreadPoolExecutor(max_workers=jobs or record.jobs_default()) as ex:
            got = list(ex.map(lambda s: _safe_digest(os.path.join(venv, s[0]), s[1]), suspects))
        changed = [rel for (rel, _, d), g in zip(suspects, got) if g is None or g != d]
        how, files, hashed = "stamp", len(want), len(suspects)
    man = read_json(gen.manifest, {}) or {}
    last = man.get("verify") or {}
    drift = bool(changed or missing or extra)
    out = {"id": gen_id, "how": how, "changed": sorted(changed), "missing": sorted(missing), "extra": sorted(extra),
           "files": files, "hashed": hashed, "seconds": time.monotonic() - t0}
    if last.get("verdict") == "drift" and not drift:      # what hashes found that a stat cannot see (bit rot)
        out["last_verify"] = {"time": last.get("time"), "named": last.get("named") or []}
        drift = True
    out["verdict"] = "drift" if drift else "clean"
    out["named"] = named(out) if drift else ""
    return out


def named(check, few=3):
    """A quick check's drift in a few words: the first files named, then how many more."""
    items = [f + " changed" for f in check["changed"]] + [f + " missing" for f in check["missing"]] + \
        [f + " not installed by the build" for f in check["extra"]]
    if not items and check.get("last_verify"):
        items = [f for f in check["last_verify"]["named"]]
        lead = "its last verify (%s) found drift: " % check["last_verify"].get("time")
    else:
        lead = ""
    shown = ", ".join(_short(i) for i in items[:few])
    more = " and %d more" % (len(items) - few) if len(items) > few else ""
    return lead + shown + more


def _short(path):
    """A path under a venv as its site-packages-relative tail (lib/pythonX.Y/site-packages/ dropped)."""
    return re.sub(r"^lib/python[0-9.]+/site-packages/", "", path)


def op_quick(lay, a):
    return quick(lay, a["id"], a.get("jobs"))


def on_root(op):
    """An operation on the payload's root, which must be an absolute path."""
    def run(a):
        root = a.get("root")
        if not isinstance(root, str) or not os.path.isabs(root):
            raise AgentError("host root %r is not an absolute path" % (root,))
        return op(Layout(root), a)
    return run


OPS = {"seal": on_root(op_seal), "verify": on_root(op_verify), "quick": on_root(op_quick)}
