"""lock diff: stack changes between two locks, rendered like `plan`, and as JSON."""
from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from provision import lock as lockmod
from provision import lockcheck
from provision.cli import app

REPO = Path(__file__).resolve().parent.parent


def write(path: Path, **top) -> Path:
    data = {"lock": 1, "name": path.stem, "platform": {"python": "3.12"}, **top}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def pkg(name, version):
    return {"name": name, "version": version, "sha256": "0" * 64}


def pair(tmp_path):
    old = write(tmp_path / "old.yaml",
                platform={"python": "3.12", "driver": {"min": "570.124.06"}, "cuda": {"version": "12.8.1", "source": "wheels"}},
                packages=[pkg("torch", "2.9.1"), pkg("flashinfer-python", "0.6.3"), pkg("nvidia-nccl-cu12", "2.27.5")],
                patches=["patches/sglang-0.5.9"], engine={"kind": "sglang", "model": "m"})
    new = write(tmp_path / "new.yaml",
                platform={"python": "3.12", "driver": {"min": "580.65.06"}, "cuda": {"version": "13.0.1", "source": "wheels"}},
                packages=[pkg("flashinfer-python", "0.6.4"), pkg("cuda-toolkit", "13.0.1")],
                unresolved=[{"name": "torch", "requirement": "torch==2.9.1+cu130", "reason": "index unreachable"}],
                patches=["patches/sglang-0.5.9", "patches/extra"],
                engine={"kind": "sglang", "model": "m", "speculative": {"algorithm": "EAGLE3", "steps": 3}})
    return old, new


def test_diff_text_like_plan(tmp_path):
    old, new = pair(tmp_path)
    text = lockcheck.diff(lockmod.load(old), lockmod.load(new)).render()
    lines = text.splitlines()
    assert lines[0] == "Lock diff: old → new"
    assert any(l.startswith("  ~ cuda") and l.endswith("12.8.1 (wheels) → 13.0.1 (wheels)") for l in lines)
    assert any(l.startswith("  ~ driver min") and "570.124.06 → 580.65.06  (upgrade)" in l for l in lines)
    assert any(l.startswith("  ~ flashinfer-python") and "0.6.3 → 0.6.4  (upgrade)" in l for l in lines)
    assert any(l.startswith("  + cuda-toolkit") and l.endswith("13.0.1") for l in lines)
    assert any(l.startswith("  - nvidia-nccl-cu12") and l.endswith("2.27.5") for l in lines)
    assert any(l.startswith("  ~ torch") and l.endswith("2.9.1 → 2.9.1+cu130 (unresolved)") for l in lines)
    assert any(l.startswith("  + extra") for l in lines)
    assert any(l.startswith("  + speculative.algorithm") and l.endswith("EAGLE3") for l in lines)
    assert lines[-1] == "Diff: 4 added, 4 changed, 1 removed."


def test_diff_json_and_no_changes(tmp_path):
    old, new = pair(tmp_path)
    res = CliRunner().invoke(app, ["lock", "diff", str(old), str(new), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["from"] == "old" and d["to"] == "new" and d["summary"] == {"add": 4, "change": 4, "remove": 1}
    fl = next(c for c in d["changes"] if c["name"] == "flashinfer-python")
    assert fl == {"category": "package", "name": "flashinfer-python", "action": "change", "old": "0.6.3",
                  "new": "0.6.4", "direction": "upgrade"}
    res = CliRunner().invoke(app, ["lock", "diff", str(old), str(old)])
    assert res.exit_code == 0 and "No changes." in res.output


def test_real_stack_locks_diff():
    """The README's headline: baseline CUDA 12.8 → target CUDA 13.0 (no network: diff reads only the locks)."""
    base = lockmod.load(REPO / "lockfiles" / "cuda12.8-sglang0.5.9.yaml")
    target = lockmod.load(REPO / "lockfiles" / "cuda13.0-sglang0.5.9.yaml")
    d = lockcheck.diff(base, target)
    by = {(c.category, c.name): c for c in d.changes}
    assert by[("toolkit", "cuda")].new == "13.0.1 (wheels)"
    assert by[("driver", "driver min")].new == "580.65.06"
    assert (by[("package", "flashinfer-python")].old, by[("package", "flashinfer-python")].new) == ("0.6.3", "0.6.4")
    assert by[("package", "torch")].new == "2.9.1+cu130 (unresolved)"
    assert by[("engine", "speculative.algorithm")].new == "EAGLE3"
    assert ("package", "sglang") not in by                       # same SGLang, same patch series
    assert not any(c.category == "patch" for c in d.changes)


def test_a_service_change_is_its_own_part_of_the_diff(tmp_path):
    svc = {"unit": "sglang.service", "gates": {"min_tok_s_ratio": 0.9}}
    old = write(tmp_path / "old.yaml", engine={"kind": "sglang"}, service=svc)
    new = write(tmp_path / "new.yaml", engine={"kind": "sglang"},
                service={"unit": "sglang.service", "gates": {"min_tok_s_ratio": 0.95}, "bench": {"concurrency": [1, 8]}})
    lines = lockcheck.diff(lockmod.load(old), lockmod.load(new)).render().splitlines()
    at = lines.index("  service (its cutover)")
    assert lines[at + 1].split() == ["~", "bench.concurrency", "[1]", "→", "[1,", "8]"]     # from its default
    assert lines[at + 2].split() == ["~", "gates.min_tok_s_ratio", "0.9", "→", "0.95"]
    assert lockmod.load(new).service.bench.concurrency == [1, 8]
