"""apply's patch hook on the real SGLang 0.5.9 wheel: patched inside the new generation before switch,
sha256 of each patched file recorded; a series that does not apply leaves `current` untouched."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from provision import apply as applymod
from provision import generations, lock as lockmod
from provision.bundled import PATCHES
from provision.errors import PatchError
from provision.transport import connect
from sglang_wheel import wheel
from wheelhouse import write_lock



def sglang_lock(tmp_path, name, patches):
    path = write_lock(tmp_path / f"{name}.yaml", name, [wheel("0.5.9")], patches=patches,
                      engine={"kind": "none", "architecture": "KimiK25ForConditionalGeneration"})
    return lockmod.load(path)


def test_patches_applied_in_new_generation_and_recorded(target, tmp_path):
    lk = sglang_lock(tmp_path, "sgl", ["patches/sglang-0.5.9"])      # the series shipped with provision
    tr = connect(target)
    try:
        rep = applymod.apply(tr, lk)
        man = generations.read(tr, rep.generation)["manifest"]
    finally:
        tr.close()
    assert rep.status == "applied"
    statuses = [p["status"] for s in rep.patches["series"] for p in s["patches"]]
    assert statuses == ["applied", "applied", "applied"]
    site = next((Path(target.root) / "generations" / rep.generation / "venv" / "lib").glob(
        "python3*/site-packages"))
    kimi = site / "sglang" / "srt" / "models" / "kimi_k25.py"
    assert "def get_embed_and_head" in kimi.read_text()
    recorded = man["patches"]["files"]
    assert recorded and all(hashlib.sha256((site / f).read_bytes()).hexdigest() == h for f, h in recorded.items())
    probes = {r["name"]: r for r in rep.probes["results"]}
    assert probes["patches"]["status"] == "pass"     # checked in the new generation, before the switch
    assert probes["contract"]["status"] == "pass"


def test_unpatched_kimi_k25_refused_by_contract_probe(target, tmp_path, wheels):
    """The founding case: EAGLE-3 on Kimi K2.5 with pristine SGLang 0.5.9 would fail at start-up;
    the contract probe catches it inside the new generation and `current` is never switched."""
    good = lockmod.load(write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]]))
    lk = sglang_lock(tmp_path, "sgl-unpatched", [])
    tr = connect(target)
    try:
        applymod.apply(tr, good)
        with pytest.raises(applymod.ProbesFailed, match="contract"):
            applymod.apply(tr, lk)
        h = generations.history(tr)
    finally:
        tr.close()
    assert h.current == "0001-stack-a"
    assert h.generations[-1].status == "failed"


def test_series_that_does_not_apply_refused_current_untouched(target, tmp_path, wheels):
    bad = tmp_path / "bad-series"
    bad.mkdir()
    src = PATCHES / "sglang-0.5.9"
    for f in src.iterdir():
        (bad / f.name).write_text(f.read_text())
    victim = sorted(bad.glob("*.patch"))[-1]
    text = victim.read_text().replace("self.language_model.load_weights(language_weights)",
                                      "self.language_model.load_weights(other_weights)", 1)
    assert text != victim.read_text()
    victim.write_text(text)
    good = lockmod.load(write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]]))
    lk = sglang_lock(tmp_path, "sgl", [str(bad.relative_to(tmp_path))])
    tr = connect(target)
    try:
        applymod.apply(tr, good)
        with pytest.raises(PatchError, match=victim.name.split(".")[0]):
            applymod.apply(tr, lk)
        h = generations.history(tr)
    finally:
        tr.close()
    assert h.current == "0001-stack-a"
    assert os.readlink(Path(target.root) / "current") == "generations/0001-stack-a"
    assert h.generations[-1].status == "failed"
