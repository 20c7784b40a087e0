"""CUDA toolkits per major: CUDA_HOME of a wheels toolkit is the home the build lays out in the venv; `lock check`
refuses a toolkit source that cannot give the nvcc probe an nvcc; the CUDA 12.8 baseline takes its toolkit from the
host. With the real nvcc on this GPU-less machine: the nvcc probe compiles arch-specific targets (sm_120a) for what
the lock targets, and flashinfer's JIT compiles its kernels for 12.0a and reports what it refuses there."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

from provision import lock as lockmod, lockcheck, plan, toolkit
from provision.agent import build as agentbuild
from provision.agent import gpu_probes, jit
from provision.facts import Facts

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "lockfiles" / "cuda12.8-sglang0.5.9.yaml"
TARGET = ROOT / "lockfiles" / "cuda13.0-sglang0.5.9.yaml"


def _with_cuda(lk, **cuda) -> lockmod.Lock:
    data = copy.deepcopy(lk.raw)
    data["platform"]["cuda"] = cuda
    return lockmod.from_data(data, str(BASELINE))


def test_cuda_home_per_source_and_major():
    lk = lockmod.load(BASELINE)
    for version in ("13.0.1", "12.8.1"):    # laid out by the build agent over either wheel layout
        assert toolkit.home(_with_cuda(lk, version=version, source="wheels"), "/g/venv") == "/g/venv/cuda-home"
    assert toolkit.home(_with_cuda(lk, version="12.8.1", source="apt", package="cuda-toolkit-12-8"), "/v") == \
        "/usr/local/cuda-12.8"
    assert toolkit.home(lk, "/v") == "/usr/local/cuda-12.8"          # the baseline: the host's toolkit
    assert lk.platform.cuda.source == "host"


def test_lock_check_refuses_cuda12_from_wheels_before_any_download():
    lk = _with_cuda(lockmod.load(BASELINE), version="12.8.1", source="wheels")
    rep = lockcheck.check(lk, offline=True)
    (err,) = [f for f in rep.errors if f.rule == "toolkit"]
    assert "has no nvcc" in err.message and "source: host" in err.message
    facts = Facts(host="h", pythons={"3.12": "/usr/bin/python3.12"}, disk_free_bytes=1 << 50, root="/opt/provision")
    assert (True, err.message) in plan.preflight_findings(facts, lk)        # apply refuses it before downloading
    for ok in (lockmod.load(BASELINE), lockmod.load(TARGET)):
        assert not [f for f in lockcheck.check(ok, offline=True).errors if f.rule == "toolkit"]


def test_nvcc_probe_skips_for_a_host_toolkit_that_is_absent_and_fails_for_a_missing_wheel_toolkit(tmp_path):
    absent = str(tmp_path / "cuda-12.8")
    r = gpu_probes.p_nvcc({"cuda_home": absent, "cuda_source": "host", "cuda_version": "12.8.1"})
    assert r["status"] == "skip" and "source host" in r["reason"]
    r = gpu_probes.p_nvcc({"cuda_home": absent, "cuda_source": "wheels", "cuda_version": "13.0.1"})
    assert r["status"] == "fail"


# ---------------------------------------------------------------- the real nvcc and flashinfer's JIT, no GPU

def _nvcc_home() -> tuple[str, str]:
    """(CUDA home, release) of the nvcc on PATH, as nvcc itself reports them; skips where there is none."""
    import re
    import shutil
    import subprocess

    if not shutil.which("nvcc"):
        pytest.skip("no nvcc on PATH: the compile checks need a real CUDA toolkit")
    dry = subprocess.run(["nvcc", "--dryrun", "-c", "-x", "cu", "/dev/null", "-o", "/dev/null"],
                         capture_output=True, text=True)
    here = re.search(r"^#\$ _HERE_=(.+)$", dry.stderr + dry.stdout, re.M)
    release = re.search(r"release (\d+\.\d+)", subprocess.run(["nvcc", "--version"], capture_output=True,
                                                             text=True).stdout)
    assert here and release, dry.stderr[-400:]
    return str(Path(here.group(1).strip()).parent), release.group(1)


def test_nvcc_probe_compiles_what_the_lock_targets_and_the_gpus_are_arch_specific_where_they_can_be():
    home, release = _nvcc_home()
    a = {"cuda_home": home, "cuda_source": "host", "cuda_version": release, "ccs": ["12.0", "8.9"],
         "gpus": [{"compute_cap": "9.0"}, {"compute_cap": "12.0"}]}
    r = gpu_probes.p_nvcc(a)
    assert r["status"] == "pass", r
    assert r["figures"]["targets"] == {"8.9": "lock", "9.0": "gpu", "12.0": "lock+gpu"}
    assert r["figures"]["compiled"].keys() == {"sm_89", "sm_90a", "sm_120a"} and not r["figures"]["failed"]
    assert "sm_120a (lock+gpu, " in r["reason"] and "sm_90a (gpu, " in r["reason"]
    assert [gpu_probes.specific(cc) for cc in ("8.9", "9.0", "10.3", "12.0")] == ["8.9", "9.0a", "10.3a", "12.0a"]
    r = gpu_probes.p_nvcc(dict(a, gpus=[{"compute_cap": "[N/A]"}]))
    assert r["status"] == "fail" and "compute capability '[N/A]', not major.minor" in r["reason"]


@pytest.fixture(scope="module")
def flashinfer_python(tmp_path_factory) -> str:
    """A venv over this interpreter (its CPU torch) with the target lock's flashinfer-python and the
    distributions its JIT needs to import and build (apache-tvm-ffi, ninja, nvidia-ml-py), from real wheels."""
    import subprocess
    import sys

    from sglang_wheel import wheel

    want = lockmod.load(TARGET).versions()
    wheels = [str(wheel(want[d], d)) for d in ("flashinfer-python", "apache-tvm-ffi", "ninja", "nvidia-ml-py")]
    venv = tmp_path_factory.mktemp("flashinfer") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                        "--no-deps", "--no-index", "--no-compile", "--disable-pip-version-check", *wheels],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-600:]
    return str(venv / "bin" / "python")


def test_flashinfer_jit_compiles_for_sm120_without_a_gpu_and_reports_what_it_refuses(flashinfer_python, tmp_path,
                                                                                       agent_bundle):
    """flashinfer 0.6.4's own JitSpecs, built by the real nvcc for 12.0a on this CPU-only machine: its fused
    SiLU-and-mul kernel compiles; the trtllm all-reduce fusion module is refused for 12.0 (a finding, not a
    failure) and accepted for 9.0."""
    home, _ = _nvcc_home()
    st, reason, figs = jit.jit_part({"ccs": ["12.0"], "cuda_home": home}, python=flashinfer_python,
                                            build=("silu-and-mul",))
    got = figs["jit"]["sm_120a"]
    if got["silu-and-mul"]["status"] == "built":                          # a host with a driver: linked
        assert st == "pass" and reason.startswith("JIT-compiled silu-and-mul sm_120a ("), reason
    else:                         # no driver: compiled, and the link lacks only the driver's libcuda
        assert got["silu-and-mul"]["status"] == "compiled" and got["silu-and-mul"]["missing"] == ["cuda"], got
        assert agentbuild.driver_libcuda() is None
        assert st == "skip" and reason.startswith("no NVIDIA driver on this host: JIT compiled silu-and-mul "
                                                  "sm_120a ("), reason
    assert reason.endswith("; refused: trtllm allreduce fusion (sm_120a)")
    assert got["silu-and-mul"]["module"] == "silu_and_mul" and got["silu-and-mul"]["seconds"] > 0
    assert got["allreduce-fusion"]["status"] == "refused" and "major versions [9, 10]" in \
        got["allreduce-fusion"]["error"]
    hopper = jit.flashinfer_jit("9.0", home, flashinfer_python, build=(), check=("allreduce-fusion",))
    assert hopper == {"allreduce-fusion": {"status": "accepted", "module": "trtllm_comm"}}

    st, reason, _ = jit.jit_part({"ccs": ["12.0"], "cuda_home": str(tmp_path / "cuda")})
    assert st == "skip" and reason == f"JIT not compiled: no nvcc at {tmp_path / 'cuda' / 'bin' / 'nvcc'}"
    assert jit.jit_part({"ccs": [], "cuda_home": home})[0] == "skip"


# What the JIT worker printed for flashinfer 0.7.2's silu-and-mul on this CPU-only machine (no driver), with a
# home that is a toolkit (only -lcuda missing at the link) and with one that lacks lib64/libcudart.so too.
COMPILED_NO_LIBCUDA = {"status": "compiled", "module": "silu_and_mul", "seconds": 31.79, "missing": ["cuda"], "compiled": 2,
                       "error": "/usr/bin/ld: cannot find -lcuda: No such file or directory"}
COMPILED_NO_CUDART = dict(COMPILED_NO_LIBCUDA, missing=["cuda", "cudart"],
                          error="/usr/bin/ld: cannot find -lcudart: No such file or directory")


@pytest.mark.parametrize("out, driver, status, why", [
    (COMPILED_NO_LIBCUDA, None, "skip", "no NVIDIA driver on this host: JIT compiled silu-and-mul sm_120a (32s); "
                                        "not linked: -lcuda needs the driver's library and the toolkit has no stub"),
    (COMPILED_NO_LIBCUDA, "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "fail",
     "JIT failed: silu-and-mul sm_120a compiled: /usr/bin/ld: cannot find -lcuda"),
    (COMPILED_NO_CUDART, None, "fail", "JIT failed: silu-and-mul sm_120a compiled: /usr/bin/ld: cannot find -lcudart"),
    (dict(COMPILED_NO_LIBCUDA, status="failed", missing=[]), None, "fail", "JIT failed: silu-and-mul sm_120a failed"),
])
def test_a_jit_link_that_only_lacks_the_drivers_libcuda_skips_and_nothing_else_passes(monkeypatch, tmp_path,
                                                                                      out, driver, status, why):
    """Objects compiled but not linked pass nowhere: without a driver, and -lcuda the only library the link
    lacks, the part skips naming the missing driver; a host with a driver, or any other missing library or
    error, fails. (The compiler's output is recorded; the driver's presence is what is stood in for.)"""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    monkeypatch.setattr(jit, "jit_builds", lambda *a, **k: {"_workers": 1, "sm_120a": {"silu-and-mul": out}})
    monkeypatch.setattr(jit, "driver_libcuda", lambda: driver)
    st, reason, figs = jit.jit_part({"ccs": ["12.0"], "cuda_home": str(tmp_path)}, build=("silu-and-mul",),
                                            check=())
    assert (st, reason[:len(why)]) == (status, why), reason
    assert figs["jit_unlinked"] == (["silu-and-mul sm_120a (32s)"] if status == "skip" else [])
