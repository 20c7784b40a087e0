"""Wheel sizes: `lock resolve` records them from the index (PEP 700), the lock validates them, plan counts
the bytes a host has to download and the disk a build needs (and refuses what does not fit); an error in a
plan is exit 1, always."""
from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import threading
from pathlib import Path

import pytest
import yaml

from provision import lock as lockmod
from provision import resolve
from provision.errors import LockError
from provision.units import human_size
from test_core import cli, host_args
from wheelhouse import make_wheel, sha256, write_lock

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- resolve records sizes

class JsonIndex(http.server.SimpleHTTPRequestHandler):
    """A PEP 691 JSON index on loopback: /simple/<name>/ is <root>/simple/<name>/index.json."""
    extensions_map = {".json": "application/vnd.pypi.simple.v1+json", "": "application/octet-stream"}

    def log_message(self, *args):
        pass

    def send_head(self):
        if self.path.endswith("/"):
            self.path += "index.json"
        return super().send_head()


@pytest.fixture
def json_index(tmp_path, monkeypatch):
    monkeypatch.setattr(resolve, "CACHE", tmp_path / "cache")
    root = tmp_path / "index"
    built = [make_wheel(tmp_path / "build", "app", "1.0", ["lib>=1"], body="x = %r\n" % ("a" * 3000)),
             make_wheel(tmp_path / "build", "lib", "1.0")]
    (root / "files").mkdir(parents=True)
    for w in built:
        (root / "files" / w.name).write_bytes(w.read_bytes())
        name = w.name.split("-")[0]
        (root / "simple" / name).mkdir(parents=True)
        (root / "simple" / name / "index.json").write_text(json.dumps({
            "meta": {"api-version": "1.1"}, "name": name, "versions": ["1.0"],
            "files": [{"filename": w.name, "url": f"../../files/{w.name}", "hashes": {"sha256": sha256(w)},
                       "size": w.stat().st_size}]}))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(JsonIndex, directory=str(root)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}/simple", {w.name: w.stat().st_size for w in built}
    srv.shutdown()
    srv.server_close()


def test_resolve_records_each_wheels_size_from_the_index(tmp_path, json_index):
    url, sizes = json_index
    lk = tmp_path / "l.yaml"
    lk.write_text(f"lock: 1\nname: t\nplatform:\n  python: '3.12'\nindexes:\n  local: {url}\nrequires:\n- app==1.0\n"
                  "engine: {kind: none}\n")
    res = resolve.resolve(lockmod.load(lk))
    assert {p["filename"]: p["size"] for p in res.packages} == sizes
    written = tmp_path / "out.yaml"
    written.write_text(resolve.rewrite_resolved(lk.read_text(), res))
    assert {p.filename: p.size for p in lockmod.load(written).packages} == sizes


# ---------------------------------------------------------------- the lock's field

@pytest.mark.parametrize("value, why", [("-1", r"-1 is out of range"), ("'12'", "expected int, got a string"),
                                        ("true", "expected a number"), ("1.5", "expected int, got a float")])
def test_size_must_be_a_non_negative_integer(tmp_path, wheels, value, why):
    text = write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]]).read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("  sha256: ", f"  size: {value}\n  sha256: ", 1))
    line = next(i for i, ln in enumerate(bad.read_text().splitlines(), 1) if ln.startswith("  size:"))
    with pytest.raises(LockError, match=why) as e:
        lockmod.load(bad)
    assert str(e.value).startswith(f"{bad}:{line}: packages.0.size: ")
    p = cli("lock", "check", bad, check=2)
    assert f"{bad}:{line}" in p.stderr and "packages.0.size" in p.stderr


# ---------------------------------------------------------------- plan: download bytes, disk, exit codes

def sized_lock(path: Path, name: str, wheels: list[Path], remote: dict[str, int | None]) -> Path:
    """A lock of `wheels` (file:// URLs, which the controller pushes) plus packages named in `remote`
    served from an index over https (never reached by plan), each with the size given (None: no size)."""
    data = yaml.safe_load(write_lock(path, name, wheels).read_text())
    for i, (pkg, size) in enumerate(remote.items()):
        fname = f"{pkg.replace('-', '_')}-1.0-py3-none-any.whl"
        entry = {"name": pkg, "version": "1.0", "filename": fname,
                 "url": f"https://files.example.org/{fname}", "sha256": hashlib.sha256(fname.encode()).hexdigest()}
        if size is not None:
            entry["size"] = size
        data["packages"].append(entry)
        data["requires"].append(f"{pkg}==1.0")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def plan_json(target, lk: Path, check: int) -> dict:
    p = cli("plan", *host_args(target), "--lock", lk, "--json", check=check)
    return json.loads(p.stdout)


def test_plan_counts_what_the_host_lacks_with_sizes_and_unknowns(target, wheels, tmp_path):
    cli("apply", *host_args(target), "--lock", write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]]),
        check=0)                                           # alpha is now in the host's cache
    lk = sized_lock(tmp_path / "b.yaml", "stack-b", [wheels["alpha-1.0"], wheels["beta-1.0"]],
                    {"remote-one": 123_456_789, "remote-two": None})
    plan = plan_json(target, lk, 0)
    beta = wheels["beta-1.0"].stat().st_size               # a file:// wheel: its size is the file's
    assert {k: plan["download"][k] for k in ("wheels", "bytes", "unknown")} == \
        {"wheels": 3, "bytes": beta + 123_456_789, "unknown": 1}
    text = cli("plan", *host_args(target), "--lock", lk, check=0).stdout
    assert f"download 3 wheels, {human_size(beta + 123_456_789)} (+1 of unknown size)" in text
    assert f"disk needed ≥ {human_size(plan['download']['disk_needed'])}" in text

    every = sized_lock(tmp_path / "c.yaml", "stack-c", [wheels["alpha-1.0"]], {"remote-one": 1000})
    plan = plan_json(target, every, 0)
    assert plan["download"]["unknown"] == 0 and plan["download"]["bytes"] == 1000
    text = cli("plan", *host_args(target), "--lock", every, check=0).stdout
    assert "unknown size" not in text and "disk needed ≥" not in text and f"download 1 wheels, {human_size(1000)};" in text


def test_plan_disk_check_uses_the_sizes_and_its_error_exits_1(target, wheels, tmp_path):
    root = Path(target.root)
    root.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    lk = sized_lock(tmp_path / "big.yaml", "stack-big", [wheels["alpha-1.0"]], {"huge": 2 * free})
    plan = plan_json(target, lk, 1)
    assert len(plan["errors"]) == 1 and plan["errors"][0].startswith("only ") and "this build needs about" in \
        plan["errors"][0]
    p = cli("plan", *host_args(target), "--lock", lk, "--detailed-exitcode", check=1)
    assert "\nerror: only " in p.stdout
    assert not (root / "generations").exists() or not any((root / "generations").iterdir())


def test_plan_exits_1_without_the_locks_python_and_on_the_headline_lock(target, wheels, tmp_path):
    lk = write_lock(tmp_path / "old.yaml", "stack-old", [wheels["alpha-1.0"]], python="3.99")
    p = cli("plan", *host_args(target), "--lock", lk, check=1)
    assert "error: host has no working Python 3.99" in p.stdout
    p = cli("plan", *host_args(target), "--lock", ROOT / "lockfiles" / "cuda13.0-sglang0.5.9.yaml", check=1)
    assert "\nerror: " in p.stdout and "is unresolved in the lock" in p.stdout
    ok = write_lock(tmp_path / "ok.yaml", "stack-ok", [wheels["alpha-1.0"]])
    cli("plan", *host_args(target), "--lock", ok, check=0)
    cli("plan", *host_args(target), "--lock", ok, "--detailed-exitcode", check=2)
