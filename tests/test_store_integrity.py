"""The host's store never lends a build bytes its names do not promise: an entry root rewrote at the same size (its
mtime and attribute put back) is hashed again and entered anew, not linked, and the seal does not call it clean; a
symlink, directory or dangling name planted where an entry belongs is removed, never followed; an entry root
deleted is entered anew, immutable, and the generations still sharing its old inode are named, their files left as
they are. Real uv, real builds, `--local` roots on this machine's filesystem, as root."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from provision import apply as applymod, lock as lockmod
from provision import generations
from provision.agent import store, verify as agentverify
from provision.layout import Layout
from provision.errors import HostError
from provision.transport import Local, Target
from provision.verify import seal
from wheelhouse import write_lock

BETA = b"__version__ = '1.0'\n"        # beta 1.0's and gamma 1.0's __init__.py (tests/wheelhouse.py)
TAMPERED = b"__version__ = '6.6'\n"    # the same size


def local(root: Path) -> Local:
    return Local(Target(host="local", root=str(root)))


def site(root: Path, gen: str) -> Path:
    return next((root / "generations" / gen / "venv" / "lib").glob("python3*/site-packages"))


def entry_of(root: Path, path: Path) -> Path:
    """The store entry the generation's file at `path` links."""
    ino = path.stat().st_ino
    return next(Path(p) for p, st in store.entries(str(root / "store" / "files")) if st.st_ino == ino)


def rewrite_in_place(path: Path, data: bytes):
    """Root, covering its tracks: the attribute off, the same number of bytes written over, mtime and attribute
    put back (only the inode's ctime, which no call sets back, tells)."""
    st = path.stat()
    assert len(data) == st.st_size
    with open(path, "rb") as f:
        store.set_immutable(f.fileno(), False)
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with open(path, "rb") as f:
        store.set_immutable(f.fileno(), True)
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    assert store.immutable(path) and path.read_bytes() == data


def remove_by_hand(path: Path):
    """Root deletes a store entry: the attribute off (an immutable inode keeps every name), then rm."""
    with open(path, "rb") as f:
        store.set_immutable(f.fileno(), False)
    path.unlink()


@pytest.fixture
def locks(tmp_path, wheels):
    return [lockmod.load(write_lock(tmp_path / f"{n}.yaml", n, ws)) for n, ws in
            (("a", [wheels["beta-1.0"]]), ("b", [wheels["beta-1.0"], wheels["gamma-1.0"]]),
             ("c", [wheels["beta-1.0"], wheels["alpha-2.0"]]))]


def test_an_entry_rewritten_with_size_mtime_and_attribute_put_back_is_entered_anew_not_linked(tmp_path, locks):
    """a and b link beta's __init__.py; root rewrites that entry at its size and puts its mtime and attribute
    back. The next build does not link it: it is hashed again, set aside (the generations linking it keep it,
    and verify names them) and entered anew from the verified wheel; the new generation holds the wheel's bytes
    on an immutable inode of its own and its seal is true."""
    root = tmp_path / "root"
    tr = local(root)
    try:
        ra, rb = applymod.apply(tr, locks[0]), applymod.apply(tr, locks[1])
        victim = site(root, ra.generation) / "beta" / "__init__.py"
        rewrite_in_place(entry_of(root, victim), TAMPERED)
        rc = applymod.apply(tr, locks[2])
    finally:
        tr.close()
    assert rc.status == "applied" and rc.verify["verdict"] == "clean", rc
    fresh = site(root, rc.generation) / "beta" / "__init__.py"
    assert fresh.read_bytes() == BETA, "the new generation linked the rewritten entry"
    assert store.immutable(fresh) and fresh.stat().st_ino != victim.stat().st_ino
    assert rc.build["store"]["evicted"] == 1 and rc.build["store"]["hashed"] == 1
    line = next(s.detail for s in rc.steps if s.name == "build")
    assert "1 store entry hashed again" in line and "1 store entry set aside" in line, line
    assert victim.read_bytes() == TAMPERED       # a's and b's file: the inode root wrote, left for verify to name
    assert entry_of(root, fresh).read_bytes() == BETA


def test_the_seal_hashes_a_store_link_whose_entry_moved_since_it_was_proven(tmp_path, locks):
    """The seal does not read files linked from the store; it trusts a link only while its entry's stat is the
    one the build recorded when it proved the entry's bytes. An entry rewritten after the build (size, mtime and
    attribute put back) is hashed by the seal, which names it instead of saying "all match RECORD"."""
    root = tmp_path / "root"
    tr = local(root)
    try:
        ra = applymod.apply(tr, locks[0])
        victim = site(root, ra.generation) / "beta" / "__init__.py"
        rewrite_in_place(entry_of(root, victim), TAMPERED)
        with pytest.raises(HostError) as e:
            seal(tr, locks[0], ra.generation, "uv")
    finally:
        tr.close()
    assert "beta 1.0: 1 changed (beta/__init__.py)" in str(e.value), str(e.value)


@pytest.mark.parametrize("plant", ["symlink to the right bytes", "dangling symlink", "directory",
                                   "its directory a symlink"])
def test_a_non_file_planted_where_an_entry_belongs_is_removed_never_followed(tmp_path, locks, plant):
    """Root replaces beta's entry (or the directory of entries it lives in) with something that is not a regular
    file (a directory). The next build removes that name (a symlink itself, not what it points to), enters the
    wheel's bytes anew and links them: no OSError, nothing written where the symlink points."""
    root = tmp_path / "root"
    tr = local(root)
    outside, elsewhere = tmp_path / "outside", tmp_path / "elsewhere"
    outside.write_bytes(BETA)
    elsewhere.mkdir()
    try:
        ra = applymod.apply(tr, locks[0])
        entry = entry_of(root, site(root, ra.generation) / "beta" / "__init__.py")
        remove_by_hand(entry)
        if plant == "its directory a symlink":
            for f in entry.parent.iterdir():
                remove_by_hand(f)
            entry.parent.rmdir()
            entry.parent.symlink_to(elsewhere)
        elif plant == "directory":
            entry.mkdir()
            (entry / "inside").write_bytes(BETA)
        else:
            entry.symlink_to(outside if plant == "symlink to the right bytes" else tmp_path / "nowhere")
        rb = applymod.apply(tr, locks[1])
    finally:
        tr.close()
    assert rb.status == "applied" and rb.verify["verdict"] == "clean", rb
    assert not entry.parent.is_symlink() and not entry.is_symlink() and entry.is_file() and store.immutable(entry) and entry.read_bytes() == BETA
    fresh = site(root, rb.generation) / "beta" / "__init__.py"
    assert fresh.stat().st_ino == entry.stat().st_ino
    assert rb.build["store"]["evicted"] == 1
    assert outside.read_bytes() == BETA and outside.stat().st_nlink == 1 and not store.immutable(outside)
    assert not any(elsewhere.iterdir())


def test_a_deleted_entry_is_entered_anew_and_the_generations_sharing_its_old_inode_are_named(tmp_path, locks):
    """a and b link beta's entry; root deletes it (the attribute off first), so their files share an inode that
    is no longer immutable. The next build enters the wheel's bytes anew (immutable, an inode of its own), leaves
    a's and b's files as they are, and says which generations still share the old inode."""
    root = tmp_path / "root"
    tr = local(root)
    try:
        ra, rb = applymod.apply(tr, locks[0]), applymod.apply(tr, locks[1])
        old = site(root, ra.generation) / "beta" / "__init__.py"
        before = old.stat()
        remove_by_hand(entry_of(root, old))
        gone = old.stat()
        rc = applymod.apply(tr, locks[2])
    finally:
        tr.close()
    assert rc.status == "applied" and rc.verify["verdict"] == "clean", rc
    fresh = site(root, rc.generation) / "beta" / "__init__.py"
    assert fresh.read_bytes() == BETA and store.immutable(fresh) and fresh.stat().st_ino != before.st_ino
    assert store.immutable(entry_of(root, fresh))
    now = old.stat()        # the old generations' inode: not written, not relinked, its attribute as root left it
    assert (now.st_ino, now.st_ctime_ns, now.st_nlink) == (gone.st_ino, gone.st_ctime_ns, gone.st_nlink)
    assert old.read_bytes() == BETA and not store.immutable(old)
    lost = rc.build["store"]["lost"]
    assert lost == [{"generations": [ra.generation, rb.generation], "links": 3, "bytes": len(BETA)}], lost
    line = next(s.detail for s in rc.steps if s.name == "build")
    assert (f"a former store entry, no longer immutable, is still shared by {ra.generation}, {rb.generation} "
            "(3 links, 20 B): a write through one reaches the others") in line, line


def test_rollback_refuses_a_generation_whose_store_entry_was_rewritten_with_its_stat_put_back(tmp_path, locks):
    """Rollback's quick check trusts a store link only while its entry is as its last proof left it: an entry a and
    b share, rewritten by root at its size with mtime and attribute put back, is hashed at rollback and named;
    the rollback to a is refused and `current` stays b."""
    root = tmp_path / "root"
    tr = local(root)
    try:
        ra, rb = applymod.apply(tr, locks[0]), applymod.apply(tr, locks[1])
        rewrite_in_place(entry_of(root, site(root, ra.generation) / "beta" / "__init__.py"), TAMPERED)
        with pytest.raises(HostError) as e:
            generations.rollback(tr)
        assert generations.status(tr).current == rb.generation
    finally:
        tr.close()
    assert "beta/__init__.py" in str(e.value), str(e.value)


def test_gc_and_a_failed_build_leave_the_store_links_of_the_generations_kept_proven(tmp_path, locks):
    """Removing a generation unlinks the entries it shares with others (their ctime moves, their bytes do not):
    the proofs move with them, so rollback's quick check of a generation left hashes none of its store links,
    after a gc and after the removal of a failed build's venv (the mark a failed apply makes)."""
    root = tmp_path / "root"
    tr = local(root)
    try:
        applymod.apply(tr, locks[0])
        rb, rc = applymod.apply(tr, locks[1]), applymod.apply(tr, locks[2])
        gone = generations.gc(tr, keep=0)
        assert [g.id for g in gone.generations] == ["0001-a"], gone
        back = generations.rollback(tr)
        assert (back.to, back.check.verdict, back.check.hashed) == (rb.generation, "clean", 0), back.check
        generations.mark(tr, rc.generation, remove_venv=True, status="failed")
        assert not (root / "generations" / rc.generation / "venv").exists()
        again = agentverify.quick(Layout(str(root)), rb.generation)
    finally:
        tr.close()
    assert (again["verdict"], again["hashed"]) == ("clean", 0), again
