"""Host agent (stdlib only): a generation against what it was built from. `seal` (the build's last step: files
read-only, a stamp of every file, a full check), `verify` (RECORD hashes, patched files' hashes, every file against
the stamp) and `quick` (rollback's check: stats against the stamp); `drift` is the one judgement both share.
"""
import json
import os
import re
import stat
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from ..layout import Layout
from . import kernels, record, store
from .host import CLEAN_ENV, AgentError, inside, read_json

# Run by the generation's own interpreter (-I -S -B: no site, no bytecode written) on a JSON list of paths of
# __pycache__ files: {path: null when it is that interpreter's compile of its source, else why not}. Code objects
# are compared (marshal's bytes depend on reference counts), with what `==` leaves out that matters to running.
OWN_BYTECODE = r"""
import json, marshal, os, sys, types
from importlib.util import MAGIC_NUMBER
def same(a, b):
    if a != b:
        return False
    if isinstance(a, types.CodeType):
        if (a.co_stacksize, a.co_nlocals, getattr(a, "co_qualname", a.co_name)) != \
                (b.co_stacksize, b.co_nlocals, getattr(b, "co_qualname", b.co_name)):
            return False
        return all(same(x, y) for x, y in zip(a.co_consts, b.co_consts))
    return True
def why(pyc):
    d, name = os.path.split(pyc)
    parts = name.split(".")
    opt = parts[2] if len(parts) == 4 else "opt-0"
    if len(parts) not in (3, 4) or parts[1] != sys.implementation.cache_tag or opt not in ("opt-0", "opt-1", "opt-2"):
        return "not this interpreter's bytecode (%s)" % sys.implementation.cache_tag
    src = os.path.join(os.path.dirname(d), parts[0] + ".py")
    try:
        with open(pyc, "rb") as f:
            data = f.read()
        with open(src, "rb") as f:
            source = f.read()
    except OSError as e:
        return "no source %s" % os.path.basename(src) if e.filename == src else "unreadable (%s)" % e.strerror
    if data[:4] != MAGIC_NUMBER or int.from_bytes(data[4:8], "little") not in (0, 1, 3):
        return "not this interpreter's bytecode (%s)" % sys.implementation.cache_tag
    try:
        code = marshal.loads(data[16:])
        want = compile(source, src, "exec", dont_inherit=True, optimize=int(opt[4:]))
    except Exception as e:
        return "does not load (%s)" % type(e).__name__
    return None if same(code, want) else "not what its source compiles to"
print(json.dumps({p: why(p) for p in json.load(sys.stdin)}))
"""


def generation(lay, gen_id):
    """The paths of one generation (layout.Generation), contained under the root's generations. Its stamp.json,
    beside the venv: the seal's {venv, files: {path under the venv: [size, mtime_ns, ctime_ns, ino, digest,
    stored]}}, or an adoption's {venv, adopted: {prefix, scope, files}} (`adopt`)."""
    if not isinstance(gen_id, str) or "/" in gen_id or gen_id in ("", ".", ".."):
        raise AgentError("bad generation id %r" % (gen_id,))
    gen = lay.gen(gen_id)
    inside(lay.generations, gen.dir)
    if not os.path.isdir(gen.dir):
        raise AgentError("no generation %s under %s" % (gen_id, lay.root))
    return gen


def walk(venv):
    """(path under the venv, lstat) of every file and symlink in the venv, bytecode included."""
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
                    stack.append((e.path, prefix + e.name + "/"))
                    continue
                yield prefix + e.name, e.stat(follow_symlinks=False)
            except OSError:
                continue


def cache_file(rel):
    """Whether `rel` is where the interpreter writes its bytecode cache (`__pycache__/NAME.TAG[.opt-N].pyc`):
    a .pyc anywhere else is never the interpreter's own, and one there may be written at run time."""
    return rel.endswith(".pyc") and os.path.basename(os.path.dirname(rel)) == "__pycache__"


def read_only(venv, stored=frozenset()):
    """Clear every installed file's write bits (as a Nix store is read-only); directories stay writable so the
    patcher can still replace a file by rename. Returns {files, shared}: `shared` counts files whose inode has
    another link (uv hardlinked it from its cache or another venv: a write through it would reach them) and is
    not one of `stored`, the immutable store entries ((st_dev, st_ino)) the build linked."""
    files = shared = 0
    for rel, st in walk(venv):
        if not stat.S_ISREG(st.st_mode):
            continue
        files += 1
        if st.st_nlink > 1 and (st.st_dev, st.st_ino) not in stored:
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


def stored(lay, venv):
    """{absolute path: (digest, size)} of the venv's files that are links to the host's store entry of their
    RECORD hash: their bytes were hashed on the way into the store, which is immutable since."""
    site = record.site_packages(venv)
    out = {}
    for _, _, info in record.dist_infos(site) if site else []:
        try:
            rows = record.entries(site, info, venv)
        except OSError:
            continue
        for _, path, algo, digest, _ in rows:
            if path is None or algo != "sha256" or not digest:
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and store.linked(lay.file_store, path, st, digest):
                out[path] = (digest, st.st_size)
    return out


def op_seal(lay, a):
    """After the build (which made the files read-only) and its patches (which keep a file's mode): a full check
    (RECORD and patch hashes, the distributions installed; files linked from the store are not read again),
    then the stamp of every file that rollback's quick check compares with, store links marked."""
    gen = generation(lay, a["id"])
    venv = gen.venv
    t0 = time.monotonic()
    patched = patched_files(gen)
    known = stored(lay, venv)
    site = record.site_packages(venv)
    for rel in patched:             # a patched file is the generation's own (the patcher made it so): hashed
        known.pop(os.path.normpath(os.path.join(site or venv, rel)), None)
    out = full(venv, patched, a.get("jobs"), digests=True, known=known)
    digests = out.pop("digests")
    creator = record.creator_files(site) if site else []
    out["extra"] = [e for e in out["extra"] if e not in creator]     # what `uv venv` wrote: stamped below
    out["outside_code"] = record.outside_code(venv)
    files, todo = {}, []
    for rel, st in walk(venv):
        full_path = os.path.join(venv, rel)
        files[rel] = _signature(st) + [digests.get(full_path), 1 if full_path in known else 0]
        if files[rel][4] is None:
            todo.append((rel, full_path, st))
    with ThreadPoolExecutor(max_workers=a.get("jobs") or record.jobs_default()) as ex:
        for (rel, full_path, st), d in zip(todo, ex.map(lambda x: _safe_digest(x[1], x[2]), todo)):
            files[rel][4] = d
    tmp = "%s.tmp-%d" % (gen.stamp, os.getpid())
    with open(tmp, "w") as f:
        f.write(json.dumps({"venv": venv, "files": files}, separators=(",", ":")))
    os.replace(tmp, gen.stamp)
    out["files"] -= len(known)              # what was read and hashed; the store's links are counted apart
    out["bytes"] -= sum(n for _, n in known.values())
    out.update(stamped=len(files), seal_seconds=time.monotonic() - t0, stored=len(known),
               stored_bytes=sum(n for _, n in known.values()))
    return out


def _moved(files, path, st, w):
    """Whether a file's stat differs from its stamp [size, mtime, ctime, inode, digest, stored]. A link to the
    host's store (`files`) is trusted only while it is the entry of its digest and that entry's stat is the one
    its last proof left (`store.linked`): its own ctime moves whenever another generation links or unlinks the
    entry, the proof's moves with it only where provision did the linking."""
    if len(w) > 5 and w[5]:
        return st.st_size != w[0] or not store.linked(files, path, st, w[4])
    return _signature(st) != w[:4]


def _safe_digest(full_path, st):
    try:
        return _digest(full_path, st)
    except OSError:
        return None


def full(venv, patched, jobs=None, baseline=False, digests=False, known=None):
    """record.check of the venv with the patched files' hashes in place of RECORD's, as one JSON-able result:
    {dists: {name: {version, files, bytes, changed, missing, outside, overwritten, patched}}, extra, unclaimed_patches,
    files, bytes, seconds, read_seconds?}."""
    res = record.check(venv, jobs=jobs, expect=patched, baseline=baseline, digests=digests, known=known)
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


def _bytecode_cache(gen):
    """Where a generation keeps the stat of each __pycache__ file its interpreter was found to have compiled from
    its source (written at run time, after the seal): a file whose stat still matches is not compiled again."""
    return os.path.join(gen.dir, "bytecode.json")


def own_bytecode(gen, found, jobs=None):
    """{rel: why} of the __pycache__ files `found` ({rel: lstat}) that are not the generation's interpreter's
    compile of their source: each is compiled again by that interpreter (isolated, without site) and its code
    compared, unless the cache says it was, with the same stat. Proven ones are cached."""
    cache_path = _bytecode_cache(gen)
    cache = read_json(cache_path, {}) or {}
    cache = cache if isinstance(cache, dict) else {}
    todo = sorted(rel for rel, st in found.items() if cache.get(rel) != _signature(st))
    bad = {}
    if todo:
        n = max(1, min(jobs or os.cpu_count() or 1, os.cpu_count() or 1, (len(todo) + 99) // 100))
        chunks = [todo[i::n] for i in range(n)]

        def run(chunk):
            paths = [os.path.join(gen.venv, rel) for rel in chunk]
            try:
                p = subprocess.run([gen.python, "-I", "-S", "-B", "-c", OWN_BYTECODE], input=json.dumps(paths),
                                   capture_output=True, text=True, env=CLEAN_ENV, cwd="/", timeout=900)
                got = json.loads(p.stdout) if p.returncode == 0 else p.stderr.strip().splitlines()[-1:]
            except (OSError, ValueError, subprocess.TimeoutExpired) as e:
                got = [str(e)]
            if not isinstance(got, dict):
                why = "not checked: %s gave no answer (%s)" % (gen.python, (got or ["exit status"])[0][:100])
                got = {}
            else:
                why = "not checked"
            return {rel: got.get(path, why) for rel, path in zip(chunk, paths)}
        with ThreadPoolExecutor(max_workers=n) as ex:
            for res in ex.map(run, chunks):
                bad.update({rel: w for rel, w in res.items() if w is not None})
    keep = {rel: _signature(st) for rel, st in found.items() if rel not in bad}
    if keep != cache:
        try:
            tmp = "%s.tmp-%d" % (cache_path, os.getpid())
            with open(tmp, "w") as f:
                f.write(json.dumps(keep, separators=(",", ":")))
            os.replace(tmp, cache_path)
        except OSError:
            pass        # a cache: the next check compiles them again
    return bad


ADOPTED_SCOPE = ("bin", "pyvenv.cfg")    # what an adoption records, with the creator's files in site-packages


def adoption_scope(venv):
    """What an adoption records of `venv` besides what RECORD lists: bin/ (every script and the interpreter
    links), pyvenv.cfg (present or not: one that appears makes a prefix a venv) and the files the venv's creator
    wrote into site-packages (record.CREATOR_WRITES), as paths under the venv."""
    site = record.site_packages(venv)
    under = os.path.relpath(site, venv) + "/" if site else ""
    return list(ADOPTED_SCOPE) + [under + n for n in (record.creator_files(site) if site else [])]


def scoped(venv, scope):
    """(path under the venv, lstat) of each file and link of `scope`, a directory walked."""
    for top in scope:
        full = os.path.join(venv, top)
        try:
            st = os.lstat(full)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            for rel, sub in walk(full):
                yield top + "/" + rel, sub
        else:
            yield top, st


def adopt(gen, prefix):
    """The record of an adopted generation's files that no RECORD lists (`adoption_scope`), as the seal's stamp
    records a built one's: [size, mtime_ns, ctime_ns, ino, sha256 or "->link target", 0] each, in stamp.json
    (`adopted`: a seal's reader of an older version finds no stamp there). Returns {recorded, scope}."""
    venv = gen.venv
    scope = adoption_scope(venv)
    files = {rel: _signature(st) + [_safe_digest(os.path.join(venv, rel), st), 0]
             for rel, st in scoped(venv, scope) if not cache_file(rel)}
    tmp = "%s.tmp-%d" % (gen.stamp, os.getpid())
    with open(tmp, "w") as f:
        f.write(json.dumps({"venv": venv, "adopted": {"prefix": prefix, "scope": scope, "files": files}},
                           separators=(",", ":")))
    os.replace(tmp, gen.stamp)
    return {"recorded": len(files), "scope": scope}


def record_of(gen):
    """(how, files, scope) of what the generation's stamp.json records: ("stamp", files, None) the seal's, every
    file of the venv; ("adopted", files, scope) an adoption's; ("record", {}, None) none (adopted or built by an
    older version): only RECORD can be checked."""
    stamp = read_json(gen.stamp, None)
    if not isinstance(stamp, dict) or stamp.get("venv") != gen.venv:
        return "record", {}, None
    if isinstance(stamp.get("files"), dict):
        return "stamp", stamp["files"], None
    rec = stamp.get("adopted")
    if isinstance(rec, dict) and isinstance(rec.get("files"), dict) and isinstance(rec.get("scope"), list) and \
            all(isinstance(x, str) and x and not x.startswith("/") and ".." not in x.split("/") for x in rec["scope"]):
        return "adopted", rec["files"], rec["scope"]
    return "record", {}, None


def drift(lay, gen, jobs=None, every=False, known=None):
    """What a generation holds that its record did not: the one judgement of the files that `verify`,
    rollback's check and status (through verify's record) share. Against the stamp (the seal's: every file of
    the venv; an adoption's: `adoption_scope`): bytes that differ from those recorded (`changed`), recorded
    files gone (`missing`), files the record did not see (`extra`: a .pyc outside __pycache__ among them, where
    the interpreter never writes one); and `bytecode` {rel: why}: __pycache__ files, unrecorded or since
    rewritten, that are not the interpreter's compile of their source. Besides the venv: `generation`, what
    differs in the generation's own files that steer what runs (kernels.env), and `outside_code`
    (record.outside_code). `every`: hash every file (verify), not only those whose stat differs (rollback);
    `known`: {absolute path: digest} hashed already. Without a record (how=record: adopted or built by an older
    version) only site-packages' bytecode is judged here, `unchecked` names what cannot be, and the caller checks
    RECORD; `creator`: the creator's files in site-packages (no RECORD lists them) that this judgement covers,
    recorded or unchecked. Returns {how, changed, missing, extra, bytecode, generation, outside_code, unchecked,
    creator, files, hashed, bytes, hash_seconds, bytecode_checked, seconds}."""
    t0 = time.monotonic()
    venv = gen.venv
    how, want, scope = record_of(gen)
    site = record.site_packages(venv)
    under = os.path.relpath(site, venv) + "/" if site else ""
    changed, extra, suspects, cached, seen = [], [], [], {}, set()
    if how == "stamp":
        found = walk(venv)
    else:       # site-packages' bytecode (an adopted prefix's own stdlib is not what RECORD checks), the record's
        for rel, st in walk(site) if site else ():
            if cache_file(rel):
                cached[under + rel] = st
        found = scoped(venv, scope) if how == "adopted" else ()
    for rel, st in found:
        seen.add(rel)
        w = want.get(rel)
        if w is None and cache_file(rel):
            cached[rel] = st
        elif w is None:
            extra.append(rel)
        elif every or _moved(lay.file_store, os.path.join(venv, rel), st, w):
            suspects.append((rel, st, w[4]))
    missing = sorted(set(want) - seen)
    known = {os.path.normpath(k): v for k, v in (known or {}).items()}
    todo = [s for s in suspects if os.path.normpath(os.path.join(venv, s[0])) not in known]
    with ThreadPoolExecutor(max_workers=jobs or record.jobs_default()) as ex:
        got = dict(zip((s[0] for s in todo), ex.map(lambda s: _safe_digest(os.path.join(venv, s[0]), s[1]), todo)))
    nbytes = sum(s[1].st_size for s in todo if stat.S_ISREG(s[1].st_mode))
    for rel, st, d in suspects:
        g = got[rel] if rel in got else known[os.path.normpath(os.path.join(venv, rel))]
        if g is not None and g == d:
            continue
        if cache_file(rel):      # the interpreter rewrites its cache of a touched source
            cached[rel] = st
        else:
            changed.append(rel)
    hash_seconds = time.monotonic() - t0
    moved = [r for r in changed + missing + extra if r == "pyvenv.cfg" or r.startswith("bin/python")]
    if moved:        # the interpreter itself drifted: it does not judge its bytecode
        bytecode = {rel: "not checked: %s drifted" % moved[0] for rel in cached}
    else:
        bytecode = own_bytecode(gen, cached, jobs)
    if how == "record":
        creator = record.creator_files(site) if site else []
        unchecked = ["bin/", "pyvenv.cfg", "the bin/python link"] + [under + n for n in creator]
    else:
        creator, unchecked = [n for n in record.CREATOR_WRITES if under + n in want], []
    steer = [why for why in [kernels.env_drift(lay, gen.dir)] if why]
    return {"how": how, "changed": sorted(changed), "missing": missing, "extra": sorted(extra),
            "bytecode": dict(sorted(bytecode.items())), "generation": steer,
            "outside_code": record.outside_code(venv) if site else [], "unchecked": unchecked, "creator": creator,
            "files": len(want), "hashed": len(todo), "bytes": nbytes, "hash_seconds": hash_seconds,
            "bytecode_checked": len(cached), "seconds": time.monotonic() - t0}


def op_verify(lay, a):
    """Every file of the generation against its RECORD (patched files against their recorded hashes) and against
    its record (`drift`: what RECORD does not name, kernels.env, code outside the venv: `sealed`,
    `outside_code`); with `baseline`, hashed from disk (each file's page
    cache dropped first) and then a first read of the same files from disk timed (`read_seconds`,
    `read_bytes`, `cache`: how). A progress event every `progress_every` seconds."""
    gen = generation(lay, a["id"])
    if not os.path.isdir(gen.venv):
        raise AgentError("generation %s has no venv (removed when it failed or was abandoned)" % a["id"])
    man = read_json(gen.manifest, {}) or {}
    baseline = bool(a.get("baseline"))
    with record.Meter("verify", a.get("progress_every")) as meter:
        stamped = sealed_files(gen) if baseline else []
        if baseline:
            record.drop(stamped)        # what `drift` hashes besides RECORD's files comes from disk too
        out = full(gen.venv, patched_files(gen), a.get("jobs"), baseline=baseline, digests=True)
        known = out.pop("digests")
        meter.phase("seal")
        d = drift(lay, gen, a.get("jobs"), every=True, known=known)
        if baseline:
            meter.phase("read")
            seconds, n, out["cache"] = record.first_read([p for p in stamped if p not in known], a.get("jobs"))
            out["read_seconds"] = out.pop("first_read_seconds") + seconds
            out["read_bytes"] += n
    site = out["site"]
    out["extra"] = [e for e in out["extra"] if e not in d["creator"]]     # the record's to judge (or unchecked)
    said = {os.path.normpath(os.path.join(site, rel)) for dist in out["dists"].values()
            for k in ("changed", "missing", "outside") for rel in dist[k]}
    said |= {os.path.normpath(os.path.join(site, rel)) for rel in out["extra"]}

    def unsaid(rels):
        return [r for r in rels if os.path.normpath(os.path.join(gen.venv, r)) not in said]
    out["sealed"] = {"how": d["how"], "changed": unsaid(d["changed"]), "missing": unsaid(d["missing"]),
                     "extra": unsaid(d["extra"]), "bytecode": d["bytecode"], "generation": d["generation"],
                     "unchecked": d["unchecked"]}
    out["outside_code"] = d["outside_code"]
    out["files"] += d["hashed"]
    out["bytes"] += d["bytes"]
    out["seconds"] += d["hash_seconds"]
    out.update(id=a["id"], installer=man.get("installer"), jobs=a.get("jobs") or record.jobs_default(),
               bytecode_checked=d["bytecode_checked"])
    return out


def sealed_files(gen):
    """The regular files the generation's stamp names (absolute, normalized paths): those `drift` hashes."""
    stamp = read_json(gen.stamp, None)
    files = stamp.get("files") if isinstance(stamp, dict) and stamp.get("venv") == gen.venv else None
    if not isinstance(files, dict):
        return []
    return [os.path.normpath(os.path.join(gen.venv, rel)) for rel, sig in files.items()
            if isinstance(sig, list) and len(sig) >= 5 and isinstance(sig[4], str) and not sig[4].startswith("->")]


def quick(lay, gen_id, jobs=None):
    """Rollback's check of one generation: `drift` with every file's stat against the stamp its build (or its
    adoption) wrote; a file whose stat differs is hashed and compared with the stamp's digest (a touched but
    unchanged file is clean). A generation without a seal's stamp (adopted, or built before stamps) gets the full
    RECORD check too. The last `verify`'s drift counts too. Returns {verdict: clean|drift, how:
    stamp|adopted|record, changed, missing, extra, bytecode, generation, outside_code, unchecked, files, hashed,
    seconds}."""
    t0 = time.monotonic()
    gen = generation(lay, gen_id)
    venv = gen.venv
    changed, missing, extra, bytecode, hashed, steer, outside, unchecked = [], [], [], {}, 0, [], [], []
    if not os.path.isdir(venv):
        how, files, missing = "record", 0, ["venv"]
    else:
        d = drift(lay, gen, jobs)
        how, files, hashed = d["how"], d["files"], d["hashed"]
        changed, missing, extra, bytecode = d["changed"], d["missing"], d["extra"], d["bytecode"]
        steer, unchecked = d["generation"], d["unchecked"]
        outside = ["%s: %s" % (o["dist"] or o["file"], o["why"]) for o in d["outside_code"]]
    if how != "stamp" and missing != ["venv"]:
        try:
            res = full(venv, patched_files(gen), jobs)
        except OSError as e:
            res = {"site": venv, "dists": {}, "extra": [], "unclaimed_patches": [str(e)], "files": 0}
        said = set()
        for name, dist in sorted(res["dists"].items()):
            said |= {os.path.normpath(os.path.join(res["site"], r)) for r in dist["changed"] + dist["missing"]}
        here = lambda rels: [r for r in rels if os.path.normpath(os.path.join(venv, r)) not in said]  # noqa: E731
        changed, missing = here(changed), here(missing)
        for name, dist in sorted(res["dists"].items()):
            changed += dist["changed"] + dist["outside"]
            missing += dist["missing"]
        extra += [e for e in res["extra"] if e not in d["creator"]]
        missing += res["unclaimed_patches"]
        files += res["files"]
        hashed += res["files"]
    man = read_json(gen.manifest, {}) or {}
    last = man.get("verify") or {}
    drifted = bool(changed or missing or extra or bytecode or steer or outside)
    out = {"id": gen_id, "how": how, "changed": sorted(changed), "missing": sorted(missing), "extra": sorted(extra),
           "bytecode": bytecode, "generation": steer, "outside_code": outside, "unchecked": unchecked,
           "files": files, "hashed": hashed, "seconds": time.monotonic() - t0}
    if last.get("verdict") == "drift" and not drifted:      # what hashes found that a stat cannot see (bit rot)
        out["last_verify"] = {"time": last.get("time"), "named": last.get("named") or []}
        drifted = True
    out["verdict"] = "drift" if drifted else "clean"
    out["named"] = named(out) if drifted else ""
    return out


def named(check, few=3):
    """A quick check's drift in a few words: the first files named, then how many more."""
    new = "not recorded at adoption" if check.get("how") == "adopted" else "not installed by the build"
    items = list(check.get("generation") or []) + list(check.get("outside_code") or []) + \
        [f + " changed" for f in check["changed"]] + [f + " missing" for f in check["missing"]] + \
        ["%s %s" % (f, new) for f in check["extra"]] + \
        ["%s: %s" % (f, why) for f, why in sorted((check.get("bytecode") or {}).items())]
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
