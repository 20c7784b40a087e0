"""EAGLE-3 interface contract, read statically from the real SGLang 0.5.9 wheel, before and after the series."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
import sglang_wheel  # noqa: E402

from provision import agent, patches  # noqa: E402
from provision.agent.contracts import check_contract  # noqa: E402
from provision.bundled import PATCHES  # noqa: E402
from provision.cli import app  # noqa: E402
from provision.transport import Local  # noqa: E402

KIMI, DSV3, LLAMA = "KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM", "LlamaForCausalLM"
REQUIRED = ["get_embed_and_head", "set_eagle3_layers_to_capture"]


@pytest.fixture(scope="module")
def pristine() -> Path:
    return sglang_wheel.site_packages("0.5.9")


@pytest.fixture(scope="module")
def patched(pristine, tmp_path_factory) -> Path:
    sp = sglang_wheel.copy(pristine, tmp_path_factory.mktemp("contract") / "site-packages")
    series = patches.load_series(PATCHES / "sglang-0.5.9")
    patches.apply_series(Local(), [series], python=sys.executable, site_packages=str(sp))
    return sp


def by_method(report):
    return {m["method"]: m for m in report["methods"]}


def test_required_methods_are_derived_from_the_installed_worker(pristine):
    r = check_contract(str(pristine), LLAMA)
    assert r["required_source"] == "derived"
    m = by_method(r)
    assert sorted(m) == REQUIRED
    assert "sglang/srt/speculative/eagle_worker.py:157" in m["get_embed_and_head"]["called_at"]
    assert any(c.startswith("sglang/srt/model_executor/model_runner.py:")
               for c in m["set_eagle3_layers_to_capture"]["called_at"])


def test_pristine_kimi_k25_missing_but_reachable_via_language_model(pristine):
    r = check_contract(str(pristine), KIMI)
    assert r["found"] and not r["ok"]
    assert r["module"] == "sglang.srt.models.kimi_k25" and r["package"]["version"] == "0.5.9"
    assert r["mro"] == ["sglang.srt.models.kimi_k25.KimiK25ForConditionalGeneration", "torch.nn.Module"]
    for name in REQUIRED:
        row = by_method(r)[name]
        assert row["status"] == "missing"
        assert row["via"]["member"] == "language_model"
        assert row["via"]["class"] == DSV3
        assert (row["via"]["status"], row["via"]["from"]) == ("inherited", "DeepseekV2ForCausalLM")


def test_pristine_deepseek_v3_inherits_and_llama_defines(pristine):
    ds = check_contract(str(pristine), DSV3)
    assert ds["ok"] and ds["module"] == "sglang.srt.models.deepseek_v2"
    assert ds["mro"][:2] == ["sglang.srt.models.deepseek_v2.DeepseekV3ForCausalLM",
                             "sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM"]
    assert {(m["status"], m["from"]) for m in ds["methods"]} == {("inherited", "DeepseekV2ForCausalLM")}
    llama = check_contract(str(pristine), LLAMA)
    assert llama["ok"] and {m["status"] for m in llama["methods"]} == {"defined"}


def test_after_the_series_kimi_k25_passes(patched):
    r = check_contract(str(patched), KIMI)
    assert r["ok"]
    assert {(m["status"], m["from"]) for m in r["methods"]} == {("defined", KIMI)}
    assert check_contract(str(patched), DSV3)["ok"] and check_contract(str(patched), LLAMA)["ok"]


def test_config_json_unknown_arch_and_fallback(pristine, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": [KIMI], "model_type": "kimi_k25"}))
    assert check_contract(str(pristine), str(cfg))["arch"] == KIMI

    unknown = check_contract(str(pristine), "NoSuchModelForCausalLM")
    assert not unknown["found"] and not unknown["ok"] and "NoSuchModelForCausalLM" in unknown["reason"]

    # an SGLang whose worker layout cannot be scanned falls back to the known list
    bare = sglang_wheel.copy(pristine, tmp_path / "bare")
    for f in (bare / "sglang/srt/speculative").glob("eagle_worker*.py"):
        f.unlink()
    (bare / "sglang/srt/model_executor/model_runner.py").unlink()
    r = check_contract(str(bare), LLAMA)
    assert r["required_source"] == "fallback" and sorted(by_method(r)) == REQUIRED and r["ok"]


def test_runs_as_a_host_agent_without_sglang_importable(pristine):
    """Through a transport, shipped on stdin, with an isolated interpreter (no torch, no sglang)."""
    via_transport = patches.check_contract(Local(), KIMI, sys.executable, site_packages=str(pristine))
    assert via_transport["methods"] == check_contract(str(pristine), KIMI)["methods"]
    out = subprocess.run(agent.command(sys.executable), capture_output=True, text=True, check=True,
                         input=agent.message("contracts", {"op": "check", "architecture": DSV3,
                                                           "site_packages": str(pristine)}).decode())
    assert json.loads(out.stdout.strip().splitlines()[-1])["ok"] is True


def test_cli_contract_before_and_after(pristine, patched):
    cli = CliRunner()
    r = cli.invoke(app, ["contract", KIMI, "--site-packages", str(pristine)])
    assert r.exit_code == 1, r.output
    assert "MISSING; reachable via self.language_model (DeepseekV3ForCausalLM, inherited from " \
           "DeepseekV2ForCausalLM)" in r.stdout
    assert "EAGLE-3 contract: FAIL (0 of 2 methods present)" in r.stdout
    r = cli.invoke(app, ["contract", KIMI, "--site-packages", str(patched), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["ok"] is True
