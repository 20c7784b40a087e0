"""Host agent (stdlib only): what a systemd unit serves: its state as systemd's manager has it, and the
generations its processes run, read from /proc (their interpreter, the files they map, the paths their command
lines name under <root>/generations). A process started from `<root>/current` maps its files by the generation's
own path, so a server started before the last switch shows the generation it really runs."""
import json
import os
import time
import urllib.error
import urllib.request

from ..steps.state import Restarted, Serving
from .systemd import Bus, BusError

RUNNING = ("active", "activating", "reloading", "deactivating")
HEALTH_TIMEOUT = 5.0        # seconds one health request may take


class Unhealthy(Exception):
    """A health check's request that failed: what was asked and why, in one line."""


def _http(url, body=None, timeout=HEALTH_TIMEOUT):
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"} if body is not None else {})
    what = ("POST " if body is not None else "GET ") + url
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:      # the lock's checked http(s) URL
            return r.status, r.read(1 << 20)
    except urllib.error.HTTPError as e:
        raise Unhealthy("%s: HTTP %d" % (what, e.code)) from None
    except (urllib.error.URLError, OSError) as e:
        raise Unhealthy("%s: %s" % (what, getattr(e, "reason", None) or e)) from None


def health(url, kind, timeout=HEALTH_TIMEOUT):
    """(healthy, detail): `generate`, SGLang's /health_generate (it answers after a real one-token generation);
    `completion`, /health and then one real completion of one token over the OpenAI API."""
    t0 = time.monotonic()
    try:
        if kind == "generate":
            _http(url + "/health_generate", timeout=timeout)
        else:
            _http(url + "/health", timeout=timeout)
            _, listed = _http(url + "/v1/models", timeout=timeout)
            try:
                model = json.loads(listed)["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise Unhealthy("GET %s/v1/models: no model listed" % url) from None
            _, out = _http(url + "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 1,
                                                    "temperature": 0}, timeout=timeout)
            try:
                if not isinstance(json.loads(out)["choices"][0]["text"], str):
                    raise TypeError
            except (ValueError, KeyError, IndexError, TypeError):
                raise Unhealthy("POST %s/v1/completions: no completion in the answer" % url) from None
    except Unhealthy as e:
        return False, str(e)[:300]
    return True, "%s in %.2f s" % ("a generation" if kind == "generate" else "a completion", time.monotonic() - t0)


def generations_run(lay, pids):
    """The generation ids whose files the processes `pids` run, map or name (sorted)."""
    prefix = os.path.join(os.path.realpath(lay.root), "generations") + "/"
    found = set()
    for pid in pids:
        paths = []
        try:
            paths.append(os.readlink("/proc/%d/exe" % pid))
        except OSError:
            pass
        try:
            with open("/proc/%d/maps" % pid) as f:
                paths += [line.split(None, 5)[5].rstrip("\n") for line in f if len(line.split(None, 5)) == 6]
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                paths += [a.decode("utf-8", "replace") for a in f.read().split(b"\0")]
        except OSError:
            continue
        found.update(p[len(prefix):].split("/", 1)[0] for p in paths if p.startswith(prefix))
    return sorted(g for g in found if g)


def _port(url):
    rest = url.split("//", 1)[-1].split("/", 1)[0]
    tail = rest.rsplit("]", 1)[-1]
    return int(tail.rsplit(":", 1)[1]) if ":" in tail else 443 if url.startswith("https:") else 80


def listeners(port):
    """The socket inodes listening on TCP `port` in this host's network (/proc/net/tcp and tcp6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                for line in list(f)[1:]:
                    cols = line.split()
                    if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add("socket:[%s]" % cols[9])
        except (OSError, ValueError, IndexError):
            continue
    return inodes


def listens(pids, port):
    """Whether one of `pids` holds a socket listening on TCP `port` (its fds against the host's listeners)."""
    inodes = listeners(port)
    for pid in pids:
        try:
            fds = os.listdir("/proc/%d/fd" % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink("/proc/%d/fd/%s" % (pid, fd)) in inodes:
                    return True
            except OSError:
                continue
    return False


def serving(lay, svc):
    """The Serving reply for the service `svc` (a manifest's stack.service): its unit's state, the generations its
    processes run, and, where it is active, its health."""
    unit = svc["unit"]
    try:
        with Bus() as bus:
            st = bus.state(unit)
            pids = bus.processes(unit) if st["active"] in RUNNING else []
    except BusError as e:
        return Serving(unit=unit, error=str(e))
    healthy, said = None, None
    if st["active"] == "active" and isinstance(svc.get("url"), str) and svc.get("health") in ("generate", "completion"):
        healthy, said = health(svc["url"].rstrip("/"), svc["health"])
        if healthy and not listens(pids, _port(svc["url"])):     # a container's server, say, or another one's
            said += "; port %d is held by no process of %s" % (_port(svc["url"]), unit)
    return Serving(unit=unit, load=st["load"], active=st["active"], sub=st["sub"], main_pid=st["main_pid"],
                   processes=len(pids), generations=generations_run(lay, pids), healthy=healthy, health=said)


def _until(done, seconds, step=0.2):
    """Whether `done()` became true within `seconds` (asked every `step`)."""
    deadline = time.monotonic() + seconds
    while True:
        if done():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(step)


def restart(lay, svc):
    """Stop the service's unit (until its processes are gone, service.stop_deadline), start it and wait for its
    health (service.start_deadline). The Restarted reply: healthy, or why not, with its downtime."""
    unit, t0 = svc["unit"], time.monotonic()
    stop_s, start_s = float(svc.get("stop_deadline") or 120), float(svc.get("start_deadline") or 600)
    url, kind = str(svc.get("url") or "http://127.0.0.1:30000").rstrip("/"), svc.get("health") or "generate"

    def failed(why, **more):
        return Restarted(unit=unit, error="%s %s" % (unit, why), seconds=round(time.monotonic() - t0, 3), **more)
    try:
        with Bus() as bus:
            bus.stop(unit)
            if not _until(lambda: not bus.processes(unit) and bus.state(unit)["active"] in ("inactive", "failed"),
                          stop_s):
                return failed("did not stop within %g s (service.stop_deadline)" % stop_s)
            stopped = round(time.monotonic() - t0, 3)
            if listeners(_port(url)):         # its health would be another server's answer
                return failed("is stopped, but port %d is still held by a process outside it: another server "
                              "answers there" % _port(url), stop_seconds=stopped)
            bus.start(unit)
            said = "not active yet"
            deadline = time.monotonic() + start_s
            while True:
                st = bus.state(unit)
                if st["active"] == "failed" or st["load"] != "loaded":
                    return failed("failed to start (%s, %s)" % (st["load"], st["result"] or st["sub"]),
                                  stop_seconds=stopped)
                if st["active"] == "active":
                    ok, said = health(url, kind)
                    if ok:
                        return Restarted(unit=unit, healthy=True, health=said, stop_seconds=stopped,
                                         seconds=round(time.monotonic() - t0, 3), main_pid=st["main_pid"],
                                         generations=generations_run(lay, bus.processes(unit)))
                if time.monotonic() > deadline:
                    return failed("was not healthy within %g s of its start (service.start_deadline): %s"
                                  % (start_s, said), stop_seconds=stopped, health=said, main_pid=st["main_pid"])
                time.sleep(0.5)
    except BusError as e:
        return failed("could not be restarted: %s" % e)
