"""A wheel cache entry is hashed once: on its way in (fetched or pushed) its inode is noted as verified, and a
build's recheck trusts it while it is untouched; any write through it (even one that puts its mtime back), a
replacement or a mode change makes the recheck hash it again, and a changed one is removed."""
from __future__ import annotations

import functools
import hashlib
import http.server
import os
import threading

from provision.agent import cache as agentcache, fetch as agentfetch


def _served(tmp_path, data: bytes):
    d = tmp_path / "served"
    d.mkdir()
    (d / "w-1.0-py3-none-any.whl").write_bytes(data)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(
        http.server.SimpleHTTPRequestHandler, directory=str(d)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/w-1.0-py3-none-any.whl"


def test_a_fetched_or_pushed_entry_is_trusted_until_something_touches_it(tmp_path, capsys):
    data = os.urandom(3 << 20)
    sha = hashlib.sha256(data).hexdigest()
    cache = tmp_path / "cache"
    srv, url = _served(tmp_path, data)
    try:
        pkg = {"name": "w", "version": "1.0", "sha256": sha, "filename": "w-1.0-py3-none-any.whl", "url": url}
        assert agentfetch.fetch(str(cache), [pkg], 2)[0] == 1
    finally:
        srv.shutdown()
    path = agentcache.entry(str(cache), sha, pkg["filename"])
    rc = agentcache.recheck([(path, sha)])
    assert (rc["checked"], rc["hashed"], rc["bytes"], rc["healed"]) == (1, 0, 0, []), rc

    os.chmod(path, 0o600)                                   # a mode change: hashed again, still good
    rc = agentcache.recheck([(path, sha)])
    assert (rc["hashed"], rc["bytes"], rc["healed"]) == (1, len(data), []), rc
    assert agentcache.recheck([(path, sha)])["hashed"] == 0          # and trusted again after that

    st = os.stat(path)
    with open(path, "r+b") as f:                            # a byte flipped in place, its mtime put back
        f.seek(len(data) // 2)
        f.write(bytes([data[len(data) // 2] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    rc = agentcache.recheck([(path, sha)])
    assert (rc["hashed"], rc["healed"]) == (1, [path]) and not os.path.exists(path), rc

    pushed = agentcache.entry(str(cache), sha, pkg["filename"])     # pushed again, through `store`
    agentcache.store(pushed, sha, iter([data[:1 << 20], data[1 << 20:]]), "w==1.0")
    assert agentcache.recheck([(pushed, sha)])["hashed"] == 0
    os.replace(pushed, pushed + ".x")                                # another inode under the name
    with open(pushed, "wb") as f:
        f.write(data)
    os.unlink(pushed + ".x")
    assert agentcache.recheck([(pushed, sha)])["hashed"] == 1


def test_an_entry_with_no_note_is_hashed_and_then_noted(tmp_path):
    data = b"wheel bytes" * 1000
    sha = hashlib.sha256(data).hexdigest()
    path = agentcache.entry(str(tmp_path), sha, "w-1.0-py3-none-any.whl")
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:                 # as a cache an older version of the tool filled
        f.write(data)
    assert agentcache.recheck([(path, sha)])["hashed"] == 1
    assert agentcache.recheck([(path, sha)])["hashed"] == 0
    assert sorted(os.listdir(os.path.dirname(path))) == [agentcache.VERIFIED, "w-1.0-py3-none-any.whl"]
