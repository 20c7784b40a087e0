"""Compiled kernels once per host: the cache key (flashinfer, torch, CUDA, capabilities; nothing else), one entry
shared by the generations whose key matches, gc of the entries no kept generation records, the JIT builds run side
by side within cores and memory, the controller naming the probe it waits for, and (slow) flashinfer's real JIT
cold then warm into the cache, with HOME untouched."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from provision import lock as lockmod
from provision.agent import jit, kernels
from provision.engine.settings import kernel_cache
from provision.layout import Layout
from provision.probes import run_probes
from provision.transport import Local, Target, Watch
from test_gc_truth import gc_cli, three_generations
from test_toolkit import _nvcc_home, flashinfer_python  # noqa: F401 - the fixture

FI = {"flashinfer-python": "0.6.4", "torch": "2.9.1+cu130", "sglang": "0.5.9", "numpy": "2.1.0"}


def test_the_key_changes_with_flashinfer_torch_cuda_and_capability_and_with_nothing_else(tmp_path, monkeypatch):
    home, release = _nvcc_home()
    base = kernels.inputs(home, ["12.0a"], dists=FI)
    assert base["cuda"].startswith(release + ".") and base["flashinfer"] == "0.6.4"   # the real nvcc's own word
    k = kernels.key(base)
    changed = {
        "flashinfer": kernels.inputs(home, ["12.0a"], dists=dict(FI, **{"flashinfer-python": "0.6.3"})),
        "torch": kernels.inputs(home, ["12.0a"], dists=dict(FI, torch="2.9.1+cu128")),
        "cuda": kernels.inputs(str(tmp_path / "no-toolkit"), ["12.0a"], dists=FI),
        "capability": kernels.inputs(home, ["12.0a", "9.0a"], dists=FI),
    }
    keys = {what: kernels.key(inp) for what, inp in changed.items()}
    assert k not in keys.values() and len(set(keys.values())) == 4, keys
    # other distributions, the order of the capabilities and the caller's environment change nothing
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "other-cuda"))
    monkeypatch.setenv("PATH", str(tmp_path))
    same = kernels.inputs(home, ["12.0a", "12.0a"], dists=dict(FI, sglang="0.5.23", numpy="2.2.0"))
    assert kernels.key(same) == k and kernels.key(kernels.inputs(home, ["9.0a", "12.0a"], dists=FI)) == \
        keys["capability"]
    assert kernels.env_of("/r/cache/kernels/" + k) == {
        "FLASHINFER_WORKSPACE_BASE": f"/r/cache/kernels/{k}/flashinfer",
        "TRITON_CACHE_DIR": f"/r/cache/kernels/{k}/triton", "TORCHINDUCTOR_CACHE_DIR": f"/r/cache/kernels/{k}/inductor"}


def _with_capability(lk: lockmod.Lock, *ccs: str) -> lockmod.Lock:
    data = copy.deepcopy(lk.raw)
    data["platform"]["gpus"] = {"compute_capability": list(ccs)}
    return lockmod.from_data(data, lk.name)


def test_generations_with_one_key_share_its_entry_and_gc_removes_only_unused_ones(tmp_path, wheels):
    """Three real applies (their probes record each generation's key): one entry for the three. Probing the oldest
    for another capability moves it to a second key; gc --keep 1 removes that generation, and with it the entry no
    kept generation uses (a dry run first names it and leaves it), and keeps the shared one."""
    root, tr, gens = three_generations(tmp_path, wheels)
    lay = Layout(str(root))
    recs = [json.loads((root / "generations" / g / "kernels.json").read_text()) for g in gens]
    shared = recs[0]["key"]
    assert [r["key"] for r in recs] == [shared] * 3
    assert sorted(os.listdir(lay.kernels)) == [shared]
    assert sorted(os.listdir(Path(lay.kernels) / shared)) == ["flashinfer", "inductor", "triton"]
    assert (root / "generations" / gens[2] / "kernels.env").read_text().splitlines() == [
        f"{var}={lay.kernels}/{shared}/{kind}" for var, kind in
        sorted((v, k) for k, v in kernels.KINDS.items())]

    assert kernel_cache(str(root / "generations" / gens[2] / "venv")) == recs[2]["env"]   # what the engine takes
    assert kernel_cache(str(tmp_path / "not-a-generation" / "venv")) == {}
    lk = lockmod.load(tmp_path / "a.yaml")
    rep = run_probes(tr, _with_capability(lk, "12.0"), generation=gens[0], only=["packages"])
    other = rep["kernels"]["key"]
    assert other != shared and rep["kernels"]["created"] and rep["kernels"]["inputs"]["archs"] == ["12.0a"]
    assert sorted(os.listdir(lay.kernels)) == sorted([shared, other])
    (Path(lay.kernels) / other / "triton" / "k.cubin").write_bytes(os.urandom(1 << 20))

    dry = gc_cli(root, "--keep", "1", "--dry-run")["kernels"]
    assert [e["key"] for e in dry["removed"]] == [other] and dry["kept"] == [shared]
    assert dry["removed"][0]["bytes"] >= 1 << 20 and (Path(lay.kernels) / other).is_dir()
    out = gc_cli(root, "--keep", "1")
    assert [g["id"] for g in out["generations"]] == [gens[0]]
    assert [e["key"] for e in out["kernels"]["removed"]] == [other] and not out["kernels"]["errors"]
    assert sorted(os.listdir(lay.kernels)) == [shared]
    assert not gc_cli(root, "--keep", "1")["kernels"]["removed"]         # the shared entry stays while it is used


def test_builds_run_side_by_side_within_the_workers_given_and_an_overrun_is_killed(tmp_path):
    """Real compiles (cc), four jobs over two workers: never more than two at once, two at once at some point,
    each object built; a job that overruns its time is killed and says so (no output)."""
    src = tmp_path / "k.c"
    src.write_text("int f(int x) { int s = 0; for (int i = 0; i < x; i++) s += i * x; return s; }\n")
    seen, lock = [], threading.Lock()

    def said(running, done, total):
        with lock:
            seen.append((len(running), done, total))

    def job(i):
        return (f"k{i}", lambda: subprocess.Popen(["sh", "-c", 'cc -O2 -c "$1" -o "$2" && sleep 0.3', "sh", str(src),
                                                   str(tmp_path / f"k{i}.o")],
                                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE))

    out = jit.run_parallel([job(i) for i in range(4)], 2, 60, said)
    assert sorted(out) == ["k0", "k1", "k2", "k3"]
    assert all(p.returncode == 0 for p, _, _, _, _ in out.values()) and all((tmp_path / f"k{i}.o").exists()
                                                                          for i in range(4))
    assert max(n for n, _, _ in seen) == 2 and seen[-1] == (0, 4, 4)
    slow = jit.run_parallel([("slow", lambda: subprocess.Popen(["sleep", "30"], stdout=subprocess.PIPE,
                                                                       stderr=subprocess.PIPE))], 4, 0.5)
    p, stdout, _, seconds, _ = slow["slow"]
    assert stdout == b"" and p.returncode != 0 and seconds < 10


def test_a_compile_only_host_compiles_the_same_sources_once_and_different_ones_again(tmp_path, agent_bundle):
    """On a host that only compiles (no driver to link or run), a build the cache holds for the same sources is
    not run again, and says so; for other sources (or no digest: a host with a driver, where ninja judges) the
    build runs. The digest of the sources follows flashinfer's and tvm-ffi's patched files, not other packages'."""
    ws = tmp_path / "flashinfer"
    ws.mkdir()
    (ws / jit.JIT_DONE).write_text(json.dumps({"sources": "same", "held": {"sm_120a": ["norm"]}}))
    home = str(tmp_path / "no-toolkit")
    out = jit.jit_builds(["12.0"], home, build=("norm",), check=(), workspace=str(ws), reuse="same")
    assert out["sm_120a"]["norm"] == {"status": "compiled", "reused": True, "compiled": 0, "seconds": 0.0,
                                      "missing": ["cuda"]} and out["_spans"] == {}          # no process started
    assert json.loads((ws / jit.JIT_DONE).read_text()) == {"sources": "same", "held": {"sm_120a": ["norm"]}}
    for reuse in ("other", None):        # a build process runs (this interpreter has no flashinfer: it fails)
        out = jit.jit_builds(["12.0"], home, build=("norm",), check=(), workspace=str(ws), reuse=reuse)
        assert "reused" not in out["sm_120a"]["norm"] and list(out["_spans"]) == ["norm sm_120a"], out
        (ws / jit.JIT_DONE).write_text(json.dumps({"sources": "same", "held": {"sm_120a": ["norm"]}}))

    base = jit.sources(None)
    assert jit.sources(None, {"sglang/srt/server_args.py": "0" * 64}) == base
    assert jit.sources(None, {"flashinfer/jit/core.py": "0" * 64}) != base
    rec = ("flashinfer/jit/core.py,sha256=aaa,10\n../../../bin/flashinfer,sha256=venv1,302\n"       # a RECORD of
           "flashinfer/__pycache__/x.pyc,,\nflashinfer_python-0.6.4.dist-info/INSTALLER,sha256=i,2\n")  # one venv
    other_venv = rec.replace("venv1", "venv2").replace("sha256=i,", "sha256=j,").replace(",,", ",sha256=p,7")
    assert jit.package_files(rec) == jit.package_files(other_venv) == ["flashinfer/jit/core.py,sha256=aaa,10"]
    assert jit.package_files(rec.replace("aaa", "bbb")) != jit.package_files(rec)      # a file of the package


def test_workers_are_bounded_by_cores_and_memory():
    cores, mem = jit.cores(), jit.mem_available()
    assert jit.compile_slots(6) == (min(6, cores, mem // jit.COMPILE_MEMORY),
                                            max(1, min(cores, mem // jit.COMPILE_MEMORY) // min(6, cores)))
    assert jit.compile_slots(6, per=mem)[0] == 1                  # memory for one compile: one at a time
    assert jit.compile_slots(1) == (1, min(cores, mem // jit.COMPILE_MEMORY))


@pytest.fixture
def adopted(tmp_path):
    """This interpreter's environment adopted as generation 0 of a fresh local root."""
    from provision import apply as applymod

    tr = Local(Target(host="local", root=str(tmp_path / "root")))
    applymod.adopt(tr, sys.prefix)
    return tr


def test_the_notice_names_the_probe_that_runs(adopted, tmp_path):
    """The real nvcc probe compiling for four capabilities is silent for seconds: with the notice lowered (the
    setting --wait-notice gives), the controller's wait names it."""
    home, release = _nvcc_home()
    waits = []
    adopted.target.notice = 0.3
    adopted.watch = Watch("probe", lambda what, s: waits.append(what))
    lk = lockmod.loads(f"lock: 1\nname: k\nplatform:\n  python: '{sys.version_info[0]}.{sys.version_info[1]}'\n"
                       f"  cuda: {{version: '{release}', source: host, home: {home}}}\n"
                       "  gpus: {compute_capability: ['8.9', '9.0', '10.0', '12.0']}\npackages: []\n", "k.yaml")
    rep = run_probes(adopted, lk, only=["nvcc"])
    assert rep["results"][0]["status"] == "pass", rep["results"][0]
    # the wait named the running probe from the moment it started (a notice before its first event, while the
    # agent starts on a loaded machine, can only say "probe")
    assert "probe nvcc" in waits and set(waits[waits.index("probe nvcc"):]) == {"probe nvcc"}, waits
    assert set(waits) <= {"probe", "probe nvcc"}, waits


# ---------------------------------------------------------------- flashinfer's real JIT into the cache (slow)

def toolkit_with_cublas(tmp_path) -> tuple[str, str]:
    """(CUDA home, release): the nvcc on PATH's toolkit, its include dir joined with NVIDIA's cuBLAS wheel's
    headers and cuRAND's (flashinfer's norm module includes cublasLt.h and curand_kernel.h), as a generation's toolkit from wheels has them."""
    import zipfile

    from sglang_wheel import wheel

    real, release = _nvcc_home()
    home = tmp_path / "cuda"
    (home / "include").mkdir(parents=True)
    for entry in os.listdir(real):
        if entry != "include":
            (home / entry).symlink_to(Path(real) / entry)
    for entry in os.listdir(Path(real) / "include"):
        (home / "include" / entry).symlink_to(Path(real) / "include" / entry)
    for version, dist in (("13.1.1.3", "nvidia-cublas"), ("10.4.0.35", "nvidia-curand")):
        with zipfile.ZipFile(wheel(version, dist)) as z:
            for name in z.namelist():
                if name.startswith("nvidia/cu13/include/") and name.endswith(".h"):
                    (home / "include" / Path(name).name).write_bytes(z.read(name))
    return str(home), release


@pytest.mark.slow
def test_flashinfer_probe_compiles_into_the_cache_once_then_finds_it_warm(tmp_path, flashinfer_python):
    """flashinfer 0.6.4's JIT by the real nvcc for 12.0a, through the probe of a generation (the venv with
    flashinfer adopted): the first run compiles into <root>/cache/kernels/<key>/flashinfer, the second compiles
    nothing (on this host, which has no driver to link with, it runs no build for the same sources and says so);
    once the sources differ (a patched flashinfer file recorded), the builds run again, and ninja finds nothing to
    compile; the controller heard which build ran; HOME stays untouched."""
    from provision import apply as applymod

    home, release = toolkit_with_cublas(tmp_path)
    fake_home = tmp_path / "home"
    fake_home.mkdir()
    tr = Local(Target(host="local", root=str(tmp_path / "root"), probe_env={"HOME": str(fake_home)}))
    applymod.adopt(tr, str(Path(flashinfer_python).parent.parent))
    lk = lockmod.loads(f"lock: 1\nname: k\nplatform:\n  python: '{sys.version_info[0]}.{sys.version_info[1]}'\n"
                       f"  cuda: {{version: '{release}', source: host, home: {home}}}\n"
                       "  gpus: {compute_capability: ['12.0']}\npackages: []\n", "k.yaml")
    heard = []
    tr.target.notice = 0.5
    tr.watch = Watch("probe", lambda what, s: heard.append(what))
    runs = [run_probes(tr, lk, only=["flashinfer"]) for _ in range(2)]
    cold, warm = [r["results"][0] for r in runs]
    assert cold["status"] in ("pass", "skip") and warm["status"] == cold["status"], cold["reason"]
    key = runs[0]["kernels"]["key"]
    assert runs[1]["kernels"]["key"] == key and runs[0]["kernels"]["inputs"]["flashinfer"] == "0.6.4"
    assert cold["figures"]["jit_cache"] == str(tmp_path / "root" / "cache" / "kernels" / key / "flashinfer")
    assert cold["figures"]["jit_builds"] == 3 and cold["figures"]["jit_compiled"] == 3, cold["figures"]
    assert warm["figures"]["jit_builds"] == 3 and warm["figures"]["jit_compiled"] == 0, warm["figures"]
    assert [r.get("reused") for r in warm["figures"]["jit"]["sm_120a"].values() if "compiled" in r] == [True] * 3
    assert "not again" in warm["reason"] and list(warm["figures"]["jit_spans"]) == ["check sm_120a"], warm
    man = tmp_path / "root" / "generations" / "0000-adopted" / "manifest.json"
    data = json.loads(man.read_text())
    man.chmod(0o644)
    man.write_text(json.dumps(dict(data, patches={"files": {"flashinfer/jit/core.py": "0" * 64}})))
    other = run_probes(tr, lk, only=["flashinfer"])["results"][0]
    assert not any(r.get("reused") for r in other["figures"]["jit"]["sm_120a"].values()), other["figures"]
    assert other["figures"]["jit_compiled"] == 0 and "not again" not in other["reason"], other
    assert (Path(cold["figures"]["jit_cache"]) / ".cache" / "flashinfer" / "0.6.4" / "120a" / "cached_ops" /
            "norm").is_dir()
    assert any(h.startswith("probe flashinfer (jit ") and "sm_120a" in h for h in heard), heard
    assert list(fake_home.iterdir()) == []
