"""All-reduce latency probe: verdicts and report (pure), SGLang 0.5.9's choice checked against the real
wheel (pristine and patched), the one-process-per-rank harness on CPU (gloo), and the skip on one GPU."""
from __future__ import annotations

import ast
import base64
import json
import sys
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import sglang_wheel  # noqa: E402

from provision import agent, patches  # noqa: E402
from provision.bundled import PATCHES  # noqa: E402
from provision.agent import allreduce as ar  # noqa: E402
from provision.agent import collective  # noqa: E402
from provision.probes import run_probes  # noqa: E402
from provision.probes.ship import bundle_files  # noqa: E402
from provision.transport import Local  # noqa: E402
from test_probes import adopted, by_name, fake_smi, lock_text  # noqa: E402,F401

SCRIPT = str(Path(ar.__file__))
NVLINK2 = {"full_nvlink": True, "p2p": True, "multicast": False}   # 2× H200, multicast off
PCIE8 = {"full_nvlink": False, "p2p": True, "multicast": False}    # 8× RTX PRO 6000 Blackwell


def rows(us, hiddens=(4096,), tokens=(1, 16), correct=True):
    return [{"hidden": h, "tokens": t, "bytes": h * t * 2, "graph": True, "correct": correct,
             "rel_err": 2e-3 if correct else 0.7, "median_us": us * t ** 0.1, "p99_us": us * 1.5}
            for h in hiddens for t in tokens]


def test_report_fastest_ratio_and_verdicts():
    paths = {"nccl": {"rows": rows(20.0)}, "symm-two-shot": {"rows": rows(10.0)},
             "flashinfer-fusion": {"skip": "flashinfer is not installed in this generation"}}
    rep = ar.report(paths, "9.0", 2, NVLINK2)
    assert rep["status"] == "pass", rep["reason"]
    f = rep["figures"]
    assert f["paths"]["flashinfer-fusion"] == {"status": "skip",
                                               "reason": "flashinfer is not installed in this generation"}
    assert [s["fastest"] for s in f["sizes"]] == ["symm-two-shot", "symm-two-shot"]
    assert [s["fastest_vs_nccl"] for s in f["sizes"]] == [2.0, 2.0]
    assert "symm-two-shot fastest at 2 of 2 sizes (2.00–2.00× NCCL)" in rep["reason"]
    assert "skipped: flashinfer-fusion" in rep["reason"]

    paths["symm-two-shot"] = {"rows": rows(10.0)[:1] + rows(10.0, tokens=(16,), correct=False)}
    rep = ar.report(paths, "9.0", 2, NVLINK2)
    assert rep["status"] == "fail"
    assert rep["reason"].startswith("symm-two-shot: wrong sum at hidden 4096 × 16 tokens (relative error 0.7)")
    # a wrong path's figures never count as the fastest
    assert {s["fastest"] for s in rep["figures"]["sizes"]} == {"nccl"}

    rep = ar.report({"nccl": {"rows": rows(20.0)[:1], "error": "hidden 4096 × 16 tokens: RuntimeError: boom"}},
                    "9.0", 2, NVLINK2)
    assert rep["status"] == "fail" and "RuntimeError: boom" in rep["reason"]
    rep = ar.report({"nccl": {"skip": "no CUDA device"}, "symm-two-shot": {"rows": rows(9.0)}}, "9.0", 2, NVLINK2)
    assert rep["status"] == "fail" and rep["reason"] == "NCCL did not run: no CUDA device"


def test_merge_takes_the_slowest_rank_and_every_ranks_correctness():
    a, b = rows(10.0), rows(30.0)
    b[1] = dict(b[1], correct=False, rel_err=0.5)
    m = ar.merge([{"nccl": {"rows": a}, "x": {"skip": "why"}}, {"nccl": {"rows": b}, "x": {"rows": []}}])
    assert m["x"] == {"skip": "why"}
    assert [r["median_us"] for r in m["nccl"]["rows"]] == [r["median_us"] for r in b]
    assert [r["correct"] for r in m["nccl"]["rows"]] == [True, False] and m["nccl"]["rows"][1]["rel_err"] == 0.5


def test_a_hung_path_is_named_and_what_finished_is_kept(tmp_path):
    """Ranks write their results after each path; a run killed mid-path still reports the paths before it."""
    for i, us in enumerate((10.0, 12.0)):
        (tmp_path / f"rank{i}.json").write_text(json.dumps(
            {"paths": {"nccl": {"rows": rows(us)}}, "torch": "2.11.0+cu130", "backend": "nccl", "iters": 400,
             "cc": "9.0", "topology": NVLINK2}))
    r = ar.finish(str(tmp_path), 2, None, "still running after 600s (a hung kernel?)")
    assert r["status"] == "fail"
    assert r["reason"] == "symm-one-shot: did not finish: still running after 600s (a hung kernel?)"
    p = r["figures"]["paths"]
    assert p["nccl"]["status"] == "pass" and p["flashinfer-fusion"] == {
        "status": "skip", "reason": "not run: symm-one-shot did not finish"}
    assert [s["us"]["nccl"]["median_us"] for s in r["figures"]["sizes"]] == [r_["median_us"] for r_ in rows(12.0)]
    r = ar.finish(str(tmp_path), 3, None, "rank 2 crashed")
    assert r["status"] == "fail" and r["reason"] == "rank 2 reported nothing: rank 2 crashed"


def test_sglang_choice():
    choice = ar.sglang_paths("12.0", 8, 7168 * 2 * 2, 2, PCIE8)
    assert choice["default"]["unpatched"][0] == "nccl" and "full NVLink" in choice["default"]["unpatched"][1]
    assert choice["symm-mem"]["unpatched"][0] == "error" and "KeyError 12" in choice["symm-mem"]["unpatched"][1]
    assert choice["symm-mem"]["patched"][0] == "symm-two-shot"
    assert choice["fusion"]["unpatched"][0] == "nccl"
    assert choice["fusion"]["patched"][0] == "error" and "SM90/SM100 only" in choice["fusion"]["patched"][1]
    assert ar.sglang_paths("12.0", 2, 8192, 1, PCIE8)["default"]["patched"][0] == "custom-ar"
    h200 = ar.sglang_paths("9.0", 2, 8192, 1, NVLINK2)
    assert h200["default"]["unpatched"][0] == "custom-ar"
    assert h200["symm-mem"]["patched"][0] == "nccl" and "multicast" in h200["symm-mem"]["patched"][1]
    assert h200["fusion"]["unpatched"][0] == "flashinfer-fusion"
    assert ar.sglang_paths("9.0", 4, 8192, 1, dict(NVLINK2, multicast=True))["symm-mem"]["unpatched"][0] == \
        "symm-multimem"


def _literal(path: Path, name: str):
    """A module- or class-level constant of a source file, evaluated as a literal (MiB = 1024 * 1024)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return eval(compile(ast.Expression(node.value), str(path), "eval"), {"MiB": 1 << 20, "_is_hip": False})
    raise AssertionError(f"{name} not in {path}")


def test_sglang_tables_are_the_real_wheels(tmp_path):
    """The constants sglang_paths() encodes, read from the real SGLang 0.5.9 wheel, before and after the
    SM120 series (so a new SGLang or a changed patch cannot leave them silently wrong)."""
    pristine = sglang_wheel.site_packages("0.5.9")
    dc = "sglang/srt/distributed/device_communicators"
    assert _literal(pristine / dc / "all_reduce_utils.py", "TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES") == ar.SYMM_MAX_SIZES
    assert {k: tuple(v) for k, v in _literal(pristine / dc / "torch_symm_mem.py", "_WORLD_SIZES_MULTIMEM").items()} \
        == ar.MULTIMEM_WORLD_SIZES
    custom = pristine / dc / "custom_all_reduce.py"
    assert tuple(_literal(custom, "_SUPPORTED_WORLD_SIZES")) == ar.CUSTOM_AR_WORLD_SIZES
    assert _literal(custom, "_MAX_CAR_SIZE") == ar.CUSTOM_AR_MAX_BYTES
    comm = pristine / "sglang/srt/layers/communicator.py"
    assert _literal(comm, "FUSE_ALLREDUCE_MAX_BATCH_SIZE") == ar.FUSION_MAX_TOKENS
    assert "(_is_sm90_supported or _is_sm100_supported)" in comm.read_text()

    sp = sglang_wheel.copy(pristine, tmp_path / "sp")
    series = patches.load_series(PATCHES / "sglang-0.5.9")
    patches.apply_series(Local(), [series], python=sys.executable, site_packages=str(sp))
    assert _literal(sp / dc / "all_reduce_utils.py", "TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES") == \
        ar.SYMM_MAX_SIZES_PATCHED
    assert _literal(sp / dc / "torch_symm_mem.py", "_WORLD_SIZES_MULTIMEM")[12] == []
    assert "needs_multicast = self.device_capability != 12" in (sp / dc / "torch_symm_mem.py").read_text()
    assert "(_is_sm90_supported or _is_sm100_supported or _is_sm120_supported)" in \
        (sp / "sglang/srt/layers/communicator.py").read_text()


def test_flashinfer_comm_majors_are_the_real_wheels():
    """flashinfer 0.6.4 builds its trtllm communication module for capability majors 9 and 10 only
    (so SGLang's fusion cannot run on SM120 with it, patched or not)."""
    import zipfile

    with zipfile.ZipFile(sglang_wheel.wheel("0.6.4", "flashinfer-python")) as z:
        tree = ast.parse(z.read("flashinfer/jit/comm.py").decode())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "gen_trtllm_comm_module")
    kw = next(k for n in ast.walk(fn) if isinstance(n, ast.Call) for k in n.keywords
              if k.arg == "supported_major_versions")
    assert tuple(ast.literal_eval(kw.value)) == ar.FLASHINFER_COMM_MAJORS


def test_harness_on_cpu_one_process_per_rank(agent_bundle):
    """The real agent, two ranks over gloo: NCCL's slot runs torch.distributed and is checked against the
    reference sum; every GPU-only path skips with its reason on both ranks."""
    a = {"allreduce_backend": "gloo", "world": 2, "timeout": 120,
         "allreduce": {"hiddens": [64], "tokens": [1, 3], "iters": 20}}
    r = collective.p_allreduce(a)
    assert r["status"] == "pass", r["reason"]
    f = r["figures"]
    assert f["backend"] == "gloo" and f["world"] == 2
    assert f["paths"]["nccl"]["status"] == "pass"
    for name in ar.PATHS[1:]:
        assert f["paths"][name] == {"status": "skip", "reason": "no CUDA device (backend gloo)"}
    assert [(s["hidden"], s["tokens"], s["fastest"]) for s in f["sizes"]] == [(64, 1, "nccl"), (64, 3, "nccl")]
    assert all(s["us"]["nccl"]["median_us"] > 0 for s in f["sizes"])
    json.dumps(r)


def test_one_gpu_skips_and_the_ranks_travel_in_the_agent_bundle(adopted, tmp_path):  # noqa: F811
    assert collective.p_allreduce({"gpus": [{"compute_cap": "9.0"}]})["status"] == "skip"
    adopted.target.nvidia_smi = fake_smi(tmp_path, gpus=1)
    r = by_name(run_probes(adopted, lock_text(), only=["allreduce"]))["allreduce"]
    assert r["status"] == "skip" and r["reason"].startswith("one GPU on this host")

    # two GPUs listed (recorded nvidia-smi) but a CPU torch: the probe fails saying so
    adopted.target.nvidia_smi = fake_smi(tmp_path, gpus=2)
    r = by_name(run_probes(adopted, lock_text(), only=["allreduce"]))["allreduce"]
    assert r["status"] == "fail" and "torch.cuda.is_available() is False" in r["reason"]
    # the ranks are agents of the bundle every agent call carries: nothing is shipped for them
    bundled = json.loads(zlib.decompress(base64.b64decode(agent.bundle())))
    assert bundled["provision/agent/allreduce.py"] == Path(SCRIPT).read_text()
    assert "provision/agent/allreduce.py" not in dict(bundle_files())


def test_script_is_stdlib_plus_torch():
    tree = ast.parse(Path(SCRIPT).read_text())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert mods <= set(sys.stdlib_module_names) | {"torch", "flashinfer", "pynvml"}, mods


@pytest.mark.parametrize("q,want", [(50, 3), (99, 5), (0, 1)])
def test_percentile(q, want):
    assert ar.percentile([5, 1, 4, 2, 3], q) == want
