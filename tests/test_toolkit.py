"""CUDA toolkits per major: CUDA_HOME follows the real wheel layouts; `lock check` refuses a toolkit source
that cannot give the nvcc probe an nvcc; the CUDA 12.8 baseline takes its toolkit from the host."""
from __future__ import annotations

import copy
from pathlib import Path

from provision import lock as lockmod, lockcheck, plan, toolkit
from provision.agent import probes as agentprobes

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "lockfiles" / "cuda12.8-sglang0.5.9.yaml"
TARGET = ROOT / "lockfiles" / "cuda13.0-sglang0.5.9.yaml"


def _with_cuda(lk, **cuda) -> lockmod.Lock:
    data = copy.deepcopy(lk.raw)
    data["platform"]["cuda"] = cuda
    return lockmod.from_data(data, str(BASELINE))


def test_cuda_home_per_source_and_major():
    lk = lockmod.load(BASELINE)
    sp = "/g/venv/lib/python3.12/site-packages"
    assert toolkit.home(_with_cuda(lk, version="13.0.1", source="wheels"), "/g/venv") == f"{sp}/nvidia/cu13"
    assert toolkit.home(_with_cuda(lk, version="12.8.1", source="wheels"), "/g/venv") == f"{sp}/nvidia/cuda_nvcc"
    assert toolkit.home(_with_cuda(lk, version="12.8.1", source="apt", package="cuda-toolkit-12-8"), "/v") == \
        "/usr/local/cuda-12.8"
    assert toolkit.home(lk, "/v") == "/usr/local/cuda-12.8"          # the baseline: the host's toolkit
    assert lk.platform.cuda.source == "host"


def test_lock_check_refuses_cuda12_from_wheels_before_any_download():
    lk = _with_cuda(lockmod.load(BASELINE), version="12.8.1", source="wheels")
    rep = lockcheck.check(lk, offline=True)
    (err,) = [f for f in rep.errors if f.rule == "toolkit"]
    assert "has no nvcc" in err.message and "source: host" in err.message
    facts = {"pythons": {"3.12": "/usr/bin/python3.12"}, "disk_free_bytes": 1 << 50, "root": "/opt/provision"}
    assert (True, err.message) in plan.preflight_findings(facts, lk)        # apply refuses it before downloading
    for ok in (lockmod.load(BASELINE), lockmod.load(TARGET)):
        assert not [f for f in lockcheck.check(ok, offline=True).errors if f.rule == "toolkit"]


def test_nvcc_probe_skips_for_a_host_toolkit_that_is_absent_and_fails_for_a_missing_wheel_toolkit(tmp_path):
    absent = str(tmp_path / "cuda-12.8")
    r = agentprobes.p_nvcc({"cuda_home": absent, "cuda_source": "host", "cuda_version": "12.8.1"})
    assert r["status"] == "skip" and "source host" in r["reason"]
    r = agentprobes.p_nvcc({"cuda_home": absent, "cuda_source": "wheels", "cuda_version": "13.0.1"})
    assert r["status"] == "fail"
