"""The core flow against a real sshd on loopback, real ansible-runner and real uv/pip installs."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from provision import apply as applymod
from provision import generations, lock as lockmod
from provision.replies import to_json
from provision.errors import HostError, HostKeyError, HostLockedError, LockError, ProvisionError
from provision.facts import Facts, gather
from provision.loopback import LoopbackHost
from provision.plan import preflight_findings
from provision.transport import connect, trust_host
from wheelhouse import make_wheel, write_lock

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, check=None):
    p = subprocess.run([sys.executable, "-m", "provision.cli", *map(str, args)], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    assert "Traceback" not in p.stderr, p.stderr
    if check is not None:
        assert p.returncode == check, (p.returncode, p.stdout, p.stderr)
    return p


def ctrl_c_as_at_a_terminal() -> None:
    """preexec_fn of a command a test interrupts: SIGINT handled as a terminal's Ctrl-C finds it (a test run
    started in the background ignores SIGINT, and its children would inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def host_args(t):
    return [f"{t.user}@{t.host}:{t.port}", "--key", t.key_file, "--known-hosts", t.known_hosts,
            "--root", t.root]


@pytest.fixture
def locks(tmp_path, wheels):
    a = write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"], wheels["beta-1.0"]])
    b = write_lock(tmp_path / "b.yaml", "stack-b", [wheels["alpha-2.0"], wheels["gamma-1.0"]])
    return a, b


def current_link(t):
    link = Path(t.root) / "current"
    return os.readlink(link) if link.is_symlink() else None


def test_plan_apply_noop_rollback_history(target, locks):
    a, b = locks
    p = cli("plan", *host_args(target), "--lock", a, "--detailed-exitcode", check=2)
    assert "+ alpha  1.0" in p.stdout and "Plan: 2 to add, 0 to change, 0 to remove." in p.stdout

    cli("apply", *host_args(target), "--lock", a, check=0)
    assert current_link(target) == "generations/0001-stack-a"
    venv_py = Path(target.root) / "current" / "venv" / "bin" / "python"
    out = subprocess.run([venv_py, "-c", "import alpha, beta; print(alpha.__version__)"], capture_output=True, text=True)
    assert out.stdout.strip() == "1.0"

    p = cli("plan", *host_args(target), "--lock", b, "--json", check=0)
    plan = json.loads(p.stdout)
    assert plan["summary"] == {"add": 1, "change": 1, "remove": 1}
    assert {(c["name"], c["action"], c["old"], c["new"]) for c in plan["changes"]} == {
        ("alpha", "change", "1.0", "2.0"), ("gamma", "add", None, "1.0"), ("beta", "remove", "1.0", None)}

    rep = json.loads(cli("apply", *host_args(target), "--lock", b, "--json", check=0).stdout)
    assert rep["status"] == "applied" and rep["generation"] == "0002-stack-b" and rep["previous"] == "0001-stack-a"
    assert [s["name"] for s in rep["steps"]] == ["recover", "facts", "plan", "build", "patch", "seal", "probe", "switch"]

    again = json.loads(cli("apply", *host_args(target), "--lock", b, "--json", check=0).stdout)
    assert again["status"] == "noop" and again["generation"] == "0002-stack-b"
    cli("plan", *host_args(target), "--lock", b, "--detailed-exitcode", check=0)

    rb = json.loads(cli("rollback", *host_args(target), "--json", check=0).stdout)
    assert (rb["from"], rb["to"]) == ("0002-stack-b", "0001-stack-a")
    assert current_link(target) == "generations/0001-stack-a"
    out = subprocess.run([venv_py, "-c", "import alpha; print(alpha.__version__)"], capture_output=True, text=True)
    assert out.stdout.strip() == "1.0"

    h = json.loads(cli("history", *host_args(target), "--json", check=0).stdout)
    assert h["current"] == "0001-stack-a"
    assert [(g["id"], g["status"]) for g in h["generations"]] == [("0001-stack-a", "ready"), ("0002-stack-b", "ready")]
    assert [e["event"] for e in h["events"] if e["event"] != "probe"] == ["staged", "apply", "staged", "apply",
                                                                          "rollback"]   # staged: built, probed
    table = cli("history", *host_args(target), check=0).stdout
    assert "0001-stack-a" in table and "→" in table

    cli("rollback", *host_args(target), "--to", "2", check=0)
    assert current_link(target) == "generations/0002-stack-b"


def test_saved_plan_applied_exactly_and_refused_after_drift(target, locks, tmp_path):
    a, b = locks
    saved = tmp_path / "plan.json"
    cli("plan", *host_args(target), "--lock", a, "--out", saved, check=0)
    cli("apply", *host_args(target), "--plan", saved, check=0)
    assert current_link(target) == "generations/0001-stack-a"

    stale = tmp_path / "stale.json"
    cli("plan", *host_args(target), "--lock", b, "--out", stale, check=0)
    cli("apply", *host_args(target), "--lock", b, check=0)          # the host moves on
    p = cli("apply", *host_args(target), "--plan", stale, check=1)
    assert "host changed since this plan was made" in p.stderr
    assert [line for line in p.stderr.splitlines() if line.startswith("error:")] == [p.stderr.splitlines()[-1]]

    edited = json.loads(saved.read_text())
    edited["lock"]["packages"][0]["sha256"] = "0" * 64
    saved.write_text(json.dumps(edited))
    p = cli("apply", *host_args(target), "--plan", saved, check=2)
    assert "edited after planning" in p.stderr


def test_hash_mismatch_refused_current_unchanged(target, locks, tmp_path, wheels):
    a, _ = locks
    cli("apply", *host_args(target), "--lock", a, check=0)
    bad = tmp_path / "bad.yaml"
    data = lockmod.load(write_lock(tmp_path / "c.yaml", "stack-c", [wheels["gamma-1.0"]])).raw
    data["packages"][0]["sha256"] = "0" * 64
    bad.write_text(lockmod.dump(data))
    p = cli("apply", *host_args(target), "--lock", bad, check=1)
    assert "gamma==1.0" in p.stderr and "sha256 mismatch" in p.stderr and f"{bad}:" in p.stderr
    assert current_link(target) == "generations/0001-stack-a"


def test_hash_mismatch_on_host_fetch_refused(target, wheels, tmp_path):
    """A wheel the host fetches from an index whose bytes differ from the lock's sha256 is refused there."""
    import functools
    import http.server

    good = lockmod.load(write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]]))
    served = tmp_path / "index"
    evil = make_wheel(served, "alpha", "1.0", body="EVIL = True\n")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *a: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    data = good.raw
    data["packages"][0]["url"] = f"http://127.0.0.1:{srv.server_address[1]}/{evil.name}"
    lk = lockmod.from_data(data, str(tmp_path / "a.yaml"))
    tr = connect(target)
    try:
        with pytest.raises(HostError, match=r"fetch failed: alpha==1.0: sha256 mismatch"):
            applymod.apply(tr, lk)
        h = generations.history(tr)
        assert h.current is None and h.generations[0].status == "failed"
        assert h.events[-1]["event"] == "apply-failed"
    finally:
        tr.close()
        srv.shutdown()


def test_pip_installer_and_adoption(target, locks, tmp_path):
    a, _ = locks
    # An unmanaged environment already on the host.
    env = tmp_path / "legacy-env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", env], check=True)
    tr = connect(target)
    try:
        rep = applymod.apply(tr, lockmod.load(a), adopt_path=str(env), installer="pip")
        assert rep.status == "applied" and rep.generation == "0001-stack-a"
        h = generations.history(tr)
        assert [g.id for g in h.generations] == ["0000-adopted", "0001-stack-a"]
        assert h.generations[0].status == "adopted" and to_json(h.generations[0])["adopted_from"] == str(env)
        assert generations.read(tr, "0001-stack-a")["manifest"]["installer"] == "pip"
        rb = generations.rollback(tr)
        assert rb.to == "0000-adopted"
        assert os.path.realpath(Path(target.root) / "current" / "venv") == str(env)
        assert env.exists()   # adopted, never moved
        adopted_lock = lockmod.loads(generations.read(tr, "0000-adopted")["lock_text"])
        assert adopted_lock.platform.python == "%d.%d" % sys.version_info[:2]
    finally:
        tr.close()


def test_unknown_and_changed_host_keys_refused(tmp_path, locks):
    a, _ = locks
    with LoopbackHost() as h:
        t = h.target
        p = cli("plan", *host_args(t), "--lock", a, check=1)
        assert "unknown host key ssh-ed25519 SHA256:" in p.stderr and "hosts trust" in p.stderr
        p = cli("hosts", "trust", h.spec, "--yes", "--known-hosts", t.known_hosts, check=0)
        assert "SHA256:" in p.stdout
        cli("plan", *host_args(t), "--lock", a, check=0)
        h.rekey()   # the host's key changes (reinstalled host, or someone in the middle)
        with pytest.raises(HostKeyError, match="CHANGED"):
            connect(t)


def test_concurrent_apply_refused_while_lock_held(target, locks):
    a, _ = locks
    tr = connect(target)
    try:
        with tr.hold():
            p = cli("apply", *host_args(target), "--lock", a, check=1)
            assert "another run holds the host lock" in p.stderr
            with pytest.raises(HostLockedError):
                applymod.apply(tr, lockmod.load(a))
        assert current_link(target) is None
        assert applymod.apply(tr, lockmod.load(a)).status == "applied"
    finally:
        tr.close()


def test_host_vanishing_mid_build_leaves_current_untouched(tmp_path, wheels):
    big = [make_wheel(tmp_path / "wh", f"pkg{i}", "1.0") for i in range(12)]
    lk_a = lockmod.load(write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]]))
    lk_b = lockmod.load(write_lock(tmp_path / "b.yaml", "stack-b", big))
    with LoopbackHost() as h:
        trust_host(h.target)
        tr = connect(h.target)
        applymod.apply(tr, lk_a)
        killer = threading.Thread(target=lambda: (time.sleep(0.3), h.vanish()))
        seen = []

        def progress(step, state, detail):
            seen.append(step)
            if step == "build" and state == "start":
                killer.start()

        with pytest.raises(ProvisionError) as e:
            applymod.apply(tr, lk_b, progress=progress)
        assert "\n" not in str(e.value) and h.target.name in str(e.value)
        assert os.readlink(Path(h.root) / "current") == "generations/0001-stack-a"
        assert (Path(h.root) / "generations" / "0001-stack-a" / "venv" / "bin" / "python").exists()


def test_malformed_lock_names_file_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("lock: 1\nname: x\nplatform:\n  python: '3.11'\npackages:\n  - name: a\n    version: not a version\n")
    p = cli("lock", "check", bad)
    assert p.returncode == 2 and f"{bad}:7" in p.stderr and "invalid version" in p.stderr
    bad.write_text("lock: 1\nname: x\nplatform: {python: '3.11'}\nextra: &a [*a]\n")
    with pytest.raises(LockError):
        lockmod.load(bad)
    bad.write_text("lock: 1\nname: x\nplatform: !!python/object/apply:os.system ['true']\n")
    p = cli("lock", "check", bad)
    assert p.returncode == 2 and f"{bad}:3" in p.stderr


def test_facts_with_recorded_nvidia_smi(target, tmp_path):
    """A GPU host's facts through nvidia-smi's recorded real output (no GPU can exist here)."""
    data = Path(__file__).parent / "data" / "h200" / "nvidia-smi-query.csv"   # recorded on an H200 host
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\ncat {data}\n")
    fake.chmod(0o755)
    target.nvidia_smi = str(fake)
    tr = connect(target)
    try:
        f = gather(tr)
    finally:
        tr.close()
    assert f.driver == "580.159.04"
    assert f.gpus[0].name == "NVIDIA H200" and f.gpus[0].compute_cap == "9.0"
    lk = lockmod.loads("lock: 1\nname: x\nplatform: {python: '3.11', driver: {min: '590.1'}, "
                       "gpus: {compute_capability: ['12.0']}}\n")
    findings = preflight_findings(f, lk)
    assert (True, "NVIDIA driver 580.159.04 is older than the lock's minimum 590.1") in findings
    assert any("compute capability 9.0" in m for _, m in findings)


def test_facts_glibc_and_a_lock_for_a_newer_one(tmp_path):
    """The host's glibc is a fact; a lock whose wheels need a newer one is refused before any download."""
    import platform

    from provision.transport import Local

    tr = Local()
    tr.target.python, tr.target.root = sys.executable, str(tmp_path / "root")
    f = gather(tr)
    have = f.os.glibc
    assert have == platform.libc_ver()[1]
    minor = int(have.split(".")[1])
    own = "%d.%d" % sys.version_info[:2]
    newer = lockmod.loads(f"lock: 1\nname: x\nplatform: {{python: '{own}', glibc: '2.{minor + 1}'}}\n")
    assert (True, f"host glibc {have} is older than the lock's platform.glibc 2.{minor + 1} (its wheels may be "
                  f"manylinux_2_{minor + 1})") in preflight_findings(f, newer)
    assert not preflight_findings(f, newer, action="reuse")          # a reuse installs nothing
    same = lockmod.loads(f"lock: 1\nname: x\nplatform: {{python: '{own}', glibc: '{have}'}}\n")
    assert not any("glibc" in m for _, m in preflight_findings(f, same))


def test_a_malformed_facts_reply_is_refused_in_one_line_naming_the_field():
    """A host's reply is untrusted: each field the controller reads is checked where the reply arrives."""
    gen = {"id": "0001-a", "number": 1, "status": "ready", "venv_ok": True, "stack": {}}
    good = {"root": "/r", "pythons": {"3.12": "/usr/bin/python3.12"}, "generations": [gen], "current": "0001-a",
            "gpus": [{"index": 0, "name": "NVIDIA H200", "uuid": "GPU-1", "driver": "580.159.04",
                      "compute_cap": "9.0", "memory": "143771 MiB", "pci": "00000000:19:00.0"}]}
    f = Facts.from_reply(good, "h")
    assert f.generation("0001-a").settled == "ready" and f.gpus[0].compute_cap == "9.0"
    cases = [
        ({"pythons": {"3.12": "python3.12"}}, "pythons['3.12']: 'python3.12' is not an absolute path"),
        ({"uv": "/usr/../bin/uv"}, "uv: '/usr/../bin/uv' is not an absolute path"),
        ({"current": "../../etc"}, "current: '../../etc' is not a generation id"),
        ({"generations": [dict(gen, id="0001-a\nb")]}, "generations[0].id: '0001-a\\nb' is not a generation id"),
        ({"generations": [dict(gen, stack=[])]}, "generations[0].stack: expected an object, not list"),
        ({"gpus": [{"index": "0"}]}, "gpus[0].index: expected a whole number, not str"),
        ({"disk_free_bytes": "lots"}, "disk_free_bytes: expected a whole number, not str"),
        ({"cached_wheels": [None]}, "cached_wheels[0]: expected a string, not NoneType"),
    ]
    for change, says in cases:
        with pytest.raises(HostError) as e:
            Facts.from_reply(dict(good, **change), "h")
        assert str(e.value) == f"h: the host's facts are malformed: {says}"
    with pytest.raises(HostError, match="^h: the host's facts are malformed: facts: expected an object, not list$"):
        Facts.from_reply([], "h")


def test_facts_look_only_for_the_locks_python(tmp_path, monkeypatch):
    """Given the lock's python, facts start no other interpreter (a broken python3.X on PATH goes unseen)
    and still say where that version is; a broken wanted one is named with why; no python: every version."""
    from provision.transport import Local

    own = "%d.%d" % sys.version_info[:2]
    other = "3.%d" % (sys.version_info[1] + 1)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / f"python{other}"
    fake.write_text("#!/bin/sh\necho 'no such version here' >&2\nexit 127\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    tr = Local()
    tr.target.python, tr.target.root = sys.executable, str(tmp_path / "root")
    f = gather(tr, python=own)
    assert f.pythons == {own: sys.executable} and f.broken_pythons == {}
    assert f.python_versions[own] == "%d.%d.%d" % sys.version_info[:3] and f.pythons_looked_for == own
    f = gather(tr, python=other)
    assert other not in f.pythons and f.broken_pythons == {str(fake): "no such version here"}
    lk = lockmod.loads(f"lock: 1\nname: x\nplatform: {{python: '{other}'}}\n")
    (fatal, msg), = [x for x in preflight_findings(f, lk) if "Python" in x[1]]
    assert fatal and msg.startswith(f"host has no working Python {other} (found: {own} ({sys.executable})); "
                                    f"broken: {fake}: no such version here; looked for python{other} in PATH (")
    f = gather(tr)
    assert f.pythons_looked_for == "all" and str(fake) in f.broken_pythons
    with pytest.raises(HostError, match="python must be 3.X"):
        gather(tr, python="3.12; rm -rf /")


def test_cuda_toolkit_from_nvidia_wheels_into_generation(toolkit_generation):
    """cuda-toolkit[nvcc,cudart,cccl,crt,nvvm]==13.0.1 from the index: nvcc V13.0.88 at the recorded CUDA_HOME,
    and it compiles for SM120 on a CPU-only host."""
    target, rep, lk = toolkit_generation
    assert rep.status == "applied"
    tr = connect(target)
    try:
        man = generations.read(tr, rep.generation)["manifest"]
    finally:
        tr.close()
    home = Path(man["cuda_home"])
    assert home.name == "cuda-home" and str(home).startswith(target.root)
    out = subprocess.run([home / "bin" / "nvcc", "--version"], capture_output=True, text=True)
    assert "V13.0.88" in out.stdout
    src = home.parent.parent / "k.cu"
    src.write_text("__global__ void k(float *x) { x[threadIdx.x] *= 2.0f; }\n")
    out = subprocess.run([home / "bin" / "nvcc", "-arch=sm_120", "-c", src, "-o", src.with_suffix(".o")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert src.with_suffix(".o").stat().st_size > 0
