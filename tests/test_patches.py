"""Patch series and engine against the real SGLang 0.5.9 wheel (and 0.5.8 for the version gate)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
import sglang_wheel  # noqa: E402

from provision import patches  # noqa: E402
from provision.agent import patcher  # noqa: E402
from provision.bundled import PATCHES  # noqa: E402
from provision.cli import app  # noqa: E402
from provision.errors import PatchError  # noqa: E402
from provision.transport import Local  # noqa: E402

SERIES_DIR = PATCHES / "sglang-0.5.9"
TOUCHED = [
    "sglang/srt/distributed/device_communicators/all_reduce_utils.py",
    "sglang/srt/distributed/device_communicators/torch_symm_mem.py",
    "sglang/srt/layers/communicator.py",
    "sglang/srt/models/kimi_k25.py",
]
PY = sys.executable


@pytest.fixture(scope="session")
def pristine() -> Path:
    return sglang_wheel.site_packages("0.5.9")


@pytest.fixture
def sp(pristine, tmp_path) -> Path:
    """A fresh, writable copy of the pristine 0.5.9 site-packages."""
    return sglang_wheel.copy(pristine, tmp_path / "site-packages")


@pytest.fixture(scope="session")
def series():
    return patches.load_series(SERIES_DIR)


def tree_digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".complete"}


def run(series_list, sp, **kw):
    return patches.apply_series(Local(), series_list, python=PY, site_packages=str(sp), **kw)


def statuses(report):
    return [p["status"] for s in report["series"] for p in s["patches"]]


# ---------------------------------------------------------------- the series itself

def test_series_loads_and_targets_real_files(series, pristine):
    assert series.package == "sglang" and str(series.specifier) == "==0.5.9"
    assert [p.name for p in series.patches] == sorted(p.name for p in series.patches)
    assert sorted(f for p in series.patches for f in p.files) == sorted(TOUCHED)
    for p in series.patches:
        assert p.description and p.reason
        assert all((pristine / f).is_file() for f in p.files)


def test_series_errors_name_the_line(tmp_path):
    d = tmp_path / "sglang-0.5.9"
    d.mkdir()
    for f in SERIES_DIR.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    text = (d / "series.yaml").read_text()
    (d / "series.yaml").write_text(text.replace('version: "==0.5.9"', 'version: "=>0.5.9"'))
    with pytest.raises(PatchError, match=r"series\.yaml:\d+: invalid version specifier"):
        patches.load_series(d)
    (d / "series.yaml").write_text(text)
    (d / "0002-flashinfer-allreduce-fusion-sm120.patch").unlink()
    with pytest.raises(PatchError, match="cannot read .*0002-flashinfer"):
        patches.load_series(d)


# ---------------------------------------------------------------- apply / idempotence / revert

def test_apply_is_idempotent_and_reverts_byte_identical(series, sp, pristine):
    before = tree_digest(sp)

    check = run([series], sp, check_only=True)
    assert statuses(check) == ["would-apply"] * 3 and not check["written"] and check["ok"]
    assert tree_digest(sp) == before

    applied = run([series], sp)
    assert statuses(applied) == ["applied"] * 3 and applied["written"]
    assert sorted(applied["files"]) == sorted(TOUCHED) == applied["changed"]
    for rel, digest in applied["files"].items():
        assert hashlib.sha256((sp / rel).read_bytes()).hexdigest() == digest != before[rel]
    assert applied["files"] == check["files"]          # check predicted the result exactly
    after = tree_digest(sp)
    assert {k for k in after if after[k] != before.get(k)} == set(TOUCHED)
    kimi = (sp / "sglang/srt/models/kimi_k25.py").read_text()
    assert "return self.language_model.set_eagle3_layers_to_capture(layer_ids)" in kimi
    assert "12: [],  # SM120" in (sp / TOUCHED[1]).read_text()
    subprocess.run([PY, "-m", "py_compile", *[str(sp / f) for f in TOUCHED]], check=True)

    mtimes = {f: os.stat(sp / f).st_mtime_ns for f in TOUCHED}
    again = run([series], sp)
    assert statuses(again) == ["already-applied"] * 3 and not again["written"] and again["changed"] == []
    assert again["files"] == applied["files"]
    assert {f: os.stat(sp / f).st_mtime_ns for f in TOUCHED} == mtimes

    reverted = run([series], sp, revert=True)
    assert statuses(reverted) == ["reverted"] * 3
    assert tree_digest(sp) == tree_digest(pristine)
    assert statuses(run([series], sp, revert=True)) == ["not-applied"] * 3


def test_partly_applied_series_completes(series, sp):
    only_kimi = dataclasses.replace(series, patches=[series.patches[2]])
    assert statuses(run([only_kimi], sp)) == ["applied"]
    assert statuses(run([series], sp)) == ["applied", "applied", "already-applied"]


def test_corrupted_target_is_refused_and_nothing_written(series, sp):
    comm = sp / "sglang/srt/layers/communicator.py"
    sglang_wheel.rewrite(comm, comm.read_text().replace("_is_sm100_supported = _is_cuda and is_sm100_supported()",
                                             "_is_sm100_supported = False  # local edit"))
    before = tree_digest(sp)
    with pytest.raises(PatchError) as err:
        run([series], sp)
    msg = str(err.value)
    assert "0002-flashinfer-allreduce-fusion-sm120.patch" in msg
    assert "sglang/srt/layers/communicator.py" in msg and "hunk #1" in msg and "local edit" in msg
    assert "\n" not in msg
    assert tree_digest(sp) == before                   # 0001 and 0003 would apply, but nothing was written

    check = run([series], sp, check_only=True)         # check reports instead of raising
    assert statuses(check) == ["would-apply", "failed", "would-apply"] and not check["ok"]
    assert tree_digest(sp) == before


def test_version_gate_refuses_another_release(series, tmp_path):
    other = sglang_wheel.copy(sglang_wheel.site_packages("0.5.8"), tmp_path / "sp")   # a real, other release
    before = tree_digest(other)
    with pytest.raises(PatchError, match=r"applies to sglang==0\.5\.9, but sglang 0\.5\.8 is installed"):
        run([series], other)
    assert tree_digest(other) == before


def test_per_patch_gate_skips(series, sp):
    gated = dataclasses.replace(series, patches=[
        series.patches[0], dataclasses.replace(series.patches[1], applies_to=Requirement("sglang<0.5.9"))])
    report = run([gated], sp)
    assert statuses(report) == ["applied", "skipped-by-gate"]
    assert "needs sglang<0.5.9" in report["series"][0]["patches"][1]["reason"]
    assert "is_sm120_supported" not in (sp / "sglang/srt/layers/communicator.py").read_text()


def test_environment_found_through_its_interpreter(series, pristine, tmp_path):
    """No site-packages given: the target interpreter's own metadata locates SGLang."""
    venv = tmp_path / "venv"
    subprocess.run([PY, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    purelib = subprocess.run([py, "-c", "import sysconfig;print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    sglang_wheel.copy(pristine, Path(purelib))

    report = patches.apply_series(Local(), [series], python=py)
    assert statuses(report) == ["applied"] * 3
    assert report["series"][0]["site_packages"] == purelib
    assert patches.verify_manifest(Local(), report["files"], py) == []

    target = Path(purelib) / "sglang/srt/models/kimi_k25.py"
    sglang_wheel.rewrite(target, target.read_text() + "# drift\n")
    bad = patches.verify_manifest(Local(), {**report["files"], "sglang/nope.py": "0" * 64}, py)
    assert [m["path"] for m in bad] == ["sglang/nope.py", "sglang/srt/models/kimi_k25.py"]
    assert bad[0]["actual"] is None and bad[1]["actual"] != bad[1]["expected"]


# ---------------------------------------------------------------- the applier on its own

def _apply(text, diff):
    (fp,) = patcher.parse(diff)
    return patcher.apply_hunks(text.splitlines(keepends=True), fp.hunks)


def test_applier_offsets_and_missing_final_newline():
    diff = ("--- a/m.py\n+++ b/m.py\n@@ -1,2 +1,2 @@\n a = 1\n-b = 2\n\\ No newline at end of file\n"
            "+b = 3\n\\ No newline at end of file\n")
    new, distance = _apply("# moved\na = 1\nb = 2", diff)
    assert "".join(new) == "# moved\na = 1\nb = 3" and distance == 1
    failed, (n, header, detail) = _apply("a = 1\nb = 9", diff)
    assert failed is None and n == 1 and header == "@@ -1,2 +1,2 @@" and "line 2" in detail


# ---------------------------------------------------------------- CLI

def test_cli_apply_check_and_refusal(sp, tmp_path):
    cli = CliRunner()
    r = cli.invoke(app, ["patches", "apply", "--site-packages", str(sp), "--series", str(SERIES_DIR), "--json"])
    assert r.exit_code == 0, r.output
    assert statuses(json.loads(r.stdout)) == ["applied"] * 3
    r = cli.invoke(app, ["patches", "check", "--site-packages", str(sp), "--series", str(SERIES_DIR)])
    assert r.exit_code == 0 and "Patches: 3 already-applied (nothing written)" in r.stdout

    other = sglang_wheel.copy(sglang_wheel.site_packages("0.5.8"), tmp_path / "other")
    r = cli.invoke(app, ["patches", "apply", "--site-packages", str(other)])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "refusing" in r.output


def test_over_ssh_through_the_cli(sp, sshd):
    """The same verbs against the real sshd on loopback (agent source and payload travel over SSH)."""
    t = sshd.target
    common = ["--key", t.key_file, "--known-hosts", str(t.known_hosts), "--site-packages", str(sp)]
    cli = CliRunner()
    r = cli.invoke(app, ["patches", "apply", sshd.spec, *common, "--series", str(SERIES_DIR), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["host"] == sshd.spec and statuses(report) == ["applied"] * 3
    r = cli.invoke(app, ["contract", "KimiK25ForConditionalGeneration", sshd.spec, *common])
    assert r.exit_code == 0 and "EAGLE-3 contract: PASS" in r.stdout, r.output
    r = cli.invoke(app, ["patches", "revert", sshd.spec, *common, "--series", str(SERIES_DIR)])
    assert r.exit_code == 0 and "Patches: 3 reverted; wrote 4 files" in r.stdout, r.output


def test_series_see_each_others_staged_changes(series, sp):
    """Two series touching the same file: the second is checked against the first's result."""
    first = dataclasses.replace(series, name="a", patches=[series.patches[2]])
    second = dataclasses.replace(series, name="b", patches=[series.patches[2]])
    report = run([first, second], sp)
    assert statuses(report) == ["applied", "already-applied"] and report["changed"] == [TOUCHED[3]]
