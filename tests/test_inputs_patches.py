"""Patch series stay inside their package on the host: files the package's RECORD lists, no symlinked
component, no context-free hunk on a non-empty file. Each attack is refused and nothing is written."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from provision import patches
from provision.errors import PatchError
from provision.transport import Local


def install(sp: Path, name: str, files: dict[str, str], extra_record: tuple = ()) -> None:
    """A distribution in `sp`: its files, METADATA and a RECORD listing them (plus `extra_record`)."""
    for rel, text in files.items():
        (sp / rel).parent.mkdir(parents=True, exist_ok=True)
        (sp / rel).write_text(text)
    info = sp / f"{name}-1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "RECORD").write_text("".join(f"{p},,\n" for p in [*files, *extra_record, f"{info.name}/RECORD"]))


def series(tmp_path: Path, diff: str, package: str = "alpha") -> patches.Series:
    d = tmp_path / "series"
    d.mkdir(exist_ok=True)
    (d / "series.yaml").write_text(f"series: 1\npackage: {package}\nversion: '==1.0'\npatches:\n"
                                   "  - file: 0001.patch\n    description: the attack\n    reason: the test needs it\n")
    (d / "0001.patch").write_text(diff)
    return patches.load_series(d)


def diff_of(path: str, hunk: str) -> str:
    return f"--- a/{path}\n+++ b/{path}\n{hunk}"


@pytest.fixture
def env(tmp_path):
    sp = tmp_path / "sp"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "target.py").write_text("x = 1\n")
    install(sp, "alpha", {"alpha/__init__.py": "x = 1\n", "alpha/empty.py": ""},
            extra_record=("alpha/linked/target.py", "alpha/evil.py"))
    install(sp, "beta", {"beta/__init__.py": "x = 1\n"})
    os.symlink(outside, sp / "alpha" / "linked")                       # a symlinked directory inside the package
    os.symlink(outside / "target.py", sp / "alpha" / "evil.py")          # a symlinked file
    return sp, outside


def snapshot(*dirs: Path) -> dict:
    return {str(p): p.read_bytes() for d in dirs for p in sorted(d.rglob("*")) if p.is_file() and not p.is_symlink()}


ATTACKS = [
    ("other-package", "beta/__init__.py", "@@ -1 +1,2 @@\n x = 1\n+import os\n", "RECORD does not list it"),
    ("symlinked-dir", "alpha/linked/target.py", "@@ -1 +1,2 @@\n x = 1\n+import os\n", "is a symbolic link"),
    ("symlinked-file", "alpha/evil.py", "@@ -1 +1,2 @@\n x = 1\n+import os\n", "is a symbolic link"),
    ("zero-context-insert", "alpha/__init__.py", "@@ -0,0 +1 @@\n+import os\n", "has no context lines"),
    ("zero-context-replace", "alpha/__init__.py", "@@ -1 +1 @@\n-x = 1\n+x = 2\n", "has no context lines"),
    ("not-in-record", "alpha/new.py", "@@ -0,0 +1 @@\n+import os\n", "RECORD does not list it"),
]


@pytest.mark.parametrize("case", ATTACKS, ids=[a[0] for a in ATTACKS])
def test_attack_refused_nothing_written(env, tmp_path, case):
    sp, outside = env
    _, path, hunk, expect = case
    s = series(tmp_path, diff_of(path, hunk))
    before = snapshot(sp, outside)
    with pytest.raises(PatchError, match=expect):
        patches.apply_series(Local(), [s], python=sys.executable, site_packages=str(sp))
    rep = patches.apply_series(Local(), [s], python=sys.executable, site_packages=str(sp), check_only=True)
    [row] = rep["series"][0]["patches"]
    assert row["status"] == "failed" and expect in row["reason"] and not rep["ok"]
    assert snapshot(sp, outside) == before


def test_zero_context_hunk_allowed_on_an_empty_file(env, tmp_path):
    sp, _ = env
    s = series(tmp_path, diff_of("alpha/empty.py", "@@ -0,0 +1 @@\n+x = 1\n"))
    rep = patches.apply_series(Local(), [s], python=sys.executable, site_packages=str(sp))
    assert rep["series"][0]["patches"][0]["status"] == "applied"
    assert rep["series"][0]["patches"][0]["files"] == ["alpha/empty.py"]
    assert (sp / "alpha" / "empty.py").read_text() == "x = 1\n"
