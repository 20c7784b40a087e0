"""Host agent (stdlib only): a generation back into stored wheels, each file first checked against its RECORD
(`record.check`, as `verify` checks).
Payload {op: pack, venv, out, root?, gen_dir?, allow_drift?, series?, filenames?, jobs?, workers?} or
{op: clean, root, dir};
`arcname` says where each installed file goes; patched files go back as shipped (`shipped_from_cache`)."""
import csv
import hashlib
import heapq
import io
import itertools
import os
import re
import shlex
import shutil
import stat
import struct
import time
import urllib.parse
import zipfile
import zlib
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed

from ..layout import Generation, Layout
from . import record
from .host import AgentError, emit, inside, read_json

# what installers write into a dist-info (and the signature of the RECORD written anew)
DROPPED = ("INSTALLER", "REQUESTED", "direct_url.json", "uv_cache.json", "RECORD", "RECORD.jws", "RECORD.p7s")
SHEBANG_SH = b"'''exec' "          # the /bin/sh trampoline installers write for an over-long interpreter path
SHEBANG_ARGS = b' "$0" "$@"'
PYTHON_NAME = re.compile(r"python(\d+(\.\d+)?)?w?\Z")     # bin/python, python3, python3.12


def skipped(rel):
    """Written at run time by the interpreter, never shipped in a wheel."""
    return rel.endswith(".pyc") or "__pycache__/" in rel


# ------------------------------------------------------------------ wheel names

def wheel_meta(site, info):
    """(tags in WHEEL's order, build tag or None) from the dist-info's WHEEL."""
    tags, build = [], None
    with open(os.path.join(site, info, "WHEEL"), encoding="utf-8", errors="replace") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k.strip() == "Tag" and v.strip():
                tags.append(v.strip())
            elif k.strip() == "Build" and v.strip():
                build = v.strip()
    if not tags:
        raise AgentError("%s/WHEEL names no Tag" % info)
    return tags, build


def compress_tags(tags):
    """PEP 425's compressed tag set: each component's values in the order they first appear, joined by '.'
    (py2-none-any + py3-none-any -> py2.py3-none-any)."""
    parts = ([], [], [])
    for t in tags:
        fields = t.split("-")
        if len(fields) != 3 or not all(fields):
            raise AgentError("bad wheel tag %r in WHEEL" % t)
        for seen, value in zip(parts, fields):
            if value not in seen:
                seen.append(value)
    return "-".join(".".join(p) for p in parts)


def source_tags(filename, tags):
    """The compressed tag set as `filename` (the wheel a distribution was installed from) spells it, when it
    stands for exactly `tags`; else None."""
    parts = filename[:-len(".whl")].split("-") if filename and filename.endswith(".whl") else []
    if len(parts) not in (5, 6):
        return None
    spelled = parts[-3:]
    expanded = {"-".join(t) for t in itertools.product(*(c.split(".") for c in spelled))}
    return "-".join(spelled) if expanded == set(tags) else None


def wheel_name(name, version, tags, build=None, source=None):
    """<name>-<version>[-<build>]-<tags>.whl with PEP 427/491 escaping: runs of -_. in the name become _, a
    lowercase name; - in the version (never in a normalized one) becomes _. The tags are spelled as in `source`,
    the file the distribution was installed from, where it names the same tags; else in WHEEL's order."""
    escaped = re.sub(r"[-_.]+", "_", name).lower()
    tagged = source_tags(source, tags) or compress_tags(tags)
    return "-".join([escaped, version.replace("-", "_")] + ([build] if build else []) + [tagged]) + ".whl"


def installed_from(site, info):
    """The file name of the wheel the installer recorded in direct_url.json (None when it recorded none)."""
    url = (read_json(os.path.join(site, info, "direct_url.json"), {}) or {}).get("url")
    if not isinstance(url, str):
        return None
    return os.path.basename(urllib.parse.unquote(urllib.parse.urlsplit(url).path)) or None


# ------------------------------------------------------------------ where each installed file goes

def entry_point_scripts(site, info):
    """Names of the console and GUI scripts the installer generates from entry_points.txt."""
    names, section = set(), None
    try:
        with open(os.path.join(site, info, "entry_points.txt"), encoding="utf-8", errors="replace") as f:
            for line in f:
                line = line.strip()
                if line.startswith("["):
                    section = line.strip("[]").strip()
                elif section in ("console_scripts", "gui_scripts") and "=" in line and not line.startswith(("#", ";")):
                    names.add(line.split("=", 1)[0].strip())
    except OSError:
        pass
    return names


def arcname(venv, site, full, rel, data_dir, scripts, py):
    """Where an installed file goes in the wheel: its RECORD path under site-packages; a file that climbs out
    goes to <data_dir>/scripts (bin/), headers (include/site/pythonX.Y/), data (the rest, by its path under
    the venv); None for a console/GUI script the installer writes from entry_points.txt."""
    if not rel.startswith("../") and not rel.startswith(".." + os.sep):
        return os.path.normpath(rel).replace(os.sep, "/")
    under = os.path.relpath(full, venv).replace(os.sep, "/")
    head, _, rest = under.partition("/")
    if head == "bin" and rest and "/" not in rest:
        return None if rest in scripts else "%s/scripts/%s" % (data_dir, rest)
    headers = "include/site/%s/" % py
    if under.startswith(headers) and under.count("/") > headers.count("/"):
        return "%s/headers/%s" % (data_dir, under[len(headers):].split("/", 1)[1])
    return "%s/data/%s" % (data_dir, under)


def installer_interpreter(path, bindirs):
    """Whether `path` (bytes, from a script's first line) names a Python of the venv whose bin/ is in `bindirs`:
    what an installer writes in place of `#!python`."""
    path = os.fsdecode(path)
    if not PYTHON_NAME.match(os.path.basename(path)):
        return False
    d = os.path.dirname(path)
    return os.path.normpath(d) in bindirs or os.path.realpath(d) in bindirs


def unshebang(data, bindirs):
    """A script as a wheel ships it: an interpreter line the installer wrote (a Python of the venv whose bin/ is
    in `bindirs`, directly or through the /bin/sh trampoline for an over-long path) back to `#!python`; any
    other script byte for byte."""
    first, nl, rest = data.partition(b"\n")
    if first == b"#!/bin/sh":             # #!/bin/sh, '''exec' PY "$0" "$@", ' ''', the script
        second, _, rest = rest.partition(b"\n")
        third, nl, body = rest.partition(b"\n")
        if third != b"' '''" or not second.startswith(SHEBANG_SH) or not second.endswith(SHEBANG_ARGS):
            return data
        try:
            words = shlex.split(second[len(SHEBANG_SH):-len(SHEBANG_ARGS)].decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return data
        if len(words) == 1 and installer_interpreter(os.fsencode(words[0]), bindirs):
            return b"#!python" + nl + body
        return data
    if first.startswith(b"#!") and installer_interpreter(first[2:], bindirs):
        return b"#!python" + (b"w" if first.endswith(b"pythonw") else b"") + nl + rest
    return data


# ------------------------------------------------------------------ one distribution

def plan_dist(venv, site, name, version, info, drift, restored, py, source=None):
    """([(arcname, source path, bytes or None, (digest, size) or None, mode)], wheel file name) of one
    distribution; missing files and paths outside the venv (named in the drift) are left out. `source`: the
    file name of the wheel it was installed from (its lock's), for the order of the tags."""
    tags, build = wheel_meta(site, info)
    data_dir = info[:-len(".dist-info")] + ".data"
    scripts = entry_point_scripts(site, info)
    bindirs = {os.path.normpath(os.path.join(venv, "bin")), os.path.realpath(os.path.join(venv, "bin"))}
    items, seen = [], set()
    for rel, full, algo, digest, size in record.entries(site, info, venv):
        if full is None or skipped(rel):
            continue
        if rel.startswith(info + "/") and rel[len(info) + 1:] in DROPPED:
            continue
        arc = arcname(venv, site, full, rel, data_dir, scripts, py)
        if arc is None or arc in seen:
            continue
        if not os.path.isfile(full):      # missing: named in the drift already
            continue
        seen.add(arc)
        mode = os.stat(full).st_mode
        data = restored.get(full)
        if arc.startswith(data_dir + "/scripts/"):
            with open(full, "rb") as f:
                data = unshebang(f.read(), bindirs)
        known = None
        if data is None and algo == "sha256" and digest and rel not in drift and size is not None:
            known = (digest, size)      # checked against RECORD just now: its digest stands
        items.append((arc, full, data, known, mode))
    items.sort(key=lambda it: (it[0].startswith(info + "/"), it[0].startswith(data_dir + "/"), it[0]))
    spelled = [f for f in (source, installed_from(site, info)) if source_tags(f, tags)]
    return items, wheel_name(name, version, tags, build, spelled[0] if spelled else None)


class StoredZip:
    """A stored (uncompressed) zip written front to back: each member's CRC-32 and size are known before its
    header is written, so nothing is sought back and the file's sha256 is taken as it is written (zip64 where
    a size, an offset or the member count needs it)."""

    TIME, DATE = 0, (1 << 5) | 1      # 1980-01-01 00:00:00: every pack of a generation gives the same bytes
    FLAGS = 0x800                     # names are UTF-8
    BIG = 0xFFFFFFFF

    def __init__(self, f):
        self.f, self.h, self.pos, self.members = f, hashlib.sha256(), 0, []

    def _write(self, b):
        self.f.write(b)
        self.h.update(b)
        self.pos += len(b)

    def add(self, name, crc, size, mode, chunks):
        """One member: `chunks` yield exactly `size` bytes whose CRC-32 is `crc`."""
        raw = name.encode("utf-8")
        extra = struct.pack("<HHQQ", 1, 16, size, size) if size >= self.BIG else b""
        small = min(size, self.BIG)
        offset = self.pos
        self._write(struct.pack("<IHHHHHIIIHH", 0x04034b50, 45 if extra else 20, self.FLAGS, 0, self.TIME,
                                self.DATE, crc, small, small, len(raw), len(extra)) + raw + extra)
        n = 0
        for chunk in chunks:
            self._write(chunk)
            n += len(chunk)
        if n != size:
            raise AgentError("%s changed size while it was packed (%d, then %d bytes)" % (name, size, n))
        perm = 0o755 if mode & 0o111 else 0o644
        self.members.append((raw, crc, size, (stat.S_IFREG | perm) << 16, offset))

    def close(self):
        """Write the central directory; returns the zip's sha256 (hex)."""
        start = self.pos
        for raw, crc, size, attr, offset in self.members:
            big = ([size, size] if size >= self.BIG else []) + ([offset] if offset >= self.BIG else [])
            extra = struct.pack("<HH" + "Q" * len(big), 1, 8 * len(big), *big) if big else b""
            need = 45 if extra else 20
            self._write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014b50, (3 << 8) | need, need, self.FLAGS, 0,
                                    self.TIME, self.DATE, crc, min(size, self.BIG), min(size, self.BIG), len(raw),
                                    len(extra), 0, 0, 0, attr, min(offset, self.BIG)) + raw + extra)
        size, count = self.pos - start, len(self.members)
        if count >= 0xFFFF or start >= self.BIG or size >= self.BIG:
            at = self.pos
            self._write(struct.pack("<IQHHIIQQQQ", 0x06064b50, 44, (3 << 8) | 45, 45, 0, 0, count, count, size, start))
            self._write(struct.pack("<IIQI", 0x07064b50, 0, at, 1))
        self._write(struct.pack("<IHHHHIIH", 0x06054b50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                                min(size, self.BIG), min(start, self.BIG), 0))
        return self.h.hexdigest()


def chunks_of(path, h=None):
    """A file's bytes in chunks of up to 1 MiB, each also fed to `h` when given. Each chunk is a view of one
    buffer per thread (record's), valid until the next is asked for."""
    buf = record.buffer()
    view = memoryview(buf)
    with open(path, "rb") as f:
        while True:
            n = f.readinto(buf)
            if not n:
                return
            if h is not None:
                h.update(view[:n])
            yield view[:n]


def crc_of(path):
    crc = 0
    for b in chunks_of(path):
        crc = zlib.crc32(b, crc)
    return crc


def crcs_of(paths):
    return [crc_of(p) for p in paths]


def bins(paths, n):
    """`paths` in `n` lists of about equal bytes (the largest first, each into the lightest list so far)."""
    heap = [(0, i, []) for i in range(max(1, n))]
    for p in sorted(paths, key=lambda x: -os.path.getsize(x)):
        size, i, items = heapq.heappop(heap)
        items.append(p)
        heapq.heappush(heap, (size + os.path.getsize(p), i, items))
    return [items for _, _, items in sorted(heap, key=lambda b: -b[0]) if items]


def write_wheel(path, info, items, crcs):
    """A stored wheel of `items` (file members' CRC-32 in `crcs`) with a fresh RECORD last; returns
    (members, bytes of content, sha256 of the wheel)."""
    rows, total = [], 0
    with open(path, "wb") as f:
        z = StoredZip(f)
        for arc, full, data, known, mode in items:
            if data is not None:
                z.add(arc, zlib.crc32(data), len(data), mode, [data])
                digest, size = record.b64digest(hashlib.sha256(data).digest()), len(data)
            else:
                size = os.path.getsize(full)
                h = None if known else hashlib.sha256()
                z.add(arc, crcs[full], size, mode, chunks_of(full, h))
                digest = known[0] if known else record.b64digest(h.digest())
            rows.append((arc, "sha256=" + digest, str(size)))
            total += size
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows(rows + [(info + "/RECORD", "", "")])
        text = out.getvalue().encode("utf-8")
        z.add(info + "/RECORD", zlib.crc32(text), len(text), 0o644, [text])
        sha = z.close()
    return len(rows), total, sha


def plan_one(args):
    return plan_dist(*args)


def build_one(out, name, version, info, items, filename, crcs):
    """Write one distribution's wheel into `out` (through a temp file); its row for the reply."""
    dest = os.path.join(out, filename)
    tmp = os.path.join(out, ".%s.tmp-%d" % (filename, os.getpid()))
    try:
        files, size, sha = write_wheel(tmp, info, items, crcs)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {"name": name, "version": version, "filename": filename, "sha256": sha, "size": os.path.getsize(dest),
            "files": files, "bytes": size, "sources": [full for _, full, data, _, _ in items if data is None]}


# ------------------------------------------------------------------ patches, drift

def restore_patched(site, series):
    """{absolute path: bytes as shipped} of the files a patch series changed, by reversing the series in memory
    (the patcher's own engine: exact context, nothing written)."""
    if not series:
        return {}
    from . import patcher

    infos = {n: info for n, _, info in record.dist_infos(site)}
    out = {}
    for s in series:
        info = infos.get(record.norm(s["package"]))
        if info is None:
            raise AgentError("patch series %s: %s is not installed here" % (s["name"], s["package"]))
        owned = {rel for rel, full, _, _, _ in record.entries(site, info, site) if full is not None}
        try:
            _, state, original = patcher.plan(site, [s], "revert", owned=owned)
        except patcher.PatchFailed as e:
            raise AgentError("cannot recover the shipped files: %s" % e)
        for path, lines in state.items():
            if lines != original[path]:
                out[os.path.normpath(path)] = "".join(lines).encode("utf-8")
    return out


def shipped_from_cache(chk, site, gen, wheels_dir):
    """{absolute path: bytes as shipped} of the files the generation's patches changed (its manifest names them),
    read from the generation's own wheels in the host's cache (its requirements.txt names each by hash)."""
    man = read_json(gen.manifest, {}) or {}
    patched = set(((man.get("patches") or {}).get("files") or {}))
    owners = {name: [rel for rel in d["changed"] if rel in patched] for name, d in chk["dists"].items()}
    owners = {n: rels for n, rels in owners.items() if rels}
    if not owners:
        return {}
    wheels = {}
    try:
        with open(gen.requirements) as f:
            for line in f:
                m = re.match(r"^(\S+) @ file://(\S+) --hash=sha256:[0-9a-f]{64}$", line.strip())
                if m:
                    wheels[record.norm(m.group(1))] = m.group(2)
    except OSError:
        return {}
    out = {}
    for name, rels in owners.items():
        path = wheels.get(name)
        if not path or not os.path.isfile(path):
            continue
        with zipfile.ZipFile(inside(wheels_dir, path)) as z:
            have = set(z.namelist())
            for rel in rels:
                if rel in have:
                    out[os.path.normpath(os.path.join(site, rel))] = z.read(rel)
    return out


def drift_of(chk, site, restored):
    """{name: [paths]} of the files that no longer match their RECORD, once patched files are taken back to
    what was shipped; bytecode is left out (never packed)."""
    drift = {}
    for name, d in sorted(chk["dists"].items()):
        bad = []
        for rel in d["changed"]:
            if skipped(rel):
                continue
            full = os.path.normpath(os.path.join(site, rel))
            if full in restored and restored_ok(site, d["info"], rel, restored[full]):
                continue
            bad.append(rel)
        bad += [rel for rel in d["missing"] + d["outside"] if not skipped(rel)]
        if bad:
            drift[name] = sorted(set(bad))
    return drift


def restored_ok(site, info, rel, data):
    """Whether bytes recovered by reversing a patch are what RECORD says was installed."""
    want = next((digest for r, _, algo, digest, _ in record.entries(site, info, site) if r == rel), None)
    return want == record.b64digest(hashlib.sha256(data).digest())


# ------------------------------------------------------------------ the agent

def op_pack(a):
    venv, out = a["venv"], a["out"]
    if not os.path.isabs(out) or "\0" in out:
        raise AgentError("output folder %r is not an absolute path" % out)
    workers = a.get("workers") if a.get("workers") in ("threads", "processes") else "processes"
    cores = os.cpu_count() or 1
    jobs = int(a.get("jobs") or (cores if workers == "processes" else min(32, cores * 2)))
    threads = int(a.get("jobs") or record.jobs_default())   # the check's and the read's, as `verify` runs them
    t0 = time.perf_counter()
    site = record.site_packages(venv)
    if site is None:
        raise AgentError("no site-packages under %s" % venv)
    chk = record.check(venv, jobs=threads)
    restored = restore_patched(site, a.get("series") or [])
    if a.get("gen_dir") and a.get("root"):
        lay = Layout(a["root"])
        restored.update(shipped_from_cache(chk, site, Generation(inside(lay.root, a["gen_dir"])), lay.wheel_cache))
    drift = drift_of(chk, site, restored)
    t_check = time.perf_counter() - t0
    emit({"_event": {"step": "check", "files": chk["files"], "bytes": chk["bytes"], "seconds": t_check,
                     "drift": sum(map(len, drift.values()))}})
    if drift and not a.get("allow_drift"):
        return {"refused": "drift", "drift": drift, "check_seconds": t_check, "files": chk["files"]}
    py = os.path.basename(os.path.dirname(site))
    dists = sorted(chk["dists"].items(), key=lambda kv: -kv[1]["bytes"])
    os.makedirs(out, exist_ok=True)
    results, errors = {}, []

    t1 = time.perf_counter()
    wheel_files = {record.norm(n): f for n, f in (a.get("filenames") or {}).items() if isinstance(f, str)}
    # a file another distribution overwrote goes in as found, hashed afresh (its RECORD digest is the lost copy's)
    todo = [(venv, site, name, d["version"], d["info"], sorted(set(drift.get(name, [])) | set(d["overwritten"])),
             restored, py, wheel_files.get(name)) for name, d in dists
            if d["info"] + "/RECORD" not in d["missing"]]     # no RECORD: nothing says what the dist is (drift)
    with pool(workers, jobs) as ex:
        plans = dict(zip([t[2] for t in todo], ex.map(plan_one, todo)))
        # every member's CRC-32 first, all files at once (the largest first), so each wheel is then written
        # front to back; a large distribution's files are spread over every worker
        sources = bins({full for items, _ in plans.values() for _, full, data, _, _ in items if data is None},
                       jobs * 4 if workers == "processes" else jobs * 64)
        t_plan = time.perf_counter()
        crcs = {p: c for share, got in zip(sources, ex.map(crcs_of, sources)) for p, c in zip(share, got)}
        t_crc = time.perf_counter()
        futures = {}
        for name, d in dists:
            if name in plans:
                items, filename = plans[name]
                mine = {full: crcs[full] for _, full, data, _, _ in items if data is None}
                futures[ex.submit(build_one, out, name, d["version"], d["info"], items, filename, mine)] = name
        for fut in as_completed(futures):
            name = futures[fut]
            try:
                results[name] = fut.result()
            except (OSError, AgentError) as e:
                errors.append("%s: %s" % (name, getattr(e, "strerror", None) or e))
            emit({"_event": {"step": "pack", "done": len(results) + len(errors), "total": len(futures),
                             "name": name}})
    results.update({n: None for n, _ in dists if n not in plans})
    t_pack = time.perf_counter() - t1
    if errors:
        more = " (and %d more)" % (len(errors) - 1) if len(errors) > 1 else ""
        raise AgentError("cannot pack %s%s" % (errors[0], more))
    unpacked = sorted(n for n, r in results.items() if r is None)
    results = {n: r for n, r in results.items() if r is not None}
    sources = [p for r in results.values() for p in r.pop("sources")]
    t_read, read_bytes = record.read_all(sources, threads)
    return {"site": site, "python": py, "wheels": [results[n] for n in sorted(results)],
            "unpacked": unpacked,
            "drift": drift, "extra": len([e for e in chk["extra"] if not skipped(e)]),
            "files": chk["files"], "bytes": chk["bytes"],
            "read_bytes": read_bytes,
            "seconds": {"check": t_check, "pack": t_pack, "read": t_read, "pack_plan": t_plan - t1,
                        "pack_crc": t_crc - t_plan, "pack_write": t1 + t_pack - t_crc}, "jobs": jobs,
            "workers": workers}


def pool(workers, jobs):
    """`jobs` worker processes (forked: they share this process's modules, the agent bundle included) or
    threads. Processes spread the per-file interpreter work too; threads share one interpreter lock."""
    if workers == "processes":
        import multiprocessing

        return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork"))
    return ThreadPoolExecutor(max_workers=jobs)


def op_clean(a):
    """Remove a pack's temporary folder under the host root's tmp/."""
    tmp = Layout(a["root"]).tmp
    path = inside(tmp, a["dir"])
    if os.path.realpath(path) == os.path.realpath(tmp):
        raise AgentError("refusing to remove %s itself" % path)
    shutil.rmtree(path, ignore_errors=True)
    return {"removed": path}


OPS = {"pack": op_pack, "clean": op_clean}
