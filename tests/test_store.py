"""The host's file store: generations link one immutable inode per content, so a cached build costs links, not
copies; nothing written through one generation reaches another; root's deliberate write is what `verify` names;
rollback to a generation sharing files stays clean and hashes nothing; gc removes what no kept generation links
and says what it does while it does it; the plan's disk estimate is what the build then uses. Real uv, real
wheels (the SGLang 0.5.9 wheel among them), `--local` roots on this machine's ext4, as root."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from provision import apply as applymod, generations, lock as lockmod
from provision.agent import store
from provision.plan import plan_host, render_plan
from provision.transport import Local, Target
from sglang_wheel import wheel as sglang_wheel
from wheelhouse import make_wheel, write_lock

ROOT = Path(__file__).resolve().parent.parent


def du(root: Path) -> int:
    """Bytes on disk under `root`, each inode once (du's own count), history.jsonl left out."""
    out = subprocess.run(["du", "-s", "--block-size=1", "--exclude=history.jsonl", str(root)], capture_output=True,
                         text=True, check=True).stdout
    return int(out.split()[0])


def local(root: Path) -> Local:
    return Local(Target(host="local", root=str(root)))


def site(root: Path, gen: str) -> Path:
    return next((root / "generations" / gen / "venv" / "lib").glob("python3*/site-packages"))


def cli(root: Path, *args, prefix=()):
    p = subprocess.run([*prefix, sys.executable, "-m", "provision.cli", args[0], "--local", "--root", str(root),
                        *args[1:]], capture_output=True, text=True, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    assert "Traceback" not in p.stderr, p.stderr
    return p


def test_plan_shows_linked_copied_own_and_its_disk_estimate_is_what_the_build_uses(tmp_path, wheels):
    """Two builds of the real SGLang wheel: the first enters its files into the store, the second links them.
    Each plan says what is linked, copied and the generation's own, with sizes; its disk estimate is within 10 %
    of du's difference of the root around the apply (the wheels' download, uv's unpacked copy, the store, the
    generation's directories, own files and stamp)."""
    sg = sglang_wheel()
    root = tmp_path / "root"
    tr = local(root)
    locks = [lockmod.load(write_lock(tmp_path / "a.yaml", "a", [sg, wheels["alpha-1.0"]])),
             lockmod.load(write_lock(tmp_path / "b.yaml", "b", [sg, wheels["beta-1.0"]]))]
    try:
        for n, lk in enumerate(locks):
            plan = plan_host(tr, lk)
            dl = plan.download
            text = render_plan(plan)
            assert dl["isolation"] == "store" and "linked from the store" in text and "copied into it" in text
            assert "compiled: none at build" in text and "isolation store" in text, text
            before = du(root) if root.exists() else 0
            rep = applymod.apply(tr, lk)
            used = du(root) - before
            assert rep.status == "applied" and rep.build["isolation"] == "store"
            assert abs(dl["disk_needed"] - used) <= 0.10 * used, (n, dl, used)
            if n == 0:      # SGLang's 1,900 files go into the store once
                assert dl["entered"]["files"] > 1800 and rep.build["store"]["entered"] > 1800
            else:           # and are linked from there: the build costs directories, own files, the stamp
                assert dl["linked"]["files"] > 1900 and dl["entered"]["files"] < 5, dl
                assert rep.build["store"]["linked"] > 1900 and rep.build["store"]["entered"] < 5
                assert used < 0.15 * dl["installed"], (used, dl["installed"])
    finally:
        tr.close()


def test_rollback_to_a_generation_sharing_files_is_clean_and_hashes_nothing(tmp_path, wheels):
    """b links the same store entries as a (each link changes the shared inodes' ctime): rollback's quick check
    of a still says clean, hashing no file, and the switch needs no --force; the seal hashed only what was new."""
    root = tmp_path / "root"
    tr = local(root)
    la = lockmod.load(write_lock(tmp_path / "a.yaml", "a", [wheels["alpha-1.0"], wheels["beta-1.0"]]))
    lb = lockmod.load(write_lock(tmp_path / "b.yaml", "b", [wheels["alpha-2.0"], wheels["beta-1.0"]]))
    try:
        ra, rb = applymod.apply(tr, la), applymod.apply(tr, lb)
    finally:
        tr.close()
    shared = site(root, ra.generation) / "beta" / "__init__.py"
    assert shared.stat().st_ino == (site(root, rb.generation) / "beta" / "__init__.py").stat().st_ino
    assert store.immutable(shared) and rb.build["store"]["linked"] > rb.build["store"]["entered"]
    stamp = json.loads((root / "generations" / rb.generation / "stamp.json").read_text())["files"]
    assert sum(1 for w in stamp.values() if w[5]) == rb.build["store"]["linked"]      # store links marked
    p = cli(root, "rollback", "--to", ra.generation.split("-")[0], "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout)
    assert out["to"] == ra.generation and out["check"]["verdict"] == "clean" and out["check"]["hashed"] == 0, out
    assert out["check"]["seconds"] < 5


def test_roots_deliberate_write_is_what_verify_names_in_every_generation_linking_it(tmp_path, wheels):
    """Root can clear the attribute and write: the bytes change in every generation linking that entry (as in a
    Nix store), `verify` names the file in each, rollback refuses them, and the next build does not link the
    written entry (hashed again, set aside) but enters the right bytes anew."""
    root = tmp_path / "root"
    tr = local(root)
    la = lockmod.load(write_lock(tmp_path / "a.yaml", "a", [wheels["beta-1.0"]]))
    lb = lockmod.load(write_lock(tmp_path / "b.yaml", "b", [wheels["beta-1.0"], wheels["gamma-1.0"]]))
    lc = lockmod.load(write_lock(tmp_path / "c.yaml", "c", [wheels["beta-1.0"], wheels["alpha-2.0"]]))
    try:
        ra, rb = applymod.apply(tr, la), applymod.apply(tr, lb)
        victim = site(root, ra.generation) / "beta" / "__init__.py"
        with pytest.raises(PermissionError):
            open(victim, "a").write("X = 1\n")
        with open(victim, "rb") as f:
            store.set_immutable(f.fileno(), False)          # root, deliberately
        with open(victim, "a") as f:
            f.write("X = 1\n")
        assert "X = 1" in (site(root, rb.generation) / "beta" / "__init__.py").read_text()   # the same inode
        rc = applymod.apply(tr, lc)
    finally:
        tr.close()
    for gen in (ra.generation, rb.generation):
        p = cli(root, "verify", gen)
        assert p.returncode == 1 and "beta 1.0: 1 changed (beta/__init__.py)" in p.stdout, p.stdout
    p = cli(root, "rollback", "--to", ra.generation.split("-")[0])
    assert p.returncode == 1 and "beta/__init__.py changed" in p.stderr, p.stderr
    assert rc.build["store"]["evicted"] == 1 and rc.verify["verdict"] == "clean"
    fresh = site(root, rc.generation) / "beta" / "__init__.py"
    assert "X = 1" not in fresh.read_text() and store.immutable(fresh)
    assert fresh.stat().st_ino != victim.stat().st_ino


def test_gc_removes_what_no_kept_generation_links_counts_it_truly_and_is_never_silent(tmp_path, wheels):
    """gc of a (kept: c, and b as rollback target) removes a's links and the store entries only a linked (alpha
    1.0's), keeps those b and c link; the bytes it reports are du's difference; it sends progress events, the
    first at once and none more than 5 s after the one before."""
    root = tmp_path / "root"
    tr = local(root)
    only_a = make_wheel(tmp_path / "wh", "onlya", "1.0", body="ONLY_A = 'a' * 5000\n")
    locks = [lockmod.load(write_lock(tmp_path / f"{n}.yaml", n, ws)) for n, ws in
             (("a", [only_a, wheels["beta-1.0"]]), ("b", [wheels["alpha-2.0"], wheels["beta-1.0"]]),
              ("c", [wheels["beta-1.0"]]))]
    try:
        a, b, c = [applymod.apply(tr, lk).generation for lk in locks]
        files = root / "store" / "files"
        only = site(root, a) / "onlya" / "__init__.py"
        only_entry = next(Path(p) for p, st in store.entries(str(files)) if st.st_ino == only.stat().st_ino)
        shared = site(root, c) / "beta" / "__init__.py"
        dry = generations.gc(tr, keep=1, dry_run=True)
        before = du(root)
        events, stamps = [], []

        def on_event(ev):
            events.append(ev)
            stamps.append(time.monotonic())
        t0 = time.monotonic()
        out = tr.run_agent("state", {"op": "gc", "root": str(root), "keep": 1, "take_lock": True},
                           on_event=on_event)
        t1 = time.monotonic()
    finally:
        tr.close()
    freed = before - du(root)
    assert [g["id"] for g in out["generations"]] == [a] and out["generations"][0]["removed"]
    assert out["bytes"] == freed == dry.bytes, (out["bytes"], freed, dry.bytes)
    assert out["store"]["entries"] >= 1 and dry.store.entries == out["store"]["entries"]
    assert not only_entry.exists() and shared.exists() and store.immutable(shared)
    assert shared.stat().st_nlink == 3            # the store, b, c
    gc_events = [e for e in events if e.get("step") == "gc"]
    assert [e["phase"] for e in gc_events][:1] == ["survey"] and gc_events[-1]["phase"] == "done", gc_events
    gaps = [y - x for x, y in zip([t0] + stamps, stamps + [t1])]
    assert max(gaps) < 5, gaps
    p = cli(root, "gc", "--keep", "1")                   # the operator sees each phase (stderr)
    assert p.returncode == 0 and "local: gc survey" in p.stderr and "local: gc done" in p.stderr, p.stderr


def test_without_the_attribute_the_build_copies_and_says_so_in_plan_and_build(tmp_path, wheels):
    """Root without CAP_LINUX_IMMUTABLE (setpriv drops it): no store; plan and build say `copy` and why; every
    file is the generation's own (one link) and read-only, and the generation verifies clean."""
    if not shutil.which("setpriv"):
        pytest.skip("setpriv is not installed")
    drop = ["setpriv", "--inh-caps=-linux_immutable", "--bounding-set=-linux_immutable"]
    root = tmp_path / "root"
    lk = write_lock(tmp_path / "a.yaml", "a", [wheels["alpha-1.0"], wheels["beta-1.0"]])
    p = cli(root, "plan", "--lock", str(lk), prefix=drop)
    assert p.returncode in (0, 2) and "isolation copy" in p.stdout and "CAP_LINUX_IMMUTABLE" in p.stdout, p.stdout
    p = cli(root, "apply", "--lock", str(lk), "--json", prefix=drop)
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads(p.stdout)
    build = rep["build"]
    assert build["isolation"] == "copy" and "CAP_LINUX_IMMUTABLE" in build["isolation_why"], build
    assert not (root / "store" / "files").exists() or not any(store.entries(str(root / "store" / "files")))
    gen = (root / "current").resolve()
    for f in (gen / "venv").rglob("*"):
        if f.is_file() and not f.is_symlink():
            assert f.stat().st_nlink == 1 and f.stat().st_mode & 0o222 == 0 and not store.immutable(f), f
    assert cli(root, "verify").returncode == 0


def test_an_entry_left_without_its_attribute_is_hashed_again_and_sealed_by_the_next_build(tmp_path, wheels):
    """A build killed between clearing an entry's attribute and setting it again leaves the entry writable: the
    next build that links it hashes it (its bytes are still its key's), links it and makes it immutable again;
    nothing is evicted."""
    root = tmp_path / "root"
    tr = local(root)
    la = lockmod.load(write_lock(tmp_path / "a.yaml", "a", [wheels["beta-1.0"]]))
    lb = lockmod.load(write_lock(tmp_path / "b.yaml", "b", [wheels["beta-1.0"], wheels["gamma-1.0"]]))
    try:
        ra = applymod.apply(tr, la)
        shared = site(root, ra.generation) / "beta" / "__init__.py"
        with open(shared, "rb") as f:
            store.set_immutable(f.fileno(), False)
        assert not store.immutable(shared)
        rb = applymod.apply(tr, lb)
    finally:
        tr.close()
    assert store.immutable(shared) and rb.build["store"]["evicted"] == 0 and rb.verify["verdict"] == "clean"
    assert (site(root, rb.generation) / "beta" / "__init__.py").stat().st_ino == shared.stat().st_ino
