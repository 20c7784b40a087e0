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
import time
import urllib.parse
import zipfile
import zlib
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, ThreadPoolExecutor, wait

from ..layout import Generation, Layout
from . import record
from .host import AgentError, inside, read_json

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

def plan_dist(venv, site, name, version, info, restored, py, source=None):
    """([(arcname, source path, bytes or None, mode, size)], wheel file name, {path: (digest, bytes)} of the
    files read here) of one distribution; a file it lists that is not there is left for the RECORD check to
    name. `restored`: {path: bytes as shipped} of patched files, packed (and checked) in their place; a script
    is read here, checked as installed and packed as shipped. `source`: the file name of the wheel it was
    installed from (its lock's), for the order of the tags."""
    tags, build = wheel_meta(site, info)
    data_dir = info[:-len(".dist-info")] + ".data"
    scripts = entry_point_scripts(site, info)
    bindirs = {os.path.normpath(os.path.join(venv, "bin")), os.path.realpath(os.path.join(venv, "bin"))}
    items, seen, found = [], set(), {}
    for rel, full, algo, digest, size in record.entries(site, info, venv):
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
SPLIT = 1 << 24       # a larger file is deflated in pieces of this size, by several workers at once
PIECE = 1 << 24       # about this many bytes read per task of the pool
# formats that are compressed already: stored as they are (deflate would spend time and save nothing)
COMPRESSED = (".gz", ".tgz", ".bz2", ".xz", ".lzma", ".zst", ".lz4", ".zip", ".whl", ".jar", ".egg", ".7z",
              ".png", ".jpg", ".jpeg", ".gif", ".webp", ".ico", ".mp3", ".mp4", ".ogg", ".woff", ".woff2", ".npz")
STORED, DEFLATED = 0, 8


def deflate(data, level, last=True):
    """Raw deflate of `data` by a compressor of its own: ends the stream (`last`), or at a byte boundary
    with the stream open, so that pieces deflated apart are one stream once put end to end."""
    c = zlib.compressobj(level, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)


def stored(name, head, level):
    """Whether a member goes in as it is: at level 0, in a compressed format (by its name), or when deflate
    takes less than a tenth off its first block `head`. The bytes alone decide: a generation packs the same."""
    if level == 0 or not head or name.lower().endswith(COMPRESSED):
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


def read_piece(part, segments, level):
    """One task of the pool: each segment read once, and as it is read hashed (sha256 of a whole file: the
    RECORD check), its CRC-32 taken and it deflated or stored into the file `part`. A segment is
    (kind, path, offset, length, store, name, last): kind "file" (a whole file), "chunk" (`length` bytes of a
    larger file from `offset`, `last` or not; `store` decided for the whole file) or "check" (hashed only,
    nothing written). Returns per segment (digest or None, CRC-32, bytes read, bytes written, offset in `part`,
    stored, `part`); a file gone has digest None, one that cannot be read "" (the RECORD check names both)."""
    out, pos = [], 0
    with open(part, "wb") if part else io.BytesIO() as w:
        for kind, path, offset, length, store, name, last in segments:
            if kind == "check":
                try:
                    digest, n = record.hash_file(path)
                except FileNotFoundError:
                    digest, n = None, 0
                except OSError:
                    digest, n = "", 0
                out.append((digest, 0, n, 0, 0, True, part))
                continue
            with open(path, "rb", buffering=0) as f:
                if kind == "chunk":
                    data = os.pread(f.fileno(), length, offset)
                    if len(data) != length:
                        raise AgentError("%s changed size while it was packed" % path)
                else:
                    data = f.read()
            digest = None
            if kind == "file":
                digest = record.b64digest(hashlib.sha256(data).digest())
                store = stored(name, data[:BLOCK], level)
            body = data if store else deflate(data, level, last)
            if kind == "file" and len(body) >= len(data):     # deflate made it no smaller: as it is
                body, store = data, True
            w.write(body)
            out.append((digest, zlib.crc32(data), len(data), len(body), pos, store, part))
            pos += len(body)
    return out


def digest_of(path):
    """sha256 (as RECORD writes it) and size of one large file, read through (its pieces are deflated apart)."""
    try:
        return record.hash_file(path)
    except FileNotFoundError:
        return None, 0


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


def spans(sources):
    """The bytes of a member's pieces, in order, from the part files the tasks wrote."""
    for part, offset, length in sources:
        with open(part, "rb", buffering=0) as f:
            f.seek(offset)
            left = length
            while left:
                b = f.read(min(left, record.CHUNK))
                if not b:
                    raise AgentError("part %s ended early" % part)
                left -= len(b)
                yield b


def write_wheel(path, info, members, level):
    """The wheel at `path`: `members` in order, each (arcname, mode, bytes) to deflate or store here, or
    (arcname, mode, method, CRC-32, size, stored size, digest, [(part file, offset, length)]) written by the
    tasks; then a fresh RECORD. Returns (members, bytes of content, sha256 of the wheel, methods used)."""
    rows, total, used = [], 0, {STORED: 0, DEFLATED: 0}
    with open(path, "wb") as f:
        z = Zip(f)

        def add_data(arc, mode, data):
            store = stored(arc, data[:BLOCK], level)
            body = data if store else deflate(data, level)
            if len(body) >= len(data):
                body, store = data, True
            method = STORED if store else DEFLATED
            z.add(arc, method, zlib.crc32(data), len(data), len(body), mode, [body])
            used[method] += 1

        for m in members:
            if len(m) == 3:
                arc, mode, data = m
                add_data(arc, mode, data)
                digest, size = record.b64digest(hashlib.sha256(data).digest()), len(data)
            else:
                arc, mode, method, crc, size, csize, digest, sources = m
                z.add(arc, method, crc, size, csize, mode, spans(sources))
                used[method] += 1
            rows.append((arc, "sha256=" + digest, str(size)))
            total += size
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows(rows + [(info + "/RECORD", "", "")])
        add_data(info + "/RECORD", 0o644, out.getvalue().encode("utf-8"))
        sha = z.close()
    return len(rows), total, sha, used


def build_one(out, name, version, info, members, filename, level):
    """Write one distribution's wheel into `out` under a temporary name (it takes its own once the whole
    generation proved clean, or drift is allowed); its row for the reply, with `tmp`."""
    tmp = os.path.join(out, ".%s.tmp-%d" % (filename, os.getpid()))
    try:
        files, size, sha, used = write_wheel(tmp, info, members, level)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return {"name": name, "version": version, "filename": filename, "sha256": sha, "size": os.path.getsize(tmp),
            "files": files, "bytes": size, "stored": used[STORED], "deflated": used[DEFLATED], "tmp": tmp}


def tasks_of(plans, check_only, level, parts):
    """The pool's work: per distribution, its members' segments in pieces of about PIECE bytes (a file larger
    than SPLIT in pieces of its own that several workers deflate at once, and read through once more for its
    sha256: a "digest" task), and the files only checked. Returns (tasks, segments per distribution: [(member
    index, segment)]); a task is (dist or None, kind, args)."""
    tasks, segs_of, n = [], {}, itertools.count()

    def piece(name, segs):
        if segs:
            tasks.append((name, "piece", (os.path.join(parts, "%d" % next(n)) if name else None, segs, level)))

    for name, (items, _, _) in plans.items():
        cur, cur_bytes, mine = [], 0, []
        for i, (arc, full, data, mode, size) in enumerate(items):
            if data is not None:
                continue
            if size > SPLIT:
                with open(full, "rb") as f:
                    store = stored(arc, f.read(BLOCK), level)
                for off in range(0, size, SPLIT):
                    seg = ("chunk", full, off, min(SPLIT, size - off), store, arc, off + SPLIT >= size)
                    mine.append((i, seg))
                    piece(name, [seg])
                tasks.append((name, "digest", (full,)))
                continue
            seg = ("file", full, 0, size, None, arc, True)
            mine.append((i, seg))
            cur.append(seg)
            cur_bytes += size
            if cur_bytes >= PIECE or len(cur) >= 512:
                piece(name, cur)
                cur, cur_bytes = [], 0
        piece(name, cur)
        segs_of[name] = mine
    for share in bins(check_only, max(1, len(check_only) // 256)):
        piece(None, [("check", p, 0, 0, True, p, True) for p in share])
    tasks.sort(key=lambda t: -sum(seg[3] for seg in t[2][1]) if t[1] == "piece" else -record.size_of(t[2][0]))
    return tasks, segs_of


def pack_all(ex, tasks, segs_of, plans, dists, out, level, meter, found):
    """Run the tasks on the pool, the largest first; a distribution's wheel is written (by the pool too) as
    soon as its segments are all in. Fills `found` ({path: (digest, bytes read)}); returns {name: wheel row}."""
    left = {name: 0 for name in plans}
    seg_out, errors, results, futures = {}, [], {}, {}

    def wheel(name):
        mine = {seg: seg_out[seg] for _, seg in segs_of[name]}
        digests = {seg[1]: found[seg[1]][0] for _, seg in segs_of[name] if seg[0] == "chunk"}
        fut = ex.submit(assemble, out, name, dists[name], plans[name], segs_of[name], mine, digests, level)
        futures[fut] = (name, "wheel", ())

    for name, kind, args in tasks:
        futures[ex.submit(read_piece if kind == "piece" else digest_of, *args)] = (name, kind, args)
        if name:
            left[name] += 1
    for name in plans:
        if not left[name]:
            wheel(name)
    while futures:
        done, _ = wait(futures, return_when=FIRST_COMPLETED)
        for fut in done:
            name, kind, args = futures.pop(fut)
            try:
                got = fut.result()
            except (OSError, AgentError) as e:
                errors.append("%s: %s" % (name or "check", getattr(e, "strerror", None) or e))
                continue
            if kind == "wheel":
                results[name] = got
                continue
            if kind == "digest":
                found[args[0]] = got
                meter.add(1, 0)
            else:
                files = 0
                for seg, res in zip(args[1], got):
                    seg_out[seg] = res
                    if seg[0] != "chunk":
                        found[seg[1]] = (res[0], res[2])
                        files += 1
                meter.add(files, sum(r[2] for r in got))
            if name:
                left[name] -= 1
                if not left[name]:
                    wheel(name)
    if errors:
        for r in results.values():
            os.unlink(r["tmp"])
        more = " (and %d more)" % (len(errors) - 1) if len(errors) > 1 else ""
        raise AgentError("cannot pack %s%s" % (errors[0], more))
    return results


def assemble(out, name, dist, plan, segs, seg_out, digests, level):
    """One distribution's wheel from its plan and what the tasks made of its segments (`digests`: the sha256 of
    each file deflated in pieces)."""
    items, filename, _ = plan
    by_item = {}
    for i, seg in segs:
        by_item.setdefault(i, []).append(seg)
    members = []
    for i, (arc, full, data, mode, size) in enumerate(items):
        if data is not None:
            members.append((arc, mode, data))
            continue
        got = [seg_out[s] for s in by_item[i]]
        crc, n = got[0][1], got[0][2]
        for _, c, k, _, _, _, _ in got[1:]:
            crc = crc32_combine(crc, c, k)
            n += k
        digest = digests[full] if full in digests else got[0][0]
        if not digest:
            raise AgentError("%s vanished while it was packed" % full)
        members.append((arc, mode, STORED if got[0][5] else DEFLATED, crc, n, sum(g[3] for g in got), digest,
                        [(g[6], g[4], g[3]) for g in got]))
    return build_one(out, name, dist["version"], dist["info"], members, filename, level)


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


# ------------------------------------------------------------------ the agent

def op_pack(a):
    """Every file read once: hashed against its RECORD, deflated (or stored) into its wheel, on a pool of one
    process per core; the wheels take their names only once the whole generation proved clean (or drift is
    allowed). Then a first read of the same files from disk, the yardstick (`seconds.read`)."""
    venv, out = a["venv"], a["out"]
    if not os.path.isabs(out) or "\0" in out:
        raise AgentError("output folder %r is not an absolute path" % out)
    workers = a.get("workers") if a.get("workers") in ("threads", "processes") else "processes"
    cores = os.cpu_count() or 1
    jobs = int(a.get("jobs") or (cores if workers == "processes" else min(32, cores * 2)))
    level = a.get("level")
    level = level if isinstance(level, int) and not isinstance(level, bool) and 0 <= level <= 9 else 1
    site = record.site_packages(venv)
    if site is None:
        raise AgentError("no site-packages under %s" % venv)
    with record.Meter("pack", a.get("progress_every")) as meter:
        meter.phase("plan")
        t0 = time.perf_counter()
        lst = record.listing(venv)
        restored = restore_patched(site, a.get("series") or [])
        if a.get("gen_dir") and a.get("root"):
            lay = Layout(a["root"])
            restored.update(shipped_from_cache(site, Generation(inside(lay.root, a["gen_dir"])), lay.wheel_cache,
                                               lst))
        py = os.path.basename(os.path.dirname(site))
        wheel_files = {record.norm(n): f for n, f in (a.get("filenames") or {}).items() if isinstance(f, str)}
        todo = [(venv, site, name, d["version"], d["info"], restored, py, wheel_files.get(name))
                for name, d in sorted(lst["dists"].items())
                if d["info"] + "/RECORD" not in d["missing"]]     # no RECORD: nothing says what the dist is (drift)
        os.makedirs(out, exist_ok=True)
        parts = os.path.join(out, ".pack-parts-%d" % os.getpid())
        os.makedirs(parts, exist_ok=True)
        try:
            with pool(workers, jobs) as ex:
                plans = dict(zip([t[2] for t in todo], ex.map(plan_one, todo)))
                found = {p: f for _, _, got in plans.values() for p, f in got.items()}   # read while planning
                packed = {full for items, _, _ in plans.values() for _, full, data, _, _ in items if data is None}
                check_only = sorted({w[2] for w in lst["work"] if not skipped(w[1])} - packed - set(found))
                tasks, segs_of = tasks_of(plans, check_only, level, parts)
                reads = sorted(packed | set(check_only))
                t_plan = time.perf_counter() - t0
                record.drop(reads)                  # the pack reads from disk, as the yardstick will
                meter.phase("pack", len(reads), sum(map(record.size_of, reads)))
                t1 = time.perf_counter()
                results = pack_all(ex, tasks, segs_of, plans, lst["dists"], out, level, meter, found)
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
    return {"site": site, "python": py, "wheels": [results[n] for n in sorted(results)],
            "unpacked": sorted(n for n in lst["dists"] if n not in plans), "drift": drift,
            "extra": len([e for e in record.unlisted(site, lst["listed"]) if not skipped(e)]),
            "files": len(reads), "bytes": sum(found[p][1] for p in reads if p in found), "read_bytes": read_bytes,
            "cache": how, "level": level, "seconds": {"plan": t_plan, "pack": t_pack, "read": t_read},
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
