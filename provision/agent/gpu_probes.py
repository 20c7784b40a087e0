"""Host agent helpers (stdlib + optional torch): the generation's GPU stack as the probes see it.

`result()`, capabilities and targets, torch's facts and the environment every probe runs in (SAFE_ENV); the
environment probes (driver, nvcc, packages, torch's CUDA, arch coverage) and the kernel smoke tests.
"""
import glob
import json
import os
import re
import shutil
import sys
import tempfile
import time

from .allreduce import SAFE_ENV
from .host import installed_dists, norm, query_gpus, sh

os.environ.update(SAFE_ENV)   # NVLink multicast off wherever a probe starts GPU work (it can wedge shared hosts)
for _k in list(os.environ):   # verdicts depend on the generation alone, not on the operator's shell
    if _k.startswith(("PYTHON", "PIP_", "UV_", "CONDA_")) or _k == "VIRTUAL_ENV":
        del os.environ[_k]
TORCH_JSON_ENV = "PROVISION_PROBE_TORCH_JSON"   # tests only: recorded torch facts of a real GPU host


def result(name, status, reason="", **figures):
    return {"name": name, "status": status, "reason": reason, "figures": figures}


def major_minor(v):
    return ".".join(str(v).split(".")[:2]) if v else None


def vtuple(v):
    return tuple(int(x) for x in re.findall(r"\d+", v or ""))


def sm(cc):
    """'12.0' → 'sm_120'; '9.0' → 'sm_90'."""
    major, minor = cc.split(".")
    return "sm_%s%s" % (major, minor)


def specific(cc):
    """A capability with its arch-specific feature set where it has one (9.0 and later: wgmma, tcgen05,
    the Blackwell block-scaled MMA): '12.0' → '12.0a', '8.9' → '8.9'."""
    return cc + "a" if int(cc.split(".")[0]) >= 9 else cc


CC_RE = re.compile(r"^\d{1,3}\.\d{1,2}$")


def targets(a):
    """{capability: 'lock', 'gpu' or 'lock+gpu'}: what the lock targets and what this host's GPUs are
    (a GPU capability nvidia-smi printed in another form is left out; `unreadable_caps` names it)."""
    gpu = {g["compute_cap"] for g in a.get("gpus") or [] if CC_RE.match(g.get("compute_cap") or "")}
    lock = set(a.get("ccs") or [])
    return {cc: "+".join(w for w, s in (("lock", lock), ("gpu", gpu)) if cc in s)
            for cc in sorted(lock | gpu, key=vtuple)}


def unreadable_caps(a):
    return sorted({str(g.get("compute_cap")) for g in a.get("gpus") or []
                   if not CC_RE.match(g.get("compute_cap") or "")})


# ------------------------------------------------------------------ torch facts

_TORCH = {}


def torch_facts():
    """torch's version, CUDA build, arch list and devices; recorded ones when the test env var is set."""
    if _TORCH:
        return _TORCH
    rec = os.environ.get(TORCH_JSON_ENV)
    if rec:
        with open(rec) as f:
            r = json.load(f)
        caps = r.get("caps") or ([r["cap"]] if r.get("cap") else [])
        _TORCH.update(installed=True, recorded=rec, version=r.get("torch"), cuda=r.get("cuda"),
                      arch_list=r.get("arch_list") or [], available=False,
                      devices=[{"index": i, "cap": "%d.%d" % tuple(c), "name": r.get("name")}
                               for i, c in enumerate(caps)])
        return _TORCH
    try:
        import torch
    except ImportError as e:
        _TORCH.update(installed=False, error=str(e))
        return _TORCH
    avail = torch.cuda.is_available()
    devs = []
    if avail:
        for i in range(torch.cuda.device_count()):
            devs.append({"index": i, "cap": "%d.%d" % torch.cuda.get_device_capability(i),
                         "name": torch.cuda.get_device_name(i)})
    _TORCH.update(installed=True, recorded=None, version=torch.__version__, cuda=torch.version.cuda,
                  arch_list=torch.cuda.get_arch_list() if avail or torch.version.cuda else [],
                  available=avail, devices=devs)
    return _TORCH


# ------------------------------------------------------------------ probes

def p_driver(a):
    found = query_gpus(a.get("nvidia_smi") or "nvidia-smi")
    if not found["nvidia_smi"]:
        return result("driver", "fail", "nvidia-smi not found, but the host's facts listed GPUs")
    if found.get("error"):
        return result("driver", "fail", "nvidia-smi failed: %s" % found["error"])
    rows = found["gpus"]
    drivers = sorted({r["driver"] for r in rows})
    want = a.get("driver_min")
    figs = {"driver": drivers[0] if drivers else None, "gpus": len(rows), "min": want,
            "names": sorted({r["name"] for r in rows})}
    if not drivers:
        return result("driver", "fail", "nvidia-smi listed no driver version", **figs)
    if not want:
        return result("driver", "pass", "driver %s (the lock sets no minimum)" % drivers[0], **figs)
    old = [d for d in drivers if vtuple(d) < vtuple(want)]
    if old:
        return result("driver", "fail", "driver %s is older than the lock's minimum %s" % (old[0], want), **figs)
    return result("driver", "pass", "driver %s >= %s" % (drivers[0], want), **figs)


KERNEL_CU = """
__global__ void saxpy(int n, float a, const float *x, float *y) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
"""


def p_nvcc(a):
    want = a.get("cuda_version")
    home = a.get("cuda_home")
    figs = {"cuda_home": home, "lock_cuda": want, "source": a.get("cuda_source")}
    nvcc = os.path.join(home, "bin", "nvcc") if home else None
    if (not nvcc or not os.path.exists(nvcc)) and a.get("cuda_source") == "host":
        return result("nvcc", "skip", "no nvcc at %s: the lock takes CUDA %s from the host (source host), and this "
                      "host has no toolkit there" % (nvcc, want), **figs)
    if not nvcc or not os.path.exists(nvcc):
        return result("nvcc", "fail", "no nvcc at %s (CUDA_HOME of this generation)" % nvcc, **figs)
    rc, out, err = sh([nvcc, "--version"], timeout=60)
    m = re.search(r"release (\d+\.\d+), V(\d+\.\d+\.\d+)", out)
    if rc != 0 or not m:
        return result("nvcc", "fail", "%s --version failed: %s" % (nvcc, (err or out).strip()[-200:]), **figs)
    figs["nvcc"] = m.group(2)
    if major_minor(m.group(1)) != major_minor(want):
        return result("nvcc", "fail", "nvcc %s at %s, the lock wants CUDA %s" % (m.group(2), home, want), **figs)
    ccs = targets(a)
    figs["targets"] = ccs
    odd = unreadable_caps(a)
    if odd:
        figs["unreadable_caps"] = odd
        return result("nvcc", "fail", "nvidia-smi reported compute capability %r, not major.minor: cannot say what "
                                      "to compile for" % odd[0], **figs)
    if not ccs:
        return result("nvcc", "pass", "nvcc %s = CUDA %s; no compute capability to compile for" % (m.group(2), want),
                      **figs)
    compiled, failed = {}, {}
    env = dict(os.environ, CUDA_HOME=home, PATH=os.path.join(home, "bin") + os.pathsep + os.environ.get("PATH", ""))
    with tempfile.TemporaryDirectory(prefix="provision-nvcc-") as d:
        src = os.path.join(d, "k.cu")
        with open(src, "w") as f:
            f.write(KERNEL_CU)
        for cc in ccs:
            arch = sm(specific(cc))
            obj = os.path.join(d, "k_%s.o" % arch)
            t0 = time.perf_counter()
            rc, out, err = sh([nvcc, "-arch=%s" % arch, "-c", src, "-o", obj], timeout=300, env=env, cwd=d)
            if rc != 0 or not os.path.exists(obj):
                last = (err or out).strip().splitlines()[-1:] or ["exit %d" % rc]
                failed[arch] = last[0][:200]
                continue
            compiled[arch] = round(time.perf_counter() - t0, 2)
    figs.update(compiled=compiled, failed=failed)
    if failed:
        arch, why = next(iter(failed.items()))
        return result("nvcc", "fail", "nvcc -arch=%s failed: %s%s" % (
            arch, why, "; compiled for %s" % ", ".join(compiled) if compiled else ""), **figs)
    return result("nvcc", "pass", "nvcc %s = CUDA %s; compiled for %s" % (
        m.group(2), want, ", ".join("%s (%s, %.1fs)" % (sm(specific(cc)), w, compiled[sm(specific(cc))])
                                    for cc, w in ccs.items())), **figs)


BOOTSTRAP = {"pip", "setuptools", "wheel"}   # seeded into a venv by `python -m venv`, not installed from a lock


def p_packages(a):
    want = {norm(k): v for k, v in (a.get("packages") or {}).items()}
    have = installed_dists()
    missing = sorted(n for n in want if n not in have)
    differ = sorted("%s %s (lock %s)" % (n, have[n], want[n]) for n in want if n in have and have[n] != want[n])
    extra = sorted(n for n in have if n not in want and n not in BOOTSTRAP)
    figs = {"expected": len(want), "installed": len(have), "against": a.get("packages_source"),
            "missing": missing, "different": differ, "extra": extra}
    if missing or differ or extra:
        parts = []
        if differ:
            parts.append("version differs: " + ", ".join(differ[:5]))
        if missing:
            parts.append("missing: " + ", ".join(missing[:5]))
        if extra:
            parts.append("not in the lock: " + ", ".join(extra[:5]))
        return result("packages", "fail", "; ".join(parts), **figs)
    return result("packages", "pass", "%d distributions = %s" % (len(want), a.get("packages_source")), **figs)


def p_torch_cuda(a):
    want = major_minor(a.get("cuda_version"))
    if not want:        # nothing to compare torch.version.cuda with: its version from metadata, no import
        version = installed_dists().get("torch")
        if version is None:
            return result("torch-cuda", "skip", "torch is not installed in this generation")
        return result("torch-cuda", "skip", "the lock names no CUDA version", torch=version, lock_cuda=None)
    t = torch_facts()
    if not t["installed"]:
        return result("torch-cuda", "skip", "torch is not installed in this generation")
    figs = {"torch": t["version"], "torch_cuda": t["cuda"], "lock_cuda": want, "recorded": t.get("recorded")}
    if major_minor(t["cuda"]) == want:
        return result("torch-cuda", "pass", "torch %s built for CUDA %s" % (t["version"], t["cuda"]), **figs)
    msg = "torch %s is built for CUDA %s, the lock wants %s" % (t["version"], t["cuda"] or "none (CPU build)", want)
    if not a.get("gpus"):
        return result("torch-cuda", "warn", msg + " (no GPU on this host, so not enforced)", **figs)
    return result("torch-cuda", "fail", msg, **figs)


def covered(cc, archs):
    """How a GPU of capability `cc` can run code from an arch list: exact cubin, a same-major lower
    cubin (binary compatible), or PTX of a capability ≤ cc (JIT). None: 'no kernel image'."""
    major, minor = (int(x) for x in cc.split("."))
    cubins = {}
    ptx = []
    for a in archs:
        m = re.match(r"^(sm|compute)_(\d+?)(\d)([af]?)$", a)
        if not m:
            continue
        M, n, suffix = int(m.group(2)), int(m.group(3)), m.group(4)
        if m.group(1) == "sm":
            cubins[(M, n, suffix)] = a
        else:
            ptx.append((M, n, a))
    for (M, n, suf), a in sorted(cubins.items()):
        if M == major and n == minor:
            return a
    for (M, n, suf), a in sorted(cubins.items(), reverse=True):
        if M == major and n < minor and not suf:
            return a
    for M, n, a in sorted(ptx, reverse=True):
        if (M, n) <= (major, minor):
            return a + " (PTX JIT)"
    return None


def lib_archs(package_dir, cuobjdump):
    """sm_XY targets compiled into a package's shared objects (cuobjdump --list-elf)."""
    found = set()
    for so in glob.glob(os.path.join(package_dir, "**", "*.so"), recursive=True)[:40]:
        rc, out, _ = sh([cuobjdump, "--list-elf", so], timeout=60)
        if rc == 0:
            found |= set(re.findall(r"\.(sm_\d+[af]?)\.", out))
    return sorted(found)


def p_arch(a):
    t = torch_facts()
    if not t["installed"]:
        return result("arch", "skip", "torch is not installed in this generation")
    gpu_ccs = sorted({g["compute_cap"] for g in a.get("gpus") or []})
    lock_ccs = a.get("ccs") or []
    figs = {"arch_list": t["arch_list"], "gpu_ccs": gpu_ccs, "lock_ccs": lock_ccs, "recorded": t.get("recorded")}
    if not t["recorded"] and not t["available"]:
        return result("arch", "fail", "nvidia-smi lists %d GPU(s) but torch.cuda.is_available() is False "
                                      "(torch %s, CUDA %s)" % (len(a.get("gpus") or []), t["version"], t["cuda"]),
                      **figs)
    bad, how = [], {}
    for cc in sorted(set(gpu_ccs) | set(lock_ccs)):
        c = covered(cc, t["arch_list"])
        how["torch:" + cc] = c
        if c is None:
            bad.append("torch has no kernel image for %s (capability %s)" % (sm(cc), cc))
    cuobjdump = shutil.which("cuobjdump") or (os.path.join(a["cuda_home"], "bin", "cuobjdump")
                                              if a.get("cuda_home") else None)
    dists = installed_dists()
    for lib, mod in (("sgl-kernel", "sgl_kernel"), ("flashinfer-python", "flashinfer")):
        if lib not in dists:
            continue
        if not cuobjdump or not os.path.exists(cuobjdump):
            how[lib] = "not readable (no cuobjdump)"
            continue
        pdir = None
        for sp in sys.path:
            if sp and os.path.isdir(os.path.join(sp, mod)):
                pdir = os.path.join(sp, mod)
                break
        archs = lib_archs(pdir, cuobjdump) if pdir else []
        if not archs:
            how[lib] = "no compiled targets found (JIT or unreadable)"
            continue
        for cc in sorted(set(gpu_ccs) | set(lock_ccs), key=vtuple):
            c = covered(cc, archs)
            how["%s:%s" % (lib, cc)] = c
            if c is None:
                bad.append("%s has no kernel image for %s (has %s)" % (lib, sm(cc), ", ".join(archs)))
    figs["covered_by"] = how
    # A GPU the lock does not target: covered or not, this host is not the hardware the lock was made for.
    figs["untargeted_gpus"] = untargeted = [cc for cc in gpu_ccs if lock_ccs and cc not in lock_ccs]
    note = "; this host's GPU capability %s is not among the lock's targets (%s): its kernels are checked on " \
           "it, the lock's by compiling for them (nvcc, flashinfer probes)" % (
               ", ".join(untargeted), ", ".join(lock_ccs)) if untargeted else ""
    if bad:
        return result("arch", "fail", "; ".join(bad) + note, **figs)
    return result("arch", "pass", "every capability (%s) covered by torch's arch list%s" %
                  (", ".join(sorted(set(gpu_ccs) | set(lock_ccs), key=vtuple)), note), **figs)


def need_cuda(name):
    t = torch_facts()
    if not t["installed"]:
        return result(name, "skip", "torch is not installed in this generation")
    if t.get("recorded"):
        return result(name, "fail", "GPU kernels cannot run from a recording (%s)" % TORCH_JSON_ENV)
    if not t["available"]:
        return result(name, "fail", "nvidia-smi lists GPUs but torch.cuda.is_available() is False "
                                    "(torch %s, CUDA %s)" % (t["version"], t["cuda"]))
    return None


def smoke_matmul(device, n=1024):
    """bf16 matmul vs an fp32 reference; relative error."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device)
    b = torch.randn(n, n, generator=g).to(device)
    ref = a.float() @ b.float()
    out = (a.bfloat16() @ b.bfloat16()).float()
    return float((out - ref).norm() / ref.norm())


def smoke_flashinfer(device):
    """flashinfer's decode attention (one query token against a 128-token KV cache, the kernel every decode step
    runs) against SDPA in float32. Its first call JIT-compiles the module for this GPU's capability: decode, not
    prefill, whose build for 9.0 alone took 60-112 s cold on 16 cores."""
    import torch
    import torch.nn.functional as F
    import flashinfer

    torch.manual_seed(0)
    L, H, D = 128, 8, 128
    q = torch.randn(H, D, device=device, dtype=torch.float16)
    k, v = (torch.randn(L, H, D, device=device, dtype=torch.float16) for _ in range(2))
    out = flashinfer.single_decode_with_kv_cache(q, k, v)
    ref = F.scaled_dot_product_attention(q.unsqueeze(1).float(), k.transpose(0, 1).float(),
                                         v.transpose(0, 1).float()).squeeze(1)
    return float((out.float() - ref).abs().max())


def smoke_sgl_kernel(device):
    import torch
    import sgl_kernel

    torch.manual_seed(0)
    x = torch.randn(64, 4096, device=device, dtype=torch.bfloat16)
    w = torch.randn(4096, device=device, dtype=torch.bfloat16)
    out = sgl_kernel.rmsnorm(x, w, 1e-6)
    xf = x.float()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    return float((out.float() - ref).abs().max())


SMOKES = {  # probe → (distribution, function, tolerance, what)
    "matmul": (None, smoke_matmul, 2e-2, "bf16 matmul vs fp32 reference (relative error)"),
    "flashinfer": ("flashinfer-python", smoke_flashinfer, 2e-2, "single_decode_with_kv_cache vs SDPA (max abs)"),
    "sgl-kernel": ("sgl-kernel", smoke_sgl_kernel, 1e-1, "rmsnorm vs torch (max abs)"),
}


def p_smoke(a, name):
    dist, fn, tol, what = SMOKES[name]
    if dist and dist not in installed_dists():
        return result(name, "skip", "%s is not installed in this generation" % dist)
    early = need_cuda(name)
    if early:
        return early
    import torch

    errs = {}
    for d in torch_facts()["devices"]:
        try:
            errs["cuda:%d" % d["index"]] = fn("cuda:%d" % d["index"])
            torch.cuda.synchronize(d["index"])
        except Exception as e:  # noqa: BLE001 - "no kernel image", missing symbols, ...
            return result(name, "fail", "cuda:%d: %s: %s" % (d["index"], type(e).__name__, str(e).splitlines()[0][:200]),
                          errors=errs, check=what)
    worst = max(errs.values()) if errs else None
    if worst is None or worst != worst or worst > tol:
        return result(name, "fail", "%s: error %s > %g" % (what, worst, tol), errors=errs, check=what)
    return result(name, "pass", "%s on %d GPU(s): max error %.2g ≤ %g" % (what, len(errs), worst, tol),
                  errors=errs, check=what)

