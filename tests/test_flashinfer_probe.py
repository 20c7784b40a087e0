"""The flashinfer probe's check on the GPUs runs in a process of its own beside the JIT builds (started first,
within the same core and memory bound), says while they run what is running every few seconds, and its figures
account for the probe's seconds: the check's imports and run, each process's span, the JIT's end and the wall.
Real flashinfer 0.6.4 in a venv over this interpreter's CPU torch; the GPU is the recorded H200's nvidia-smi, so
the check itself fails the way a host whose torch cannot use its GPU fails."""
from __future__ import annotations

import json
from pathlib import Path

from provision import apply as applymod
from provision.agent import jit
from provision.probes import run_probes
from provision.transport import Local, Target
from test_probes import by_name, fake_smi, lock_text
from test_toolkit import _nvcc_home, flashinfer_python  # noqa: F401 - the fixture

CHECK = {"op": "flashinfer-check"}
NO_CUDA = "nvidia-smi lists GPUs but torch.cuda.is_available() is False"


def test_the_check_runs_beside_the_jit_processes_and_progress_is_never_silent(flashinfer_python, monkeypatch,
                                                                               capsys, agent_bundle):
    """The check's process and a JIT process (flashinfer generating the all-reduce module for 12.0a: a real
    interpreter importing torch and flashinfer, as a build does before it compiles) run at once: each starts
    before the other ends. The check's answer says what its imports took apart from its run; the controller
    hears the running processes named at least every PROGRESS_EVERY seconds."""
    home, _ = _nvcc_home()
    monkeypatch.setattr(jit, "PROGRESS_EVERY", 0.5)
    st, reason, figs = jit.jit_part({"ccs": ["12.0"], "cuda_home": home}, python=flashinfer_python,
                                            build=(), check=("allreduce-fusion",), beside=CHECK)
    spans = figs["jit_spans"]
    assert sorted(spans) == [jit.CHECK, "check sm_120a"], spans
    (c0, c1), (j0, j1) = spans[jit.CHECK], spans["check sm_120a"]
    assert figs["jit_workers"] == jit.compile_slots(2)[0] == 2   # two cores, memory for two compiles
    assert c0 < j1 and j0 < c1, spans                                   # they overlapped
    assert figs["jit_seconds"] == j1
    got = figs["_beside"]
    assert got["status"] == "fail" and got["reason"].startswith(NO_CUDA), got
    imports = got["figures"]["import_seconds"]
    assert sorted(imports) == ["flashinfer", "torch"] and all(v > 0 for v in imports.values()), got
    assert 0 <= got["figures"]["check_seconds"] < c1 - c0
    heard = [e["_event"] for e in map(json.loads, capsys.readouterr().out.splitlines()) if "_event" in e]
    doing = [e["doing"] for e in heard if e.get("step") == "probe"]
    assert any(jit.CHECK in d and "check sm_120a" in d for d in doing), doing
    ticks = len([d for d in doing if d.startswith("flashinfer (jit ")])
    assert ticks >= int(max(c1, j1) / 0.5) - 1, (ticks, spans)          # one at least every half second


def test_the_probe_with_nothing_to_compile_runs_the_check_alone_and_accounts_for_its_seconds(flashinfer_python,
                                                                                           tmp_path):
    """Through the controller, on the flashinfer venv adopted as a generation with the recorded H200's nvidia-smi
    and a lock that names no capability: the check runs in its own process, and the probe's figures hold its
    span, its imports and its run, and the probe's wall."""
    tr = Local(Target(host="local", root=str(tmp_path / "root"), nvidia_smi=fake_smi(tmp_path)))
    applymod.adopt(tr, str(Path(flashinfer_python).parent.parent))
    r = by_name(run_probes(tr, lock_text(), only=["flashinfer"]))["flashinfer"]
    assert r["status"] == "fail" and r["reason"].startswith(NO_CUDA), r
    assert "JIT not compiled: the lock names no compute capability" in r["reason"]
    f = r["figures"]
    assert list(f["jit_spans"]) == [jit.CHECK], f
    start, end = f["jit_spans"][jit.CHECK]
    assert sorted(f["import_seconds"]) == ["flashinfer", "torch"], f
    assert sum(f["import_seconds"].values()) + f["check_seconds"] <= end - start <= f["wall_seconds"] <= r["seconds"]
