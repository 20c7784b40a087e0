"""Compiled kernels, once per host (stdlib): flashinfer's JIT output and Triton's and torch inductor's caches live in
<root>/cache/kernels/<key>/, the key a digest of what they depend on as the generation itself has it (flashinfer,
torch, its CUDA, the capabilities compiled for); each generation records its key, and gc removes unused entries."""
import hashlib
import json
import os
import re
import shutil
import time

from ..layout import Layout
from .facts import nvcc_version
from .host import AgentError, installed_dists, read_json, write_atomic

# Where each kind goes, and the variable that version of the library reads for it: flashinfer 0.6.4 puts its
# workspace under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/<archs>/ (jit/env.py; default: HOME).
KINDS = {"flashinfer": "FLASHINFER_WORKSPACE_BASE", "triton": "TRITON_CACHE_DIR", "inductor": "TORCHINDUCTOR_CACHE_DIR"}
RECORD = "kernels.json"     # in a generation's dir: the key it uses (written before the entry is made)
ENV_FILE = "kernels.env"    # the same, as KEY=VALUE lines for the engine's service (EnvironmentFile=)
KEY_RE = re.compile(r"^[0-9a-f]{20}\Z")
GEN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,199}\Z")


def cuda_version(cuda_home):
    """The full CUDA version of a toolkit home, as its nvcc says (None: no nvcc there)."""
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else None
    return nvcc_version(nvcc) if nvcc and os.path.exists(nvcc) else None


def inputs(cuda_home, archs, dists=None):
    """What the kernels depend on, read from this interpreter's distributions (the generation's) and its CUDA
    home: {flashinfer, torch, cuda, archs}; `archs`: the capabilities compiled for ('12.0a', '8.9')."""
    d = installed_dists() if dists is None else dists
    return {"flashinfer": d.get("flashinfer-python"), "torch": d.get("torch"), "cuda": cuda_version(cuda_home),
            "archs": sorted(set(archs))}


def key(inp):
    """The content key of `inputs`: equal inputs, one key."""
    return hashlib.sha256(json.dumps(inp, sort_keys=True).encode()).hexdigest()[:20]


def env_of(entry):
    """The variables that send each library's compiled kernels into `entry`."""
    return {var: os.path.join(entry, kind) for kind, var in KINDS.items()}


def env_text(env):
    """kernels.env's text for `env`: one KEY=VALUE line per variable, sorted."""
    return "".join("%s=%s\n" % kv for kv in sorted(env.items()))


def env_drift(lay, gen_dir):
    """Why `<gen_dir>/kernels.env` (what a service loads with EnvironmentFile=) is not exactly what the generation's
    kernel record gives (`env_text` of `env_of` its key's entry under this root), or None: it is, or there is none."""
    path = os.path.join(gen_dir, ENV_FILE)
    try:
        with open(path, "rb") as f:
            have = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        return "%s: unreadable (%s)" % (ENV_FILE, e.strerror or e)
    rec = read_json(os.path.join(gen_dir, RECORD))
    k = rec.get("key") if isinstance(rec, dict) else None
    if not (isinstance(k, str) and KEY_RE.match(k)):
        return "%s: no kernel record (%s with a key) it could come from" % (ENV_FILE, RECORD)
    want = env_text(env_of(os.path.join(lay.kernels, k)))
    if have == want.encode():
        return None
    lines, wanted = have.decode("utf-8", "replace").splitlines(), want.splitlines()
    odd = [ln[:160] for ln in lines if ln not in wanted]
    lacks = [ln.split("=", 1)[0] for ln in wanted if ln not in lines]
    what = ", ".join(odd[:3]) if odd else "lacks " + ", ".join(lacks) if lacks else "its bytes differ"
    return "%s: not what %s gives (%s)" % (ENV_FILE, RECORD, what)


def prepare(root, gen_id, cuda_home, archs):
    """The cache entry of generation `gen_id` for compiling for `archs`: its record written in the generation
    (first, so that a concurrent gc sees the use before the entry exists), then the entry's directories.
    Returns {key, dir, inputs, env, created}."""
    lay = Layout(root)
    if not isinstance(gen_id, str) or not GEN_RE.match(gen_id) or not os.path.isdir(lay.gen(gen_id).dir):
        raise AgentError("no generation %r under %s" % (gen_id, root))
    inp = inputs(cuda_home, archs)
    k = key(inp)
    entry = os.path.join(lay.kernels, k)
    env = env_of(entry)
    rec = {"key": k, "dir": entry, "inputs": inp, "env": env}
    gen = lay.gen(gen_id).dir
    write_atomic(os.path.join(gen, RECORD), json.dumps(rec, indent=2, sort_keys=True))
    write_atomic(os.path.join(gen, ENV_FILE), env_text(env))
    created = not os.path.isdir(entry)
    for d in env.values():
        os.makedirs(d, mode=0o750, exist_ok=True)
    return dict(rec, created=created)


IN_USE = {}         # this process's entry (`use`): the probes, JIT builds and engines started here compile into it
OPERATOR_ENV = {}   # what this process's environment said for the entry's variables before `use`


def use(root, gen_id, cuda_home, archs):
    """The entry `prepare` makes, put in this process's environment (the processes it starts inherit it) and kept
    in IN_USE; returns it."""
    rec = prepare(root, gen_id, cuda_home, archs)
    OPERATOR_ENV.update({v: os.environ.get(v) for v in rec["env"]})
    os.environ.update(rec["env"])
    IN_USE.update(rec)
    return rec


def record_of(lay, gen_id):
    """The key generation `gen_id` records (None: none, or not one of ours)."""
    k = (read_json(os.path.join(lay.gen(gen_id).dir, RECORD)) or {}).get("key")
    return k if isinstance(k, str) and KEY_RE.match(k) else None


def disk_bytes(path):
    """Bytes on disk under `path`, each inode once (symlinks not followed)."""
    seen, total = set(), 0
    for d, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                st = os.lstat(os.path.join(d, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def collect(lay, kept, dry_run=False):
    """Remove the entries that no generation in `kept` (ids) records: each renamed aside into <root>/.trash, then
    deleted. The entries are listed before the records are read, so an entry a probe makes meanwhile (its record
    comes first) is never taken. Returns {removed: [{key, bytes}], kept: [key], bytes, errors}."""
    try:
        names = sorted(n for n in os.listdir(lay.kernels) if KEY_RE.match(n))
    except OSError:
        names = []
    used = {record_of(lay, g) for g in kept}
    out = {"removed": [], "kept": [n for n in names if n in used], "bytes": 0, "errors": []}
    for n in names:
        if n in used:
            continue
        path = os.path.join(lay.kernels, n)
        entry = {"key": n, "bytes": disk_bytes(path)}
        if not dry_run:
            aside = os.path.join(lay.trash, "kernels-%s-%d-%d" % (n, os.getpid(), time.time() * 1e6))
            try:
                os.makedirs(lay.trash, mode=0o750, exist_ok=True)
                os.rename(path, aside)
                shutil.rmtree(aside)
            except OSError as e:
                out["errors"].append("kernels %s: %s" % (n, e.strerror or e))
                continue
        out["removed"].append(entry)
        out["bytes"] += entry["bytes"]
    return out
