"""Damaged state on real host roots (loopback sshd or `--local`): a cut-off manifest or history line, `current`
pointing outside the generations, a read-only root, a full disk; and a stale override beside unreadable
metadata. Each case is told in one line and costs no good generation."""
from __future__ import annotations

import json
import os
import re
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from test_core import cli, host_args
from wheelhouse import make_wheel, sha256, write_lock


def test_stale_override_warned_beside_unreadable_metadata(tmp_path):
    """An override of a package the lock lacks is named even when its `use` names a package left unresolved and
    another package's METADATA cannot be read."""
    w = make_wheel(tmp_path / "w", "app", "1.0", [])
    missing = tmp_path / "lib-1.0-py3-none-any.whl"
    data = {"lock": 1, "name": "t", "platform": {"python": "3.12", "cuda": {"source": "none"}},
            "requires": ["app==1.0", "lib==1.0"],
            "packages": [{"name": "app", "version": "1.0", "filename": w.name, "url": w.resolve().as_uri(),
                          "sha256": sha256(w)},
                         {"name": "lib", "version": "1.0", "filename": missing.name, "url": missing.as_uri(),
                          "sha256": "0" * 64}],
            "unresolved": [{"name": "torch", "requirement": "torch==2.9.1", "reason": "no reachable index serves it"}],
            "overrides": [{"package": "gone", "pins": "torch==2.9.0", "use": "torch==2.9.1",
                           "reason": "the upstream pin is older than the stack"}]}
    lk = tmp_path / "l.yaml"
    lk.write_text(yaml.safe_dump(data, sort_keys=False))
    out = cli("lock", "check", lk, check=1).stdout
    assert "[metadata] lib: cannot read its METADATA" in out
    assert "[override] gone: override for gone, which is not in the closure  (%s:" % lk in out


@pytest.fixture
def locks(tmp_path, wheels):
    return [write_lock(tmp_path / f"{n}.yaml", f"stack-{n}", ws) for n, ws in
            (("a", [wheels["alpha-1.0"]]), ("b", [wheels["alpha-2.0"]]))]


def current(root: Path) -> str:
    return os.readlink(root / "current").rsplit("/", 1)[-1]


def test_cut_off_history_line_is_reported_and_the_next_event_kept(target, locks):
    """history.jsonl's last line cut off mid-line (a crash during its write): the next rollback's event starts on
    a line of its own, the broken line is named (history.jsonl:LINE) and skipped, and a second rollback returns
    to the generation the first one left."""
    a, b = locks
    root = Path(target.root)
    for lk in (a, b):
        cli("apply", *host_args(target), "--lock", lk, check=0)
    hist = root / "history.jsonl"
    text = hist.read_bytes()
    hist.write_bytes(text[:-20])                                 # the last event loses its end and its newline
    broken = text[:-20].count(b"\n") + 1
    p = cli("rollback", *host_args(target), check=0)
    assert current(root) == "0001-stack-a"
    assert f"warning: " in p.stderr and f"{hist}:{broken} is not an event" in p.stderr, p.stderr
    lines = hist.read_bytes().split(b"\n")
    assert json.loads(lines[broken])["event"] == "rollback"      # its own line, right after the broken one
    p = cli("rollback", *host_args(target), check=0)
    assert current(root) == "0002-stack-b", p.stdout
    h = json.loads(cli("history", *host_args(target), "--json").stdout)
    h = h[0] if isinstance(h, list) else h
    assert any(f"{hist}:{broken}" in w for w in (h.get("value") or h).get("warnings")), h


def test_cut_off_manifest_of_a_ready_generation_is_kept_and_named(target, locks):
    """0001's manifest.json cut off (its venv, stamp, probes and lock intact): the recovery that rollback and gc
    run first keeps it as it is and names it with what is wrong; rollback refuses it in one line saying why;
    gc keeps it."""
    a, b = locks
    root = Path(target.root)
    for lk in (a, b):
        cli("apply", *host_args(target), "--lock", lk, check=0)
    g1 = root / "generations" / "0001-stack-a"
    man = g1 / "manifest.json"
    cut = man.read_bytes()[:-40]
    man.write_bytes(cut)
    err = cli("rollback", *host_args(target), check=1).stderr
    assert err.count("\n") == 1 and "0001-stack-a (manifest.json cannot be read (cut off or not JSON" in err, err
    err = cli("rollback", *host_args(target), "--to", "1", check=1).stderr
    assert "generation 0001-stack-a: manifest.json cannot be read" in err and "not switched to it" in err, err
    gc = cli("gc", *host_args(target), "--keep", "1", check=0)
    assert "warning: " in gc.stdout + gc.stderr and "generation 0001-stack-a: manifest.json cannot be read" in \
        gc.stdout + gc.stderr and "kept as it is" in gc.stdout + gc.stderr, gc
    assert (g1 / "venv" / "bin" / "python").exists() and man.read_bytes() == cut and current(root) == "0002-stack-b"
    assert not [e for e in map(json.loads, (root / "history.jsonl").read_text().splitlines())
                if e.get("event") == "abandoned"]


@pytest.mark.parametrize("what", ["link to /usr", "directory"])
def test_current_outside_the_generations(target, locks, what):
    """`current` pointing at /usr, or replaced by a real directory, with two ready generations: rollback says in one
    line what `current` is and offers `rollback --to`, which works (a directory is kept aside, never deleted)."""
    a, b = locks
    root = Path(target.root)
    for lk in (a, b):
        cli("apply", *host_args(target), "--lock", lk, check=0)
    link = root / "current"
    link.unlink()
    if what == "directory":
        link.mkdir()
        (link / "note").write_text("kept")
        said = f"{link} is a directory, not a link to a generation under {root}/generations"
    else:
        link.symlink_to("/usr")
        said = f"{link} points at /usr, not at a generation under {root}/generations"
    err = cli("rollback", *host_args(target), check=1).stderr
    assert err.count("\n") == 1 and said in err and "rollback --to GEN (have: 0001-stack-a, 0002-stack-b)" in err, err
    st = json.loads(cli("status", *host_args(target), "--json").stdout)[0]
    assert said in json.dumps(st), st
    p = cli("rollback", *host_args(target), "--to", "1", check=0)
    assert "→ 0001-stack-a" in p.stdout and said in p.stderr, (p.stdout, p.stderr)
    assert current(root) == "0001-stack-a"
    if what == "directory":
        kept = [d for d in root.iterdir() if d.name.startswith("current.set-aside-")]
        assert len(kept) == 1 and (kept[0] / "note").read_text() == "kept" and str(kept[0]) in p.stderr
    assert said not in cli("status", *host_args(target), "--json").stdout
    cli("rollback", *host_args(target), "--to", "2", check=0)
    assert current(root) == "0002-stack-b"


@contextmanager
def read_only(path: Path):
    """`path` bind-mounted onto itself read-only (a real read-only filesystem); skips where mounting is refused."""
    p = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot bind-mount here (a read-only root needs it): {p.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], check=True, capture_output=True)
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_read_only_root(target, locks):
    """The host root remounted read-only: verify gives its verdict (and says it is not recorded); rollback and gc
    say in one line that the root is read-only, exit 1, and change nothing."""
    a, b = locks
    root = Path(target.root)
    for lk in (a, b):
        cli("apply", *host_args(target), "--lock", lk, check=0)
    said = f"host root {root} is read-only"
    with read_only(root):
        p = cli("verify", *host_args(target), check=0)
        assert "0002-stack-b on" in p.stdout and "clean" in p.stdout, p.stdout
        assert "the verdict is not recorded: " + said in p.stderr, p.stderr
        for verb in (["rollback"], ["gc", "--keep", "1"]):
            err = cli(*verb, *host_args(target), check=1).stderr
            assert err.count("\n") == 1 and said in err and "nothing was written" in err, err
        assert "Would roll back" in cli("rollback", *host_args(target), "--dry-run", check=0).stdout
    assert current(root) == "0002-stack-b" and (root / "generations" / "0001-stack-a" / "venv").is_dir()


@contextmanager
def tmpfs(path: Path, size: str):
    """A real small filesystem at `path` (tmpfs); skips where mounting is refused."""
    path.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (a full disk needs one): {p.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def fill(root: Path, leave: int) -> Path:
    """Write a filler file under `root` until only about `leave` bytes are free."""
    st = os.statvfs(root)
    filler = root / "filler"
    with open(filler, "wb") as f:
        left = st.f_bavail * st.f_frsize - leave
        try:
            while left > 0:
                left -= f.write(b"\0" * min(left, 1 << 20))
            f.flush()
        except OSError:
            pass
    return filler


def bulky_wheel(tmp_path: Path, name: str, mib: int, inner: str = "blob.bin") -> Path:
    """A real wheel whose one file of `mib` MiB of zeros is deflated: a few KiB to download, `mib` MiB installed."""
    import zipfile

    w = make_wheel(tmp_path / "src", name, "1.0", extra={f"{name}/{inner}": b"\0" * (mib << 20)})
    out = tmp_path / "w" / w.name
    out.parent.mkdir(exist_ok=True)
    with zipfile.ZipFile(w) as zi, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zo:
        for i in zi.infolist():
            zo.writestr(i.filename, zi.read(i))
    return out


def test_full_disk(tmp_path, wheels):
    """A 16 MiB root: plan counts a wheel's installed size (10 MiB of zeros in an 11 KiB wheel: in the venv and in
    uv's cache), not twice its download, and refuses; a disk that fills up during the install, or right after the
    build, fails the apply with a message that names what failed, starts on a whole word, says the disk under the
    root is full and where `current` is (unchanged)."""
    from provision import apply as applymod
    from provision import lock as lockmod
    from provision.errors import ProvisionError
    from provision.plan import plan_host
    from provision.transport import Local, Target

    with tmpfs(tmp_path / "a-rather-long-directory-name-for-the-host-root" / "root", "16m") as root:
        tr = Local(Target(host="local", root=str(root)))
        a = lockmod.load(write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]]))
        assert applymod.apply(tr, a).status == "applied"
        big = lockmod.load(write_lock(tmp_path / "big.yaml", "stack-big", [bulky_wheel(tmp_path, "bulky", 10)]))
        planned = plan_host(tr, big)
        assert any("free under" in e and re.search(r"this build needs about 20\.[0-9] MiB", e)    # and the venv's own
                   for e in planned.errors), planned
        assert planned.download["installed"] >= 10 << 20 and planned.download["disk_needed"] >= 20 << 20

        deep = "/".join(["d" * 200] * 2 + ["b" * 200])      # a long path: the install's error is long
        c = lockmod.load(write_lock(tmp_path / "c.yaml", "stack-c", [bulky_wheel(tmp_path, "roomy", 4, deep)]))
        assert not plan_host(tr, c).errors
        for when, leave, said in (("plan", 2 << 20, "build: install failed (exit "),
                                  ("build", 0, "recording generation 0003-stack-c as built failed: ")):
            def progress(step, state, detail, when=when, leave=leave):
                if (step, state) == (when, "done"):
                    fill(root, leave)
            with pytest.raises(ProvisionError) as e:
                applymod.apply(tr, c, progress=progress)
            msg = e.value.message
            assert said in msg and f"the disk under host root {root} is full" in msg, msg
            assert msg.endswith("; current is 0001-stack-a"), msg
            assert current(root) == "0001-stack-a"
            if when == "plan":
                text = msg.split(said, 1)[1].split(": ", 1)[1]
                log = (root / "generations" / "0002-stack-c" / "build.log").read_text()
                first = (text[2:] if text.startswith("… ") else text).split()[0]
                assert first in log.split(), text                   # a whole word of what the install said
            else:
                assert e.value.report.steps[-1].name == "build" and e.value.report.steps[-1].status == "done"
            (root / "filler").unlink()
