"""lock check: each consistency rule with a failing and a passing lock (local wheels, no network)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from provision import lock as lockmod
from provision import lockcheck, resolve
from provision.cli import app
from wheelhouse import make_wheel, sha256


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(resolve, "CACHE", tmp_path / "cache")


def build(tmp_path: Path, wheels: list[tuple], *, cuda=None, driver=None, requires=None, hashed=True, **top) -> Path:
    """A lock whose packages are real wheels in tmp_path/w: wheels = [(name, version, [Requires-Dist])]."""
    pkgs = []
    for name, version, reqs in wheels:
        w = make_wheel(tmp_path / "w", name, version, reqs)
        p = {"name": name, "version": version, "filename": w.name, "url": w.resolve().as_uri()}
        if hashed:
            p["sha256"] = sha256(w)
        pkgs.append(p)
    platform = {"python": "3.12", "cuda": cuda or {"source": "none"}}
    if driver:
        platform["driver"] = {"min": driver}
    data = {"lock": 1, "name": "t", "platform": platform,
            "requires": requires if requires is not None else [f"{n}=={v}" for n, v, _ in wheels],
            "packages": pkgs, **top}
    path = tmp_path / "l.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run(path: Path) -> lockcheck.Report:
    return lockcheck.check(lockmod.load(path))


def rules(report, level="error") -> list[tuple[str, str]]:
    return [(f.rule, f.package) for f in report.findings if f.level == level]


def test_requires_dist_satisfied_with_markers_and_extras(tmp_path):
    r = run(build(tmp_path, [
        ("app", "1.0", ["lib>=2", 'winonly; sys_platform == "win32"', 'old; python_version < "3.10"',
                        "tool[fast]"]),
        ("lib", "2.1", []),
        ("tool", "1.0", ['speedup; extra == "fast"', 'slowdown; extra == "slow"']),
        ("speedup", "1.0", []),
    ], requires=["app==1.0"]))
    assert r.ok and r.findings == [], r.findings


def test_requires_dist_missing_and_wrong_version(tmp_path):
    r = run(build(tmp_path, [("app", "1.0", ["lib>=2", "gone", "tool[fast]"]), ("lib", "1.0", []),
                             ("tool", "1.0", ['speedup; extra == "fast"'])], requires=["app==1.0"]))
    msgs = {f.requirement: f.message for f in r.errors}
    assert set(msgs) == {"lib>=2", "gone", 'speedup; extra == "fast"'}
    assert "lock has lib 1.0" in msgs["lib>=2"] and all(f.package in ("app", "tool") for f in r.errors)
    assert r.errors[0].where.startswith(str(tmp_path / "l.yaml") + ":")


def test_override_with_reason_covers_a_pin(tmp_path):
    ov = [{"package": "app", "pins": "lib==1.0", "use": "lib==1.1",
           "reason": "lib 1.1 fixes the crash on SM120 that 1.0 has"}]
    failing = run(build(tmp_path, [("app", "1.0", ["lib==1.0"]), ("lib", "1.1", [])], requires=["app==1.0"]))
    assert rules(failing) == [("requires-dist", "app")]
    passing = run(build(tmp_path, [("app", "1.0", ["lib==1.0"]), ("lib", "1.1", [])], requires=["app==1.0"],
                        overrides=ov))
    assert passing.ok and passing.overrides_used == ["app: lib==1.0 → lib==1.1"]
    wrong_use = dict(ov[0], use="lib==1.2")   # an override whose `use` is not what the lock has covers nothing
    r = run(build(tmp_path, [("app", "1.0", ["lib==1.0"]), ("lib", "1.1", [])], requires=["app==1.0"],
                  overrides=[wrong_use]))
    assert rules(r) == [("requires-dist", "app")] and rules(r, "warning") == [("override", "app")]


def test_override_leaves_a_dependency_out_only_under_a_false_marker(tmp_path):
    wheels = [("app", "1.0", ["big>=4"])]
    assert rules(run(build(tmp_path, wheels, requires=["app==1.0"]))) == [("requires-dist", "app")]
    out = {"package": "app", "pins": "big>=4", "use": "big; sys_platform == 'never'",
           "reason": "app's optional kernels from big are not used by this stack"}
    passing = run(build(tmp_path, wheels, requires=["app==1.0"], overrides=[out]))
    assert passing.ok and passing.overrides_used == ["app: big>=4 → big; sys_platform == 'never'"]
    true_marker = dict(out, use="big; sys_platform == 'linux'")   # a marker true for the platform leaves nothing out
    r = run(build(tmp_path, wheels, requires=["app==1.0"], overrides=[true_marker]))
    assert rules(r) == [("requires-dist", "app")] and rules(r, "warning") == [("override", "app")]


def test_top_level_requires_must_be_in_packages(tmp_path):
    r = run(build(tmp_path, [("lib", "1.0", [])], requires=["lib==2.0", "other"]))
    assert sorted(rules(r)) == [("requires", "lib"), ("requires", "other")]


@pytest.mark.parametrize("version,cuda,ok", [("2.9.1+cu130", "13.0.1", True), ("2.9.1+cu128", "13.0.1", False),
                                             ("2.9.1+cu128", "12.8.1", True), ("2.9.1", "13.0.1", True)])
def test_local_cuda_tag_agrees_with_toolkit(tmp_path, version, cuda, ok):
    driver = "580.65.06" if cuda.startswith("13") else "570.124.06"
    r = run(build(tmp_path, [("torch", version, [])], cuda={"version": cuda, "source": "host"}, driver=driver))
    assert r.ok is ok
    if not ok:
        [f] = r.errors
        assert (f.rule, f.package, f.requirement) == ("cuda-tag", "torch", "torch==2.9.1+cu128")
        assert "CUDA 12.8" in f.message and "13.0.1" in f.message


def test_cuda_major_suffix_and_toolkit_wheel(tmp_path):
    r = run(build(tmp_path, [("nvidia-cublas-cu12", "12.8.4.1", []), ("cuda-toolkit", "13.0.0", [])],
                  cuda={"version": "13.0.1", "source": "wheels"}, driver="580.65.06"))
    assert rules(r) == [("cuda-toolkit", "cuda-toolkit")]
    assert rules(r, "warning") == [("cuda-tag", "nvidia-cublas-cu12")]
    r = run(build(tmp_path, [("cuda-toolkit", "13.0.1", [])], cuda={"version": "13.0.1", "source": "wheels"},
                  driver="580.65.06"))
    assert r.ok and not r.findings
    r = run(build(tmp_path, [("cuda-toolkit", "13.0.3.0", [])], cuda={"version": "13.0.3", "source": "wheels"},
                  driver="580.65.06"))        # NVIDIA numbers the 13.0.3 toolkit wheel 13.0.3.0
    assert r.ok and not r.findings


@pytest.mark.parametrize("driver,level", [("570.124.06", "error"), (None, "warning"), ("580.65.06", None),
                                          ("590.44.01", None)])
def test_driver_minimum_for_cuda_13(tmp_path, driver, level):
    path = build(tmp_path, [("lib", "1.0", [])], cuda={"version": "13.0.1", "source": "host"}, driver=driver)
    r = run(path)
    found = [f for f in r.findings if f.rule == "driver"]
    assert [f.level for f in found] == ([level] if level else [])
    if level == "error":
        assert "580.65.06" in found[0].message and found[0].where == f"{path}:{1 + path.read_text().splitlines().index('    min: 570.124.06')}"


def test_flashinfer_versions_agree(tmp_path):
    bad = run(build(tmp_path, [("flashinfer-python", "0.6.4", []), ("flashinfer-cubin", "0.6.3", []),
                               ("flashinfer-jit-cache", "0.6.4+cu130", [])],
                    cuda={"version": "13.0.1", "source": "host"}, driver="580.65.06"))
    assert rules(bad) == [("flashinfer", "flashinfer-cubin")]
    good = run(build(tmp_path, [("flashinfer-python", "0.6.4", []), ("flashinfer-cubin", "0.6.4", []),
                                ("flashinfer-jit-cache", "0.6.4+cu130", [])],
                     cuda={"version": "13.0.1", "source": "host"}, driver="580.65.06"))
    assert good.ok and not good.findings


def test_unhashed_entries_warn_and_exit_zero(tmp_path):
    path = build(tmp_path, [("lib", "1.0", [])], hashed=False)
    r = run(path)
    assert r.ok and rules(r, "warning") == [("hash", "lib")]
    res = CliRunner().invoke(app, ["lock", "check", str(path)])
    assert res.exit_code == 0 and "[hash] lib" in res.output


def test_unresolved_listed_with_reason_and_dependents(tmp_path):
    unresolved = [{"name": "torch", "requirement": "torch==2.9.1+cu130", "reason": "the cu130 index is unreachable"}]
    r = run(build(tmp_path, [("app", "1.0", ["torch==2.9.1"])], requires=["app==1.0", "torch==2.9.1+cu130"],
                  unresolved=unresolved, cuda={"version": "13.0.1", "source": "host"}, driver="580.65.06"))
    assert r.ok
    [f] = r.warnings
    assert (f.rule, f.package, f.requirement) == ("unresolved", "torch", "torch==2.9.1+cu130")
    assert "the cu130 index is unreachable" in f.message and "app (torch==2.9.1)" in f.message
    # a dependent that contradicts the unresolved pin is an error already
    r = run(build(tmp_path, [("app", "1.0", ["torch>=2.10"])], requires=["app==1.0"], unresolved=unresolved,
                  cuda={"version": "13.0.1", "source": "host"}, driver="580.65.06"))
    assert rules(r) == [("requires-dist", "app")] and "pins torch 2.9.1+cu130 (unresolved)" in r.errors[0].message


def test_metadata_unreadable_is_an_error(tmp_path):
    path = build(tmp_path, [("lib", "1.0", [])])
    data = yaml.safe_load(path.read_text())
    data["packages"][0]["url"] = (tmp_path / "gone" / data["packages"][0]["filename"]).as_uri()
    path.write_text(yaml.safe_dump(data))
    r = run(path)
    assert rules(r) == [("metadata", "lib")]


def test_cli_exit_codes(tmp_path):
    bad = build(tmp_path, [("app", "1.0", ["gone"])], requires=["app==1.0"])
    res = CliRunner().invoke(app, ["lock", "check", str(bad)])
    assert res.exit_code == 1 and "requires gone, which is not in the closure" in res.output
    res = CliRunner().invoke(app, ["lock", "check", "--json", str(bad)])
    assert res.exit_code == 1 and '"rule": "requires-dist"' in res.output
    schema = tmp_path / "s.yaml"
    schema.write_text("lock: 1\nname: t\nplatform: {python: 3.12}\npackages: [{name: x}]\n")
    res = CliRunner().invoke(app, ["lock", "check", str(schema)])
    assert res.exit_code == 2


def test_cuda_of_tag():
    assert lockcheck.cuda_of_tag("2.9.1+cu130") == "13.0"
    assert lockcheck.cuda_of_tag("0.3.21+cu128") == "12.8"
    assert lockcheck.cuda_of_tag("1.0+cu118.abc") == "11.8"
    assert lockcheck.cuda_of_tag("2.9.1") is None and lockcheck.cuda_of_tag("2.9.1+cpu") is None
