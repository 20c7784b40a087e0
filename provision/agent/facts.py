"""Host agent (stdlib only): every fact a plan needs, gathered in one run, printed as one JSON line.

Payload: {op: gather, root, python?: X.Y, interpreter?: PATH, adopt?: PYTHON, nvidia_smi?: CMD}. Facts: OS, pythons (X.Y only
when given, PATH only when given, else every python3.X in the usual places), uv, disk, GPUs and driver
(nvidia-smi), CUDA toolkits, generations, `current`.
"""
import glob
import os
import platform
import re
import shutil
import sys

from ..layout import DEFAULT_ROOT, Layout
from . import store
from .cache import sha256_file, still_verified
from .host import CLEAN_ENV, current, generations as host_generations, query_gpus, run_agent, sh


def os_release():
    info = {}
    try:
        for line in open("/etc/os-release"):
            k, _, v = line.strip().partition("=")
            if k:
                info[k] = v.strip('"')
    except OSError:
        pass
    return {"id": info.get("ID"), "version_id": info.get("VERSION_ID"), "pretty": info.get("PRETTY_NAME"),
            "kernel": platform.release(), "arch": platform.machine(), "glibc": glibc()}


def glibc():
    """The host's glibc version ("2.39"), None on another C library."""
    try:
        name, _, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").partition(" ")
    except (AttributeError, ValueError, OSError):
        return None
    return version if name == "glibc" and re.match(r"^\d+\.\d+", version) else None


VERSION_SCRIPT = "import sys;print('%d.%d.%d' % sys.version_info[:3])"


def run_isolated(python, script, timeout=60):
    """`python -I -c script` in a clean environment: no PYTHONPATH, VIRTUAL_ENV, PIP_*, UV_* or cwd."""
    return sh([python, "-I", "-c", script], timeout=timeout, env=CLEAN_ENV, cwd="/")


def uv_python_dirs():
    """Where uv keeps the Pythons it manages: $UV_PYTHON_INSTALL_DIR, $XDG_DATA_HOME/uv/python,
    ~/.local/share/uv/python (the ones that are set, once each)."""
    home = os.path.expanduser("~")
    dirs = [os.environ.get("UV_PYTHON_INSTALL_DIR"),
            os.path.join(os.environ["XDG_DATA_HOME"], "uv", "python") if os.environ.get("XDG_DATA_HOME") else None,
            os.path.join(home, ".local", "share", "uv", "python") if home.startswith("/") else None]
    out = []
    for d in dirs:
        if d and os.path.isabs(d) and d not in out:
            out.append(d)
    return out


def _patch_level(path):
    m = re.search(r"cpython-3\.\d+\.(\d+)", path)
    return int(m.group(1)) if m else -1


def candidates(minor):
    """python3.X in the usual places, in order: on PATH, /usr/bin, /usr/local/bin, then uv-managed Pythons
    (newest patch release first). Returns (existing paths, [where it looked])."""
    name = "python3.%d" % minor
    looked = ["PATH (%s)" % os.environ.get("PATH", ""), "/usr/bin", "/usr/local/bin"] + uv_python_dirs()
    found = [shutil.which(name), "/usr/bin/" + name, "/usr/local/bin/" + name]
    for d in uv_python_dirs():
        found += sorted(glob.glob(os.path.join(glob.escape(d), "cpython-3.%d.*" % minor, "bin", name)),
                        key=_patch_level, reverse=True)
    out = []
    for p in found:
        if p and os.path.isabs(p) and os.path.exists(p) and os.path.realpath(p) not in map(os.path.realpath, out):
            out.append(p)
    return out, looked


def _version_of(path):
    """(X.Y.Z, None) of an interpreter that runs, else (None, why)."""
    rc, out, err = run_isolated(path, VERSION_SCRIPT, timeout=20)
    version = out.strip()
    if rc == 0 and re.match(r"^3\.\d+\.\d+$", version):
        return version, None
    return None, ((err or out).strip().splitlines() or ["exit %d" % rc])[-1][:200]


def pythons(want=None, given=None):
    """Interpreters that run, by minor version: this one, then python3.X in the usual places (`candidates`),
    each executed (a broken one is listed under `broken_pythons` with why, not offered to a lock). With
    `want` ("3.12") only that version is looked for, and nothing is started when this interpreter is it.
    With `given` (an absolute path, the operator's --python) only that interpreter is tried, for `want`.
    Returns (found, exact versions, broken, [where it looked])."""
    if given is not None:
        if not os.path.exists(given):
            return {}, {}, {given: "does not exist"}, [given]
        version, why = _version_of(given)
        if version is None:
            return {}, {}, {given: why}, [given]
        if want and ".".join(version.split(".")[:2]) != want:
            return {}, {}, {given: "is Python %s, not %s" % (version, want)}, [given]
        return {want or ".".join(version.split(".")[:2]): given}, {want: version}, {}, [given]
    found = {"%d.%d" % sys.version_info[:2]: sys.executable}
    exact = {"%d.%d" % sys.version_info[:2]: "%d.%d.%d" % sys.version_info[:3]}
    broken, looked = {}, []
    minors = [int(want.split(".")[1])] if want else range(8, 16)
    for m in minors:
        if "3.%d" % m in found:
            continue
        paths, looked = candidates(m)
        for path in paths:
            version, why = _version_of(path)
            if version is not None and ".".join(version.split(".")[:2]) == "3.%d" % m:
                found["3.%d" % m], exact["3.%d" % m] = path, version
                break
            broken[path] = why or "is Python %s" % version
    return found, exact, broken, looked or candidates(minors[0])[1]


def gpus(nvidia_smi):
    found = query_gpus(nvidia_smi)
    rows = found["gpus"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:   # what CUDA programs here will see: by index or UUID, in that order
        keys = [v.strip() for v in visible.split(",") if v.strip()]
        rows = [r for k in keys for r in rows if k == str(r["index"]) or r["uuid"].startswith(k)]
    out = {"nvidia_smi": found["nvidia_smi"], "gpus": rows, "driver": rows[0]["driver"] if rows else None}
    if found["nvidia_smi"]:
        out["cuda_visible_devices"] = visible
    if found.get("error"):
        out["gpu_error"] = found["error"]     # not "error": that key would say the facts agent itself failed
    return out


def nvcc_version(nvcc):
    rc, out, _ = sh([nvcc, "--version"])
    m = re.search(r"release (\d+\.\d+), V(\d+\.\d+\.\d+)", out) if rc == 0 else None
    return m.group(2) if m else None


def toolkits():
    found, seen = [], set()
    for home in sorted(set(glob.glob("/usr/local/cuda-*")) | {"/usr/local/cuda"}):
        nvcc = os.path.join(home, "bin", "nvcc")
        if os.path.exists(nvcc) and os.path.realpath(home) not in seen:
            seen.add(os.path.realpath(home))
            found.append({"home": os.path.realpath(home), "nvcc": nvcc_version(nvcc)})
    path_nvcc = shutil.which("nvcc")
    return {"toolkits": found, "nvcc_on_path": path_nvcc, "nvcc_on_path_version": nvcc_version(path_nvcc) if path_nvcc else None}


def generations(lay):
    gens = []
    for number, name, man in host_generations(lay):
        gens.append({"id": name, "number": number, "lock_name": man.get("lock_name", name.split("-", 1)[1]),
                     "status": man.get("status", "incomplete"), "created": man.get("created"),
                     "lock_digest": man.get("lock_digest"), "adopted_from": man.get("adopted_from"),
                     "cuda_home": man.get("cuda_home"), "probes": man.get("probes_summary"),
                     "isolation": man.get("isolation"),
                     "stack": man.get("stack"), "python": man.get("python"),
                     "venv_ok": os.path.exists(lay.gen(name).python),
                     "patches": [p.get("name") for p in (man.get("patches") or {}).get("series", [])]
                     if isinstance(man.get("patches"), dict) else []})
    return gens, current(lay)


def dists_of(python):
    if not os.path.exists(python):
        return {"error": "%s does not exist" % python}
    return run_agent(python, "host", {"op": "dists"}, timeout=60)


def cached_wheels(lay, check=()):
    """sha256 of every complete entry of the content-addressed wheel cache. An entry of `check` (the wheels a lock
    installs) counts only if a build would use it as it is: untouched since its bytes were verified, or hashed
    again here and matching its name, as the build's `recheck` finds it (nothing is written: a plan is
    read-only); one that does not is a download."""
    cache, check = lay.wheel_cache, set(check or ())
    out = []
    for sha in sorted(os.listdir(cache)) if os.path.isdir(cache) else []:
        d = os.path.join(cache, sha)
        if not re.match(r"^[0-9a-f]{64}$", sha) or not os.path.isdir(d):
            continue
        wheels = [os.path.join(d, f) for f in sorted(os.listdir(d)) if not f.startswith(".") and f.endswith(".whl")]
        if wheels and (sha not in check or any(_intact(w, sha) for w in wheels)):
            out.append(sha)
    return out


def _intact(path, sha):
    """A cache entry's bytes are what its name says (trusted while untouched since verified)."""
    if still_verified(path):
        return True
    try:
        return os.path.isfile(path) and sha256_file(path) == sha
    except OSError:
        return False


def op_gather(a):
    lay = Layout(a.get("root") or DEFAULT_ROOT)
    root = lay.root
    adopt = a.get("adopt")
    smi = a.get("nvidia_smi") or "nvidia-smi"
    want, given = a.get("python"), a.get("interpreter")
    if want is not None and not re.match(r"^3\.\d{1,2}\Z", str(want)):
        return {"error": "python must be 3.X, not %r" % (want,)}
    if given is not None and not (isinstance(given, str) and os.path.isabs(given) and "\0" not in given
                                  and "\n" not in given):
        return {"error": "interpreter must be an absolute path, not %r" % (given,)}
    found, exact, broken, looked = pythons(want, given)
    facts = {"root": root, "os": os_release(), "pythons": found, "python_versions": exact,
             "broken_pythons": broken, "pythons_looked_for": want or "all", "pythons_looked_in": looked,
             "python_given": given, "uv": shutil.which("uv"),
             "cached_wheels": cached_wheels(lay, [w for w in a.get("wheels") or [] if isinstance(w, str)]),
             "python_executable": sys.executable,
             "user": os.environ.get("USER") or str(os.getuid())}
    probe = root
    while not os.path.exists(probe):
        probe = os.path.dirname(probe) or "/"
    st = os.statvfs(probe)
    facts["disk_free_bytes"] = st.f_bavail * st.f_frsize
    facts.update(gpus(smi))
    facts.update(toolkits())
    gens, cur = generations(lay)
    facts["generations"], facts["current"] = gens, cur
    facts["managed"] = bool(gens)
    facts["current_dists"] = None
    if cur:
        r = dists_of(lay.gen(cur).python)
        facts["current_dists"] = r.get("dists")
        facts["current_python"] = r.get("python")
        facts["current_error"] = r.get("error")
    if adopt:
        facts["adopt"] = dists_of(adopt)
        facts["adopt"]["path"] = adopt
    facts["lock_file"] = lay.lock_file
    facts["isolation"], facts["isolation_why"] = store.expected(root)
    facts["stored_wheels"] = sorted({sha for g in gens if g.get("isolation") == "store" and g["venv_ok"]
                                     for sha in ((g.get("stack") or {}).get("hashes") or {}).values()})
    return facts


OPS = {"gather": op_gather}
