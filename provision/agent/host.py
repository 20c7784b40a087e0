"""Host side, shared by every agent (stdlib only): the entry point that reads the one JSON payload,
the host root and its lock, nvidia-smi, installed distributions and path containment.

Agents are modules of `provision.agent`; each has `OPS = {op: function(payload) -> dict}`, and a payload names its
operation under `op`. See `agent/__init__.py`.
"""
import fcntl
import importlib
import json
import mmap
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib

from ..layout import Layout

CLEAN_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
UMASK = 0o027           # the host root and everything under it: dirs 0750, files 0640

# The one command line an agent runs with: `PYTHON -I -c BOOT`. Its stdin's first line is one JSON
# message {bundle, agent, input, env}: `bundle` holds this package's sources (zlib, base64), which
# BOOT imports from memory (with nothing heavier than importlib.util: it runs on every round trip);
# nothing proportional to the input is ever on a command line.
BOOT = r"""
import binascii, json, sys, zlib
from importlib.util import spec_from_loader
m = json.loads(sys.stdin.buffer.readline())
S = json.loads(zlib.decompress(binascii.a2b_base64(m["bundle"])))
class L:
    def find_spec(self, n, p=None, t=None):
        f = n.replace(".", "/")
        for k, pkg in ((f + "/__init__.py", True), (f + ".py", False)):
            if k in S:
                return spec_from_loader(n, self, origin=k, is_package=pkg)
    def create_module(self, spec):
        return None
    def exec_module(self, mod):
        exec(compile(S[mod.__spec__.origin], mod.__spec__.origin, "exec"), mod.__dict__)
sys.meta_path.insert(0, L())
import provision.agent.host
provision.agent.host.serve(m)
""".strip()
MESSAGE = {}            # the message this process was started with (to start sibling agents)
AT_END = []             # what `end` does once this agent's process tree is gone (the host lock waits for work)
WORKING = []            # <root>/.work held shared while this agent lives (never closed: its exit lets it go)
ON_PULSE = []           # what each heartbeat from the controller does (the host lock notes its holder is heard)
STDIN_OPS = {("host", "hold"), ("cache", "push")}    # the operations that read stdin after their message


class AgentError(Exception):
    """A refusal or failure an agent reports as its one-line `error`."""


# ------------------------------------------------------------------ entry

_BUFFERS = threading.local()


def thread_buffer(name, size):
    """This thread's page-aligned buffer `name` of at least `size` bytes (anonymous memory, mapped once per thread
    and reused for every file it reads): no fresh page per byte, and what an O_DIRECT read or write needs."""
    buf = getattr(_BUFFERS, name, None)
    if buf is None or len(buf) < size:
        buf = memoryview(mmap.mmap(-1, size))
        setattr(_BUFFERS, name, buf)
    return buf


def bundle_of(files):
    """The agents' bundle of `files` {path: source}: what BOOT reads back (zlib, then base64 of the JSON)."""
    import base64
    return base64.b64encode(zlib.compress(json.dumps(files, sort_keys=True).encode(), 9)).decode()


def serve(message):
    """Run `message["agent"]` on `message["input"]`; print its result as the last stdout line."""
    MESSAGE.update(message)
    os.umask(UMASK)
    os.environ.update({str(k): str(v) for k, v in (message.get("env") or {}).items()})
    payload = message.get("input") if isinstance(message.get("input"), dict) else {}
    guard(working=not (message.get("agent") == "host" and payload.get("op") in ("hold", "end", "unlock")),
          root=payload.get("root"), heartbeat=message.get("heartbeat"),
          reads_stdin=(message.get("agent"), payload.get("op")) in STDIN_OPS)
    try:
        try:
            result = dispatch(message["agent"], payload)
        except AgentError as e:
            result = {"error": str(e)}
        except Exception as e:  # noqa: BLE001 - the controller wants one JSON line, never a traceback
            result = {"error": "%s: %s" % (type(e).__name__, (str(e).splitlines() or [""])[0][:300])}
        emit(result)
    finally:
        end_tree()              # nothing this agent started outlives it


def dispatch(agent, payload):
    """The one convention: agent module `agent` runs its operation `payload["op"]` on the payload."""
    ops = getattr(importlib.import_module("provision.agent." + agent), "OPS", {})
    op = payload.get("op")
    if op not in ops:
        raise AgentError("unknown op %r" % (op,))
    return ops[op](payload)


# ------------------------------------------------------------------ an agent's work dies with its controller

def guard(working, root, heartbeat=None, reads_stdin=False):
    """Tie this agent's work to its controller. Every process it starts, at any depth, stays its descendant
    (it is their subreaper), and when the controller goes (its end of our stdout closes: the ssh channel or
    the local pipe is gone), or falls silent for `heartbeat` seconds (a network partition closes nothing), or
    SIGHUP/SIGTERM comes, `end` kills them all, waits until they are gone, then exits. A `working` agent holds
    <root>/.work shared while it lives; the host lock's holder takes it exclusive before letting the lock go,
    so the next run never races what this one started. An agent the controller started says its pid first."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)     # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass
    if working and isinstance(root, str) and os.path.isabs(root) and os.path.isdir(root):
        try:
            f = open(Layout(root).work, "a+")
            fcntl.flock(f, fcntl.LOCK_SH)
            WORKING.append(f)   # let go by this process's exit alone: after its last thread has stopped
        except OSError:
            pass
    for s in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(s, lambda signum, frame: end(128 + signum))
    threading.Thread(target=_watch_controller, daemon=True).start()
    if isinstance(heartbeat, (int, float)) and not isinstance(heartbeat, bool) and heartbeat > 0:
        _listen(float(heartbeat), reads_stdin)
        emit({"_agent": {"pid": os.getpid(), "start": proc_start(os.getpid())}})


def _listen(bound, forward):
    """Hear the controller's heartbeat: each chunk that comes on stdin is a sign of life (ON_PULSE). No byte for
    `bound` seconds ends this agent as a closed channel does; the end of stdin ends the listening (the controller
    is done sending, not gone). Stdin becomes a pipe that gets what came (`forward`: an operation that reads its
    stdin) or nothing, so the programs an agent starts read an ended stdin, not heartbeats."""
    src = os.dup(0)
    r, w = os.pipe()
    os.dup2(r, 0)
    os.close(r)
    if not forward:
        os.close(w)
    heard, closed = [time.monotonic()], threading.Event()

    def relay():
        try:
            for chunk in iter(lambda: os.read(src, 65536), b""):
                heard[0] = time.monotonic()
                for f in ON_PULSE:
                    f()
                if forward:
                    os.write(w, chunk)
        except OSError:
            pass
        closed.set()
        if forward:
            os.close(w)

    def watch():
        while not closed.wait(min(1.0, bound / 4)):
            if time.monotonic() - heard[0] > bound:
                end(1)

    threading.Thread(target=relay, daemon=True).start()
    threading.Thread(target=watch, daemon=True).start()


def _watch_controller():
    """Wait until nobody reads our stdout any more (POLLERR on a pipe, POLLHUP on a socket), then `end`."""
    p = select.poll()
    p.register(sys.stdout.fileno(), 0)       # no events asked: only the error and hang-up conditions report
    while True:
        try:
            if any(ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL) for _, ev in p.poll()):
                break
        except InterruptedError:
            continue
    end(1)


_ENDING = threading.Lock()


def end(code):
    """Kill every descendant of this agent, wait until they are gone, run AT_END, exit."""
    if not _ENDING.acquire(blocking=False):
        return                      # another thread is ending this agent
    end_tree()
    for f in AT_END:
        f()
    os._exit(code)


def descendants(pid):
    """The pids of every live process below `pid` (from /proc)."""
    kids = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/%s/stat" % name) as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def has_children():
    """Whether this process has a child (live or not yet reaped); True when the kernel cannot say."""
    try:
        for t in os.listdir("/proc/self/task"):
            with open("/proc/self/task/%s/children" % t) as f:
                if f.read().strip():
                    return True
        return False
    except OSError:
        return True


def end_tree():
    """SIGKILL every descendant until none is left (orphans come back to us: we are their subreaper)."""
    while True:
        pids = descendants(os.getpid()) if has_children() else []
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        time.sleep(0.02)


def wait_for_work(root):
    """Block until no agent works under `root` any more (each holds <root>/.work shared while it lives)."""
    with open(Layout(root).work, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)


_EMIT = threading.Lock()


def emit(obj):
    line = json.dumps(obj) + "\n"
    with _EMIT:              # one whole line at a time, whichever thread speaks
        sys.stdout.write(line)
        sys.stdout.flush()


def event(**fields):
    """A progress event for the controller (a line before the result)."""
    emit({"_event": fields})


# ------------------------------------------------------------------ the host root

def ensure_root(root):
    """Create the host root (0750) if needed; tighten it if it is ours and wider. Returns its Layout."""
    if not os.path.isabs(root):
        raise AgentError("host root %r is not an absolute path" % root)
    os.makedirs(root, mode=0o750, exist_ok=True)
    st = os.stat(root)
    if st.st_uid == os.getuid() and st.st_mode & 0o027:
        os.chmod(root, st.st_mode & ~0o027 & 0o7777)
    return Layout(root)


def inside(root, path):
    """`path` if it is absolute and stays under `root` once resolved, else AgentError."""
    if not isinstance(path, str) or not os.path.isabs(path) or "\0" in path:
        raise AgentError("not an absolute path: %r" % (path,))
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if real != real_root and not real.startswith(real_root + os.sep):
        raise AgentError("%s is outside %s" % (path, root))
    return path


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path, text):
    """Write, fsync, rename, fsync the directory; on any failure the temp file is removed."""
    tmp = "%s.tmp-%d" % (path, os.getpid())
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    fsync_dir(os.path.dirname(path))


def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def current(lay):
    """The id of the generation `current` names (None: no link, or one that names no generation: see
    `current_problem`)."""
    return current_link(lay)[0]


def current_problem(lay):
    """What is wrong with `current`, in a few words (None: it is absent or names a generation)."""
    return current_link(lay)[1]


def disk_full(lay):
    """What an error caused by a full disk adds: the root, what is free there, and where `current` is."""
    try:
        st = os.statvfs(lay.root)
        free = "%.1f MiB free" % (st.f_bavail * st.f_frsize / float(1 << 20))
    except OSError:
        free = "free space unknown"
    return "the disk under host root %s is full (%s); current is %s" % (lay.root, free, current(lay) or "(none)")


def current_link(lay):
    """(id of the generation `current` names, None) or (None, what `current` is instead)."""
    link = lay.current
    if not os.path.lexists(link):
        return None, None
    if not os.path.islink(link):
        what = "a directory" if os.path.isdir(link) else "a file"
        return None, "%s is %s, not a link to a generation under %s" % (link, what, lay.generations)
    target = os.readlink(link)
    full = os.path.normpath(os.path.join(lay.root, target))
    name = os.path.basename(full)
    if re.match(r"^\d{4}-.+$", name) and \
            os.path.realpath(os.path.dirname(full)) == os.path.realpath(lay.generations):
        return name, None
    return None, "%s points at %s, not at a generation under %s" % (link, target, lay.generations)


def generations(lay):
    """[(number, id, manifest)] of the generation directories, oldest first. A manifest that cannot be read
    (cut off, not a JSON object, or missing beside a venv) is {"status": "unreadable", "unreadable": what is
    wrong}: nothing says what that generation is, so nothing treats it as incomplete. A directory with neither
    manifest nor venv is a `prepare` that was cut short: its manifest is {}."""
    gdir = lay.generations
    out = []
    for name in sorted(os.listdir(gdir)) if os.path.isdir(gdir) else []:
        m = re.match(r"^(\d{4})-(.+)$", name)
        if m:
            out.append((int(m.group(1)), name, manifest_of(lay.gen(name))))
    return out


def manifest_of(gen):
    """A generation's manifest (see `generations`)."""
    try:
        with open(gen.manifest) as f:
            man = json.load(f)
    except FileNotFoundError:
        return {"status": "unreadable", "unreadable": "manifest.json is missing"} \
            if os.path.lexists(gen.venv) else {}
    except (OSError, ValueError) as e:
        return {"status": "unreadable", "unreadable": "manifest.json cannot be read (%s)" % (
            e.strerror if isinstance(e, OSError) else "cut off or not JSON: %s" % e)}
    if not isinstance(man, dict):
        return {"status": "unreadable", "unreadable": "manifest.json is not a JSON object"}
    return man


# ------------------------------------------------------------------ host lock

def try_lock(root, step=None):
    """Take the host's flock without waiting: (file, None) when held, (None, holder) when another run has it
    (`holder`: who, in words). The file records its holder: pid and start time, since when, its controller,
    the heartbeat bound it hears that controller by, and the step (`step`, else this agent's op); each
    heartbeat heard sets the file's mtime, so `op_unlock` can tell a holder that still hears its controller."""
    path = ensure_root(root).lock_file
    f = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o640), "r+")    # not O_APPEND: the record is rewritten
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = holder_text(f.read(4096))
        f.close()
        return None, holder
    op = (MESSAGE.get("input") or {}).get("op") if isinstance(MESSAGE.get("input"), dict) else None
    record = {"pid": os.getpid(), "start": proc_start(os.getpid()),
              "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "controller": MESSAGE.get("controller"), "heartbeat": MESSAGE.get("heartbeat"), "step": step or op}
    write_record(f, record)

    def heard():
        try:
            os.utime(f.fileno())
        except (OSError, ValueError):     # let go already
            pass
    ON_PULSE.append(heard)
    return f, None


def write_record(f, record):
    """Write the holder record over the lock file's text in one write, then cut what is left of the old one."""
    data = json.dumps(record).encode()
    os.pwrite(f.fileno(), data, 0)
    os.ftruncate(f.fileno(), len(data))


def read_record(text):
    """The holder record of a lock file's text ({} when it has none)."""
    try:
        record = json.loads(text)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def holder_text(text):
    """Who holds a lock, in words: `pid N (CONTROLLER, since T, step S)`, from the record in the lock file."""
    r = read_record(text)
    if not isinstance(r.get("pid"), int):
        return "unknown"
    said = ", ".join(printable(v) for v in (r.get("controller"), r.get("since") and "since %s" % r["since"],
                                            r.get("step") and "step %s" % r["step"]) if v)
    return "pid %d%s" % (r["pid"], " (%s)" % said if said else "")


def printable(v):
    return "".join(c if c.isprintable() else "?" for c in str(v))[:120]


# ------------------------------------------------------------------ processes, GPUs, distributions

def sh(argv, timeout=20, env=None, cwd=None):
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
        return p.returncode, p.stdout, p.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, "", str(e)


GPU_FIELDS = ("index", "name", "uuid", "driver", "compute_cap", "memory", "pci")


def query_gpus(nvidia_smi="nvidia-smi"):
    """{nvidia_smi, gpus: [{index, name, uuid, driver, compute_cap, memory, pci}], error?} from nvidia-smi."""
    cmd = shutil.which(nvidia_smi) or (nvidia_smi if os.path.exists(nvidia_smi) else None)
    if not cmd:
        return {"nvidia_smi": None, "gpus": []}
    rc, out, err = sh([cmd, "--query-gpu=index,name,uuid,driver_version,compute_cap,memory.total,pci.bus_id",
                       "--format=csv,noheader"], timeout=30)
    if rc != 0:
        return {"nvidia_smi": cmd, "gpus": [], "error": (err or out).strip()[:200]}
    rows = []
    for line in out.strip().splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) >= len(GPU_FIELDS) and f[0].isdigit():
            row = dict(zip(GPU_FIELDS, f))
            row["index"] = int(row["index"])
            rows.append(row)
    return {"nvidia_smi": cmd, "gpus": rows}


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_dists(path=None):
    """{normalized name: version} of the distributions this interpreter sees (or those in `path`)."""
    from importlib import metadata

    out = {}
    for d in metadata.distributions(path=[path]) if path else metadata.distributions():
        n = d.metadata["Name"]
        if n:
            out.setdefault(norm(n), d.version)
    return out


def distribution(package, site_packages=None):
    """The installed distribution named `package` (PEP 503 comparison), from this interpreter or a given dir."""
    from importlib import metadata

    want = norm(package)
    for d in metadata.distributions(path=[site_packages]) if site_packages else metadata.distributions():
        if norm(d.metadata["Name"] or "") == want:
            return d
    return None


def locate(package, site_packages=None):
    """{name, version, root} of one installed distribution, or None."""
    d = distribution(package, site_packages)
    if d is None:
        return None
    return {"name": d.metadata["Name"], "version": d.version, "root": os.path.abspath(str(d.locate_file("")))}


def message_to(agent, payload):
    """The one stdin line that starts `agent` on `payload` in another interpreter, with this agent's bundle."""
    return (json.dumps({"bundle": MESSAGE["bundle"], "agent": agent, "input": payload}) + "\n").encode()


def start_agent(python, agent, payload, env=CLEAN_ENV, cwd="/"):
    """Start another agent of this bundle in `python` (e.g. a generation's; `-I`), as the controller starts
    agents: the constant loader, the message on stdin. Returns the process (stdout and stderr piped)."""
    p = subprocess.Popen([python, "-I", "-c", BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env, cwd=cwd)
    try:
        p.stdin.write(message_to(agent, payload))
        p.stdin.flush()
    except BrokenPipeError:
        pass                    # it ended at once: its stderr says why
    return p


def answer(p, stdout, stderr):
    """The result dict a finished agent process printed last; RuntimeError (its last stderr line) if none."""
    out = stdout.decode(errors="replace").strip().splitlines()
    try:
        return json.loads(out[-1])
    except (IndexError, ValueError):
        err = [l for l in stderr.decode(errors="replace").strip().splitlines() if l.strip()]
        raise RuntimeError((err or ["exit %d" % p.returncode])[-1])


def run_agent(python, agent, payload, timeout=120):
    """Run another agent in another interpreter on this host (e.g. a generation's), through the same
    channel the controller uses, isolated (`-I`, clean environment, cwd /); returns its result dict."""
    try:
        p = start_agent(python, agent, payload)
        try:
            return answer(p, *p.communicate(timeout=timeout))
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        return {"error": "cannot run %s: %s" % (python, e)}


# ------------------------------------------------------------------ this module as an agent

def op_hold(a):
    """Take the host lock and keep it until stdin closes. Lines on stdin are the controller's heartbeat; one that
    is {"step": NAME} records the step the run is in."""
    f, holder = try_lock(a["root"], step="hold")
    if f is None:
        return {"held": False, "by": holder}
    AT_END.append(lambda: wait_for_work(a["root"]))
    emit({"held": True})
    f.seek(0)
    record = read_record(f.read(4096))
    for line in sys.stdin.buffer:   # held until the controller closes stdin or its connection dies,
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, str) and re.match(r"^[a-z][a-z0-9_-]{0,31}\Z", step) and step != record.get("step"):
            record["step"] = step
            write_record(f, record)
    wait_for_work(a["root"])  # and then until the work it started under the root is gone
    return {"released": True}


# ------------------------------------------------------------------ ending another run's host work

def proc_stat(pid):
    """(state, start time in clock ticks) of a live process, else None."""
    try:
        with open("/proc/%d/stat" % int(pid)) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def proc_start(pid):
    st = proc_stat(pid)
    return st[1] if st else None


def is_agent(pid, start):
    """Whether `pid` is still the agent that started at `start` (not a pid used again, not another program)."""
    st = proc_stat(pid)
    if st is None or st[0] == "Z" or st[1] != start:
        return False
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return BOOT.encode() in f.read()
    except OSError:
        return False


def kill_tree(pid):
    """Stop `pid` and every process below it (so none starts another), then SIGKILL them all; works on a stopped
    process too. Returns the pids ended."""
    seen, tried = [], set()
    todo = [pid]
    while todo:
        for p in todo:
            tried.add(p)
            try:
                os.kill(p, signal.SIGSTOP)
                seen.append(p)
            except OSError:
                pass
        todo = [p for p in descendants(pid) if p not in tried]
    for p in seen:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + 10
    while any((proc_stat(p) or ("Z",))[0] != "Z" for p in seen) and time.monotonic() < deadline:
        time.sleep(0.02)
    return seen


def op_end(a):
    """{pid, start, grace}: end the agent `pid` (started at `start`) and its tree, unless it ends by itself within
    `grace` seconds (the controller closed its session: it should). -> {ended, stopped}."""
    pid, start = int(a["pid"]), a.get("start")
    deadline = time.monotonic() + float(a.get("grace") or 0)
    while is_agent(pid, start) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not is_agent(pid, start):
        return {"ended": False}
    stopped = (proc_stat(pid) or ("?",))[0] == "T"
    kill_tree(pid)
    return {"ended": True, "stopped": stopped}


def open_by(path):
    """Pids of the processes that have `path` open (a process's other descriptors may close while it is read)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fds = os.listdir("/proc/%s/fd" % name)
            except OSError:
                continue
            for fd in fds:
                try:
                    if os.readlink("/proc/%s/fd/%s" % (name, fd)) == path:
                        out.append(int(name))
                        break
                except OSError:
                    continue
    return out


def parent(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def op_unlock(a):
    """{root} -> {state: free | held | broken, holder, heard}: break the host lock of an orphaned run.

    A holder is orphaned when it has heard no heartbeat from its controller for longer than its own bound (the
    controller is gone or cut off, or the holder is stopped): then the holder and the agents of its run (those
    working under the root from the same session as the holder) are ended, and the lock is free. A holder
    that hears its controller is left alone (`held`)."""
    lay = Layout(a["root"])
    if not os.path.isfile(lay.lock_file):
        return {"state": "free"}
    with open(lay.lock_file, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return {"state": "free"}
        except OSError:
            pass
        f.seek(0)
        text = f.read(4096)
        record, heard = read_record(text), round(time.time() - os.fstat(f.fileno()).st_mtime, 1)
        out = {"holder": holder_text(text), "heard": heard, "bound": record.get("heartbeat")}
        pid, start, bound = record.get("pid"), record.get("start"), record.get("heartbeat")
        if not isinstance(pid, int) or not is_agent(pid, start):
            return dict(out, state="held", why="its recorded holder is not the process that holds it")
        if not isinstance(bound, (int, float)) or heard <= bound:
            return dict(out, state="held", why="it hears its controller" if bound else "it has no heartbeat")
        session = parent(pid)
        run = [pid] + [p for p in open_by(os.path.realpath(lay.work)) if p != os.getpid() and p != pid
                       and parent(p) == session and is_agent(p, proc_start(p))]
        ended = [p for p in run for p in kill_tree(p)]
        deadline = time.monotonic() + 10
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    return dict(out, state="held", why="it still holds the lock after its run was ended")
                time.sleep(0.05)
        return dict(out, state="broken", ended=sorted(set(ended)))


def op_dists(a):
    """This interpreter's distributions."""
    return {"dists": installed_dists(), "python": "%d.%d.%d" % sys.version_info[:3], "prefix": sys.prefix,
            "executable": sys.executable}


OPS = {"hold": op_hold, "dists": op_dists, "end": op_end, "unlock": op_unlock}
