"""A fleet from an Ansible inventory: two hosts in their own network namespaces, each with its own
sshd and root; batches (--serial) stop the rollout at the first failing batch; hosts that cannot reach
the index build from wheels the controller fetched once and pushed by hash."""
from __future__ import annotations

import http.server
import os
import threading
from functools import partial
from pathlib import Path

import pytest
import yaml

from provision.loopback import LoopbackHost
from provision.transport import trust_host
from test_core import cli
from wheelhouse import write_lock


@pytest.fixture
def fleet(tmp_path):
    hosts = [LoopbackHost(netns=True), LoopbackHost(netns=True)]
    kh = tmp_path / "known_hosts"
    try:
        for h in hosts:
            h.start()
            t = h.target
            t.known_hosts = kh
            trust_host(t)
        yield hosts, kh
    finally:
        for h in hosts:
            h.cleanup()


def inventory(path: Path, hosts, roots) -> Path:
    lines = ["all:", "  hosts:"]
    for i, (h, root) in enumerate(zip(hosts, roots)):
        lines += [f"    gpu{i}:", f"      ansible_host: {h.address}", f"      ansible_port: {h.port}",
                  "      ansible_user: root", f"      ansible_ssh_private_key_file: {h.dir / 'client_ed25519'}",
                  f"      provision_root: {root}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_fleet_apply_and_failed_batch_stops_rollout(fleet, tmp_path, wheels):
    hosts, kh = fleet
    a = write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]])
    inv = inventory(tmp_path / "inv.yml", hosts, [h.root for h in hosts])
    out = cli("apply", "-i", inv, "--known-hosts", kh, "--lock", a, "--serial", "1", check=0).stdout
    assert "Fleet: 2 applied, 0 noop, 0 failed, 0 not-attempted." in out
    for h in hosts:
        assert os.readlink(Path(h.root) / "current") == "generations/0001-stack-a"

    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the first host's root should be\n")
    inv2 = inventory(tmp_path / "inv2.yml", hosts, [blocked, hosts[1].root + "-2"])
    p = cli("apply", "-i", inv2, "--known-hosts", kh, "--lock", a, "--serial", "1", check=1)
    assert "1 failed, 1 not-attempted" in p.stdout
    assert not Path(hosts[1].root + "-2").exists()


@pytest.fixture
def index(wheels):
    """The test wheels served over http on the controller's loopback, which no namespaced host can reach;
    yields (base URL, the paths requested)."""
    requested: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            requested.append(self.path)
            super().do_GET()

        def log_message(self, *a):
            pass

    d = next(iter(wheels.values())).parent
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(d)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", requested
    server.shutdown()
    server.server_close()


def served_lock(path: Path, name: str, wheels: list[Path], base: str, bad_sha: str | None = None) -> Path:
    write_lock(path, name, wheels)
    data = yaml.safe_load(path.read_text())
    for p in data["packages"]:
        p["url"] = f"{base}/{p['filename']}"
        if p["name"] == bad_sha:
            p["sha256"] = "0" * 64
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_wheels_from_controller_fetched_once_and_pushed_to_offline_hosts(fleet, tmp_path, wheels, index,
                                                                          monkeypatch):
    hosts, kh = fleet
    base, requested = index
    monkeypatch.setenv("PROVISION_HOME", str(tmp_path / "controller"))
    lk = served_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"], wheels["beta-1.0"]], base)
    inv = inventory(tmp_path / "inv.yml", hosts, [h.root for h in hosts])

    p = cli("apply", "-i", inv, "--known-hosts", kh, "--lock", lk, check=1)    # the hosts fetch: no route
    assert "Fleet: 0 applied, 0 noop, 2 failed" in p.stdout
    # the downloads run in parallel: the first to fail is named (the others are stopped), whichever it is
    assert p.stdout.count("fetch failed: ") == 2 and ("alpha==1.0" in p.stdout or "beta==1.0" in p.stdout)
    assert requested == []

    p = cli("apply", "-i", inv, "--known-hosts", kh, "--lock", lk, "--wheels-from", "controller", check=0)
    assert "Fleet: 2 applied, 0 noop, 0 failed, 0 not-attempted." in p.stdout
    assert p.stderr.count("2 packages with uv, 2 pushed by the controller") == 2
    assert sorted(requested) == ["/alpha-1.0-py3-none-any.whl", "/beta-1.0-py3-none-any.whl"]   # once per fleet
    for h in hosts:
        assert os.readlink(Path(h.root) / "current") == "generations/0002-stack-a"
        assert len(list((Path(h.root) / "cache" / "wheels").glob("*/*.whl"))) == 2

    bad = served_lock(tmp_path / "bad.yaml", "stack-bad", [wheels["alpha-2.0"], wheels["gamma-1.0"]], base,
                      bad_sha="gamma")
    line = next(i for i, t in enumerate(bad.read_text().splitlines(), 1) if t.startswith("- name: gamma"))
    p = cli("apply", "-i", inv, "--limit", "gpu0", "--known-hosts", kh, "--lock", bad, "--wheels-from",
            "controller", check=1)
    said = [ln.split() for ln in p.stderr.splitlines()]     # an inventory's one host goes through the play too
    assert ["gpu0", "✗", "build", f"{bad}:{line}:", "gamma==1.0:", "sha256", "mismatch"] in [s[:7] for s in said], \
        p.stderr
    assert "Fleet: 0 applied, 0 noop, 1 failed" in p.stdout, p.stdout
    assert not list((tmp_path / "controller" / "cache" / "wheels").glob("0000*"))
    assert not list((Path(hosts[0].root) / "cache" / "wheels").glob("*/gamma*"))
