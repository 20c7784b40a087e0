"""A file server for the fetch benchmark: serves a directory over plain HTTP/1.1 on 127.0.0.1 with byte ranges
(keep-alive, zero-copy sendfile) and, with --rate, a link of that many bytes per second shared by every
connection (one token bucket: more connections do not get more bandwidth, as on a real link).
Usage: python bench/fetch_server.py DIR [--rate BYTES_PER_S]   (prints its port on the first line)
"""
from __future__ import annotations

import argparse
import http.server
import os
import re
import sys
import threading
import time

CHUNK = 256 << 10


class Link:
    """A shared token bucket: `take(n)` returns when n bytes may go out at `rate` bytes per second."""

    def __init__(self, rate: float):
        self.rate, self.lock, self.next = rate, threading.Lock(), time.monotonic()

    def take(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            self.next = max(self.next, now - 0.05) + n / self.rate      # at most 50 ms of burst
            wait = self.next - now
        if wait > 0:
            time.sleep(wait)


def serve(root: str, rate: float | None) -> http.server.ThreadingHTTPServer:
    link = Link(rate) if rate else None

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            path = os.path.join(root, os.path.basename(self.path.split("?")[0]))
            try:
                f = open(path, "rb")
            except OSError:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            with f:
                size = os.fstat(f.fileno()).st_size
                lo, hi, status = 0, size - 1, 200
                m = re.match(r"^bytes=(\d+)-(\d*)$", self.headers.get("Range") or "")
                if m:
                    lo, hi, status = int(m.group(1)), min(int(m.group(2) or size - 1), size - 1), 206
                self.send_response(status)
                self.send_header("Content-Length", str(hi + 1 - lo))
                self.send_header("Accept-Ranges", "bytes")
                if status == 206:
                    self.send_header("Content-Range", "bytes %d-%d/%d" % (lo, hi, size))
                self.end_headers()
                self.wfile.flush()
                at, end = lo, hi + 1
                try:
                    while at < end:
                        n = min(CHUNK, end - at)
                        if link:
                            link.take(n)
                        at += os.sendfile(self.connection.fileno(), f.fileno(), at, n)
                except OSError:
                    self.close_connection = True

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    return srv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--rate", type=float, help="bytes per second for all connections together")
    args = ap.parse_args()
    srv = serve(args.dir, args.rate)
    print(srv.server_address[1], flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
