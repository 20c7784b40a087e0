"""What is on a host is what its lock says: generations link immutable store entries or own their files (a write
through one reaches no other, nor the store, the cache or a later build), `verify` names what drifted, rollback
refuses a drifted target, the host's cache heals a changed entry and loses partial downloads. Real sshd, real uv."""
from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import yaml

from provision import apply as applymod, generations, lock as lockmod
from provision.errors import HostError
from provision.transport import connect
from sglang_wheel import wheel as sglang_wheel
from wheelhouse import make_wheel, write_lock

ROOT = Path(__file__).resolve().parent.parent


def cli(target, *args):
    """`provision VERB HOST ARGS --root R` as an operator runs it (output piped)."""
    t = target
    verb, rest = args[0], args[1:]
    argv = [sys.executable, "-m", "provision", verb, f"{t.user}@{t.host}:{t.port}", *rest, "--key", t.key_file,
            "--known-hosts", str(t.known_hosts), "--root", t.root]
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)


def site(root: Path, gen: str) -> Path:
    return next((root / "generations" / gen / "venv" / "lib").glob("python3*/site-packages"))


def append(path: Path, text: str) -> None:
    """`echo TEXT >> PATH` as root does it: the file's read-only mode does not stop root."""
    if os.geteuid() != 0:
        os.chmod(path, 0o644)
    with open(path, "a") as f:
        f.write(text)


def grep_tree(top: Path, needle: bytes) -> list[Path]:
    return [p for p in top.rglob("*") if p.is_file() and not p.is_symlink() and needle in p.read_bytes()]


def refused(victim: Path) -> None:
    """Every in-place write through a file linked from the host's store is refused (EPERM), root's included:
    `echo >>`, `sed -i`, truncate, open('a'), unlink, a rename over it, chmod."""
    before = victim.read_bytes()
    for argv in (["sh", "-c", 'echo TAMPERED >> "$0"', str(victim)], ["sed", "-i", "s/^/TAMPERED/", str(victim)],
                 ["truncate", "-s", "0", str(victim)]):
        p = subprocess.run(argv, capture_output=True, text=True)
        assert p.returncode != 0 and "not permitted" in p.stderr, (argv, p.stderr)
    other = victim.with_name("x.tmp")
    other.write_text("TAMPERED")
    for write in (lambda: open(victim, "a").write("TAMPERED"), lambda: os.truncate(victim, 0),
                  lambda: os.unlink(victim), lambda: os.replace(other, victim), lambda: os.chmod(victim, 0o644)):
        with pytest.raises(PermissionError):
            write()
    other.unlink()
    assert victim.read_bytes() == before


def test_tamper_reaches_nothing_else_verify_names_it_rollback_refuses(target, tmp_path, wheels):
    """Generation a's files are links to immutable store entries (a write is refused, so it reaches neither b,
    which links the same entry, nor the store, nor a later build) or files of its own (one link: a write lands
    there only, verify names it, rollback refuses a)."""
    from provision.agent import store

    root = Path(target.root)
    la = lockmod.load(write_lock(tmp_path / "a.yaml", "a", [wheels["alpha-1.0"], wheels["beta-1.0"]]))
    lb = lockmod.load(write_lock(tmp_path / "b.yaml", "b", [wheels["alpha-2.0"], wheels["beta-1.0"]]))
    lc = lockmod.load(write_lock(tmp_path / "c.yaml", "c", [wheels["beta-1.0"], wheels["gamma-1.0"]]))
    tr = connect(target)
    try:
        ra, rb = applymod.apply(tr, la), applymod.apply(tr, lb)
        shared = site(root, ra.generation) / "beta" / "__init__.py"
        victim = site(root, ra.generation) / "beta-1.0.dist-info" / "INSTALLER"     # what uv wrote: a's own
        assert ra.build["isolation"] == "store" == rb.build["isolation"]           # root, ext4
        entry = root / "store" / "files" / hashlib.sha256(shared.read_bytes()).hexdigest()[:2] / \
            hashlib.sha256(shared.read_bytes()).hexdigest()
        assert shared.stat().st_ino == entry.stat().st_ino == (site(root, rb.generation) / "beta" / "__init__.py"
                                                                ).stat().st_ino
        for f in (root / "generations" / ra.generation / "venv").rglob("*"):    # a store link, or its own inode
            if f.is_file() and not f.is_symlink():
                assert f.stat().st_mode & 0o222 == 0 and (store.immutable(f) or f.stat().st_nlink == 1), f
        assert ra.build["store"]["linked"] >= 6 and rb.build["store"]["entered"] < ra.build["store"]["entered"]
        man = generations.read(tr, ra.generation)["manifest"]
        assert man["isolation"] == ra.build["isolation"] and man["verify"]["verdict"] == "clean"
        refused(shared)
        append(victim, "TAMPERED=1\n")                  # through the old generation
        assert grep_tree(site(root, rb.generation), b"TAMPERED") == []          # current: untouched
        assert grep_tree(root / "cache", b"TAMPERED") == []                       # uv's cache and the wheels
        assert grep_tree(root / "store", b"TAMPERED") == []                       # the store
        rc = applymod.apply(tr, lc)                                             # a later build of the same wheel
        assert grep_tree(site(root, rc.generation), b"TAMPERED") == []
        assert rc.verify["verdict"] == "clean"
    finally:
        tr.close()

    p = cli(target, "verify", ra.generation, "--baseline")
    assert p.returncode == 1, p.stderr
    assert "beta 1.0: 1 changed (beta-1.0.dist-info/INSTALLER)" in p.stdout and "drift" in p.stdout
    assert "hashed in" in p.stdout and "without hashing" in p.stdout and "Traceback" not in p.stderr
    for gen in (rb.generation, rc.generation):                      # the other generations verify clean
        p = cli(target, "verify", gen, "--json")
        assert p.returncode == 0, p.stdout + p.stderr
        v = json.loads(p.stdout)
        assert v["verdict"] == "clean" and v["files"] > 0 and v["bytes"] > 0 and "read_seconds" not in v

    p = cli(target, "rollback", "--to", ra.generation.split("-")[0])
    assert p.returncode == 1
    assert f"generation {ra.generation} fails verification (beta-1.0.dist-info/INSTALLER changed)" in p.stderr
    assert os.readlink(root / "current") == f"generations/{rc.generation}"
    p = cli(target, "rollback", "--to", ra.generation.split("-")[0], "--force")
    assert p.returncode == 0, p.stderr
    assert os.readlink(root / "current") == f"generations/{ra.generation}"
    p = cli(target, "rollback", "--to", rb.generation.split("-")[0])            # a clean target: checked, switched
    assert p.returncode == 0 and "stamp" in p.stdout, p.stdout + p.stderr

    events = [json.loads(x) for x in (root / "history.jsonl").read_text().splitlines()]
    verdicts = [(e["generation"], e["verdict"]) for e in events if e["event"] == "verify"]
    assert verdicts == [(ra.generation, "drift"), (rb.generation, "clean"), (rc.generation, "clean")]
    assert [e.get("forced") for e in events if e["event"] == "rollback"] == [True, False]
    p = cli(target, "status")
    assert p.returncode == 0 and "verified" in p.stdout and "clean (" in p.stdout, p.stdout


def test_a_path_two_wheels_ship_holds_one_of_their_copies(target, tmp_path):
    """flashinfer-python 0.7.2 and torch-c-dlpack-ext 0.1.5 both ship a top-level build_backend.py: the copy
    installed last stands, the seal and verify accept it as one of its owners' (the other distribution lists
    it as overwritten), and bytes matching neither owner are still caught."""
    root = Path(target.root)
    ws = [make_wheel(tmp_path / "w", n, "1.0", extra={"build_backend.py": f"# {n}'s backend\n".encode()})
          for n in ("first", "second")]
    tr = connect(target)
    try:
        rep = applymod.apply(tr, lockmod.load(write_lock(tmp_path / "l.yaml", "l", ws)))
        assert rep.status == "applied", rep.error
    finally:
        tr.close()
    shared = site(root, rep.generation) / "build_backend.py"
    assert shared.read_text() in ("# first's backend\n", "# second's backend\n")
    p = cli(target, "verify", rep.generation)
    assert p.returncode == 0, p.stdout + p.stderr
    append(shared, "# neither\n")
    p = cli(target, "verify", rep.generation)
    assert p.returncode == 1
    assert "1 changed (build_backend.py)" in p.stdout


def test_touched_file_is_not_drift_an_added_distribution_is(target, tmp_path, wheels):
    """Rollback's quick check hashes what a stat says changed: a touched file is clean; `verify` compares the
    distributions with the lock: one that the lock does not list is named."""
    root = Path(target.root)
    la = lockmod.load(write_lock(tmp_path / "a.yaml", "a", [wheels["alpha-1.0"]]))
    lb = lockmod.load(write_lock(tmp_path / "b.yaml", "b", [wheels["alpha-2.0"]]))
    tr = connect(target)
    try:
        ra, rb = applymod.apply(tr, la), applymod.apply(tr, lb)
        sp_a, sp_b = site(root, ra.generation), site(root, rb.generation)
        os.utime(sp_a / "alpha-1.0.dist-info" / "INSTALLER", (1, 1))          # stat changed, bytes did not
        out = generations.rollback(tr)
        assert out.to == ra.generation and out.check.verdict == "clean"
        assert out.check.hashed == 1 and out.check.how == "stamp"
        with zipfile.ZipFile(wheels["gamma-1.0"]) as z:                       # a distribution slipped in
            z.extractall(sp_b)
    finally:
        tr.close()
    p = cli(target, "verify", rb.generation)
    assert p.returncode == 1
    assert "gamma 1.0: installed, but not in the lock" in p.stdout
    p = cli(target, "rollback", "--to", rb.generation.split("-")[0])
    assert p.returncode == 1 and "not installed by the build" in p.stderr and "and " in p.stderr


def test_changed_cache_entry_is_fetched_again_and_partials_are_removed(target, tmp_path, wheels):
    root = Path(target.root)
    served = tmp_path / "served"
    served.mkdir()
    for name in ("alpha-1.0", "beta-1.0"):
        (served / wheels[name].name).write_bytes(wheels[name].read_bytes())
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(
        http.server.SimpleHTTPRequestHandler, directory=str(served)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"

    def lock(name, whls):
        path = write_lock(tmp_path / f"{name}.yaml", name, whls)
        data = yaml.safe_load(path.read_text())
        for p in data["packages"]:
            p["url"] = f"{base}/{p['filename']}"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return lockmod.load(path)

    tr = connect(target)
    try:
        ra = applymod.apply(tr, lock("a", [wheels["alpha-1.0"]]))
        sha = hashlib.sha256(wheels["alpha-1.0"].read_bytes()).hexdigest()
        entry = root / "cache" / "wheels" / sha / wheels["alpha-1.0"].name
        data = bytearray(entry.read_bytes())
        data[len(data) // 2] ^= 0xFF                                          # flipped bytes in the store
        os.chmod(entry, 0o644)
        entry.write_bytes(bytes(data))
        partial = entry.parent / (entry.name + ".part-4242-17")               # an interrupted download
        partial.write_bytes(b"half")
        lines = []
        rb = applymod.apply(tr, lock("b", [wheels["alpha-1.0"], wheels["beta-1.0"]]),
                            progress=lambda step, state, detail: lines.append(detail))
        assert not partial.exists() and str(partial) in rb.recovered["removed_partial"]
        healed = [x for x in lines if x.startswith("cache: ")]
        assert healed == [f"cache: 1 entry no longer matched its sha256 ({entry.name}): removed and fetched again"]
        assert rb.build["recheck"]["healed"] == [entry.name] and rb.build["fetched"] == 2
        assert "healed 1 changed cache entry" in next(s.detail for s in rb.steps if s.name == "build")
        assert hashlib.sha256(entry.read_bytes()).hexdigest() == sha
        assert rb.verify["verdict"] == "clean"

        gc_partial = entry.parent / (entry.name + ".part-4343-18")
        gc_partial.write_bytes(b"half")
        uv_bin = sorted((root / "cache" / "uv-bin").glob("*/uv"))
        out = generations.gc(tr, keep=1)
        assert str(gc_partial) in out.recovered.removed_partial and not gc_partial.exists()
        assert sorted((root / "cache" / "uv-bin").glob("*/uv")) == uv_bin       # the tool's own uv stays
    finally:
        tr.close()
        srv.shutdown()


def test_pushed_entry_that_changed_is_pushed_again(target, tmp_path, wheels):
    root = Path(target.root)
    la = lockmod.load(write_lock(tmp_path / "a.yaml", "a", [wheels["alpha-1.0"]]))
    lb = lockmod.load(write_lock(tmp_path / "b.yaml", "b", [wheels["alpha-1.0"], wheels["gamma-1.0"]]))
    tr = connect(target)
    try:
        applymod.apply(tr, la)
        entry = next((root / "cache" / "wheels").glob(f"*/{wheels['alpha-1.0'].name}"))
        os.chmod(entry, 0o644)
        entry.write_bytes(b"not a wheel")
        lines = []
        rb = applymod.apply(tr, lb, progress=lambda step, state, detail: lines.append(detail))
    finally:
        tr.close()
    assert f"cache: 1 entry no longer matched its sha256 ({entry.name}): removed and pushed again" in lines
    assert rb.build["pushed"] == 2 and entry.read_bytes() == wheels["alpha-1.0"].read_bytes()


def test_patched_generation_verifies_clean_and_a_changed_patched_file_is_caught(target, tmp_path):
    """The real SGLang 0.5.9 wheel with the shipped series: the patcher replaces read-only files by rename, the
    seal checks the patched files against the series' hashes, and a later change to one is named."""
    root = Path(target.root)
    path = write_lock(tmp_path / "sgl.yaml", "sgl", [sglang_wheel("0.5.9")], patches=["patches/sglang-0.5.9"],
                      engine={"kind": "none", "architecture": "KimiK25ForConditionalGeneration"})
    tr = connect(target)
    try:
        rep = applymod.apply(tr, lockmod.load(path))
    finally:
        tr.close()
    assert rep.status == "applied" and rep.verify["verdict"] == "clean"
    sp = site(root, rep.generation)
    patched = sorted(rep.patches["files"])
    assert patched and all((sp / f).stat().st_mode & 0o222 == 0 for f in patched)   # read-only after the rename
    from provision.agent import store
    with zipfile.ZipFile(sglang_wheel("0.5.9")) as z:                       # the store keeps the wheel's bytes
        original = z.read("sglang/srt/models/kimi_k25.py")
    key = hashlib.sha256(original).hexdigest()
    entry = root / "store" / "files" / key[:2] / key
    assert entry.read_bytes() == original and store.immutable(entry) and rep.build["isolation"] == "store"
    assert all((sp / f).stat().st_nlink == 1 and not store.immutable(sp / f) for f in patched)  # the generation's own
    p = cli(target, "verify", "--json")
    v = json.loads(p.stdout)
    assert p.returncode == 0 and v["verdict"] == "clean", p.stdout + p.stderr
    victim = sp / "sglang" / "srt" / "models" / "kimi_k25.py"
    append(victim, "# changed after the patch\n")
    p = cli(target, "verify")
    assert p.returncode == 1
    assert any(line.strip().startswith("sglang 0.5.9: 1 changed (sglang/srt/models/kimi_k25.py)")
               for line in p.stdout.splitlines()), p.stdout


def test_reuse_of_a_drifted_generation_builds_a_new_one(target, tmp_path, wheels):
    """apply of a lock an existing generation holds switches to it only if it passes the quick check; a store
    entry root wrote through is not linked by a later build (hashed again, set aside)."""
    from provision.agent import store

    root = Path(target.root)
    la = lockmod.load(write_lock(tmp_path / "a.yaml", "a", [wheels["alpha-1.0"]]))
    lb = lockmod.load(write_lock(tmp_path / "b.yaml", "b", [wheels["beta-1.0"]]))
    tr = connect(target)
    try:
        ra, _ = applymod.apply(tr, la), applymod.apply(tr, lb)
        victim = site(root, ra.generation) / "alpha" / "__init__.py"
        st, text = victim.stat(), victim.read_text()
        with open(victim, "rb") as f:       # root, deliberately: the store's attribute off, the file written
            store.set_immutable(f.fileno(), False)
        os.chmod(victim, 0o644)
        victim.write_text(text.replace("1.0", "6.6"))          # same size, and its mtime put back
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert victim.stat().st_size == st.st_size and victim.stat().st_mtime_ns == st.st_mtime_ns
        again = applymod.apply(tr, la)
    finally:
        tr.close()
    assert again.status == "applied" and again.generation not in (ra.generation, None)
    assert any(w.startswith(f"{ra.generation} holds this lock but fails verification (alpha/__init__.py changed)")
               for w in again.warnings), again.warnings
    assert "6.6" not in (site(root, again.generation) / "alpha" / "__init__.py").read_text()
    assert again.verify["verdict"] == "clean" and again.build["store"]["evicted"] == 1


def test_changed_copy_in_uvs_cache_fails_the_seal_not_a_generation(target, tmp_path, wheels):
    """A write into uv's unpacked cache (not through a generation) never reaches a generation: a build links the
    store's entry of that content where the store has one, and where it has none the changed copy does not enter
    the store: the seal finds it before the probes, the generation fails, `current` stays."""
    from provision.agent import store

    root = Path(target.root)
    la = lockmod.load(write_lock(tmp_path / "a.yaml", "a", [wheels["beta-1.0"]]))
    lb = lockmod.load(write_lock(tmp_path / "b.yaml", "b", [wheels["alpha-1.0"], wheels["beta-1.0"]]))
    lc = lockmod.load(write_lock(tmp_path / "c.yaml", "c", [wheels["beta-1.0"], wheels["gamma-1.0"]]))
    tr = connect(target)
    try:
        applymod.apply(tr, la)
        (cached,) = (root / "cache" / "uv" / "archive-v0").glob("*/beta/__init__.py")
        append(cached, "TAMPERED=1\n")
        rb = applymod.apply(tr, lb)                      # the store holds beta's files: linked from there
        assert rb.verify["verdict"] == "clean" and grep_tree(site(root, rb.generation), b"TAMPERED") == []
        for entry, _ in list(store.entries(str(root / "store" / "files"))):     # root, deliberately: an empty store
            store.unlink(entry)
        with pytest.raises(HostError) as e:
            applymod.apply(tr, lc)
        msg = str(e.value)
        h = generations.history(tr)
    finally:
        tr.close()
    assert "does not match its lock after the build: beta 1.0: 1 changed (beta/__init__.py)" in msg
    assert "uv's unpacked cache" in msg
    assert h.current == rb.generation and h.generations[-1].status == "failed"
    assert grep_tree(root / "store", b"TAMPERED") == []
