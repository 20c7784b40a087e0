"""Host agent (stdlib only): a generation back into wheels, each file read once: checked against its RECORD (as
`verify` judges, `record.tally`) and deflated, or stored when its content is compressed already, as it is read.
Payload {op: pack, venv, out, root?, gen_dir?, allow_drift?, series?, filenames?, jobs?, workers?, level?,
progress_every?} or {op: clean, root, dir};
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
import threading
import time
import urllib.parse
import zipfile
import zlib
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, ThreadPoolExecutor, wait

from ..layout import Generation, Layout
from . import record
from .host import AgentError, inside, read_json, thread_buffer

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

def plan_dist(venv, site, name, version, info, restored, py, source=None, rows=None):
    """([(arcname, source path, bytes or None, mode, size)], wheel file name, {path: (digest, bytes)} of the
    files read here) of one distribution; a file it lists that is not there is left for the RECORD check to
    name. `restored`: {path: bytes as shipped} of patched files, packed (and checked) in their place; a script
    is read here, checked as installed and packed as shipped. `source`: the file name of the wheel it was
    installed from (its lock's), for the order of the tags; `rows`: its RECORD's `entries`, when read already."""
    tags, build = wheel_meta(site, info)
    data_dir = info[:-len(".dist-info")] + ".data"
    scripts = entry_point_scripts(site, info)
    bindirs = {os.path.normpath(os.path.join(venv, "bin")), os.path.realpath(os.path.join(venv, "bin"))}
    items, seen, found = [], set(), {}
    for rel, full, algo, digest, size in record.entries(site, info, venv) if rows is None else rows:
        if full is None or skipped(rel):
            continue
        if rel.startswith(info + "/") and rel[len(info) + 1:] in DROPPED:
            continue
        arc = arcname(venv, site, full, rel, data_dir, scripts, py)
        if arc is None or arc in seen:
            continue
        try:
            st = os.stat(full)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        seen.add(arc)
        data = restored.get(full)
        if data is not None:
            found[full] = (record.b64digest(hashlib.sha256(data).digest()), len(data))
        elif arc.startswith(data_dir + "/scripts/"):
            with open(full, "rb") as f:
                raw = f.read()
            found[full] = (record.b64digest(hashlib.sha256(raw).digest()), len(raw))
            data = unshebang(raw, bindirs)
        items.append((arc, full, data, st.st_mode, len(data) if data is not None else st.st_size))
    items.sort(key=lambda it: (it[0].startswith(info + "/"), it[0].startswith(data_dir + "/"), it[0]))
    spelled = [f for f in (source, installed_from(site, info)) if source_tags(f, tags)]
    return items, wheel_name(name, version, tags, build, spelled[0] if spelled else None), found


def plan_one(args):
    return plan_dist(*args)


# ------------------------------------------------------------------ members: stored or deflated

BLOCK = 1 << 16       # the first block of a file that deflate is tried on, to decide how it goes in
SPLIT = 1 << 24       # a larger file is read by tasks of its own: deflated in pieces of this size at once
# formats that are compressed already: stored as they are (deflate would spend time and save nothing)
COMPRESSED = (".gz", ".tgz", ".bz2", ".xz", ".lzma", ".zst", ".lz4", ".zip", ".whl", ".jar", ".egg", ".7z",
              ".png", ".jpg", ".jpeg", ".gif", ".webp", ".ico", ".mp3", ".mp4", ".ogg", ".woff", ".woff2", ".npz")
STORED, DEFLATED = 0, 8
AHEAD = 4             # threads of each wheel's task that ask the kernel to read its small files ahead
# Unless told a level, every member is stored: the same generation packs to the same bytes on every host, at the
# speed of reading it (deflate at level 1 costs about 10 CPU-seconds per GB: several times the read on a small host).
DEFAULT_LEVEL = 0


def deflate(data, level, last=True):
    """Raw deflate of `data` by a compressor of its own: ends the stream (`last`), or at a byte boundary
    with the stream open, so that pieces deflated apart are one stream once put end to end."""
    c = zlib.compressobj(level, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)


def stored(name, head, level):
    """Whether a member goes in as it is: at level 0, in a compressed format (by its name), or when deflate
    takes less than a tenth off its first block `head`. The bytes alone decide: a generation packs the same."""
    if level == 0 or not len(head) or name.lower().endswith(COMPRESSED):
        return True
    return len(deflate(head[:BLOCK], 1)) > 0.9 * len(head[:BLOCK])


def crc32_combine(crc1, crc2, len2):
    """The CRC-32 of A+B from CRC-32(A), CRC-32(B) and len(B) (zlib's crc32_combine, which Python's zlib
    does not expose): the CRC of a file deflated in pieces."""
    def times(mat, vec):
        out, i = 0, 0
        while vec:
            if vec & 1:
                out ^= mat[i]
            vec >>= 1
            i += 1
        return out

    def square(mat):
        return [times(mat, mat[n]) for n in range(32)]

    if len2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]      # the operator for one zero bit
    even = square(odd)                                    # two zero bits
    odd = square(even)                                    # four
    while True:
        even = square(odd)
        if len2 & 1:
            crc1 = times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = square(even)
        if len2 & 1:
            crc1 = times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


def big_buffer():
    """This worker's buffer of SPLIT bytes (reused: a fresh one per file would cost its page faults)."""
    return thread_buffer("big", SPLIT)[:SPLIT]


def read_whole(path):
    """A file of at most SPLIT bytes, read into this worker's buffer: a view of its bytes."""
    buf = big_buffer()
    view, n = memoryview(buf), 0
    with open(path, "rb", buffering=0) as f:
        while n < len(buf):
            k = f.readinto(view[n:])
            if not k:
                break
            n += k
        if n == len(buf) and f.read(1):
            raise AgentError("%s grew while it was packed" % path)
    return view[:n]


def deflate_piece(part, path, offset, length, last, level):
    """One piece of a large file, read once and deflated into the file `part`: (CRC-32, bytes read, bytes
    written)."""
    view = memoryview(big_buffer())[:length]
    fd = os.open(path, os.O_RDONLY)
    try:
        n = os.preadv(fd, [view], offset)
    finally:
        os.close(fd)
    if n != length:
        raise AgentError("%s changed size while it was packed" % path)
    body = deflate(view, level, last)
    with open(part, "wb") as f:
        f.write(body)
    return zlib.crc32(view), n, len(body)


def digest_of(path):
    """(sha256 as RECORD writes it, CRC-32, size) of a large file, read through once."""
    h, crc, n = hashlib.sha256(), 0, 0
    buf = record.buffer()
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                break
            h.update(view[:k])
            crc = zlib.crc32(view[:k], crc)
            n += k
    return record.b64digest(h.digest()), crc, n


def check_files(paths):
    """[(digest or None when gone or "" when unreadable, bytes)] of files that are checked but not packed."""
    out = []
    for path in paths:
        try:
            out.append(record.hash_file(path))
        except FileNotFoundError:
            out.append((None, 0))
        except OSError:
            out.append(("", 0))
    return out


class Zip:
    """A zip written front to back: each member's CRC-32 and sizes are known before its header is written, so
    nothing is sought back, and the file's sha256 is taken as it is written (zip64 where a size, an offset or
    the member count needs it)."""

    TIME, DATE = 0, (1 << 5) | 1      # 1980-01-01 00:00:00: every pack of a generation gives the same bytes
    FLAGS = 0x800                     # names are UTF-8
    BIG = 0xFFFFFFFF

    def __init__(self, f):
        self.f, self.h, self.pos, self.members = f, hashlib.sha256(), 0, []

    def _write(self, b):
        self.f.write(b)
        self.h.update(b)
        self.pos += len(b)

    def add(self, name, method, crc, size, csize, mode, chunks):
        """One member: `chunks` yield exactly `csize` bytes (deflated or, when `method` is STORED, as they are),
        `size` bytes once inflated, whose CRC-32 is `crc`."""
        raw = name.encode("utf-8")
        big = size >= self.BIG or csize >= self.BIG
        extra = struct.pack("<HHQQ", 1, 16, size, csize) if big else b""
        offset = self.pos
        self._write(struct.pack("<IHHHHHIIIHH", 0x04034b50, 45 if big else 20, self.FLAGS, method, self.TIME,
                                self.DATE, crc, self.BIG if big else csize, self.BIG if big else size, len(raw),
                                len(extra)) + raw + extra)
        n = 0
        for chunk in chunks:
            self._write(chunk)
            n += len(chunk)
        if n != csize:
            raise AgentError("%s changed while it was packed (%d, then %d bytes)" % (name, csize, n))
        perm = 0o755 if mode & 0o111 else 0o644
        self.members.append((raw, method, crc, size, csize, (stat.S_IFREG | perm) << 16, offset))

    def close(self):
        """Write the central directory; returns the zip's sha256 (hex)."""
        start = self.pos
        for raw, method, crc, size, csize, attr, offset in self.members:
            big = [v for v in (size, csize, offset) if v >= self.BIG]
            extra = struct.pack("<HH" + "Q" * len(big), 1, 8 * len(big), *big) if big else b""
            need = 45 if extra else 20
            self._write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014b50, (3 << 8) | need, need, self.FLAGS, method,
                                    self.TIME, self.DATE, crc, min(csize, self.BIG), min(size, self.BIG), len(raw),
                                    len(extra), 0, 0, 0, attr, min(offset, self.BIG)) + raw + extra)
        size, count = self.pos - start, len(self.members)
        if count >= 0xFFFF or start >= self.BIG or size >= self.BIG:
            at = self.pos
            self._write(struct.pack("<IQHHIIQQQQ", 0x06064b50, 44, (3 << 8) | 45, 45, 0, 0, count, count, size, start))
            self._write(struct.pack("<IIQI", 0x07064b50, 0, at, 1))
        self._write(struct.pack("<IHHHHIIH", 0x06054b50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                                min(size, self.BIG), min(start, self.BIG), 0))
        return self.h.hexdigest()


def prefetch(paths):
    """Ask the kernel to read `paths` ahead (posix_fadvise WILLNEED starts the reads and returns), so that reading
    many small files one after another waits on the disk once, not once a file."""
    record.advise(paths, getattr(os, "POSIX_FADV_WILLNEED", 3))


def copy_file(path, size):
    """A large stored file's bytes, as read now (the size it had when its CRC-32 was taken, or an error)."""
    buf = record.buffer()
    view, n = memoryview(buf), 0
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                break
            n += k
            yield view[:k]
    if n != size:
        raise AgentError("%s changed size while it was packed" % path)


def copy_parts(parts):
    for part in parts:
        with open(part, "rb") as f:
            yield f.read()


def write_dist(out, name, version, info, items, filename, level, big):
    """One distribution's wheel, written front to back into `out` under a temporary name (it takes its own once
    the whole generation proved clean, or drift is allowed): each file of `items` read once here, hashed (the
    RECORD check), its CRC-32 taken and deflated or stored as it is read; a file larger than SPLIT comes from
    the tasks that read it (`big`: {path: {digest, crc, size, parts: [part files] when deflated}}); then a
    fresh RECORD. Returns its row for the reply (with `tmp`) and {path: (digest, bytes)} of the files read."""
    rows, total, used, found = [], 0, {STORED: 0, DEFLATED: 0}, {}
    tmp = os.path.join(out, ".%s.tmp-%d" % (filename, os.getpid()))
    small = [it[1] for it in items if it[2] is None and it[1] not in big]
    for i in range(AHEAD):          # each thread every AHEAD-th file: the disk sees several reads at once
        threading.Thread(target=prefetch, args=(small[i::AHEAD],), daemon=True).start()
    try:
        with open(tmp, "wb") as f:
            z = Zip(f)

            def add(arc, mode, data):
                store = stored(arc, data[:BLOCK], level)
                body = data if store else deflate(data, level)
                if len(body) >= len(data):         # deflate made it no smaller: as it is
                    body, store = data, True
                method = STORED if store else DEFLATED
                z.add(arc, method, zlib.crc32(data), len(data), len(body), mode, [body])
                used[method] += 1

            for arc, full, data, mode, size in items:
                if data is not None:
                    add(arc, mode, data)
                    digest, size = record.b64digest(hashlib.sha256(data).digest()), len(data)
                elif full in big:
                    b = big[full]
                    digest, size = b["digest"], b["size"]
                    if b.get("parts"):
                        z.add(arc, DEFLATED, b["crc"], size, b["csize"], mode, copy_parts(b["parts"]))
                        used[DEFLATED] += 1
                    else:
                        z.add(arc, STORED, b["crc"], size, size, mode, copy_file(full, size))
                        used[STORED] += 1
                else:
                    data = read_whole(full)
                    digest, size = record.b64digest(hashlib.sha256(data).digest()), len(data)
                    found[full] = (digest, size)
                    add(arc, mode, data)
                rows.append((arc, "sha256=" + digest, str(size)))
                total += size
            text = io.StringIO()
            csv.writer(text, lineterminator="\n").writerows(rows + [(info + "/RECORD", "", "")])
            add(info + "/RECORD", 0o644, text.getvalue().encode("utf-8"))
            sha = z.close()
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return {"name": name, "version": version, "filename": filename, "sha256": sha, "size": os.path.getsize(tmp),
            "files": len(rows), "bytes": total, "stored": used[STORED], "deflated": used[DEFLATED],
            "tmp": tmp}, found


def pack_all(ex, plans, dists, check_only, out, parts, level, meter, found):
    """Every file read once on the pool: each distribution's wheel by one task (`write_dist`), once the tasks
    that read its files larger than SPLIT are done (their pieces deflated by several workers at once, and the
    whole file read through for its sha256 and CRC-32), the largest first; and the files only checked. Fills
    `found` ({path: (digest, bytes read)}); returns {name: wheel row}."""
    big, waits, futures, results, errors = {}, {}, {}, {}, []
    n = itertools.count()

    def submit(fn, args, what):
        futures[ex.submit(fn, *args)] = what

    for name, (items, _, _) in plans.items():
        for arc, full, data, mode, size in items:
            if data is None and size > SPLIT:
                with open(full, "rb") as f:
                    store = stored(arc, f.read(BLOCK), level)
                big[full] = {"store": store, "size": size, "pieces": {}}
                waits.setdefault(name, set()).add(full)
    for full in sorted(big, key=lambda p: -big[p]["size"]):
        submit(digest_of, (full,), ("digest", full))
        if not big[full]["store"]:
            size = big[full]["size"]
            for off in range(0, size, SPLIT):
                part = os.path.join(parts, "%d" % next(n))
                submit(deflate_piece, (part, full, off, min(SPLIT, size - off), off + SPLIT >= size, level),
                       ("piece", full, off, part))
    for share in bins(check_only, max(1, len(check_only) // 256)):
        submit(check_files, (share,), ("check", share))

    def wheel(name):
        items, filename, _ = plans[name]
        mine = {full: big[full] for full in {it[1] for it in items} if full in big}
        submit(write_dist, (out, name, dists[name]["version"], dists[name]["info"], items, filename, level, mine),
               ("wheel", name))

    for name in sorted(plans, key=lambda x: -dists[x]["bytes"]):
        if name not in waits:
            wheel(name)
    owners = {}
    for name, fulls in waits.items():
        for full in fulls:
            owners.setdefault(full, []).append(name)
    while futures:
        done, _ = wait(futures, return_when=FIRST_COMPLETED)
        for fut in done:
            what = futures.pop(fut)
            try:
                got = fut.result()
            except (OSError, AgentError) as e:
                errors.append("%s: %s" % (what[1] if isinstance(what[1], str) else "check",
                                          getattr(e, "strerror", None) or e))
                continue
            kind, full = what[0], what[1]
            if kind == "wheel":
                results[full], files = got
                found.update(files)
                meter.add(len(files), sum(k for _, k in files.values()))
                continue
            if kind == "check":
                found.update(zip(full, got))
                meter.add(len(got), sum(k for _, k in got))
                continue
            b = big[full]
            if kind == "digest":
                b["digest"], b["crc_whole"], b["read"] = got
                found[full] = (b["digest"], b["read"])
                meter.add(1, 0 if not b["store"] else b["read"])
            else:
                b["pieces"][what[2]] = (what[3],) + got
                meter.add(0, got[1])
            if "digest" in b and (b["store"] or sum(p[2] for p in b["pieces"].values()) == b["size"]):
                if b["read"] != b["size"]:
                    errors.append("%s: changed size while it was packed" % full)
                    continue
                pieces = [b["pieces"][off] for off in sorted(b["pieces"])]
                b["crc"] = b["crc_whole"]
                if pieces:
                    crc = pieces[0][1]
                    for _, c, k, _ in pieces[1:]:
                        crc = crc32_combine(crc, c, k)
                    if crc != b["crc"]:       # its pieces are not the bytes hashed
                        errors.append("%s: changed while it was packed" % full)
                        continue
                    b.update(parts=[p[0] for p in pieces], csize=sum(p[3] for p in pieces))
                for name in owners.pop(full, []):
                    waits[name].discard(full)
                    if not waits[name]:
                        wheel(name)
    if errors:
        for r in results.values():
            os.unlink(r["tmp"])
        more = " (and %d more)" % (len(errors) - 1) if len(errors) > 1 else ""
        raise AgentError("cannot pack %s%s" % (errors[0], more))
    return results


def bins(paths, n):
    """`paths` in `n` lists of about equal bytes (the largest first, each into the lightest list so far)."""
    heap = [(0, i, []) for i in range(max(1, n))]
    for p in sorted(paths, key=lambda x: -record.size_of(x)):
        size, i, items = heapq.heappop(heap)
        items.append(p)
        heapq.heappush(heap, (size + record.size_of(p), i, items))
    return [items for _, _, items in sorted(heap, key=lambda b: -b[0]) if items]


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


def shipped_from_cache(site, gen, wheels_dir, lst):
    """{absolute path: bytes as shipped} of the files the generation's patches changed (its manifest names them),
    read from the generation's own wheels in the host's cache (its requirements.txt names each by hash)."""
    man = read_json(gen.manifest, {}) or {}
    patched = set(((man.get("patches") or {}).get("files") or {}))
    owners = {}
    for name, rel, _, _, _ in lst["work"]:
        if rel in patched:
            owners.setdefault(name, []).append(rel)
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


def drift_of(lst):
    """{name: [paths]} of the files that no longer match their RECORD (a patched file as shipped counts as the
    file), missing or outside the venv; bytecode is left out (never packed)."""
    drift = {}
    for name, d in sorted(lst["dists"].items()):
        bad = [rel for rel in d["changed"] + d["missing"] + d["outside"] if not skipped(rel)]
        if bad:
            drift[name] = sorted(set(bad))
    return drift


def unpackable(venv, site, lst):
    """[{dist, version, path, why}] of what no wheel holds truthfully, each named with the path that says so: a
    distribution without RECORD (nothing says which files are its), an egg-info one (no RECORD either), an
    editable or development install and any other code the venv runs from outside itself (a wheel of it would
    point the rebuild at this host's tree, or lose it: record.outside_code)."""
    out = []
    for name, d in sorted(lst["dists"].items()):
        if d["info"] + "/RECORD" in d["missing"]:
            out.append({"dist": name, "version": d["version"], "path": os.path.join(site, d["info"]),
                        "why": "no RECORD: nothing says which files are its"})
    for fn in sorted(os.listdir(site)):
        if fn.endswith((".egg-info", ".egg")) and not fn.startswith("."):
            out.append({"dist": fn.rsplit(".", 1)[0], "version": None, "path": os.path.join(site, fn),
                        "why": "an egg, not a wheel's install: no RECORD says which files are its"})
    infos = {name: d["info"] for name, d in lst["dists"].items()}
    groups = {}
    for o in record.outside_code(venv):
        owned = o["dist"] in infos and o["version"] is not None
        key = (o["dist"], o["version"]) if owned else (o["dist"] or o["file"], None, o["file"])
        groups.setdefault(key, []).append(o)
    for key, found in sorted(groups.items(), key=lambda kv: str(kv[0])):
        where = ", ".join("%s (%s)" % (o["where"], os.path.basename(o["file"])) for o in found)
        if len(key) == 2:
            out.append({"dist": key[0], "version": key[1], "path": os.path.join(site, infos[key[0]]),
                        "why": "an editable install: the code it runs is outside the environment, at %s; a wheel "
                               "of it would point the rebuild at this host's source tree" % where})
        elif key[2].endswith(".egg-link"):
            out.append({"dist": key[0], "version": None, "path": os.path.join(site, key[2]),
                        "why": "a development install (.egg-link): its code and metadata are outside the "
                               "environment, at %s; no wheel holds them" % found[0]["where"]})
        else:
            out.append({"dist": key[0], "version": None, "path": os.path.join(site, key[2]),
                        "why": "puts %s on the path: code outside the environment, which no wheel holds"
                               % ", ".join(o["where"] for o in found)})
    return out


# ------------------------------------------------------------------ the agent

def op_pack(a):
    """Every file read once: hashed against its RECORD, deflated (or stored) into its wheel, on a pool of one
    process per core; the wheels take their names only once the whole generation proved clean (or drift is
    allowed). What no wheel holds truthfully (`unpackable`) refuses the pack before anything is written. Then a
    first read of the same files from disk, the yardstick (`seconds.read`)."""
    venv, out = a["venv"], a["out"]
    if not os.path.isabs(out) or "\0" in out:
        raise AgentError("output folder %r is not an absolute path" % out)
    workers = a.get("workers") if a.get("workers") in ("threads", "processes") else "processes"
    cores = os.cpu_count() or 1
    jobs = int(a.get("jobs") or (cores if workers == "processes" else min(32, cores * 2)))
    level, auto = a.get("level"), False
    if not (isinstance(level, int) and not isinstance(level, bool) and 0 <= level <= 9):
        level, auto = DEFAULT_LEVEL, True
    site = record.site_packages(venv)
    if site is None:
        raise AgentError("no site-packages under %s" % venv)
    with record.Meter("pack", a.get("progress_every")) as meter:
        meter.phase("plan")
        t0 = time.perf_counter()
        lst = record.listing(venv)
        refuse = unpackable(venv, site, lst)
        if refuse:                          # before anything is written
            return {"refused": "unpackable", "unpackable": refuse}
        restored = restore_patched(site, a.get("series") or [])
        if a.get("gen_dir") and a.get("root"):
            lay = Layout(a["root"])
            restored.update(shipped_from_cache(site, Generation(inside(lay.root, a["gen_dir"])), lay.wheel_cache,
                                               lst))
        py = os.path.basename(os.path.dirname(site))
        wheel_files = {record.norm(n): f for n, f in (a.get("filenames") or {}).items() if isinstance(f, str)}
        todo = [(venv, site, name, d["version"], d["info"], restored, py, wheel_files.get(name), lst["rows"][name])
                for name, d in sorted(lst["dists"].items())
                if d["info"] + "/RECORD" not in d["missing"]]     # none left: refused above (`unpackable`)
        os.makedirs(out, exist_ok=True)
        parts = os.path.join(out, ".pack-parts-%d" % os.getpid())
        os.makedirs(parts, exist_ok=True)
        try:
            with pool(workers, jobs) as ex:
                plans = dict(zip([t[2] for t in todo], ex.map(plan_one, todo)))
                found = {p: f for _, _, got in plans.values() for p, f in got.items()}   # read while planning
                packed = {full for items, _, _ in plans.values() for _, full, data, _, _ in items if data is None}
                check_only = sorted({w[2] for w in lst["work"] if not skipped(w[1])} - packed - set(found))
                reads = sorted(packed | set(check_only))
                t_plan = time.perf_counter() - t0
                record.drop(reads)                  # the pack reads from disk, as the yardstick will
                meter.phase("pack", len(reads), sum(map(record.size_of, reads)))
                t1 = time.perf_counter()
                results = pack_all(ex, plans, lst["dists"], check_only, out, parts, level, meter, found)
                t_pack = time.perf_counter() - t1
        finally:
            shutil.rmtree(parts, ignore_errors=True)
        checked = [w for w in lst["work"] if not skipped(w[1])]
        record.tally(lst, ((w,) + tuple(found.get(w[2], (None, 0))) for w in checked))
        drift = drift_of(lst)
        if drift and not a.get("allow_drift"):
            for r in results.values():
                os.unlink(r["tmp"])
            return {"refused": "drift", "drift": drift, "files": len(reads)}
        for r in results.values():
            os.replace(r.pop("tmp"), os.path.join(out, r["filename"]))
        meter.phase("read", len(reads), sum(map(record.size_of, reads)))
        t_read, read_bytes, how = record.first_read(reads, a.get("jobs") or record.jobs_default())
        meter.phase("extra")
        extra = [e for e in record.unlisted(site, lst["listed"]) if not skipped(e)]
    return {"site": site, "python": py, "wheels": [results[n] for n in sorted(results)],
            "drift": drift, "extra": len(extra),
            "files": len(reads), "bytes": sum(found[p][1] for p in reads if p in found), "read_bytes": read_bytes,
            "cache": how, "level": level, "level_auto": auto,
            "seconds": {"plan": t_plan, "pack": t_pack, "read": t_read},
            "jobs": jobs, "workers": workers}


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
