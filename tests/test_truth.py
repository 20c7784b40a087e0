"""Verdicts are true: the engine probe cannot be borrowed, and probes/facts depend on the generation alone."""
from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from provision import apply as applymod
from provision import generations
from provision import lock as lockmod
from provision.probes import run_probes
from provision.transport import Local, Target
from wheelhouse import make_wheel, write_lock

ROOT = Path(__file__).resolve().parent.parent
H200 = Path(__file__).parent / "data" / "h200"


class StandIn(http.server.BaseHTTPRequestHandler):
    """Answers like an SGLang server whose speculation works: health, and /generate with 3-token steps."""

    def log_message(self, *a):
        pass

    def _send(self, body: dict):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"ok": True})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._send({"text": "same", "output_ids": [1, 2, 3], "meta_info": {"completion_tokens": 12,
                                                                            "spec_verify_ct": 4}})


def stand_in(port: int = 0) -> http.server.ThreadingHTTPServer:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), StandIn)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture
def gpu_host(tmp_path):
    """This interpreter's environment adopted on a local root whose nvidia-smi replays a recorded H200."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat {H200 / 'nvidia-smi-query.csv'}\n")
    smi.chmod(0o755)
    tr = Local(Target(host="local", root=str(tmp_path / "root"), nvidia_smi=str(smi)))
    applymod.adopt(tr, sys.prefix)
    return tr


def sglang_lock(port: int, launch: list[str], timeout: int = 20) -> lockmod.Lock:
    data = {"lock": 1, "name": "spoof", "platform": {"python": "%d.%d" % sys.version_info[:2]}, "packages": [],
            "engine": {"kind": "sglang", "port": port, "launch": launch},
            "probes": {"engine_timeout": timeout, "max_tokens": 4, "prompts": ["a"]}}
    return lockmod.loads(yaml.safe_dump(data), "spoof.yaml")


def engine_result(tr, lk) -> dict:
    rep = run_probes(tr, lk, only=["engine"])
    return next(r for r in rep["results"] if r["name"] == "engine")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SLEEPER = ["python", "-c", "import time; time.sleep(120)"]


def procs(marker: str) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                out.append(int(pid))
        except OSError:
            pass
    return [p for p in out if p != os.getpid()]


def test_engine_probe_refuses_a_port_already_answering(gpu_host):
    srv = stand_in()
    try:
        port = srv.server_address[1]
        r = engine_result(gpu_host, sglang_lock(port, SLEEPER))
        assert r["status"] == "fail", r
        assert f"port {port} is already in use by pid {os.getpid()}" in r["reason"]
    finally:
        srv.shutdown()
        srv.server_close()


def test_engine_probe_never_trusts_an_answer_it_did_not_launch(gpu_host):
    """The launch only sleeps; another process starts answering on the port after the launch: fail."""
    port = free_port()
    marker = f"spoof-{port}"
    late: list = []

    def after_launch():
        deadline = time.time() + 60
        while time.time() < deadline and not procs(marker):
            time.sleep(0.05)
        late.append(stand_in(port))

    t = threading.Thread(target=after_launch)
    t.start()
    try:
        r = engine_result(gpu_host, sglang_lock(port, ["python", "-c", f"import time; time.sleep(120)  # {marker}"]))
    finally:
        t.join()
        for srv in late:
            srv.shutdown()
            srv.server_close()
    assert r["status"] == "fail", r
    assert f"port {port} answers, but not from the launched engine" in r["reason"]
    assert f"pid {os.getpid()}" in r["reason"]
    log = Path(r["figures"]["log"])
    assert log.parent == Path(gpu_host.target.root) / "generations" / "0000-adopted"


def test_engine_probe_fails_a_launch_that_never_listens(gpu_host):
    r = engine_result(gpu_host, sglang_lock(free_port(), SLEEPER, timeout=3))
    assert r["status"] == "fail" and "engine not healthy after" in r["reason"], r


def test_probes_and_facts_ignore_the_operators_environment(tmp_path, wheels):
    """`apply --local` from a directory holding a foreign dist-info, with PYTHONPATH= and VIRTUAL_ENV set:
    the generation's `packages` probe and the plan see only the generation."""
    work = tmp_path / "checkout"
    (work / "intruder-9.9.dist-info").mkdir(parents=True)
    (work / "intruder-9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: intruder\nVersion: 9.9\n")
    lk = write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]])
    root = tmp_path / "root"
    env = {**os.environ, "VIRTUAL_ENV": str(tmp_path / "elsewhere"), "PIP_INDEX_URL": "http://x.invalid",
           "COLUMNS": "200"}

    def cli(*args):
        p = subprocess.run([sys.executable, "-m", "provision.cli", *map(str, args)], capture_output=True, text=True,
                           cwd=work, env={**env, "PYTHONPATH": f"{ROOT}:"})   # the tool itself, then '' (cwd)
        assert "Traceback" not in p.stderr, p.stderr
        return p

    p = cli("apply", "--local", "--root", root, "--lock", lk, "--json")
    rep = json.loads(p.stdout)
    assert p.returncode == 0 and rep["status"] == "applied", (rep.get("error"), p.stderr[-500:])
    pk = next(r for r in rep["probes"]["results"] if r["name"] == "packages")
    assert pk["status"] == "pass", pk
    p = cli("plan", "--local", "--root", root, "--lock", lk, "--detailed-exitcode")
    assert p.returncode == 0 and "No changes" in p.stdout, p.stdout


def broken_toolkit(tmp_path: Path) -> Path:
    """A CUDA home whose bin/nvcc is not a program (a broken toolkit install): the nvcc probe fails."""
    home = tmp_path / "broken-cuda"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").write_text("")
    return home


def test_gc_keeps_current_and_rollback_target_and_failed_drop_their_venv_at_once(tmp_path, wheels):
    root = tmp_path / "root"
    tr = Local(Target(host="local", root=str(root)))
    only_a = make_wheel(tmp_path / "wh", "onlya", "1.0")
    locks = [lockmod.load(write_lock(tmp_path / "a.yaml", "a", [wheels["alpha-1.0"], only_a])),
             lockmod.load(write_lock(tmp_path / "b.yaml", "b", [wheels["alpha-2.0"]])),
             lockmod.load(write_lock(tmp_path / "c.yaml", "c", [wheels["beta-1.0"]]))]
    reps = [applymod.apply(tr, lk) for lk in locks]
    bad = yaml.safe_load(Path(locks[2].path).read_text())
    bad["platform"]["cuda"] = {"version": "13.0", "source": "host", "home": str(broken_toolkit(tmp_path))}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(applymod.ProbesFailed) as e:
        applymod.apply(tr, lockmod.load(tmp_path / "bad.yaml"))
    failed = e.value.report.generation
    assert not (root / "generations" / failed / "venv").exists()          # dropped at once
    assert (root / "generations" / failed / "probes.json").exists()       # its record kept

    def cli(*args):
        p = subprocess.run([sys.executable, "-m", "provision.cli", "gc", "--local", "--root", str(root), *args,
                            "--json"], capture_output=True, text=True, cwd=ROOT)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
        return json.loads(p.stdout)

    def unpacked():    # uv's cache: each unpacked wheel by its dist-info, one archive dir each
        return {d.name: next(d.glob("*.dist-info")).name for d in (root / "cache" / "uv" / "archive-v0").iterdir()}

    dry = cli("--keep", "2", "--dry-run")
    assert (dry["current"], dry["rollback_target"]) == (reps[2].generation, reps[1].generation)
    before = unpacked()
    assert sorted(before[u["archive"]] for u in dry["uv_cache"]) == ["alpha-1.0.dist-info", "onlya-1.0.dist-info"]
    assert sorted(g["id"] for g in dry["generations"]) == sorted([reps[0].generation, failed])
    assert {c["sha256"] for c in dry["cache"]} == {p.sha256 for p in locks[0].packages}   # only `a` used them
    assert (root / "generations" / reps[0].generation / "venv").exists()   # a dry run removes nothing
    out = cli("--keep", "2")
    assert sorted(g["id"] for g in out["generations"]) == sorted(g["id"] for g in dry["generations"])
    assert sorted(p.name for p in (root / "generations").iterdir()) == [reps[1].generation, reps[2].generation]
    assert not (root / "cache" / "wheels" / dry["cache"][0]["sha256"]).exists()
    assert out["run_dirs"] == ([reps[0].run_dir] if reps[0].run_dir else [])     # an Ansible run's dir, if any
    assert not reps[0].run_dir or not Path(reps[0].run_dir).exists()
    assert sorted(unpacked().values()) == ["alpha-2.0.dist-info", "beta-1.0.dist-info"]  # what kept venvs link
    assert generations.rollback(tr).to == reps[1].generation              # what rollback needs is kept
    assert generations.history(tr).events[-2]["event"] == "gc"
    again = applymod.apply(tr, locks[0])                                   # uv unpacks a pruned wheel again
    assert again.status == "applied" and "onlya-1.0.dist-info" in sorted(unpacked().values())
