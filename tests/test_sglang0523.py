"""The shipped SGLang 0.5.23 stack: its lock checks clean against the real wheels' METADATA, and its patch
series against the real 0.5.23 wheel: two SM120 patches still needed, and the 0.5.9 series' other fixes
proven upstream (their code is there, Kimi K2.5's EAGLE-3 contract passes)."""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
import sglang_wheel  # noqa: E402

from provision import lock as lockmod  # noqa: E402
from provision import lockcheck  # noqa: E402
from provision import patches  # noqa: E402
from provision.agent.contracts import check_contract  # noqa: E402
from provision.bundled import PATCHES  # noqa: E402
from provision.cli import app  # noqa: E402
from provision.errors import PatchError, SeriesError  # noqa: E402
from provision.transport import Local  # noqa: E402

VERSION = "0.5.23"
SERIES_DIR = PATCHES / f"sglang-{VERSION}"
LOCK = Path(__file__).resolve().parents[1] / "lockfiles" / f"cuda13.0-sglang{VERSION}.yaml"
KIMI = "sglang/srt/models/kimi_k25.py"
SYMM = "sglang/srt/distributed/device_communicators/torch_symm_mem.py"
PATCHED = [
    "sglang/srt/distributed/device_communicators/all_reduce_utils.py",
    SYMM,
    "sglang/srt/layers/flashinfer_comm_fusion.py",
    "sglang/srt/layers/layer_boundary/residual/add_norm.py",
]


@pytest.fixture(scope="module")
def pristine() -> Path:
    return sglang_wheel.site_packages(VERSION)


@pytest.fixture
def sp(pristine, tmp_path) -> Path:
    return sglang_wheel.copy(pristine, tmp_path / "site-packages")


@pytest.fixture(scope="module")
def series():
    return patches.load_series(SERIES_DIR)


def run(series_list, sp, **kw):
    return patches.apply_series(Local(), series_list, python=sys.executable, site_packages=str(sp), **kw)


def statuses(report):
    return {p["name"]: p["status"] for s in report["series"] for p in s["patches"]}


def digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".complete"}


def without_line(sp: Path, rel: str, line: str) -> None:
    text = (sp / rel).read_text()
    assert line + "\n" in text
    sglang_wheel.rewrite(sp / rel, text.replace(line + "\n", "", 1))


# ---------------------------------------------------------------- what 0.5.23 has, and what it lacks

def test_the_lock_names_this_series_for_its_sglang():
    lk = lockmod.load(LOCK)
    assert lk.patches == [f"patches/sglang-{VERSION}"]
    assert lk.resolve_path(lk.patches[0]) == SERIES_DIR
    assert lk.package("sglang").version == VERSION
    assert patches.load_series(SERIES_DIR).specifier.contains(VERSION)


def test_the_lock_is_whole_and_checks_clean():
    """Every package hashed, nothing unresolved, and every Requires-Dist met (METADATA from PyPI, cached)."""
    lk = lockmod.load(LOCK)
    assert lk.unresolved == [] and all(p.sha256 and p.url for p in lk.packages)
    assert lk.package("torch").version == "2.14.1" and lk.package("sglang-kernel").version == "0.4.10"
    assert "nvidia-cutlass-dsl-libs-cu12" not in {p.name for p in lk.packages}       # the override's doing
    report = lockcheck.check(lk)
    assert (report.errors, report.warnings) == ([], [])


def test_kimi_k25_contract_passes_with_methods_derived_from_0523s_worker(pristine):
    r = check_contract(str(pristine), "KimiK25ForConditionalGeneration")
    assert r["ok"] and r["required_source"] == "derived" and r["package"]["version"] == VERSION
    rows = {m["method"]: m for m in r["methods"]}
    assert sorted(rows) == ["get_embed_and_head", "set_eagle3_layers_to_capture"]
    assert all(m["status"] == "defined" and m["at"].startswith(KIMI) for m in rows.values())
    assert any(c.startswith("sglang/srt/speculative/pp_draft_embedding.py:")
               for c in rows["get_embed_and_head"]["called_at"])
    assert any(c.startswith("sglang/srt/model_executor/model_runner_components/attention_backend_setup.py:")
               for c in rows["set_eagle3_layers_to_capture"]["called_at"])


def test_the_0_5_9_series_does_not_fit_0523(pristine):
    """Why a new series: the old one's hunks no longer find their code (and its gate refuses the release)."""
    old = patches.load_series(PATCHES / "sglang-0.5.9")
    loose = dataclasses.replace(old, specifier=SpecifierSet(">=0"),
                                patches=[dataclasses.replace(p, applies_to=None) for p in old.patches])
    report = run([loose], pristine, check_only=True)
    assert set(statuses(report).values()) == {"failed"}


def test_sm120_still_absent_upstream(pristine):
    """The two fixes still needed: capability 12 has no size entry and fusion admits SM90/SM100 only."""
    sizes = (pristine / PATCHED[0]).read_text()
    assert "    10: {" in sizes and "    12: {" not in sizes
    assert "if handle.multicast_ptr == 0:" in (pristine / SYMM).read_text()
    assert "is_sm120" not in (pristine / PATCHED[2]).read_text()
    assert "is_sm120" not in (pristine / PATCHED[3]).read_text()


# ---------------------------------------------------------------- the series on the real wheel

def test_check_apply_reapply_revert(series, sp, pristine):
    before = digest(sp)
    check = run([series], sp, check_only=True)
    assert statuses(check) == {"0001-torch-symm-mem-sm120.patch": "would-apply",
                               "0002-flashinfer-allreduce-fusion-sm120.patch": "would-apply",
                               "0003-kimi-k25-eagle3-delegation": "upstream",
                               "0001-torch-symm-mem-unknown-capability": "upstream"}
    assert check["ok"] and digest(sp) == before

    applied = run([series], sp)
    assert [s for s in statuses(applied).values()] == ["applied", "applied", "upstream", "upstream"]
    assert applied["changed"] == PATCHED
    assert set(applied["files"]) == {*PATCHED, KIMI}               # what the series vouches for is hashed too
    for rel in PATCHED:
        ast.parse((sp / rel).read_text(), rel)                     # still Python
    assert "_is_sm90_supported or _is_sm100_supported or _is_sm120_supported" in (sp / PATCHED[3]).read_text()
    assert "get_platform().is_sm120" in (sp / PATCHED[2]).read_text()
    assert "    12: {" in (sp / PATCHED[0]).read_text()

    again = run([series], sp)
    assert list(statuses(again).values()) == ["already-applied", "already-applied", "upstream", "upstream"]
    assert not again["written"]

    reverted = run([series], sp, revert=True)
    assert list(statuses(reverted).values()) == ["reverted", "reverted"]
    assert digest(sp) == before


def test_an_upstream_fix_that_is_not_there_fails_check_and_apply(series, sp):
    without_line(sp, KIMI, "        return self.language_model.get_embed_and_head()")
    before = digest(sp)
    check = run([series], sp, check_only=True)
    row = next(p for s in check["series"] for p in s["patches"] if p["name"] == "0003-kimi-k25-eagle3-delegation")
    assert not check["ok"] and row["status"] == "failed"
    assert KIMI in row["reason"] and "needs the patch after all" in row["reason"]
    with pytest.raises(PatchError, match="upstream 0003-kimi-k25-eagle3-delegation: .*needs the patch after all"):
        run([series], sp)
    assert digest(sp) == before                                    # the two patches were not written either


def test_contract_evidence_fails_when_the_method_is_gone(series, sp):
    """The contract, not the lines: a series that rests on Kimi's EAGLE-3 contract alone."""
    only = dataclasses.replace(series, patches=[], upstream=[dataclasses.replace(series.upstream[0], evidence={})])
    assert run([only], sp, check_only=True)["ok"]
    text = (sp / KIMI).read_text()
    sglang_wheel.rewrite(sp / KIMI, text.replace("    def set_eagle3_layers_to_capture(",
                                                 "    def set_eagle3_layers_to_capture_renamed(", 1))
    check = run([only], sp, check_only=True)
    [row] = [p for s in check["series"] for p in s["patches"]]
    assert row["status"] == "failed" and "EAGLE-3 contract of KimiK25ForConditionalGeneration fails" in row["reason"]
    assert "missing set_eagle3_layers_to_capture" in row["reason"]


def test_default_series_is_the_one_for_the_installed_release(sp):
    r = CliRunner().invoke(app, ["patches", "check", "--site-packages", str(sp), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert [s["name"] for s in report["series"]] == [f"sglang-{VERSION}"]
    r = CliRunner().invoke(app, ["patches", "check", "--site-packages", str(sp)])
    assert "Patches: 2 would-apply, 2 upstream (nothing written)" in r.stdout


# ---------------------------------------------------------------- the upstream section is read strictly

@pytest.mark.parametrize("entry, message", [
    ("  - name: x\n    description: d\n    reason: r\n    evidence: []\n", "`evidence` must be a non-empty list"),
    ("  - name: x\n    description: d\n    reason: r\n    evidence:\n      - file: ../etc/passwd\n"
     "        lines: [a]\n", "'..' component"),
    ("  - name: x\n    description: d\n    reason: r\n    evidence:\n      - file: sglang/a.py\n"
     "        lines: []\n", "`lines` must be a non-empty list"),
    ("  - name: x\n    description: d\n    reason: r\n    evidence:\n      - contract: 'not a class'\n",
     "`contract` names one architecture"),
    ("  - name: x\n    description: d\n    reason: r\n    evidence:\n      - contract: A\n        lines: [a]\n",
     "`contract` names one architecture"),
    ("  - name: x\n    description: d\n    reason: r\n    proof: yes\n", "unknown field 'proof'"),
    ("  - name: one.patch\n    description: d\n    reason: r\n    evidence:\n      - contract: A\n",
     "unique plain name"),
])
def test_upstream_entries_are_checked_at_their_line(tmp_path, entry, message):
    d = tmp_path / "s"
    d.mkdir()
    (d / "one.patch").write_text((SERIES_DIR / "0001-torch-symm-mem-sm120.patch").read_text())
    (d / "series.yaml").write_text("series: 1\npackage: sglang\nversion: '==0.5.23'\npatches:\n"
                                   "  - file: one.patch\n    description: d\n    reason: r\nupstream:\n" + entry)
    with pytest.raises(SeriesError, match=message) as e:
        patches.load_series(d)
    path, _, line = e.value.where.rpartition(":")
    assert path == str(d / "series.yaml") and int(line) >= 9         # in the upstream entry, not the file
