"""Host agent (stdlib only): wheels into the host's cache over the network, in parallel, each hashed once on the way
in. Payload {op: fetch, root, packages, ...}; the build agent runs the same step (`wheels`) before it installs.
Progress goes to the controller as events while it happens.
"""
import errno
import fcntl
import hashlib
import http.client
import json
import mmap
import os
import queue
import random
import re
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from .cache import CHUNK, entry, mark_verified, recheck
from .host import AgentError, ensure_root, event, thread_buffer

LOOPBACK = ("127.0.0.1", "localhost", "::1")     # a mirror on the host itself may speak plain http


class Meter:
    """Counts bytes and files fetched; sends a progress event at most every `every` seconds."""

    def __init__(self, total, every=0.5, known=None, log=None):
        self.total, self.every, self.known = total, every, known      # known: every file's size, from the lock
        self.log = log                                                 # the build log, for retries
        self.done = self.bytes = self.expected = self.started = self.retries = 0
        self.t0 = self.last = time.monotonic()
        self.lock = threading.Lock()

    def start(self, size):
        with self.lock:
            self.started += 1
            self.expected += size or 0

    def add(self, n=0, finished=False):
        with self.lock:
            self.bytes += n
            self.done += finished
            now = time.monotonic()
            if now - self.last >= self.every or (finished and self.done == self.total):
                self.last = now
                self.report(now)

    def retry(self, label, why, wait):
        with self.lock:
            self.retries += 1
        event(step="fetch", retry=label, why=why[:200], wait=round(wait, 1))
        if self.log:
            self.log("fetch: %s: %s; again in %.1fs" % (label, why[:200], wait))

    def report(self, now):
        secs = max(now - self.t0, 1e-6)
        rate = self.bytes / secs
        # Bytes to come: the lock's sizes, else what started downloads announced plus their average for the rest.
        avg = self.expected / self.started if self.started else 0
        est = self.known if self.known is not None else self.expected + avg * (self.total - self.started)
        eta = (est - self.bytes) / rate if rate > 0 and est >= self.bytes else None
        event(step="fetch", done=self.done, total=self.total, bytes=self.bytes, total_bytes=int(est),
              rate=rate, eta=eta, seconds=secs)


def fetchable(url, label):
    """The fetch rule of the host and the controller alike: https, or plain http from this machine itself."""
    u = urllib.parse.urlsplit(url)
    if not (u.scheme == "https" or (u.scheme == "http" and u.hostname in LOOPBACK)):
        raise AgentError("%s: only https:// URLs are fetched (http:// only from this machine), not %r"
                         % (label, url[:80]))


# ------------------------------------------------------------------ fetch: parallel, resumable, retried

SPLIT = 64 << 20        # a file larger than this is fetched as byte ranges in parallel (where the server serves ranges)
SEGMENT = 32 << 20      # the size of those ranges
# A big file's first range is fetched alone; where it came at FAST_LINK or more, or its stream waited on its own
# writer (measured over JUDGE_BYTES at least), one connection keeps up with what this host hashes and writes, and
# more streams would only contend for its cores: the rest comes as one piece. Else (a link slower per
# connection than this host's hashing) the rest comes as ranges.
FAST_LINK = 300e6       # bytes per second
SINK_BOUND = 0.5        # or: the stream waited this share of the time for its writer (hashing and writing are the
JUDGE_BYTES = 8 << 20   # bound, not the link)
STALL = 30.0            # seconds one read may wait for bytes before the stream counts as stalled
RETRIES = 6             # attempts of one piece in a row that bring no byte, before giving up
BACKOFF = (0.5, 20.0)   # first delay and cap, seconds; each delay is drawn from [d/2, d] (jitter)
RETRY_AFTER_CAP = 60.0  # the most a server's Retry-After is honoured
REDIRECTS = 5
ALIGN = 4096            # O_DIRECT: offsets, lengths and buffers in whole blocks of this size
READBACK = 8 << 20      # bytes read back per call, to hash what was written ahead of the hashed prefix


class Transient(Exception):
    """A failure worth another attempt (DNS, refused/reset connection, stall, cut body, HTTP 5xx/429/408)."""

    def __init__(self, why, wait=None):
        Exception.__init__(self, why)
        self.wait = wait


class Aborted(Exception):
    """Another file's failure ended the fetch."""


def _why(e):
    """One short reason for a network error."""
    if isinstance(e, socket.timeout) or isinstance(e, TimeoutError):
        return "stalled (no byte for the stall timeout)"
    if isinstance(e, socket.gaierror):
        return "name resolution failed: %s" % (e.strerror or e)
    if isinstance(e, OSError) and e.strerror:
        return e.strerror.lower()
    return _printable("%s%s" % (type(e).__name__, (": %s" % e) if str(e) else ""), 200)


def _proxy(u):
    """(host, port) of the proxy the environment names for an https URL (urllib's rules: https_proxy,
    no_proxy), tunnelled with CONNECT; None for none. Plain http goes only to this machine, never proxied."""
    if u.scheme != "https" or urllib.request.proxy_bypass(u.hostname or ""):
        return None
    proxy = urllib.request.getproxies().get("https")
    if not proxy:
        return None
    p = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
    return p.hostname, p.port or 80


_TLS = []


def _tls():
    """One TLS context (the system's CA store) for every connection of this process."""
    if not _TLS:
        _TLS.append(ssl.create_default_context())
    return _TLS[0]


def _printable(text, n=120):
    """Text from the network, fit for one line: control characters replaced, at most `n` characters."""
    return re.sub(r"[\x00-\x1f\x7f]", "?", str(text))[:n]


class Stream:
    """One worker's keep-alive HTTP connection (reused across files and ranges of one host), and its requests."""

    def __init__(self, stall):
        self.stall, self.key, self.conn = stall, None, None

    def close(self):
        if self.conn is not None:
            self.conn.close()
        self.key = self.conn = None

    def _conn(self, u):
        key = (u.scheme, u.hostname, u.port)
        if self.key != key:
            self.close()
            port = u.port or (443 if u.scheme == "https" else 80)
            proxy = _proxy(u)
            if u.scheme == "https":
                host, cport = proxy or (u.hostname, port)
                self.conn = http.client.HTTPSConnection(host, cport, timeout=self.stall, context=_tls())
                if proxy:
                    self.conn.set_tunnel(u.hostname, port)
            else:
                self.conn = http.client.HTTPConnection(u.hostname, port, timeout=self.stall)
            self.key = key
            return self.conn, False
        return self.conn, True

    def get(self, url, start, end, label):
        """The response to GET url (bytes [start, end) when either is set), redirects followed by the fetch rule.
        HTTP errors are raised: Transient for 5xx, 429 and 408, AgentError for the rest."""
        headers = {"User-Agent": "provision", "Accept-Encoding": "identity"}
        if start or end is not None:
            headers["Range"] = "bytes=%d-%s" % (start, "" if end is None else end - 1)
        for _ in range(REDIRECTS + 1):
            fetchable(url, label)
            u = urllib.parse.urlsplit(url)
            for fresh in (False, True):          # a kept-alive connection the server closed meanwhile: once more
                conn, reused = self._conn(u)
                try:
                    conn.request("GET", (u.path or "/") + ("?" + u.query if u.query else ""), headers=headers)
                    r = conn.getresponse()
                    break
                except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                    self.close()
                    if not reused or fresh:
                        raise
            if r.status in (301, 302, 303, 307, 308) and r.getheader("Location"):
                r.read()
                url = urllib.parse.urljoin(url, r.getheader("Location"))
                continue
            if r.status in (200, 206):
                return r, url
            r.read(1 << 16)
            self.close()
            why = "HTTP %d %s" % (r.status, _printable(r.reason, 60))
            if r.status >= 500 or r.status in (408, 429):
                wait = r.getheader("Retry-After") or ""
                raise Transient(why, float(wait) if wait.isdigit() else None)
            raise AgentError("%s: %s: %s (not retried)" % (label, _printable(url, 300), why))
        raise AgentError("%s: %s: more than %d redirects" % (label, _printable(url, 300), REDIRECTS))


class Piece:
    """Bytes [start, end) of a file (end None: to the end of the body), written up to `pos`."""

    def __init__(self, start, end):
        self.start, self.end, self.pos = start, end, start


class Download:
    """One file: pieces fetched by any worker into a partial file at their offsets, hashed in order as the written
    prefix grows; the file appears under its cache name only when every piece is in and the sha256 matches.
    The partial file (`<entry>.partial`, flocked while in use) keeps its hashed prefix across runs, noted in
    `<entry>.partial.json`: a fetch that gave up or was killed resumes there next time (hashed again first)."""

    def __init__(self, url, path, sha256, label, size=None):
        self.url, self.path, self.sha256, self.label, self.expect = url, path, sha256, label, size
        self.tmp, self.note = path + ".partial", path + ".partial.json"
        self.size, self.fd, self.error, self.keep = None, None, None, False
        self.dfd = None                     # the same file opened O_DIRECT, where the filesystem allows it
        self.pieces = [Piece(0, None)]
        self.left = 1                       # pieces not yet finished
        self.lock, self.hash_lock = threading.Lock(), threading.Lock()
        self.hash, self.hashed, self.noted = hashlib.sha256(), 0, 0
        self.base = 0                       # bytes an earlier run left, verified in order
        self.ranged = self.ignored = 0      # ranged requests made, answered with the whole file instead
        self.rest_queued = False            # a big file's pieces after the first are queued

    def open(self):
        """The partial file, once: an earlier run's verified prefix is taken up (the first piece starts after
        it); where another process holds it, a private temp file instead."""
        with self.lock:
            if self.fd is not None:
                return
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT, 0o640)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:             # another process fetches this wheel into the same cache now
                    os.close(fd)
                    self.tmp, self.note = "%s.part-%d-%d" % (self.path, os.getpid(), id(self)), None
                    fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o640)
                self.fd = fd
                self.dfd = _direct(self.tmp)
                upto = self.noted_prefix()
                if upto:
                    self.hashed = self.rehash(upto)
                    self.base = self.noted = self.pieces[0].start = self.pieces[0].pos = upto
                else:
                    os.ftruncate(fd, 0)
            except OSError as e:
                raise AgentError("%s: cannot create %s: %s" % (self.label, self.tmp, e.strerror or e)) from None

    def noted_prefix(self):
        """The bytes of the partial file an earlier run verified in order (its note), or 0."""
        if self.note is None:
            return 0
        try:
            with open(self.note) as f:
                n = json.load(f)
            upto, size = (n.get("upto"), n.get("size")) if n.get("sha256") == self.sha256 else (None, None)
        except (OSError, ValueError, AttributeError):
            return 0
        size = self.expect if self.expect is not None else size       # the rest must be something to fetch
        if type(upto) is not int or type(size) is not int or not 0 < upto < size or \
                upto > os.fstat(self.fd).st_size:
            return 0
        return upto

    def rehash(self, upto):
        for off in range(0, upto, CHUNK):
            b = os.pread(self.fd, min(CHUNK, upto - off), off)
            if not b:
                return 0
            self.hash.update(b)
        return upto

    def write_note(self):
        """Record the hashed prefix (a temp file renamed over the note: a note is whole or absent)."""
        if self.note is None or self.hashed == self.noted:
            return
        tmp = self.note + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"sha256": self.sha256, "upto": self.hashed, "size": self.size}, f)
        os.replace(tmp, self.note)
        self.noted = self.hashed

    def write(self, data, offset):
        """Write at `offset`: whole blocks straight to the disk where they can go (O_DIRECT: no copy into the
        page cache, which a multi-GB fetch would fill and which costs more CPU per byte than TLS and sha256
        together), the rest (a file's last block, a buffer that is not block-aligned) through the page cache."""
        view = memoryview(data)
        try:
            if self.dfd is not None and offset % ALIGN == 0 and len(view) >= ALIGN:
                try:
                    n = os.pwrite(self.dfd, view[:len(view) - len(view) % ALIGN], offset)
                    view, offset = view[n:], offset + n
                except OSError as e:
                    if e.errno != errno.EINVAL:     # EINVAL: not aligned after all; the page cache takes it
                        raise
            while view:
                n = os.pwrite(self.fd, view, offset)
                view, offset = view[n:], offset + n
        except OSError as e:
            raise AgentError("%s: cannot write %s: %s" % (self.label, self.tmp, e.strerror or e)) from None

    def prefix(self):
        """How many bytes from the start are written without a gap."""
        done = self.base
        for p in self.pieces:
            if p.start > done:
                break
            done = max(done, p.pos)
            if p.end is None or p.pos < p.end:
                break
        return done

    def hashed_more(self):
        """After the hashed prefix grew (hash_lock held): note it every SEGMENT bytes."""
        if self.hashed - self.noted >= SEGMENT:
            try:
                self.write_note()
            except OSError:
                pass            # a note is an optimisation: without one, the next run starts afresh

    def take(self, data, offset):
        """Hash bytes just written at `offset` from memory when they are next in line (the usual case)."""
        if self.hashed == offset and self.hash_lock.acquire(False):
            try:
                if self.hashed == offset:
                    self.hash.update(data)
                    self.hashed += len(data)
                    self.hashed_more()
            finally:
                self.hash_lock.release()

    def advance(self, wait=False):
        """Hash the written prefix beyond what is hashed (read back from the page cache); one thread at a time."""
        if not self.hash_lock.acquire(wait):
            return
        try:
            while True:
                with self.lock:
                    hi = self.prefix()
                if hi <= self.hashed:
                    return
                while self.hashed < hi:
                    n = self.read_back(hi)
                    if not n:
                        raise AgentError("%s: %s is shorter than what was written" % (self.label, self.tmp))
                    self.hashed += n
                self.hashed_more()
        finally:
            self.hash_lock.release()

    def read_back(self, hi):
        """Hash the next bytes of [hashed, hi) as read back from the file: whole blocks with O_DIRECT where it
        can (bytes written past the page cache are not read into it), else through the page cache; returns how
        many."""
        buf, at = thread_buffer("readback", READBACK), self.hashed
        n = min(READBACK, hi - at)
        if at % ALIGN:
            n = min(n, ALIGN - at % ALIGN)                  # up to the next block boundary
        elif self.dfd is not None and n >= ALIGN:
            try:
                got = os.preadv(self.dfd, [buf[:n - n % ALIGN]], at)
                self.hash.update(buf[:got])
                return got
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
        b = os.pread(self.fd, n, at)
        self.hash.update(b)
        return len(b)

    def split(self, piece, jobs):
        """Once the size is known and the server serves ranges: the rest of a big file as ranges, queued for
        other workers (`jobs` 1: as one piece); `piece` keeps the first. Returns the new pieces."""
        if self.size is None or self.size - piece.start <= SPLIT or self.rest_queued:
            return []
        with self.lock:
            piece.end = piece.start + SEGMENT
            step = SEGMENT if jobs > 1 else self.size - piece.end
            new = [Piece(lo, min(lo + step, self.size)) for lo in range(piece.end, self.size, step)]
            self.pieces += new
            self.left += len(new)
            self.rest_queued = True
        return new

    def finish(self):
        """The last piece is in: verify and move into place. Returns True when the file landed. A file that
        did not land keeps its partial file (and its note) only where it may be resumed: the fetch ended
        or gave up on a transient error, never a refusal (404, size, sha256)."""
        ok = whole = False
        try:
            with self.lock:
                whole = self.error is None and self.size is not None and self.prefix() == self.size
            if whole:         # else it failed, or the fetch ended before it was complete: nothing lands
                self.advance(wait=True)
                if self.size is not None and self.hashed != self.size:
                    raise AgentError("%s: %d of %d bytes arrived" % (self.label, self.hashed, self.size))
                if self.hash.hexdigest() != self.sha256:
                    raise AgentError("%s: sha256 mismatch for %s: file is %s, the lock says %s; refusing%s"
                                     % (self.label, os.path.basename(self.path), self.hash.hexdigest(),
                                        self.sha256, " (the first %d bytes came from an earlier run's "
                                        "partial file, now removed)" % self.base if self.base else ""))
                os.replace(self.tmp, self.path)
                mark_verified(self.path)
                ok = True
        finally:
            kept = False
            if not (ok or whole) and self.fd is not None and (self.error is None or self.keep) and self.hashed:
                try:
                    self.write_note()
                    kept = self.note is not None
                except OSError:
                    pass
            if self.dfd is not None:
                os.close(self.dfd)
            if self.fd is not None:
                os.close(self.fd)           # and with it the flock
            for f in ([] if kept else [self.tmp]) + ([self.note] if self.note and not kept else []):
                try:
                    os.unlink(f)
                except OSError:
                    pass
        return ok


class Fetcher:
    """Fetches files with `jobs` workers over kept-alive connections: big files as parallel byte ranges, each
    piece retried with backoff and resumed where it stopped (Range; a server that ignores it sends the whole
    file again, whose known prefix is read past); the first file that cannot be had ends the fetch."""

    def __init__(self, jobs=8, stall=STALL, retries=RETRIES, meter=None):
        self.jobs, self.stall, self.retries, self.meter = max(1, jobs), stall, max(1, retries), meter
        self.queue = queue.PriorityQueue()
        self.seq = 0
        self.cv = threading.Condition()
        self.pending = 0
        self.abort = threading.Event()
        self.failed = []                        # (download, message), in the order they failed

    def put(self, dl, piece, first):
        with self.cv:
            self.pending += 1
            self.seq += 1
            # Ranges of a started file first (the file lands sooner), then files largest first (no long tail).
            self.queue.put(((0, self.seq) if not first else (1, -(dl.expect or 0), self.seq), dl, piece))

    def run(self, downloads):
        """Fetch every Download; returns the bytes written. Raises AgentError naming the first failure."""
        for dl in downloads:
            self.put(dl, dl.pieces[0], True)
        workers = [threading.Thread(target=self.work, daemon=True) for _ in range(self.jobs)]
        for w in workers:
            w.start()
        with self.cv:
            while self.pending:
                self.cv.wait()
        for i, _ in enumerate(workers):
            self.queue.put(((9, i), None, None))
        for w in workers:
            w.join()
        if self.failed:
            first = self.failed[0][1]
            more = len(self.failed) - 1
            raise AgentError(first + (" (and %d more)" % more if more else ""))

    def work(self):
        stream, sink = Stream(self.stall), Sink(self.meter)
        try:
            while True:
                _, dl, piece = self.queue.get()
                if dl is None:
                    return
                try:
                    self.one(stream, sink, dl, piece)
                finally:                    # whatever happened, the piece is accounted for: `run` never hangs
                    with self.cv:
                        self.pending -= 1
                        self.cv.notify_all()
        finally:
            stream.close()
            sink.close()

    def one(self, stream, sink, dl, piece):
        """Fetch one piece; the worker that finishes a file's last piece verifies it and puts it in place."""
        try:
            if not (self.abort.is_set() or dl.error):
                self.piece(stream, sink, dl, piece)
        except Aborted:
            stream.close()
        except AgentError as e:
            stream.close()
            self.fail(dl, str(e))
        except Exception as e:  # noqa: BLE001 - named per package, never a traceback
            stream.close()
            self.fail(dl, "%s: %s: %s" % (dl.label, dl.url, _why(e)))
        with dl.lock:
            dl.left -= 1
            last = dl.left == 0
        if last:
            try:
                if dl.finish() and self.meter:
                    self.meter.add(finished=True)
            except AgentError as e:
                self.fail(dl, str(e))
            except Exception as e:  # noqa: BLE001 - e.g. the cache's disk refused the rename
                self.fail(dl, "%s: cannot store %s: %s" % (dl.label, os.path.basename(dl.path), _why(e)))

    def fail(self, dl, message):
        with self.cv:
            if dl.error is None:
                dl.error = message
                self.failed.append((dl, message))
            self.abort.set()

    def piece(self, stream, sink, dl, piece):
        """One piece, attempted until it is in: a failure that brought bytes starts the count again."""
        tries = 0
        while True:
            before = piece.pos
            try:
                return self.attempt(stream, sink, dl, piece)
            except Transient as e:
                stream.close()
                tries = 0 if piece.pos > before else tries + 1
                if tries >= self.retries:
                    dl.keep = True          # what arrived stays, to be resumed by the next run
                    raise AgentError("%s: %s: %s (gave up after %d attempts in a row without a byte)"
                                     % (dl.label, dl.url, e, tries)) from None
                d = min(BACKOFF[1], BACKOFF[0] * 2 ** max(0, tries - 1))
                d = d / 2 + random.uniform(0, d / 2)
                if e.wait is not None:
                    d = max(d, min(e.wait, RETRY_AFTER_CAP))
                if self.meter:
                    self.meter.retry(dl.label, str(e), d)
                if self.abort.wait(d):
                    raise Aborted() from None

    def attempt(self, stream, sink, dl, piece):
        # A file the lock says is big is asked for as its first range: a 206 says the server serves ranges (the
        # rest is split among the workers) and leaves the connection fit for the next piece; a 200 is the file.
        dl.open()
        head = piece.start == piece.pos == dl.base and piece.end is None
        end = piece.start + SEGMENT if head and self.jobs > 1 and (dl.expect or 0) - piece.start > SPLIT else piece.end
        ranged = piece.pos > 0 or end is not None
        try:
            r, url = stream.get(dl.url, piece.pos, end, dl.label)
            skip = 0
            if ranged:
                dl.ranged += 1
            if r.status == 206:
                lo, hi, total = _content_range(r.getheader("Content-Range"))
                last = end - 1 if end is not None else None if total is None else total - 1
                if total is not None and last is not None:
                    last = min(last, total - 1)
                if lo != piece.pos or hi != (hi if last is None else last) or total is None and piece.end is None \
                        or (dl.size is not None and total not in (None, dl.size)):
                    raise AgentError("%s: %s: asked for bytes %d-%s, the server sent %s"
                                     % (dl.label, url, piece.pos, "" if end is None else end - 1,
                                        _printable(repr(r.getheader("Content-Range")), 80)))
                length = total
            else:                                   # the whole file: a first request, or a Range ignored
                skip = piece.pos
                if ranged:
                    dl.ignored += 1
                length = r.length
            new = self.sized(dl, length)
            judge = new and head and r.status == 206 and end is not None and dl.size > end
            if judge:       # the first range alone: the rest is queued once it is in, as its rate says
                piece.end = end
            elif piece.end is None and dl.size is not None:
                piece.end = dl.size
            if new and head and not judge and self.jobs > 1 and \
                    (r.status == 206 or (r.getheader("Accept-Ranges") or "").lower() == "bytes"):
                for p in dl.split(piece, self.jobs):
                    self.put(dl, p, False)
            t0, at, w0 = time.monotonic(), piece.pos, sink.waited
            self.body(r, sink, dl, piece, skip)
            if piece is dl.pieces[0] and not dl.rest_queued and dl.size is not None and piece.end < dl.size:
                got, secs = piece.pos - at, time.monotonic() - t0
                fast = judge and got >= JUDGE_BYTES and (got >= FAST_LINK * secs or
                                                          sink.waited - w0 >= SINK_BOUND * secs)
                for p in dl.split(piece, 1 if fast else self.jobs):
                    self.put(dl, p, False)
            if r.isclosed() or r.length == 0:
                r.read()
            else:                                   # the reply goes on past this piece: the connection is spent
                stream.close()
        except (OSError, http.client.HTTPException) as e:
            if isinstance(e, ssl.SSLCertVerificationError):
                raise AgentError("%s: %s: %s" % (dl.label, dl.url, _why(e))) from None
            raise Transient(_why(e)) from None

    def sized(self, dl, length):
        """Take the size the server states (once); True the first time. A size other than the lock's is refused."""
        if length is None or dl.size is not None:
            return False
        if dl.expect is not None and length != dl.expect:
            raise AgentError("%s: %s: the server sends %d bytes, the lock says %d; refusing"
                             % (dl.label, dl.url, length, dl.expect))
        with dl.lock:
            if dl.size is not None:
                return False
            dl.size = length
        if self.meter:
            self.meter.start(length)
        return True

    def body(self, r, sink, dl, piece, skip):
        """Read the reply into the file at the piece's offsets (after `skip` bytes already there). Reads land at
        the start of one of the sink's buffers and, past a cut at an odd offset, end on a block boundary, so that
        what follows goes to the disk in whole blocks; the sink writes and hashes a buffer while the next is read.
        Returns with every byte read written (or raises), so that `piece.pos` says where a retry resumes."""
        at = piece.pos
        try:
            while piece.end is None or at < piece.end:
                if self.abort.is_set() or dl.error:
                    raise Aborted()
                want = min(CHUNK, skip) if skip else ALIGN - at % ALIGN if at % ALIGN else CHUNK
                if piece.end is not None:
                    want = min(want, piece.end - at + skip)
                view = sink.free()
                n = r.readinto(view[:want])
                if not n:
                    sink.give_back(view)
                    if piece.end is None:           # no stated length: the end of the body is the end of the file
                        sink.drain()
                        with dl.lock:
                            dl.size = piece.end = at
                        return
                    raise Transient("the connection closed after %d of %d bytes" % (at, piece.end))
                if skip:                            # bytes already in the file, read past
                    skip -= n
                    sink.give_back(view)
                    continue
                sink.put(dl, piece, view, n, at)
                at += n
        finally:
            sink.drain()


class Sink:
    """One worker's writer: buffers the worker filled are written, hashed and counted by a thread of their own
    while the worker reads the next, the write on a thread of its own while the bytes are hashed (receiving, the
    sha256 and the write each let the others run). At most BUFFERS are in flight; the first error ends the work
    and is raised to the worker by `drain` or `free`."""

    BUFFERS = 3

    def __init__(self, meter=None):
        self.meter, self.error, self.thread, self.writer = meter, None, None, None
        self.waited = 0.0           # seconds the worker waited for a free buffer: the writer was the bound
        self.work, self.spare = queue.Queue(), queue.Queue()
        self.pending = 0
        self.cv = threading.Condition()

    def free(self):
        """A buffer to read into (waits while every buffer is in flight)."""
        if self.thread is None:
            for _ in range(self.BUFFERS):
                self.spare.put(memoryview(mmap.mmap(-1, CHUNK)))
            self.writer = ThreadPoolExecutor(max_workers=1)
            self.thread = threading.Thread(target=self.run, daemon=True)
            self.thread.start()
        self.check()
        try:
            return self.spare.get_nowait()
        except queue.Empty:
            t0 = time.monotonic()
            view = self.spare.get()
            self.waited += time.monotonic() - t0
            return view

    def give_back(self, view):
        self.spare.put(view)

    def put(self, dl, piece, view, n, at):
        with self.cv:
            self.pending += 1
        self.work.put((dl, piece, view, n, at))

    def drain(self):
        """Wait until every buffer put is written; raise the first error the writing met."""
        with self.cv:
            while self.pending:
                self.cv.wait()
        self.check()

    def check(self):
        with self.cv:
            e, self.error = self.error, None
        if e is not None:
            raise e

    def run(self):
        while True:
            item = self.work.get()
            if item is None:
                return
            dl, piece, view, n, at = item
            try:
                if self.error is None:
                    data = view[:n]
                    wrote = self.writer.submit(dl.write, data, at)
                    try:
                        dl.take(data, at)
                    finally:
                        wrote.result()
                    with dl.lock:
                        piece.pos = at + n
                    if self.meter:
                        self.meter.add(n)
                    dl.advance()
            except BaseException as e:  # noqa: BLE001 - handed to the worker, which names it
                with self.cv:
                    if self.error is None:
                        self.error = e
            finally:
                self.spare.put(view)
                with self.cv:
                    self.pending -= 1
                    self.cv.notify_all()

    def close(self):
        if self.thread is not None:
            self.work.put(None)
            self.thread.join()
            self.writer.shutdown()


def _direct(path):
    """`path` opened again with O_DIRECT (read and write), or None where the filesystem refuses it (tmpfs)."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        return None


def _content_range(value):
    """(first, last, total or None) of a Content-Range `bytes a-b/n`; AgentError if malformed."""
    m = re.match(r"^bytes (\d+)-(\d+)/(\d+|\*)$", (value or "").strip())
    if not m:
        raise Transient("a 206 reply without a usable Content-Range (%r)" % (value,))
    return int(m.group(1)), int(m.group(2)), None if m.group(3) == "*" else int(m.group(3))


def streams():
    """How many downloads run at once by default: two per CPU core this process may use, 2 to 8. A verified
    download costs more CPU than a plain one (sha256, the write, the read-back of ranges that arrived ahead);
    on a small host more streams than that add contention, not bandwidth."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(2, min(8, 2 * cores))


def fetch(store, packages, jobs, stall=STALL, retries=RETRIES, log=None):
    """Every package not in the cache, with `jobs` streams; returns (count, bytes, seconds, figures)."""
    todo = [(p, entry(store, p["sha256"], p["filename"])) for p in packages]
    todo = [(p, path) for p, path in todo if not os.path.isfile(path)]
    if not todo:
        return 0, 0, 0.0, {}
    for p, _ in todo:
        if not p.get("url"):
            raise AgentError("%s==%s is not in the host's cache and has no URL to fetch" % (p["name"], p["version"]))
    for p, _ in todo:
        fetchable(p["url"], "%s==%s" % (p["name"], p["version"]))
    downloads = [Download(p["url"], path, p["sha256"], "%s==%s" % (p["name"], p["version"]),
                          p.get("size") if isinstance(p.get("size"), int) else None) for p, path in todo]
    sizes = [d.expect for d in downloads]
    meter = Meter(len(todo), known=None if None in sizes else sum(sizes), log=log)
    meter.report(meter.t0)          # the fetch begins: the controller knows what the build waits on
    try:
        Fetcher(jobs, stall, retries, meter).run(downloads)
    except AgentError as e:
        raise AgentError("fetch failed: %s" % e) from None
    meter.report(time.monotonic())
    figs = {"retries": meter.retries, "resumed_bytes": sum(d.base for d in downloads),
            "ranges": sum(d.ranged for d in downloads),
            "ranges_ignored": sum(d.ignored for d in downloads)}
    return len(todo), meter.bytes, time.monotonic() - meter.t0, figs


def wheels(a, lay, log, t0):
    """The fetch step of a build ({packages, rechecked?, jobs?, stall?, retries?}): the cache entries it will use
    hashed again (but those `have` hashed in this run, `rechecked`), a changed one removed; then every wheel the
    cache lacks fetched in parallel. Returns its figures; `t0` is when the build began."""
    figs = {}
    packages = a.get("packages") or []
    skip = set(a.get("rechecked") or [])      # what `have` hashed again in this apply already
    rc = recheck([(entry(lay.wheel_cache, p["sha256"], p["filename"]), p["sha256"]) for p in packages
                  if p["sha256"] not in skip], int(a.get("jobs") or 8))
    if rc["healed"]:
        event(step="cache", healed=[os.path.basename(p) for p in rc["healed"]])
    figs["recheck"] = dict(rc, healed=[os.path.basename(p) for p in rc["healed"]])
    log("cache: %d entries hashed again (%d bytes, %.1fs), %d untouched since verified%s" % (
        rc["hashed"], rc["bytes"], rc["seconds"], rc["checked"] - rc["hashed"], "".join(
        "; healed " + os.path.basename(p) for p in rc["healed"])))
    n, nbytes, secs, ffigs = fetch(lay.wheel_cache, packages, int(a.get("jobs") or streams()),
                                   float(a.get("stall") or STALL), int(a.get("retries") or RETRIES), log)
    figs.update(fetched=n, fetched_bytes=nbytes, fetch_seconds=round(secs, 2), cached=len(packages) - n, **ffigs)
    event(step="fetch", summary=True, fetched=n, cached=figs["cached"], bytes=nbytes, seconds=time.monotonic() - t0)
    log("fetch: %d wheels, %d bytes in %.1fs; %d cached; %d retries, %d bytes resumed from an earlier run"
        % (n, nbytes, secs, figs["cached"], figs.get("retries", 0), figs.get("resumed_bytes", 0)))
    for p in packages:
        log("  %s==%s %s" % (p["name"], p["version"], entry(lay.wheel_cache, p["sha256"], p["filename"])))
    return figs


def op_fetch(a):
    """{root, packages: [{name, version, sha256, filename, url?, size?}], jobs?, stall?, retries?} -> the fetch
    step's figures: the build's first part on its own, every wheel in the host's cache and no generation made."""
    return wheels(a, ensure_root(a["root"]), lambda line: None, time.monotonic())


OPS = {"fetch": op_fetch}
