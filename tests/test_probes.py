"""Probes: every probe's pass and fail paths (GPU ones through recorded real H200 output), verify-
before-switch over real SSH, the engine end to end with a small pair, and the H200 command sequence."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from provision import apply as applymod
from provision import generations, lock as lockmod
from provision.agent import collective, engine_probe, gpu_probes
from provision.probes import REGISTRY, run_probes
from provision.transport import Local, Target, connect
from test_core import ctrl_c_as_at_a_terminal
from wheelhouse import write_lock

ROOT = Path(__file__).resolve().parent.parent
H200 = Path(__file__).parent / "data" / "h200"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def by_name(report):
    return {r["name"]: r for r in report["results"]}


def lock_text(**over) -> lockmod.Lock:
    data = {"lock": 1, "name": "expect", "platform": {"python": "%d.%d" % sys.version_info[:2]},
            "packages": [], "engine": {}, "probes": {}}
    for k, v in over.items():
        if k in ("driver", "gpus", "cuda"):
            data["platform"][k] = v
        else:
            data[k] = v
    return lockmod.loads(yaml.safe_dump(data), "expect.yaml")


def fake_smi(tmp_path, gpus=1) -> str:
    """nvidia-smi that prints the recorded H200 query (one line per GPU)."""
    line = (H200 / "nvidia-smi-query.csv").read_text().strip()
    rows = [line] + [line.replace("0, NVIDIA", f"{i}, NVIDIA", 1) for i in range(1, gpus)]
    (tmp_path / "smi.csv").write_text("\n".join(rows) + "\n")
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat {tmp_path / 'smi.csv'}\n")
    smi.chmod(0o755)
    return str(smi)


@pytest.fixture
def adopted(tmp_path):
    """This interpreter's environment (it has torch) adopted as generation 0 of a fresh local root."""
    t = Target(host="local", root=str(tmp_path / "root"))
    tr = Local(t)
    applymod.adopt(tr, sys.prefix)
    return tr


# ---------------------------------------------------------------- verify before switch (real SSH)

def test_failing_probe_refuses_switch_and_skip_probe_is_recorded(target, wheels, tmp_path):
    a = write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]])
    nocuda = tmp_path / "broken-cuda"          # bin/nvcc is not a program: a broken toolkit install
    (nocuda / "bin").mkdir(parents=True)
    (nocuda / "bin" / "nvcc").write_text("")
    b = write_lock(tmp_path / "b.yaml", "stack-b", [wheels["alpha-2.0"]])
    data = yaml.safe_load(b.read_text())
    data["platform"]["cuda"] = {"version": "13.0", "source": "host", "home": str(nocuda)}
    b.write_text(yaml.safe_dump(data))
    tr = connect(target)
    try:
        rep = applymod.apply(tr, lockmod.load(a))
        assert rep.probes["status"] == "pass" and rep.probes["summary"]["fail"] == 0
        assert by_name(rep.probes)["packages"]["status"] == "pass"
        with pytest.raises(applymod.ProbesFailed, match=r"probes failed in 0002-stack-b: nvcc \(.*--version failed.*\); "
                                                        r"current left at 0001-stack-a"):
            applymod.apply(tr, lockmod.load(b))
        assert os.readlink(Path(target.root) / "current") == "generations/0001-stack-a"
        man = generations.read(tr, "0002-stack-b")["manifest"]
        assert man["status"] == "failed" and "nvcc" in man["reason"] and man["probes_status"] == "fail"
        stored = json.loads((Path(target.root) / "generations/0002-stack-b/probes.json").read_text())
        assert stored["failed"] == ["nvcc"] and f"{nocuda}/bin/nvcc --version failed" in by_name(stored)["nvcc"]["reason"]

        rep = applymod.apply(tr, lockmod.load(b), skip_probes=["nvcc"])
        assert rep.status == "applied" and rep.generation == "0003-stack-b"
        assert by_name(rep.probes)["nvcc"]["status"] == "skip"
        events = generations.history(tr).events
        probe_ev = [e for e in events if e["event"] == "probe" and e["generation"] == "0003-stack-b"]
        assert probe_ev and probe_ev[0]["skipped_probes"] == ["nvcc"] and probe_ev[0]["status"] == "pass"
        assert [e for e in events if e["event"] == "apply"][-1]["skipped_probes"] == ["nvcc"]
        with pytest.raises(Exception, match="unknown probe 'nvc'"):
            run_probes(tr, skip=["nvc"])
    finally:
        tr.close()


# ---------------------------------------------------------------- nvcc from NVIDIA's wheels (real apply)

def test_nvcc_from_toolkit_wheels_compiles_sm120(toolkit_generation):
    t, rep, lk = toolkit_generation
    assert rep.status == "applied", rep.error
    r = by_name(rep.probes)["nvcc"]
    assert r["status"] == "pass", r
    assert r["figures"]["nvcc"] == "13.0.88" and "sm_120a" in r["figures"]["compiled"]
    assert r["figures"]["cuda_home"].endswith("venv/cuda-home")
    tr = connect(t)
    try:
        data = copy.deepcopy(lk.raw)
        data["platform"]["cuda"]["version"] = "12.8"
        rep2 = run_probes(tr, lockmod.from_data(data, "cuda12.8"), only=["nvcc"])
        assert rep2["failed"] == ["nvcc"]
        assert "nvcc 13.0.88 at" in by_name(rep2)["nvcc"]["reason"] and "lock wants CUDA 12.8" in \
            by_name(rep2)["nvcc"]["reason"]
        data["platform"]["cuda"]["version"] = "13.0.1"
        data["platform"]["gpus"]["compute_capability"] = ["12.0", "99.9"]
        rep3 = run_probes(tr, lockmod.from_data(data, "bad-cc"), only=["nvcc"])
        assert "nvcc -arch=sm_999a failed" in by_name(rep3)["nvcc"]["reason"]
        assert by_name(rep3)["nvcc"]["figures"]["compiled"].keys() == {"sm_120a"}
    finally:
        tr.close()


# ---------------------------------------------------------------- GPU probes through recorded output

def test_gpu_probes_with_recorded_h200(adopted, tmp_path):
    adopted.target.nvidia_smi = fake_smi(tmp_path)
    adopted.target.probe_env = {"PROVISION_PROBE_TORCH_JSON": str(H200 / "torch.json")}
    good = lock_text(driver={"min": "580.65.06"}, gpus={"compute_capability": ["9.0"]},
                     cuda={"version": "13.0", "source": "host", "home": str(tmp_path)})
    rep = run_probes(adopted, good, only=["driver", "torch-cuda", "arch", "nccl", "symm-mem"])
    r = by_name(rep)
    assert r["driver"]["status"] == "pass" and r["driver"]["reason"] == "driver 580.159.04 >= 580.65.06"
    assert r["torch-cuda"]["status"] == "pass" and r["torch-cuda"]["figures"]["torch"] == "2.11.0+cu130"
    assert r["arch"]["status"] == "pass" and r["arch"]["figures"]["covered_by"]["torch:9.0"] == "sm_90"
    assert r["nccl"]["status"] == "skip" and "one GPU" in r["nccl"]["reason"]
    assert r["symm-mem"]["status"] == "skip"

    bad = lock_text(driver={"min": "590.1"}, gpus={"compute_capability": ["9.0"]},
                    cuda={"version": "12.8", "source": "host", "home": str(tmp_path)})
    rec = json.loads((H200 / "torch.json").read_text())
    rec["arch_list"] = ["sm_80", "sm_120"]          # a torch built without Hopper
    (tmp_path / "torch.json").write_text(json.dumps(rec))
    adopted.target.probe_env = {"PROVISION_PROBE_TORCH_JSON": str(tmp_path / "torch.json")}
    rep = run_probes(adopted, bad, only=["driver", "torch-cuda", "arch"])
    r = by_name(rep)
    assert rep["failed"] == ["driver", "torch-cuda", "arch"]
    assert r["driver"]["reason"] == "driver 580.159.04 is older than the lock's minimum 590.1"
    assert r["torch-cuda"]["reason"] == "torch 2.11.0+cu130 is built for CUDA 13.0, the lock wants 12.8"
    assert "torch has no kernel image for sm_90" in r["arch"]["reason"]


def test_sm120_lock_on_a_recorded_hopper_host(adopted, tmp_path):
    """lockfiles/cuda13-sm120.yaml (the seed hosts' 12.0) probed where the GPU is a 9.0 (recorded H200): arch says
    the GPU is not a target, the real nvcc compiles sm_120a (the lock's) and sm_90a (the GPU's)."""
    import shutil

    nvcc = shutil.which("nvcc")
    if not nvcc:
        pytest.skip("no nvcc on PATH: the nvcc probe needs a real CUDA toolkit")
    dry = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", "/dev/null", "-o", "/dev/null"], capture_output=True,
                         text=True)
    home = str(Path(dry.stderr.split("_HERE_=", 1)[1].splitlines()[0]).parent)
    adopted.target.nvidia_smi = fake_smi(tmp_path)
    adopted.target.probe_env = {"PROVISION_PROBE_TORCH_JSON": str(H200 / "torch.json")}
    data = yaml.safe_load((ROOT / "lockfiles" / "cuda13-sm120.yaml").read_text())
    data["platform"]["cuda"]["home"] = home              # the host's toolkit, wherever this machine has it
    rep = run_probes(adopted, lockmod.from_data(data, "cuda13-sm120"),
                     only=["driver", "nvcc", "torch-cuda", "arch", "flashinfer"])
    r = by_name(rep)
    assert rep["status"] == "pass", [(x["name"], x["reason"]) for x in rep["results"] if x["status"] == "fail"]
    assert r["arch"]["status"] == "pass" and r["arch"]["figures"]["untargeted_gpus"] == ["9.0"]
    assert "GPU capability 9.0 is not among the lock's targets (12.0)" in r["arch"]["reason"]
    assert r["arch"]["figures"]["covered_by"] == {"torch:9.0": "sm_90", "torch:12.0": "sm_120"}
    assert r["nvcc"]["figures"]["targets"] == {"9.0": "gpu", "12.0": "lock"}
    assert r["nvcc"]["figures"]["compiled"].keys() == {"sm_90a", "sm_120a"}
    assert r["flashinfer"]["status"] == "skip" and "flashinfer-python is not installed" in r["flashinfer"]["reason"]


def test_torch_cuda_with_no_cuda_in_the_lock_reads_the_version_without_importing_torch(adopted):
    import torch

    r = by_name(run_probes(adopted, lock_text(), only=["torch-cuda"]))["torch-cuda"]
    assert r["status"] == "skip" and r["reason"] == "the lock names no CUDA version"
    assert r["figures"]["torch"] == torch.__version__
    assert "torch_cuda" not in r["figures"]          # torch.version.cuda is what an import would have read


def test_gpu_listed_but_torch_cannot_use_it(adopted, tmp_path):
    """nvidia-smi (recorded) shows GPUs; this CPU torch cannot use them: every GPU probe fails, naming why."""
    adopted.target.nvidia_smi = fake_smi(tmp_path, gpus=2)
    rep = run_probes(adopted, lock_text(gpus={"compute_capability": ["9.0"]}),
                     only=["arch", "matmul", "nccl", "flashinfer"])
    r = by_name(rep)
    for name in ("arch", "matmul", "nccl"):
        assert r[name]["status"] == "fail" and "torch.cuda.is_available() is False" in r[name]["reason"], r[name]
    assert r["flashinfer"]["status"] == "skip" and "flashinfer-python is not installed" in r["flashinfer"]["reason"]


def test_a_failing_nvidia_smi_fails_the_gpu_probes_naming_its_error(adopted, tmp_path):
    """nvidia-smi is there but the driver does not answer: the host's facts still load (the error is a fact, not
    a failed agent), and the GPU probes run and fail with nvidia-smi's words instead of skipping as on a CPU host."""
    from provision import facts as factsmod

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'\n"
                   "exit 9\n")
    smi.chmod(0o755)
    adopted.target.nvidia_smi = str(smi)
    f = factsmod.gather(adopted)
    assert f.gpus == [] and "could not communicate with the NVIDIA driver" in f.gpu_error
    r = by_name(run_probes(adopted, lock_text(gpus={"compute_capability": ["9.0"]}, driver={"min": "580.65.06"}),
                           only=["driver"]))["driver"]
    assert r["status"] == "fail" and "could not communicate with the NVIDIA driver" in r["reason"], r


def test_no_gpu_probes_skip_with_reasons(adopted):
    rep = run_probes(adopted, lock_text(gpus={"compute_capability": ["9.0"]}, driver={"min": "580.65.06"}))
    r = by_name(rep)
    for name in ("driver", "arch", "matmul", "sgl-kernel"):
        assert r[name]["status"] == "skip" and r[name]["reason"].startswith("no NVIDIA GPU on this host")
    assert r["flashinfer"]["status"] == "skip" and "flashinfer-python is not installed" in r["flashinfer"]["reason"]
    assert r["nccl"]["reason"].startswith("no NVIDIA GPU on this host") and r["engine"]["status"] == "skip"
    assert [x["name"] for x in rep["results"]] == [p.name for p in REGISTRY]
    assert rep["status"] == "pass" and r["packages"]["status"] == "pass"


def test_smoke_and_collective_harness_on_cpu(monkeypatch, agent_bundle):
    """The comparison and the one-process-per-rank all-reduce harness the GPU probes use, on CPU (gloo)."""
    monkeypatch.setenv("PROVISION_ALLREDUCE_SIZES", "4096,262144")
    assert gpu_probes.smoke_matmul("cpu", n=256) < 2e-2
    out = collective.run_workers("nccl", 2, "gloo", timeout=120)
    assert out["ok"] and out["world"] == 2 and {r["dtype"] for r in out["rows"]} == {"bfloat16", "float32"}
    assert all(r["us"] > 0 and r["busbw_GBps"] >= 0 for r in out["rows"])
    assert gpu_probes.covered("12.0", ["sm_90", "compute_90"]) == "compute_90 (PTX JIT)"
    assert gpu_probes.covered("8.6", ["sm_80"]) == "sm_80"
    assert gpu_probes.covered("9.0", ["sm_80", "sm_90a"]) == "sm_90a"
    assert gpu_probes.covered("10.3", ["sm_90", "sm_100a"]) is None


# ---------------------------------------------------------------- patches, contract, JIT cache

def by_hand(path: Path, text: str) -> None:
    """Root's deliberate edit of an installed file: the immutable attribute of its store entry cleared first."""
    subprocess.run(["chattr", "-i", str(path)], check=True)
    path.write_text(text)


def test_patched_files_and_package_drift(target, wheels, tmp_path):
    import hashlib

    a = write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"], wheels["beta-1.0"]])
    tr = connect(target)
    try:
        rep = applymod.apply(tr, lockmod.load(a))
        assert by_name(rep.probes)["patches"]["status"] == "skip"
        site = next((Path(target.root) / "current" / "venv").glob("lib/python*/site-packages"))
        f = site / "alpha" / "__init__.py"
        generations.mark(tr, rep.generation, patches={"status": "applied", "files": {
            "alpha/__init__.py": hashlib.sha256(f.read_bytes()).hexdigest()}})
        r = by_name(run_probes(tr, only=["patches"]))["patches"]
        assert r["status"] == "pass" and r["reason"] == "1 patched file(s) match the manifest's sha256"
        by_hand(f, "# edited by hand after apply\n")       # root, deliberately: through the store's attribute
        extra = site / "gamma-1.0.dist-info"
        extra.mkdir()
        (extra / "METADATA").write_text("Metadata-Version: 2.1\nName: gamma\nVersion: 1.0\n")
        by_hand(next(site.glob("beta-1.0.dist-info")) / "METADATA", "Metadata-Version: 2.1\nName: beta\nVersion: 1.1\n")
        rep = run_probes(tr, only=["patches", "packages"])
        r = by_name(rep)
        assert rep["status"] == "fail" and rep["failed"] == ["packages", "patches"]
        assert "alpha/__init__.py sha256" in r["patches"]["reason"]
        p = r["packages"]
        assert p["figures"]["extra"] == ["gamma"] and p["figures"]["different"] == ["beta 1.1 (lock 1.0)"]
        assert "version differs: beta 1.1 (lock 1.0)" in p["reason"] and "not in the lock: gamma" in p["reason"]
    finally:
        tr.close()


def test_contract_probe_on_real_sglang(tmp_path):
    from sglang_wheel import site_packages

    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", env], check=True)
    sp = next(env.glob("lib/python*/site-packages"))
    (sp / "sglang.pth").write_text(str(site_packages("0.5.9")) + "\n")
    tr = Local(Target(host="local", root=str(tmp_path / "root")))
    applymod.adopt(tr, str(env))
    r = by_name(run_probes(tr, lock_text(engine={"kind": "none", "architecture": "KimiK25ForConditionalGeneration"}),
                           only=["contract"]))["contract"]
    assert r["status"] == "fail" and "KimiK25ForConditionalGeneration lacks" in r["reason"]
    assert "get_embed_and_head" in r["reason"] and "set_eagle3_layers_to_capture" in r["reason"]
    r = by_name(run_probes(tr, lock_text(engine={"architecture": "LlamaForCausalLM"}), only=["contract"]))["contract"]
    assert r["status"] == "pass", r


def test_contract_skips_without_sglang(adopted):
    r = by_name(run_probes(adopted, lock_text(engine={"architecture": "LlamaForCausalLM"}),
                           only=["contract"]))["contract"]
    assert r["status"] == "skip" and "no sglang in this generation" in r["reason"]


def test_stale_flashinfer_jit_cache_warns_with_path(adopted, tmp_path):
    base = tmp_path / "home"
    build = base / ".cache" / "flashinfer" / "0.6.4" / "90" / "cached_ops" / "batch_prefill"
    build.mkdir(parents=True)
    (build / "build.ninja").write_text("nvcc = /usr/local/cuda-12.8/bin/nvcc\ncuda_cflags = -gencode=arch=compute_90\n")
    adopted.target.probe_env = {"FLASHINFER_WORKSPACE_BASE": str(base)}
    lk = lock_text(cuda={"version": "13.0.1", "source": "host"})
    rep = run_probes(adopted, lk, only=["jit-cache"])
    r = by_name(rep)["jit-cache"]
    assert r["status"] == "warn" and rep["status"] == "pass"      # advisory: never blocks a switch
    assert r["reason"] == (f"flashinfer JIT cache built for CUDA 12.8 (lock: 13.0); clear "
                           f"{base / '.cache' / 'flashinfer' / '0.6.4'}")
    (build / "build.ninja").write_text("nvcc = /opt/g/venv/lib/python3.12/site-packages/nvidia/cu13/bin/nvcc\n")
    r = by_name(run_probes(adopted, lk, only=["jit-cache"]))["jit-cache"]
    assert r["status"] == "pass" and "none for another CUDA" in r["reason"]


# ---------------------------------------------------------------- engine end to end

def engine_procs(*markers: str) -> list[int]:
    """Processes whose command line holds every marker."""
    out = []
    for pid in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace") if pid.isdigit() else ""
            if cmd and all(m in cmd for m in markers):
                out.append(int(pid))
        except OSError:
            pass
    return out


def random_pair(dim: int, n_layer: int):
    """A target and an EAGLE-3 draft over a 260-token byte vocabulary, seeded random weights."""
    import torch

    from provision.engine.draft import DraftArgs, Eagle3Draft
    from provision.engine.model import ModelArgs, Transformer

    torch.manual_seed(0)
    kw = dict(vocab_size=260, dim=dim, n_head=4, n_local_heads=2, intermediate_size=3 * dim,
              max_position_embeddings=1024)
    target = Transformer(ModelArgs(n_layer=n_layer, **kw))
    draft = Eagle3Draft(DraftArgs(n_layer=1, draft_vocab_size=260, **kw))
    for m in (target, draft):
        for p in m.parameters():
            torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
            if p.dim() == 1:
                p.data += 1.0
    return target, draft


def save_pair(d: Path, target, draft) -> Path:
    """The pair written with the engine's own savers (the draft maps every draft id to target id 0)."""
    from provision.engine.loading import save_draft, save_target

    n_layer = target.args.n_layer
    draft.d2t.zero_()
    d.mkdir(parents=True, exist_ok=True)
    save_target(target, d, eos_token_id=257, bos_token_id=256)
    save_draft(draft, d / "draft", aux_layer_ids=[2, n_layer // 2, n_layer - 3])
    (d / "byte_tokenizer.json").write_text(json.dumps({"bos_id": 256, "eos_id": 257}))
    return d


def make_pair(d: Path, agreeing: bool, dim: int = 128, n_layer: int = 8) -> Path:
    """Engine checkpoints written with the engine's own savers. `agreeing`: target and draft both
    always predict byte 0, so every drafted token is accepted; otherwise a random draft, which
    accepts next to nothing."""
    import torch

    target, draft = random_pair(dim, n_layer)
    if agreeing:
        with torch.no_grad():
            target.output.weight.zero_()      # all logits equal: greedy picks id 0
            draft.lm_head.weight.zero_()      # so does the draft (d2t maps draft 0 → target 0)
    return save_pair(d, target, draft)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pairs")
    return {"agreeing": make_pair(d / "agreeing", True, n_layer=4), "random": make_pair(d / "random", False,
                                                                                        n_layer=4)}


def test_engine_probe_end_to_end(adopted, pairs):
    eng = {"kind": "included", "model": str(pairs["agreeing"]), "steps": 4}
    # a floor far under what it measures (it measured 0.44x once, on a loaded 2-core machine): what
    # this checks is the probe and its verdict, not the machine's speed (that is the benchmarks')
    rep = run_probes(adopted, lock_text(engine=eng, probes={"min_speedup": 0.05, "max_tokens": 32, "prompts": PROMPTS}),
                     only=["engine"])
    r = by_name(rep)["engine"]
    assert r["status"] == "pass", r
    f = r["figures"]
    assert f["greedy_identical"] and f["accept_length"] > 2.0 and f["speedup"] >= 0.05 and f["device"] == "cpu"
    assert f["exit_codes"] and all(c is not None for c in f["exit_codes"])      # stopped
    assert not engine_procs(str(pairs["agreeing"]))
    shipped = Path(adopted.target.root) / "tool"
    assert list(shipped.glob("*/provision/engine/serve.py"))


def test_engine_probe_catches_silent_fallback_and_slowdown(adopted, pairs):
    eng = {"kind": "included", "model": str(pairs["random"])}
    r = by_name(run_probes(adopted, lock_text(engine=eng, probes={"max_tokens": 16, "prompts": PROMPTS}), only=["engine"]))["engine"]
    assert r["status"] == "fail" and "speculation accepts nothing (silent fallback)" in r["reason"], r
    assert r["figures"]["greedy_identical"] is True
    eng = {"kind": "included", "model": str(pairs["agreeing"])}
    r = by_name(run_probes(adopted, lock_text(engine=eng, probes={"min_speedup": 50.0, "max_tokens": 16, "prompts": PROMPTS}),
                           only=["engine"]))["engine"]
    assert r["status"] == "fail" and "< min_speedup 50.00" in r["reason"]
    bad = {"kind": "included", "model": str(pairs["agreeing"] / "nope")}
    r = by_name(run_probes(adopted, lock_text(engine=bad), only=["engine"]))["engine"]
    assert r["status"] == "fail" and "engine exited with" in r["reason"] and "nope" in r["reason"]
    assert not engine_procs(str(pairs["agreeing"]))


# ---------------------------------------------------------------- engine probe: the greedy verdict

FAULTY = ROOT / "tests" / "engine" / "serve_with_fault.py"
FAULT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def probe_engine(fault: str, *serve_args, prompts=FAULT_PROMPTS, max_tokens=32) -> dict:
    """The engine probe's host side (agent/engine_probe.p_engine) against the real server with one fault injected
    (tests/engine/serve_with_fault.py)."""
    argv = [sys.executable, str(FAULTY), fault, "--host", "127.0.0.1", "--port", "0", "--device", "cpu",
            "--threads", "1", "--max-seq-len", "256", *map(str, serve_args)]
    r = engine_probe.p_engine({"engine": {"kind": "included", "argv": argv, "env": {"PYTHONPATH": str(ROOT)},
                                         "device": "cpu", "prompts": prompts, "max_tokens": max_tokens,
                                         "min_speedup": 0.01}})
    assert not engine_procs(str(FAULTY), fault)
    return r


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fault", ["none", "accept", "position"])
def test_engine_probe_fails_a_broken_verifier(fault, dtype):
    """The bundled tiny pair: healthy, it passes (bfloat16 on the CPU: identical, shared rows); with a broken
    accept rule or drafted tokens verified one position late it fails, at a divergence far from a near-tie."""
    r = probe_engine(fault, "--dtype", dtype)
    f = r["figures"]
    if fault == "none":
        assert r["status"] == "pass" and f["greedy_identical"] and not f["divergences"], r
        assert r["reason"].startswith("identical greedy output")
        return
    assert r["status"] == "fail" and "not at a near-tie" in r["reason"] and "logit gap in the plain step" in r["reason"], r
    assert not f["greedy_identical"]                       # the exact-identity rule failed it too
    far = [d for d in f["divergences"] if not d["near_tie"]]
    assert far and all(d["gap"] > d["bound"] and d["gap"] >= d["top2_gap"] and d["dtype"] == dtype for d in far)


def make_near_tie_pair(d: Path, dim: int = 256, n_layer: int = 4, delta: float = 0.007) -> Path:
    """A pair whose target nearly ties tokens 0 and 1 at every step (their output rows differ by `delta` in one
    coordinate) and prefers them to all others (a large first embedding coordinate); the draft always proposes 0,
    so it is accepted wherever 0 wins."""
    import torch

    target, draft = random_pair(dim, n_layer)
    with torch.no_grad():
        target.tok_embeddings.weight[:, 0] = 10.0
        row = 0.05 * torch.randn(dim)
        row[0] += 1.0
        out = target.output.weight
        out.zero_()
        out[0] = out[1] = row
        out[1, 1] += delta
        draft.lm_head.weight.zero_()
    return save_pair(d, target, draft)


def test_engine_probe_passes_divergences_at_near_ties(tmp_path):
    """A healthy bfloat16 engine whose plain steps (1 row) and verifications (5 rows) round differently, as on a
    GPU: its greedy outputs part where tokens 0 and 1 nearly tie. The probe passes it, naming each divergence's
    gap and bound; the exact-identity rule failed it."""
    pair = make_near_tie_pair(tmp_path / "tie")
    prompts = FAULT_PROMPTS + ["In the beginning", "1, 2, 3, 4, 5, 6,"]
    r = probe_engine("rows", "--model", pair, "--dtype", "bfloat16", "--steps", 4, "--topk", 1,
                     "--num-draft-tokens", 5, prompts=prompts, max_tokens=48)
    f = r["figures"]
    if f.get("greedy_identical"):
        pytest.skip("this CPU rounds one row and five rows alike: no divergence to judge")
    assert r["status"] == "pass", r
    assert f["divergences"] and all(d["near_tie"] and d["gap"] <= d["bound"] for d in f["divergences"])
    assert f["identical_prompts"] == len(prompts) - len(f["divergences"])
    assert f"greedy identical on {f['identical_prompts']} of {len(prompts)} prompts; " \
           f"{len(f['divergences'])} divergence(s) at near-ties" in r["reason"]


def test_near_tie_verdict():
    bound, judge = engine_probe.near_tie_bound, engine_probe.judge_divergence
    u = engine_probe.UNIT_ROUNDOFF
    assert bound("bfloat16", 8, 10.0) / bound("float32", 8, 10.0) == u["bfloat16"] / u["float32"]
    assert bound("float16", 8, 10.0) < bound("bfloat16", 8, 10.0) < bound("bfloat16", 32, 10.0)
    assert bound("bfloat16", 8, 20.0) == 2 * bound("bfloat16", 8, 10.0) and bound("int8", 8, 10.0) is None
    b = bound("bfloat16", 8, 10.0)
    report = {"dtype": "bfloat16", "layers": 8, "gaps": [3 * b, 3 * b, b / 2, 3 * b], "scales": [10.0] * 4}
    d = judge([5, 6, 7, 8], [5, 6, 9, 9], report)                   # parts at token 2, a near-tie there
    assert d["near_tie"] and d["position"] == 2 and (d["plain_token"], d["spec_token"]) == (7, 9) and d["bound"] == b
    report["gaps"][2] = 2 * b
    assert not judge([5, 6, 7, 8], [5, 6, 9, 9], report)["near_tie"]     # the same place, a clear winner
    assert not judge([5, 6, 7, 8], [5, 1, 7, 8], report)["near_tie"]     # an earlier divergence decides
    assert not judge([5, 6, 7], [5, 6, 7, 8], report)["near_tie"]        # lengths differ
    assert not judge([5, 6, 7, 8], [5, 6, 9, 9], dict(report, dtype="int8"))["near_tie"]
    assert judge([5, 6, 7, 8], [5, 6, 9, 9], dict(report, dtype="float32", gaps=[b / 2] * 4))["near_tie"] is False
    # with the step's largest logits named, the gap is the one between the two tokens actually picked
    report["gaps"] = [b / 4] * 4
    top = [[[7, 0.0], [3, b / 4], [9, b / 2], [4, b]]] * 4
    d = judge([5, 6, 7, 8], [5, 6, 9, 9], dict(report, top=top))
    assert d["near_tie"] and d["gap"] == b / 2 and d["top2_gap"] == b / 4 and not d["gap_at_least"]
    top = [[[7, 0.0], [3, b / 4], [4, b / 2], [2, 2 * b]]] * 4          # 9 lies below all of them
    d = judge([5, 6, 7, 8], [5, 6, 9, 9], dict(report, top=top))
    assert not d["near_tie"] and d["gap"] == 2 * b and d["gap_at_least"]
    top = [[[7, 0.0], [3, b / 4], [9, 3 * b], [4, 4 * b]]] * 4          # a small top-2 gap, but not to token 9
    assert not judge([5, 6, 7, 8], [5, 6, 9, 9], dict(report, top=top))["near_tie"]


# ---------------------------------------------------------------- CLI: the H200 command sequence on CPU

def cli(*args):
    p = subprocess.run([sys.executable, "-m", "provision.cli", *map(str, args)], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "COLUMNS": "160"})
    assert "Traceback" not in p.stderr, p.stderr
    return p


def test_h200_sequence_on_cpu(tmp_path, pairs):
    """docs/probe-h200.md's sequence (adopt --local, probe --local --json), engine pointed at a test pair."""
    root = tmp_path / "root"
    p = cli("adopt", "--local", sys.prefix, "--root", root)
    assert p.returncode == 0 and "as generation 0000-adopted" in p.stdout
    data = yaml.safe_load((ROOT / "lockfiles" / "h200-cuda13.yaml").read_text())
    data["engine"]["model"] = str(pairs["agreeing"])
    # the sequence, not a speed: a loaded machine decides no ratio here (the gate itself: the engine probe tests)
    data["probes"].update(min_speedup=0.01, max_tokens=32, prompts=PROMPTS)
    (tmp_path / "h200.yaml").write_text(yaml.safe_dump(data))
    only = [a for n in ("driver", "packages", "arch", "matmul", "nccl", "symm-mem", "engine") for a in ("--only", n)]
    p = cli("probe", "--local", "--root", root, "--lock", tmp_path / "h200.yaml", "--json", *only)
    rep = json.loads(p.stdout)
    assert p.returncode == 0, [(x["name"], x["reason"]) for x in rep["results"] if x["status"] == "fail"]
    r = by_name(rep)
    assert r["packages"]["status"] == "pass" and "captured at adoption" in r["packages"]["reason"]
    assert all(r[n]["status"] == "skip" for n in ("driver", "arch", "matmul", "nccl", "symm-mem"))
    assert r["engine"]["status"] == "pass"
    p = cli("probe", "--local", "--root", root, "--only", "packages")
    assert p.returncode == 0 and "probes in 0000-adopted on local" in p.stdout and "pass" in p.stdout
    h = cli("history", "--local", "--root", root)
    assert "pass=1" in h.stdout


def test_ctrl_c_stops_the_engine(tmp_path):
    """Ctrl-C at the CLI while the engine serves: exit 130, and no engine process is left behind."""
    import signal
    import time

    root = tmp_path / "root"
    assert cli("adopt", "--local", sys.prefix, "--root", root).returncode == 0
    p = subprocess.Popen([sys.executable, "-m", "provision.cli", "probe", "--local", "--root", str(root), "--lock",
                          str(ROOT / "lockfiles" / "h200-cuda13.yaml"), "--only", "engine"], cwd=ROOT,
                         start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         preexec_fn=ctrl_c_as_at_a_terminal)
    marker = (str(root), "provision.engine.serve")
    t0 = time.time()
    while not engine_procs(*marker) and time.time() - t0 < 60:
        time.sleep(0.2)
    assert engine_procs(*marker), "the engine never started"
    time.sleep(0.2)                                   # loading or serving: either way it must be stopped
    assert p.poll() is None, "the probe ended before it could be interrupted"
    os.killpg(p.pid, signal.SIGINT)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 130 and "interrupted" in out, (p.returncode, out)
    time.sleep(0.5)
    assert not engine_procs(*marker)
