"""Host agent (stdlib only): every fact a plan needs, gathered in one run, printed as one JSON line.

Payload: {root, python?: X.Y, adopt?: PYTHON, nvidia_smi?: CMD}. Facts: OS, pythons (python X.Y only when
given, else every python3.X), uv, disk, GPUs and driver (nvidia-smi), CUDA toolkits, generations, `current`.
"""
import glob
import os
import platform
import re
import shutil
import sys

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
            "kernel": platform.release(), "arch": platform.machine()}


VERSION_SCRIPT = "import sys;print('%d.%d.%d' % sys.version_info[:3])"


def run_isolated(python, script, timeout=60):
    """`python -I -c script` in a clean environment: no PYTHONPATH, VIRTUAL_ENV, PIP_*, UV_* or cwd."""
    return sh([python, "-I", "-c", script], timeout=timeout, env=CLEAN_ENV, cwd="/")


def pythons(want=None):
    """Interpreters that run, by minor version: this one, then python3.X on PATH, executed (a broken shim
    is listed under `broken_pythons` with why, not offered to a lock). With `want` ("3.12") only that
    version is looked for, and nothing is started when this interpreter is it."""
    found = {"%d.%d" % sys.version_info[:2]: sys.executable}
    exact = {"%d.%d" % sys.version_info[:2]: "%d.%d.%d" % sys.version_info[:3]}
    broken = {}
    minors = [int(want.split(".")[1])] if want else range(8, 16)
    for m in minors:
        path = shutil.which("python3.%d" % m)
        if not path or "3.%d" % m in found:
            continue
        rc, out, err = run_isolated(path, VERSION_SCRIPT, timeout=20)
        version = out.strip()
        if rc == 0 and ".".join(version.split(".")[:2]) == "3.%d" % m:
            found["3.%d" % m], exact["3.%d" % m] = path, version
        else:
            broken[path] = ((err or out).strip().splitlines() or ["exit %d" % rc])[-1][:200]
    return found, exact, broken


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
        out["error"] = found["error"]
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


def generations(root):
    gens = []
    for number, name, man in host_generations(root):
        gens.append({"id": name, "number": number, "lock_name": man.get("lock_name", name.split("-", 1)[1]),
                     "status": man.get("status", "incomplete"), "created": man.get("created"),
                     "lock_digest": man.get("lock_digest"), "adopted_from": man.get("adopted_from"),
                     "cuda_home": man.get("cuda_home"), "probes": man.get("probes_summary"),
                     "stack": man.get("stack"), "python": man.get("python"),
                     "venv_ok": os.path.exists(os.path.join(root, "generations", name, "venv", "bin", "python")),
                     "patches": [p.get("name") for p in (man.get("patches") or {}).get("series", [])]
                     if isinstance(man.get("patches"), dict) else []})
    return gens, current(root)


def dists_of(python):
    if not os.path.exists(python):
        return {"error": "%s does not exist" % python}
    return run_agent(python, "host", {"op": "dists"}, timeout=60)


def cached_wheels(root):
    """sha256 of every complete entry of the content-addressed wheel cache."""
    cache = os.path.join(root, "cache", "wheels")
    out = []
    for sha in sorted(os.listdir(cache)) if os.path.isdir(cache) else []:
        d = os.path.join(cache, sha)
        if re.match(r"^[0-9a-f]{64}$", sha) and any(not f.startswith(".") and f.endswith(".whl")
                                                      for f in os.listdir(d)):
            out.append(sha)
    return out


def main(a):
    root = a.get("root") or "/opt/provision"
    adopt = a.get("adopt")
    smi = a.get("nvidia_smi") or "nvidia-smi"
    want = a.get("python")
    if want is not None and not re.match(r"^3\.\d{1,2}\Z", str(want)):
        return {"error": "python must be 3.X, not %r" % (want,)}
    found, exact, broken = pythons(want)
    facts = {"root": root, "os": os_release(), "pythons": found, "python_versions": exact,
             "broken_pythons": broken, "pythons_looked_for": want or "all", "uv": shutil.which("uv"), "cached_wheels": cached_wheels(root),
             "python_executable": sys.executable,
             "user": os.environ.get("USER") or str(os.getuid())}
    probe = root
    while not os.path.exists(probe):
        probe = os.path.dirname(probe) or "/"
    st = os.statvfs(probe)
    facts["disk_free_bytes"] = st.f_bavail * st.f_frsize
    facts.update(gpus(smi))
    facts.update(toolkits())
    gens, cur = generations(root)
    facts["generations"], facts["current"] = gens, cur
    facts["managed"] = bool(gens)
    facts["current_dists"] = None
    if cur:
        py = os.path.join(root, "generations", cur, "venv", "bin", "python")
        r = dists_of(py)
        facts["current_dists"] = r.get("dists")
        facts["current_python"] = r.get("python")
        facts["current_error"] = r.get("error")
    if adopt:
        facts["adopt"] = dists_of(adopt)
        facts["adopt"]["path"] = adopt
    facts["lock_file"] = os.path.join(root, ".lock")
    return facts
