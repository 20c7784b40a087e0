"""The host's content-addressed file store (stdlib only): one read-only inode per file content, named by the sha256
its wheel's RECORD gives it, hard-linked by every generation that installed it; immutable where the filesystem and
privileges allow (FS_IMMUTABLE_FL), so that no write through any of its names reaches the others.
"""
import array
import base64
import contextlib
import errno
import fcntl
import hashlib
import os
import re
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from . import record
from .host import AgentError

GETFLAGS, SETFLAGS, IMMUTABLE = 0x80086601, 0x40086602, 0x10     # linux/fs.h: FS_IOC_[GS]ETFLAGS, FS_IMMUTABLE_FL
MTIME_NS = 1000000000      # every entry's mtime (1 s, as the Nix store's): a write through a cleared flag moves it
TMP = ".part-"             # an entry or a link being made: <name>.part-<pid>-<thread>
PROOFS = "proven"          # <root>/store/proven: each entry's stat as the build that last proved its bytes left it
ENTRY_NAME = re.compile(r"^[0-9a-f]{64}(\.x)?\Z")
_LOCKS = [threading.Lock() for _ in range(64)]      # one inode's flag is toggled by one thread at a time


def path_of(files, key, executable=False):
    """The entry of content `key` (sha256 hex): <files>/<key[:2]>/<key>, `.x` for the executable copy (a hard
    link shares its mode: a script and a module with the same bytes are two entries)."""
    return os.path.join(files, key[:2], key + (".x" if executable else ""))


def key_of(b64digest):
    """The hex sha256 of a RECORD digest (urlsafe base64, unpadded), or None for one that is not a sha256."""
    try:
        raw = base64.urlsafe_b64decode(b64digest + "=" * (-len(b64digest) % 4))
    except (ValueError, TypeError):
        return None
    return raw.hex() if len(raw) == 32 else None


def _tmp(path):
    return "%s%s%d-%d" % (path, TMP, os.getpid(), threading.get_ident())


def _lock(st):
    return _LOCKS[st.st_ino % len(_LOCKS)]


# ------------------------------------------------------------------ the immutable attribute

def flags(fd):
    buf = array.array("l", [0])
    fcntl.ioctl(fd, GETFLAGS, buf, True)
    return buf[0]


def set_immutable(fd, on):
    """Set or clear FS_IMMUTABLE_FL on the open file `fd` (a change of its ctime); returns whether it was set."""
    was = flags(fd)
    want = was | IMMUTABLE if on else was & ~IMMUTABLE
    if want != was:
        fcntl.ioctl(fd, SETFLAGS, array.array("l", [want]))
    return bool(was & IMMUTABLE)


def immutable(path):
    """Whether the file at `path` carries the immutable attribute (False where it cannot be asked)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return bool(flags(fd) & IMMUTABLE)
    except OSError:
        return False
    finally:
        os.close(fd)


def unavailable(files, gen_dir):
    """Why generations under `gen_dir` cannot share immutable store entries under `files` (the attribute needs
    CAP_LINUX_IMMUTABLE and a filesystem that keeps it; a hard link needs one filesystem), or None when they can."""
    os.makedirs(files, exist_ok=True)
    probe, link = _tmp(os.path.join(files, ".probe")), _tmp(os.path.join(gen_dir, ".store-probe"))
    fd = None
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o444)
        os.link(probe, link)
        set_immutable(fd, True)
        if not flags(fd) & IMMUTABLE:
            return "the filesystem does not keep the immutable attribute"
        try:
            os.unlink(link)
            return "the filesystem does not enforce the immutable attribute"
        except PermissionError:
            return None
    except OSError as e:
        if e.errno == errno.EXDEV:
            return "no hard links from %s to %s (two filesystems)" % (files, gen_dir)
        if e.errno in (errno.EPERM, errno.EACCES, errno.ENOTTY, errno.EOPNOTSUPP, errno.EINVAL):
            return "no immutable attribute here: %s" % (
                "not root" if os.geteuid() else "no CAP_LINUX_IMMUTABLE, or the filesystem refuses it")
        return "no store: %s" % (e.strerror or e)
    finally:
        if fd is not None:
            try:
                set_immutable(fd, False)
            except OSError:
                pass
            os.close(fd)
        for p in (link, probe):
            try:
                os.unlink(p)
            except OSError:
                pass


def through_attribute(path, change):
    """`change()` (an unlink or a rename over `path`), also where `path` names an immutable inode (a store entry or
    a generation's link to one): the flag is cleared for the change, and the inode gets it back while another
    name still holds it."""
    try:
        change()
        return
    except PermissionError:
        pass
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        with _lock(os.fstat(fd)):
            was = set_immutable(fd, False)
            try:
                change()
            finally:
                if was and os.fstat(fd).st_nlink > 0:
                    set_immutable(fd, True)
    finally:
        os.close(fd)


def unlink(path):
    """Remove one name, through the immutable attribute (`through_attribute`)."""
    through_attribute(path, lambda: os.unlink(path))


def replace(src, dst):
    """os.replace(src, dst), also where `dst` is a link to an immutable store entry: a patched file (and anything
    else that must differ per generation) becomes the generation's own, and the store keeps its bytes."""
    through_attribute(dst, lambda: os.replace(src, dst))


def rmtree(path):
    """Delete a directory tree whose files may link store entries (see `unlink`); missing is fine."""
    for d, dirs, names in os.walk(path, topdown=False):
        for name in names:
            try:
                unlink(os.path.join(d, name))
            except FileNotFoundError:
                pass
        for name in dirs:
            p = os.path.join(d, name)
            try:
                unlink(p) if os.path.islink(p) else os.rmdir(p)
            except FileNotFoundError:
                pass
    try:
        os.rmdir(path) if not os.path.islink(path) else os.unlink(path)
    except FileNotFoundError:
        pass


# ------------------------------------------------------------------ proofs: which entries still hold their bytes

# An entry's bytes are proven when they are hashed: on their way in, or again. What the store keeps of a proof is
# the entry's stat once the build that proved it linked it, its attribute set: (inode, size, ctime). Every write,
# chattr, utime, link and unlink moves an inode's ctime, and no call sets it back, so an entry whose stat is still
# its proof's is unchanged since; any other is hashed again before it is linked, and the seal reads its links.
# (Before Linux 6.13 a ctime moves in clock ticks: a change within the tick of the proof itself, while the build
# holds the entry, would not show.)

_PROOFS = {}               # the store's files -> {entry name: proof}: read once per process (a proof read earlier stays
                           # true for as long as its entry's stat is its own, so one read is never wrong, only late)


def proofs_path(files):
    return os.path.join(os.path.dirname(files), PROOFS)


def proof(st):
    """What a proof keeps of an entry's stat."""
    return (st.st_ino, st.st_size, st.st_ctime_ns)


def proven(st, recorded):
    """Whether an entry's stat `st` is its proof `recorded` (a regular file, untouched since)."""
    return recorded is not None and stat.S_ISREG(st.st_mode) and proof(st) == tuple(recorded)


def proofs(files):
    """{entry name: proof} as the last build left them ({} where there are none). A line cut off (no newline)
    or of another shape proves nothing; a name that is no entry's is never looked up."""
    if files in _PROOFS:
        return _PROOFS[files]
    try:
        with open(os.open(proofs_path(files), os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
            data = f.read()
    except OSError:
        return {}
    out = {}
    for line in data.decode("ascii", "replace").split("\n")[:-1]:
        parts = line.split(" ")
        if len(parts) == 4 and parts[1].isdigit() and parts[2].isdigit() and parts[3].isdigit():
            out[parts[0]] = (int(parts[1]), int(parts[2]), int(parts[3]))
    _PROOFS[files] = out
    return out


def keep_proofs(files, table, made):
    """Write the proofs again (a temp file renamed over): `made`, the entries a build just linked, and those of
    `table` (the proofs it read) still true of their entry; a proof of an entry gone or changed is dropped."""
    out = dict(still_proven(files, {n: p for n, p in table.items() if n not in made}), **made)
    path = proofs_path(files)
    tmp = _tmp(path)
    try:
        with open(tmp, "xb") as f:
            f.write(b"".join(b"%s %d %d %d\n" % (name.encode(), *p) for name, p in sorted(out.items())))
        os.replace(tmp, path)
        _PROOFS[files] = out
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def still_proven(files, table):
    """The proofs of `table` (entry name → proof) still true of their entry in `files` now."""
    out = {}
    for name, p in table.items():
        if ENTRY_NAME.match(name):
            try:
                if proven(os.lstat(os.path.join(files, name[:2], name)), p):
                    out[name] = p
            except OSError:
                pass
    return out


@contextlib.contextmanager
def proofs_kept(files):
    """Around a removal of generations' files (gc, an interrupted build settled): every entry proven before it
    is proven again after it at its new stat (the removal's unlinks moved its ctime, not its bytes), so the quick
    check of the generations left does not hash their store links again. An entry unproven before stays so."""
    before = still_proven(files, proofs(files))
    try:
        yield
    finally:
        made = {}
        for name in before:
            try:
                st = os.lstat(os.path.join(files, name[:2], name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and (st.st_ino, st.st_size) == before[name][:2]:
                made[name] = proof(st)
        if before and os.path.isdir(files):
            keep_proofs(files, {}, made)


# ------------------------------------------------------------------ a build's files into the store

def _copy_hashing(src, dst):
    """Copy `src` to a new file `dst`, hashing on the way (one read); returns the sha256 hex."""
    h = hashlib.sha256()
    buf = record.buffer()
    view = memoryview(buf)
    with open(src, "rb", buffering=0) as s, open(dst, "xb", buffering=0) as d:
        while True:
            k = s.readinto(buf)
            if not k:
                break
            h.update(view[:k])
            d.write(view[:k])
    return h.hexdigest()


def _own_copy(path):
    """Give `path` an inode of its own (a copy renamed over it), keeping its mode."""
    tmp = _tmp(path)
    try:
        _copy_hashing(path, tmp)
        os.chmod(tmp, stat.S_IMODE(os.lstat(path).st_mode))
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _open(entry):
    """The entry open (never through a symlink), or None when it is gone."""
    try:
        return os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise AgentError("store entry %s cannot be opened: %s" % (entry, e.strerror or e))


def _hash_fd(fd):
    """The sha256 hex of the open file `fd`, read through it (not through a name that could change since)."""
    h, off = hashlib.sha256(), 0
    buf = record.buffer()
    view = memoryview(buf)
    while True:
        k = os.preadv(fd, [buf], off)
        if not k:
            return h.hexdigest()
        h.update(view[:k])
        off += k


def _holds(fd, key, size, recorded):
    """Whether the open entry `fd` holds `key`'s bytes: its size, and its stat still the one its proof recorded
    (nothing written, its attribute not cleared since), or else its bytes hashed again."""
    st = os.fstat(fd)
    if st.st_size != size:
        return False
    return proven(st, recorded) or _hash_fd(fd) == key


def _evict(entry, st):
    """Remove what holds an entry's name and is not its content: an entry whose bytes changed (through its
    attribute; the generations that link it keep it, and verify names them), or a symlink, directory or other
    file planted there (the name itself removed, never followed)."""
    try:
        if stat.S_ISDIR(st.st_mode):
            rmtree(entry)
        elif stat.S_ISREG(st.st_mode):
            unlink(entry)
        else:
            os.unlink(entry)
    except OSError as e:
        raise AgentError("store entry %s is not its content and cannot be removed: %s" % (entry, e.strerror or e))


def _real_dir(d):
    """`d` (a directory of the store's entries) as a directory of its own: whatever else holds its name (a
    symlink, a file) is removed first, never followed. Returns how many names were removed (0 or 1)."""
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        _evict(d, st)
    os.makedirs(d, exist_ok=True)
    return int(st is not None and not stat.S_ISDIR(st.st_mode))


def _enter(entry, src, key, mode):
    """A new entry from `src` (copied while hashed): returns it open, or None when the bytes are not `key` (the
    copy in uv's cache changed): nothing is entered."""
    tmp = _tmp(entry)
    try:
        if _copy_hashing(src, tmp) != key:
            return None
        os.chmod(tmp, mode)
        os.utime(tmp, ns=(MTIME_NS, MTIME_NS))
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            os.link(tmp, entry)
        except OSError as e:
            os.close(fd)
            raise AgentError("store entry %s cannot be entered: %s" % (
                entry, "it appeared while this build entered it" if e.errno == errno.EEXIST else e.strerror or e))
        return fd
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _link_group(entry, key, paths, recorded, st):
    """Every path of one content (same key and mode) becomes a link to its entry: the entry is linked as it is
    while it holds `key`'s bytes (`_holds`), else evicted and entered anew; the entry's attribute off, the links
    made (each a link to a temp name renamed over the path), then on again. `recorded`: the entry's proof, or
    None; `st`: the entry's lstat, or None where it is missing. Returns (entered: its bytes, or None when the
    entry was there, linked [(path, size)], own [(path,
    size)], evicted, the entry's fstat once linked (what its new proof records) or None, the (inode, size) of an
    inode that was this entry and left the store as something else made it, or None)."""
    size = paths[0][1].st_size
    mode = stat.S_IMODE(paths[0][1].st_mode) & 0o555
    entered, evicted, fd, left = None, 0, None, None
    if recorded is not None and (st is None or st.st_ino != recorded[0]):
        left = recorded[:2]         # removed (or replaced) by hand: generations may still share it
    if st is not None and stat.S_ISREG(st.st_mode):
        fd = _open(entry)
        if fd is not None and not _holds(fd, key, size, recorded):
            gone, was = os.fstat(fd), flags(fd) & IMMUTABLE
            os.close(fd)
            fd = None
            _evict(entry, st)       # root wrote into it: the generations that link it are drifted, verify names
            evicted = 1             # them; from here on the store holds the content its key says
            if not was:             # written with its attribute left off: the names left share a writable inode
                left = (gone.st_ino, gone.st_size)
    elif st is not None:
        _evict(entry, st)
        evicted = 1
    if fd is None:
        fd = _enter(entry, paths[0][0], key, mode)
        if fd is None:              # its bytes are not its RECORD's: the seal names it
            for p, pst in paths:
                _own_copy(p)
            return None, [], [(p, pst.st_size) for p, pst in paths], evicted, None, left
        entered = size
    linked = []
    try:
        with _lock(os.fstat(fd)):
            fl = flags(fd)
            if fl & IMMUTABLE:
                fcntl.ioctl(fd, SETFLAGS, array.array("l", [fl & ~IMMUTABLE]))
            try:
                if os.fstat(fd).st_mtime_ns != MTIME_NS:      # hashed again: its mtime back too
                    os.utime(fd, ns=(MTIME_NS, MTIME_NS))
                for p, pst in paths:
                    tmp = _tmp(p)
                    os.link(entry, tmp)
                    os.replace(tmp, p)
                    linked.append((p, pst.st_size))
            finally:
                fcntl.ioctl(fd, SETFLAGS, array.array("l", [fl | IMMUTABLE]))
            done = os.fstat(fd)
    finally:
        os.close(fd)
    return entered, linked, [], evicted, done, left


def link_venv(files, venv, jobs=8, every=2.0, progress=None):
    """After uv hardlinked a venv from its cache: every installed file that has a RECORD sha256 and still shares
    its inode with uv's cache becomes a link to its store entry (entered, copied while hashed, when new; hashed
    again when its stat is not the one its proof recorded); every other file that shares an inode (no hash,
    listed twice with two hashes) gets one of its own. What uv wrote itself (RECORD, INSTALLER, direct_url.json,
    scripts, pyvenv.cfg) is the generation's own already. The proofs are written again: every entry linked, as
    it is now. Returns {linked, linked_bytes, entered, entered_bytes, own, own_bytes, evicted, hashed,
    hashed_bytes, seconds, inodes, left: {(inode, size)} of former entries generations may still share}."""
    t0 = time.monotonic()
    site = record.site_packages(venv)
    rows = {}
    for _, _, info in record.dist_infos(site) if site else []:
        try:
            listed = record.entries(site, info, venv)
        except OSError:
            continue
        for rel, full, algo, digest, _ in listed:
            if full is not None:
                rows.setdefault(full, set()).add(key_of(digest) if algo == "sha256" and digest else None)
    groups = {}
    for full, keys in rows.items():
        key = next(iter(keys)) if len(keys) == 1 else None
        try:
            st = os.lstat(full)
        except OSError:
            continue
        if key and stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            groups.setdefault(path_of(files, key, bool(st.st_mode & 0o111)), (key, []))[1].append((full, st))
    out = {"linked": 0, "linked_bytes": 0, "entered": 0, "entered_bytes": 0, "own": 0, "own_bytes": 0,
           "evicted": 0, "hashed": 0, "hashed_bytes": 0}
    last = [time.monotonic()]
    done, made, left, inodes = [], {}, set(), set()
    table = proofs(files)

    def chunk(items):
        return [(entry, _link_group(entry, key, paths, table.get(os.path.basename(entry)), st))
                for entry, key, paths, st in items]

    def count(results):
        for entry, (entered, linked, own, evicted, st, gone) in results:
            if entered is not None:
                out["entered"] += 1
                out["entered_bytes"] += entered
            out["linked"] += len(linked)
            out["linked_bytes"] += sum(n for _, n in linked)
            out["own"] += len(own)
            out["own_bytes"] += sum(n for _, n in own)
            out["evicted"] += evicted
            if st is not None:
                made[os.path.basename(entry)] = proof(st)
                inodes.add((st.st_dev, st.st_ino))
            if gone is not None:
                left.add(gone)
            done.append(1)
            if progress and time.monotonic() - last[0] >= every:
                last[0] = time.monotonic()
                progress(done=len(done), total=len(groups), seconds=last[0] - t0)

    # Contents new to the store, and entries whose stat moved since their proof, are read (copied while hashed,
    # or hashed again) on the pool's threads (long reads and hashes that let each other run); those proven take
    # only short syscalls each (the attribute off, a link, a rename, the attribute on), which run three times
    # faster in one thread than in several contending for the interpreter.
    for d in sorted({os.path.dirname(e) for e in groups}):
        out["evicted"] += _real_dir(d)
    new, held = [], []
    for entry, (key, paths) in sorted(groups.items()):
        try:
            st = os.lstat(entry)
        except FileNotFoundError:
            st = None
        if st is not None and proven(st, table.get(os.path.basename(entry))):
            held.append((entry, key, paths, st))
            continue
        new.append((entry, key, paths, st))
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_size == paths[0][1].st_size:
            out["hashed"] += 1          # there, its stat moved since its proof: read again before it is linked
            out["hashed_bytes"] += st.st_size
    chunks = [new[i:i + 256] for i in range(0, len(new), 256)]      # a pool task per 256 contents, not per file
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        entering = pool.map(chunk, chunks)
        for i in range(0, len(held), 256):
            count(chunk(held[i:i + 256]))
        count(r for rs in entering for r in rs)
    keep_proofs(files, table, made)
    for rel, st in _files(venv):            # whatever still shares uv's inode: the generation's own copy
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and (st.st_dev, st.st_ino) not in inodes:
            _own_copy(os.path.join(venv, rel))
            out["own"] += 1
            out["own_bytes"] += st.st_size
    out["seconds"] = round(time.monotonic() - t0, 3)
    out["inodes"] = inodes
    out["left"] = left
    return out


def still_shared(generations, skip, left):
    """Which generations under `generations` (but the one at `skip`) still link an inode that left the store
    without its attribute (`left`: {(inode, size)}, from link_venv): [{generations: [ids], links, bytes}], one
    per such inode that more than one name shares and that is not immutable (a write through one name reaches
    the others). One walk of the generations' files; only when something left."""
    if not left:
        return []
    found, dev, skip = {}, os.stat(generations).st_dev, os.path.realpath(skip)
    for gid in sorted(os.listdir(generations)):
        top = os.path.join(generations, gid)
        if os.path.islink(top) or not os.path.isdir(top) or os.path.realpath(top) == skip:
            continue
        for rel, st in _files(top):
            k = (st.st_ino, st.st_size)
            if k in left and st.st_dev == dev and stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                found.setdefault(k, [set(), st.st_nlink, os.path.join(top, rel)])[0].add(gid)
    return [{"generations": sorted(gens), "links": nlink, "bytes": k[1]}
            for k, (gens, nlink, path) in sorted(found.items()) if not immutable(path)]


def _files(top):
    """(path under `top`, lstat) of every non-directory under it."""
    for d, dirs, names in os.walk(top):
        for name in names:
            p = os.path.join(d, name)
            try:
                yield os.path.relpath(p, top), os.lstat(p)
            except OSError:
                continue


def linked(files, path, st, b64digest):
    """Whether the file at `path` (lstat `st`) is the store's entry for its RECORD digest, as the build that last
    proved that entry's bytes left it (`proven`): then they are the digest's."""
    key = key_of(b64digest or "")
    if not key or st.st_nlink < 2:
        return False
    entry = path_of(files, key, bool(st.st_mode & 0o111))
    try:
        e = os.lstat(entry)
    except OSError:
        return False
    return (e.st_dev, e.st_ino) == (st.st_dev, st.st_ino) and proven(e, proofs(files).get(os.path.basename(entry)))


# ------------------------------------------------------------------ gc

def entries(files):
    """(path, lstat) of every entry of the store (what a killed build left half-made included)."""
    for sub in sorted(os.listdir(files)) if os.path.isdir(files) else []:
        d = os.path.join(files, sub)
        if len(sub) != 2 or os.path.islink(d) or not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            p = os.path.join(d, name)
            try:
                yield p, os.lstat(p)
            except OSError:
                continue


# ------------------------------------------------------------------ what a build here will get (for the plan)

REFLINK_FS = ("btrfs", "xfs", "bcachefs", "ocfs2")      # clone files copy-on-write (xfs: made with reflink=1)
IMMUTABLE_FS = ("ext2", "ext3", "ext4", "f2fs", "jfs", "tmpfs", "btrfs", "xfs", "bcachefs")
CAP_LINUX_IMMUTABLE = 9


def fs_type(path):
    """The filesystem type of the mount holding `path` (or its nearest existing parent), from /proc/self/mounts."""
    while not os.path.exists(path):
        path = os.path.dirname(path) or "/"
    real, best, kind = os.path.realpath(path), "", None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def may_set_immutable():
    """Whether this process holds CAP_LINUX_IMMUTABLE (its effective capabilities, /proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_LINUX_IMMUTABLE & 1)
    except (OSError, ValueError):
        pass
    return os.geteuid() == 0


def expected(root):
    """(isolation, why not the store or None) a build under `root` will get, judged without writing anything: the
    filesystem's type and this process's capabilities. The build probes for itself (build.isolation) and reports
    what it got."""
    kind = fs_type(root)
    if kind in REFLINK_FS:
        return "reflink", None
    if not may_set_immutable():
        return "copy", "no immutable attribute here: %s" % ("not root" if os.geteuid() else "no CAP_LINUX_IMMUTABLE")
    if kind not in IMMUTABLE_FS:
        return "copy", "no immutable attribute on %s" % (kind or "this filesystem")
    return "store", None
