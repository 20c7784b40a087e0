"""gc tells the truth: the bytes it reports (and records in history) are the bytes the filesystem got back, with
shared inodes counted once; a generation is set aside whole before its files go."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from provision import apply as applymod, lock as lockmod
from provision import generations
from provision.transport import Local, Target
from wheelhouse import make_wheel, write_lock

ROOT = Path(__file__).resolve().parent.parent


def du(root: Path) -> int:
    """Bytes on disk under `root`, each inode once (du's own count), leaving out history.jsonl (gc appends)."""
    out = subprocess.run(["du", "-s", "--block-size=1", "--exclude=history.jsonl", str(root)], capture_output=True,
                         text=True, check=True).stdout
    return int(out.split()[0])


def gc_cli(root: Path, *args) -> dict:
    p = subprocess.run([sys.executable, "-m", "provision.cli", "gc", "--local", "--root", str(root), *args, "--json"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0 and "Traceback" not in p.stderr, (p.stdout, p.stderr)
    return json.loads(p.stdout)


def blob(path: Path, n: int) -> Path:
    path.write_bytes(os.urandom(n))
    return path


def three_generations(tmp_path, wheels):
    root = tmp_path / "root"
    tr = Local(Target(host="local", root=str(root)))
    only_a = make_wheel(tmp_path / "wh", "onlya", "1.0")
    locks = [lockmod.load(write_lock(tmp_path / f"{n}.yaml", n, ws)) for n, ws in
             (("a", [wheels["alpha-1.0"], only_a]), ("b", [wheels["alpha-2.0"]]), ("c", [wheels["beta-1.0"]]))]
    return root, tr, [applymod.apply(tr, lk).generation for lk in locks]


def test_gc_counts_shared_inodes_once_and_only_what_is_freed(tmp_path, wheels):
    """Generation a (the one gc removes) holds a file of its own, a file with two names inside it, and a file
    hard-linked into the kept generation c: the first two are freed (the second once), the third stays. The
    figure gc prints equals du's before/after difference, a dry run names the same figure, history records it."""
    root, tr, (a, b, c) = three_generations(tmp_path, wheels)
    ga, gc_ = root / "generations" / a, root / "generations" / c
    blob(ga / "own.bin", 3 << 20)
    os.link(blob(ga / "twice.bin", 2 << 20), ga / "twice-again.bin")
    os.link(blob(ga / "shared.bin", 5 << 20), gc_ / "shared-with-a.bin")

    dry = gc_cli(root, "--keep", "1", "--dry-run")
    assert [g["id"] for g in dry["generations"]] == [a]
    assert (dry["current"], dry["rollback_target"]) == (c, b)
    assert dry["generations"][0]["shared_bytes"] >= 5 << 20           # the linked file stays
    before = du(root)
    out = gc_cli(root, "--keep", "1")
    freed = before - du(root)
    assert out["bytes"] == freed == dry["bytes"], (out["bytes"], freed, dry["bytes"])
    assert out["shared_bytes"] == dry["shared_bytes"] and out["generations"][0]["removed"] is True
    assert (gc_ / "shared-with-a.bin").stat().st_nlink == 1 and not ga.exists()
    assert not (root / ".trash").exists()                             # nothing left set aside
    ev = [e for e in generations.history(tr).events if e["event"] == "gc"][-1]
    assert (ev["removed"], ev["bytes"], ev["shared_bytes"]) == ([a], out["bytes"], out["shared_bytes"])
    text = subprocess.run([sys.executable, "-m", "provision.cli", "gc", "--local", "--root", str(root), "--dry-run"],
                          capture_output=True, text=True, cwd=ROOT).stdout
    assert f"rollback target {b}" in text and "would free" in text


def test_gc_sets_a_generation_aside_whole_and_the_next_run_finishes_it(tmp_path, wheels):
    """gc renames a generation out of generations/ before deleting a file of it: a gc cut off after that rename
    leaves no generation half there (history lists it no more) and the next run's recovery deletes what was set
    aside: what it freed and what that gc then freed add up to du's difference."""
    from provision.agent import state
    from provision.layout import Layout

    root, tr, (a, b, c) = three_generations(tmp_path, wheels)
    blob(root / "generations" / a / "own.bin", 1 << 20)
    item = ("generations", {"id": a}, str(root / "generations" / a), "gen-" + a)
    trash, paths = state.set_aside(Layout(str(root)), [item], [])           # the rename, then the run is cut off
    before = du(root)
    assert Path(paths[0]).parent == Path(trash) and not (root / "generations" / a).exists()
    assert a not in [g.id for g in generations.history(tr).generations]
    out = gc_cli(root, "--keep", "3")
    assert out["generations"] == [] and out["recovered"]["trash_bytes"] > 0
    assert out["cache"]                                               # a's wheels: no kept generation names them
    assert out["recovered"]["trash_bytes"] + out["bytes"] == before - du(root)
    assert not (root / ".trash").exists()


def test_gc_keep_beyond_the_ready_count_removes_no_ready_generation(tmp_path, wheels):
    """`--keep N` keeps the newest N runnable generations: with N at or above how many there are, none goes.
    Seven ready generations, `--keep 8` and `--keep 10` remove nothing; `--keep 7` nothing either; `--keep 3`
    removes the four oldest beyond current, its rollback target and the newest other one."""
    root = tmp_path / "root"
    tr = Local(Target(host="local", root=str(root)))
    ids = [applymod.apply(tr, lockmod.load(write_lock(tmp_path / f"l{i}.yaml", f"l{i}",
                                                      [make_wheel(tmp_path / "wh", f"pkg{i}", "1.0")]))).generation
           for i in range(7)]
    for n in ("10", "8", "7"):
        dry = gc_cli(root, "--keep", n, "--dry-run")
        assert dry["generations"] == [], (n, [g["id"] for g in dry["generations"]])
    out = gc_cli(root, "--keep", "10")
    assert out["generations"] == [] and all((root / "generations" / g).is_dir() for g in ids)
    out = gc_cli(root, "--keep", "3")
    assert sorted(g["id"] for g in out["generations"]) == ids[:4]
    assert all((root / "generations" / g).is_dir() for g in ids[4:])
