"""The host's fetch against a real HTTP server on loopback that fails, stalls, cuts connections, ignores
Range and answers 404: retries with backoff, resume by Range (the server sees it), big files as parallel
ranges, one line naming the package and URL when it gives up; and the same through a real apply over SSH."""
from __future__ import annotations

import base64
import hashlib
import http.server
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from provision import apply as applymod
from provision import lock as lockmod
from provision.agent import fetch as agentfetch
from provision.agent.host import AgentError
from provision.errors import ProvisionError
from provision.transport import connect
from provision.wheelcache import WheelCache
from wheelhouse import make_wheel, sha256, write_lock

ROOT = Path(__file__).resolve().parent.parent


class Mirror:
    """A loopback HTTP/1.1 server of wheel files. `script[name]` says what each request for a file gets, in
    order ("503", "404", "cut": half the body then the connection closes, "stall": half the body then
    silence for `stall_for` seconds, "ok"); after the script, "ok". `ranges=False`: Range is ignored (the
    whole file, 200) and not advertised. Every request is recorded: (name, Range header, status, bytes sent)."""

    def __init__(self, files: dict[str, bytes], ranges: bool = True, stall_for: float = 5.0):
        self.files, self.ranges, self.stall_for = files, ranges, stall_for
        self.script: dict[str, list[str]] = {}
        self.seen: list[tuple[str, str | None, int, int]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                outer.serve(self)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda *a: None      # a client that hung up on a cut reply is expected here
        self.base = f"http://127.0.0.1:{self.server.server_port}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def requests(self, name: str) -> list[tuple[str | None, int, int]]:
        return [(rng, status, sent) for n, rng, status, sent in self.seen if n == name]

    def serve(self, h) -> None:
        name, rng = h.path.lstrip("/"), h.headers.get("Range")
        with self.lock:
            nth = sum(1 for s in self.seen if s[0] == name)
            script = self.script.get(name, [])
            what = script[nth] if nth < len(script) else "ok"
            self.seen.append((name, rng, 0, 0))
            slot = len(self.seen) - 1
        data = self.files.get(name)
        if data is None or what in ("404", "503"):
            status = 404 if data is None or what == "404" else 503
            h.send_response(status)
            h.send_header("Content-Length", "0")
            h.end_headers()
            self.seen[slot] = (name, rng, status, 0)
            return
        lo, hi, status = 0, len(data) - 1, 200
        m = re.match(r"^bytes=(\d+)-(\d*)$", rng or "")
        if m and self.ranges:
            lo, hi, status = int(m.group(1)), min(int(m.group(2) or len(data) - 1), len(data) - 1), 206
        body = data[lo:hi + 1]
        h.send_response(status)
        h.send_header("Content-Length", str(len(body)))
        if self.ranges:
            h.send_header("Accept-Ranges", "bytes")
        if status == 206:
            h.send_header("Content-Range", f"bytes {lo}-{hi}/{len(data)}")
        h.end_headers()
        if what in ("cut", "stall"):
            body = body[:len(body) // 2]
        try:
            h.wfile.write(body)
            h.wfile.flush()
            self.seen[slot] = (name, rng, status, len(body))
            if what == "stall":
                time.sleep(self.stall_for)
            if what in ("cut", "stall"):
                h.close_connection = True
                h.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass    # the client went away (it gave up on a stalled reply)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def wheel_bytes(tmp: Path, name: str, kib: int = 600) -> Path:
    """A real wheel whose body does not compress (so it is big enough to be cut in the middle)."""
    body = "DATA = %r\n" % base64.b64encode(os.urandom(kib * 1024 * 3 // 4)).decode()
    return make_wheel(tmp, name, "1.0", body=body)


@pytest.fixture
def mirror(tmp_path):
    wheels = {n: wheel_bytes(tmp_path / "served", n) for n in ("alpha", "beta")}
    m = Mirror({w.name: w.read_bytes() for w in wheels.values()})
    m.wheels = wheels
    yield m
    m.close()


def package(m: Mirror, name: str, url: str | None = None) -> dict:
    w = m.wheels[name]
    return {"name": name, "version": "1.0", "filename": w.name, "sha256": sha256(w), "url": url or m.base + w.name}


def fetch(tmp_path: Path, pkgs: list[dict], **kw):
    """The host agent's fetch into a fresh cache: (count, bytes, seconds, figures)."""
    kw.setdefault("stall", 2.0)
    return agentfetch.fetch(str(tmp_path / "cache"), pkgs, kw.pop("jobs", 4), **kw)


def cached(tmp_path: Path, p: dict) -> bytes:
    return Path(agentfetch.entry(str(tmp_path / "cache"), p["sha256"], p["filename"])).read_bytes()


def no_partials(tmp_path: Path, p: dict | None = None) -> list[str]:
    """Partial files (and notes) left in the cache: of package `p`, or of any."""
    where = tmp_path / "cache" / p["sha256"] if p else tmp_path / "cache"
    return [str(f) for f in where.rglob("*.part*")] if where.exists() else []


# ---------------------------------------------------------------- the agent's fetch

def test_503_twice_then_ok_is_retried(tmp_path, mirror):
    a = package(mirror, "alpha")
    mirror.script[a["filename"]] = ["503", "503"]
    n, nbytes, _, figs = fetch(tmp_path, [a])
    assert (n, figs["retries"]) == (1, 2)
    assert [s for _, s, _ in mirror.requests(a["filename"])] == [503, 503, 200]
    assert cached(tmp_path, a) == mirror.wheels["alpha"].read_bytes() and nbytes == len(cached(tmp_path, a))


def test_cut_mid_body_resumes_with_range(tmp_path, mirror):
    """The connection closes halfway: the next request asks for the rest only (Range from the byte where the
    body stopped), the server answers 206, and nothing is fetched twice."""
    a, b = package(mirror, "alpha"), package(mirror, "beta")
    mirror.script[a["filename"]] = ["cut"]
    fetch(tmp_path, [a, b])
    first, second = mirror.requests(a["filename"])
    assert first[0] is None and first[1] == 200 and 0 < first[2] < mirror.wheels["alpha"].stat().st_size
    size = mirror.wheels["alpha"].stat().st_size
    assert second[0] == f"bytes={first[2]}-{size - 1}" and second[1] == 206
    assert first[2] + second[2] == size
    assert cached(tmp_path, a) == mirror.wheels["alpha"].read_bytes()
    assert cached(tmp_path, b) == mirror.wheels["beta"].read_bytes()
    assert not no_partials(tmp_path)


def test_stall_mid_body_times_out_and_resumes(tmp_path):
    """Half the body, then silence: the read's stall timeout ends the attempt and a Range request resumes
    from the last whole chunk written (a read waits for a whole chunk, so one file of several chunks)."""
    m = Mirror({}, stall_for=30)
    try:
        m.wheels = {"alpha": wheel_bytes(tmp_path / "served", "alpha", kib=3 * 1024)}
        m.files[m.wheels["alpha"].name] = m.wheels["alpha"].read_bytes()
        a = package(m, "alpha")
        m.script[a["filename"]] = ["stall"]
        n, _, _, figs = fetch(tmp_path, [a], stall=0.5)
        (r1, s1, sent1), (r2, s2, sent2) = m.requests(a["filename"])
        size = len(m.files[a["filename"]])
        assert (r1, s1, s2) == (None, 200, 206) and r2 == f"bytes={size - sent2}-{size - 1}"
        assert 0 < size - sent2 <= sent1       # resumed past what was written, not from the start
        assert n == 1 and figs["retries"] == 1 and cached(tmp_path, a) == m.files[a["filename"]]
    finally:
        m.close()


def test_server_ignoring_range_restarts_from_the_start(tmp_path, mirror):
    a = package(mirror, "alpha")
    mirror.ranges = False
    mirror.script[a["filename"]] = ["cut"]
    _, nbytes, _, figs = fetch(tmp_path, [a])
    (r1, s1, sent1), (r2, s2, sent2) = mirror.requests(a["filename"])
    size = mirror.wheels["alpha"].stat().st_size
    assert (r1, s1, r2, s2) == (None, 200, f"bytes={sent1}-{size - 1}", 200)   # asked to resume; got it all
    assert sent2 == size and figs["ranges_ignored"] == 1 and nbytes == size
    assert cached(tmp_path, a) == mirror.wheels["alpha"].read_bytes()


def test_404_is_not_retried_and_named_in_one_line(tmp_path, mirror):
    a, b = package(mirror, "alpha"), package(mirror, "beta")
    mirror.script[a["filename"]] = ["404"]
    with pytest.raises(AgentError) as e:
        fetch(tmp_path, [a, b])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("fetch failed: alpha==1.0: " + a["url"] + ": HTTP 404"), msg
    assert "not retried" in msg and len(mirror.requests(a["filename"])) == 1
    assert not no_partials(tmp_path, a)        # refused: nothing of it is kept (beta's part may be, to resume)


def test_gives_up_after_the_retries_naming_package_and_url(tmp_path, mirror):
    a = package(mirror, "alpha")
    mirror.script[a["filename"]] = ["503"] * 10
    with pytest.raises(AgentError) as e:
        fetch(tmp_path, [a], retries=3)
    msg = str(e.value)
    assert msg.startswith(f"fetch failed: alpha==1.0: {a['url']}: HTTP 503") and "gave up after 3 attempts" in msg
    assert len(mirror.requests(a["filename"])) == 3


def test_refused_connection_and_dns_failure_are_retried_then_named(tmp_path, mirror):
    with socket.socket() as s:              # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for url, why in ((f"http://127.0.0.1:{port}/alpha-1.0-py3-none-any.whl", "connection refused"),
                     ("https://provision-test.invalid/alpha-1.0-py3-none-any.whl", "name resolution failed")):
        a = package(mirror, "alpha", url=url)
        with pytest.raises(AgentError) as e:
            fetch(tmp_path, [a], retries=2)
        assert str(e.value).startswith(f"fetch failed: alpha==1.0: {url}: {why}"), str(e.value)
        assert "gave up after 2 attempts" in str(e.value)


def test_hash_mismatch_is_not_retried(tmp_path, mirror):
    a = dict(package(mirror, "alpha"), sha256="0" * 64)
    with pytest.raises(AgentError, match="alpha==1.0: sha256 mismatch"):
        fetch(tmp_path, [a])
    assert len(mirror.requests(a["filename"])) == 1 and not no_partials(tmp_path)


@pytest.mark.parametrize("sized", [True, False])
def test_big_file_fetched_as_parallel_ranges_and_a_cut_range_resumed(tmp_path, mirror, monkeypatch, sized):
    """A file over the split size is fetched as byte ranges by several streams (one cut halfway and resumed);
    the pieces are hashed in order and the file lands whole. With the lock's size the first request is the
    first range already; without it, a plain GET whose reply advertises ranges is cut short after its first."""
    seg = 64 * 1024
    monkeypatch.setattr(agentfetch, "SPLIT", 2 * seg)
    monkeypatch.setattr(agentfetch, "SEGMENT", seg)
    size = mirror.wheels["alpha"].stat().st_size
    a = dict(package(mirror, "alpha"), **({"size": size} if sized else {}))
    mirror.script[a["filename"]] = ["ok", "ok", "cut"]
    n, nbytes, _, figs = fetch(tmp_path, [a], jobs=4)
    reqs = mirror.requests(a["filename"])
    assert reqs[0][:2] == ((f"bytes=0-{seg - 1}", 206) if sized else (None, 200))
    assert all(r[1] == 206 for r in reqs[1:]) and figs["ranges"] == len(reqs) - (0 if sized else 1)
    starts = sorted(int(re.match(r"bytes=(\d+)-", r[0]).group(1)) for r in reqs[1:])
    assert set(range(seg, size, seg)) <= set(starts) and len(starts) == len(range(seg, size, seg)) + 1
    sent = sum(r[2] for r in reqs[(0 if sized else 1):])
    assert sent == (size if sized else size - seg)     # the cut range was resumed: nothing fetched twice
    assert nbytes == size and cached(tmp_path, a) == mirror.wheels["alpha"].read_bytes()


def test_whole_blocks_go_past_the_page_cache(tmp_path):
    """A file of several MiB, cut at an odd offset and resumed: it lands byte for byte, and (where the
    filesystem takes O_DIRECT) its whole blocks were written past the page cache: only the few blocks around
    the cut and the file's last block are resident afterwards (fincore), not the file."""
    if not _takes_direct(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT: every write goes through the page cache")
    m = Mirror({})
    try:
        w = wheel_bytes(tmp_path / "served", "alpha", kib=4 * 1024)
        m.wheels, m.files[w.name] = {"alpha": w}, w.read_bytes()
        a = dict(package(m, "alpha"), size=w.stat().st_size)
        m.script[a["filename"]] = ["cut"]
        fetch(tmp_path, [a], jobs=1)
        (_, _, sent1), (rng, status, _) = m.requests(a["filename"])
        assert sent1 % agentfetch.ALIGN and status == 206       # the resume starts inside a block
        entry = agentfetch.entry(str(tmp_path / "cache"), a["sha256"], a["filename"])
        resident = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", entry],
                                  capture_output=True, text=True, check=True).stdout.strip()
        assert int(resident) <= 4 * agentfetch.ALIGN < a["size"] // 64, resident
        assert Path(entry).read_bytes() == m.files[a["filename"]]
    finally:
        m.close()


def _takes_direct(where: Path) -> bool:
    probe = where / "direct-probe"
    probe.write_bytes(b"")
    fd = agentfetch._direct(str(probe))
    if fd is not None:
        os.close(fd)
    return fd is not None


def test_lock_size_other_than_the_servers_is_refused(tmp_path, mirror):
    a = dict(package(mirror, "alpha"), size=123)
    with pytest.raises(AgentError, match=r"alpha==1.0: .*: the server sends \d+ bytes, the lock says 123"):
        fetch(tmp_path, [a])


def test_a_fetch_that_gave_up_is_resumed_by_the_next_run(tmp_path, mirror):
    """Half the file arrived, then the server failed until the fetch gave up: the partial file and its note
    stay; the next fetch hashes that prefix again and asks only for the rest."""
    a = package(mirror, "alpha")
    size = mirror.wheels["alpha"].stat().st_size
    mirror.script[a["filename"]] = ["cut", "503", "503"]
    with pytest.raises(AgentError, match="gave up after 2 attempts"):
        fetch(tmp_path, [a], retries=2)
    sent = mirror.requests(a["filename"])[0][2]
    assert sorted(Path(f).name for f in no_partials(tmp_path, a)) == [a["filename"] + ".partial",
                                                                       a["filename"] + ".partial.json"]
    n, nbytes, _, figs = fetch(tmp_path, [a])
    last = mirror.requests(a["filename"])[-1]
    assert last[:2] == (f"bytes={sent}-", 206) and last[2] == size - sent
    assert (n, nbytes, figs["resumed_bytes"]) == (1, size - sent, sent)
    assert cached(tmp_path, a) == mirror.wheels["alpha"].read_bytes() and not no_partials(tmp_path)


def test_a_partial_file_of_other_bytes_is_refused_and_removed(tmp_path, mirror):
    """A partial file whose noted prefix is not the wheel's (the disk changed it): the sha256 check refuses
    the result, names where the bytes came from, and removes the partial so the next run starts afresh."""
    a = package(mirror, "alpha")
    mirror.script[a["filename"]] = ["cut", "503"]
    with pytest.raises(AgentError):
        fetch(tmp_path, [a], retries=1)
    part = Path(agentfetch.entry(str(tmp_path / "cache"), a["sha256"], a["filename"]) + ".partial")
    with open(part, "r+b") as f:
        f.write(b"X")
    with pytest.raises(AgentError, match="sha256 mismatch .* came from an earlier run's partial file, now removed"):
        fetch(tmp_path, [a])
    assert not no_partials(tmp_path)
    fetch(tmp_path, [a])
    assert mirror.requests(a["filename"])[-1][0] is None and cached(tmp_path, a) == mirror.wheels["alpha"].read_bytes()


# ---------------------------------------------------------------- the controller's cache, and a real apply

def served_lock(tmp_path: Path, m: Mirror, names: list[str]) -> Path:
    lk = write_lock(tmp_path / "served.yaml", "stack-served", [m.wheels[n] for n in names])
    text = lk.read_text()
    for n in names:
        text = text.replace(m.wheels[n].resolve().as_uri(), m.base + m.wheels[n].name)
    lk.write_text(text)
    return lk


def test_controller_cache_retries_and_names_the_lock_line(tmp_path, mirror):
    lk = lockmod.load(served_lock(tmp_path, mirror, ["alpha", "beta"]))
    items = [{"label": p.pin, "url": p.url, "sha256": p.sha256, "filename": p.filename} for p in lk.packages]
    a, b = (mirror.wheels[n].name for n in ("alpha", "beta"))
    mirror.script[a] = ["503", "cut"]
    mirror.script[b] = ["404"]
    with pytest.raises(ProvisionError) as e:
        WheelCache(tmp_path / "ctl").fetch(lk, items)
    assert e.value.where == f"{lk.path}:{lk.package('beta').line}" and "HTTP 404" in e.value.message
    mirror.script[b] = []
    paths = WheelCache(tmp_path / "ctl").fetch(lk, items)
    assert [p.read_bytes() for p in paths] == [mirror.wheels[n].read_bytes() for n in ("alpha", "beta")]
    assert [r[1] for r in mirror.requests(a)][-1] == 206


def test_controller_cache_fetches_each_wheel_once_for_processes_at_once(tmp_path, mirror):
    """A fleet's hosts fetch into the controller's cache from the play's worker processes, not threads of one:
    three processes let go at once (each wheel's flock held here until all three have started) download each
    wheel once between them; the others wait for it and find the file."""
    lk_path = served_lock(tmp_path, mirror, ["alpha", "beta"])
    lk = lockmod.load(lk_path)
    cache = WheelCache(tmp_path / "ctl")
    code = ("import sys; from provision import lock; from provision.wheelcache import WheelCache\n"
            "lk = lock.load(sys.argv[1])\n"
            "items = [{'label': p.pin, 'url': p.url, 'sha256': p.sha256, 'filename': p.filename} for p in lk.packages]\n"
            "print(len(WheelCache(sys.argv[2]).fetch(lk, items)))\n")
    with cache.held(lk.package("alpha").sha256), cache.held(lk.package("beta").sha256):
        procs = [subprocess.Popen([sys.executable, "-c", code, str(lk_path), str(tmp_path / "ctl")], cwd=ROOT,
                                  stdout=subprocess.PIPE, text=True) for _ in range(3)]
        time.sleep(1.0)                 # a head start; the count below holds however the three interleave
        assert mirror.seen == []
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0] and outs == ["2\n"] * 3, outs
    assert sorted(n for n, _, _, _ in mirror.seen) == sorted(mirror.wheels[n].name for n in ("alpha", "beta"))
    got = [cache.path(p.sha256, p.filename).read_bytes() for p in lk.packages]
    assert got == [mirror.wheels[n].read_bytes() for n in ("alpha", "beta")]


def test_apply_over_ssh_survives_503_and_a_cut_and_resumes_with_range(target, tmp_path, mirror):
    lk = served_lock(tmp_path, mirror, ["alpha", "beta"])
    a = mirror.wheels["alpha"].name
    mirror.script[a] = ["503", "cut"]
    tr = connect(target)
    try:
        rep = applymod.apply(tr, lockmod.load(lk))
    finally:
        tr.close()
    assert rep.status == "applied", rep
    reqs = mirror.requests(a)
    size = mirror.wheels["alpha"].stat().st_size
    assert [s for _, s, _ in reqs] == [503, 200, 206] and reqs[2][0] == f"bytes={reqs[1][2]}-{size - 1}"
    assert rep.build["retries"] == 2 and rep.build["fetched"] == 2
    log = (Path(target.root) / "generations" / rep.generation / "build.log").read_text()
    assert "fetch: alpha==1.0: HTTP 503 Service Unavailable; again in" in log      # the retries are in the build log
    assert "fetch: alpha==1.0: the connection closed after" in log


def test_apply_cli_404_is_one_line_exit_1_and_the_host_keeps_its_generation(target, tmp_path, mirror):
    from test_core import cli, current_link, host_args

    lk = served_lock(tmp_path, mirror, ["alpha"])
    cli("apply", *host_args(target), "--lock", lk, check=0)
    before = current_link(target)
    lk2 = served_lock(tmp_path, mirror, ["alpha", "beta"])
    b = mirror.wheels["beta"].name
    mirror.script[b] = ["404"]
    p = cli("apply", *host_args(target), "--lock", lk2, check=1)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and f"beta==1.0: {mirror.base}{b}: HTTP 404" in errors[0], p.stderr
    assert f"{lk2}:" in errors[0] and current_link(target) == before
    assert len(mirror.requests(b)) == 1


@pytest.mark.parametrize("fast", [True, False])
def test_a_big_files_first_range_decides_one_stream_or_ranges_by_its_rate(tmp_path, monkeypatch, fast):
    """A big file's first range comes alone; where it arrived at FAST_LINK or more (one connection keeps up
    with the hash and the write), the rest is one more request on one stream; else it comes as parallel
    ranges. Either way the file lands whole and nothing is fetched twice. (The thresholds are set so that this
    loopback counts as fast, or as slow.)"""
    seg = agentfetch.JUDGE_BYTES
    monkeypatch.setattr(agentfetch, "SPLIT", 2 * seg)
    monkeypatch.setattr(agentfetch, "SEGMENT", seg)
    monkeypatch.setattr(agentfetch, "FAST_LINK", 1.0 if fast else 1e18)
    monkeypatch.setattr(agentfetch, "SINK_BOUND", 0.0 if fast else 2.0)
    data = os.urandom(4 * seg + 12345)
    name = "big-1.0-py3-none-any.whl"
    m = Mirror({name: data})
    try:
        a = {"name": "big", "version": "1.0", "filename": name, "sha256": hashlib.sha256(data).hexdigest(),
             "url": m.base + name, "size": len(data)}
        n, nbytes, _, figs = fetch(tmp_path, [a], jobs=4)
        reqs = m.requests(name)
    finally:
        m.close()
    assert reqs[0][:2] == (f"bytes=0-{seg - 1}", 206)
    rest = [(rng, status) for rng, status, _ in reqs[1:]]
    if fast:
        assert rest == [(f"bytes={seg}-{len(data) - 1}", 206)], rest
    else:
        assert sorted(rest) == sorted((f"bytes={lo}-{min(lo + seg, len(data)) - 1}", 206)
                                      for lo in range(seg, len(data), seg)), rest
    assert sum(s for _, _, s in reqs) == len(data) and figs["ranges"] == len(reqs)
    assert nbytes == len(data) and cached(tmp_path, a) == data
