"""The host layout: every path provision keeps under a host root, in one place.

Stdlib only: the controller imports it, and the agent bundle ships it beside the agents (as Ansible ships a
module's module_utils), so both sides name the same paths. Host paths are POSIX paths wherever the controller runs.
"""
import posixpath

DEFAULT_ROOT = "/opt/provision"
CUDA_HOME = "cuda-home"     # in a venv: see cuda_home_in

join = posixpath.join


def of(transport):
    """The layout of the host a transport reaches."""
    return Layout(transport.target.root)


def cache_entry(store, sha256, filename):
    """A file in a content-addressed store (one of Layout.stores, or the controller's own wheel cache)."""
    return join(store, sha256, filename)


def pick_generation(gens, current, name=None, default="current"):
    """The id of generation `name` (its id, or its number) among `gens` [(number, id)], for the CLI and the
    playbooks alike; None names `current` (default="newest": the newest). LookupError with the reason otherwise:
    "none" (no generations), "no current" or "no such" (its text lists the ids held)."""
    if not gens:
        raise LookupError("none")
    if name is None:
        if default == "newest":
            return gens[-1][1]
        if not current:
            raise LookupError("no current")
        return current
    g = str(name)
    for number, gen_id in gens:
        if gen_id == g or (g.isdigit() and int(g) == number):
            return gen_id
    raise LookupError("no generation %s (have: %s)" % (g, ", ".join(i for _, i in gens)))


def venv_python(venv):
    """The interpreter of a venv (a generation's, or an environment being adopted)."""
    return join(venv, "bin", "python")


def cuda_home_in(venv):
    """The toolkit home the build agent lays out in a venv when the lock's CUDA comes from NVIDIA's wheels."""
    return join(venv, CUDA_HOME)


class Generation:
    """Paths of one generation, from its directory: its venv (with the CUDA home the build agent lays out there
    when the lock's toolkit comes from NVIDIA's wheels), its lock, requirements, manifest, stamp, logs and probes."""

    def __init__(self, gen_dir):
        self.dir = gen_dir
        self.venv = join(gen_dir, "venv")
        self.python = venv_python(self.venv)
        self.cuda_home = cuda_home_in(self.venv)
        self.lock_yaml = join(gen_dir, "lock.yaml")
        self.requirements = join(gen_dir, "requirements.txt")
        self.manifest = join(gen_dir, "manifest.json")
        self.stamp = join(gen_dir, "stamp.json")
        self.build_log = join(gen_dir, "build.log")
        self.engine_log = join(gen_dir, "engine.log")
        self.probes_json = join(gen_dir, "probes.json")


class Layout:
    """Paths under one host root:

        <root>/generations/NNNN-<lock>/   see Generation
        <root>/current -> generations/…   switched by rename(2) of a fresh link
        <root>/history.jsonl  last-number  .lock (the host lock)  .work (held by working agents)  .trash (gc)
        <root>/cache/wheels/<sha256>/  cache/uv-bin/<sha256>/  cache/uv/  tool/<digest>/  tmp/  runs/
        <root>/cache/kernels/<key>/{flashinfer,triton,inductor}/   compiled kernels (agent/kernels.py)
        <root>/store/files/<sha256[:2]>/<sha256>[.x]   installed files by content, immutable, linked by generations
    """

    def __init__(self, root):
        self.root = root
        self.generations = join(root, "generations")
        self.current = join(root, "current")
        self.current_python = venv_python(join(self.current, "venv"))
        self.history = join(root, "history.jsonl")
        self.last_number = join(root, "last-number")    # the highest generation number ever allocated here
        self.lock_file = join(root, ".lock")
        self.work = join(root, ".work")
        self.trash = join(root, ".trash")
        self.wheel_cache = join(root, "cache", "wheels")
        self.uv_bin = join(root, "cache", "uv-bin")      # the controller's uv, pushed by hash
        self.uv_cache = join(root, "cache", "uv")
        self.uv_archives = join(self.uv_cache, "archive-v0")
        self.kernels = join(root, "cache", "kernels")    # compiled kernels by content key: agent/kernels.py
        self.tool = join(root, "tool")
        self.tmp = join(root, "tmp")
        self.runs = join(root, "runs")
        self.file_store = join(root, "store", "files")   # installed files by content: see agent/store.py
        self.stores = {"wheels": self.wheel_cache, "uv": self.uv_bin}   # content-addressed: <store>/<sha256>/<file>

    def __repr__(self):
        return "Layout(%r)" % self.root

    def gen(self, gen_id):
        """The paths of generation `gen_id` (an id the caller has checked is one name)."""
        return Generation(join(self.generations, gen_id))

    def current_tmp(self, pid):
        """The fresh link renamed over `current`."""
        return join(self.root, ".current.tmp-%d" % pid)

    def link_target(self, gen_id):
        """What `current` holds for `gen_id`: its directory, relative to the root."""
        return posixpath.relpath(self.gen(gen_id).dir, self.root)

    def tool_dir(self, name):
        return join(self.tool, name)

    def scratch(self, name):
        return join(self.tmp, name)
