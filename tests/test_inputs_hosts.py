"""`hosts trust` records exactly the key it showed (one scan) and says when it replaces another; host specs
are checked before anything connects."""
from __future__ import annotations

import paramiko
import pytest
from typer.testing import CliRunner

from provision.cli import app
from provision.errors import InputError
from provision.loopback import LoopbackHost
from provision.transport import Target, fingerprint, known_hosts_name


def test_trust_records_the_key_it_showed_and_says_what_it_replaces(tmp_path, monkeypatch):
    from provision import transport

    kh = tmp_path / "known_hosts"
    with LoopbackHost() as h:
        t = Target.parse(h.spec, known_hosts=kh)
        name = known_hosts_name(t)
        stale = paramiko.Ed25519Key.from_private_key_file(str(h.dir / "client_ed25519"))   # any other key
        kh.write_text(f"other.example ssh-ed25519 {stale.get_base64()}\n{name} ssh-ed25519 {stale.get_base64()}\n")

        scans = []
        real_scan = transport.scan_host_key
        monkeypatch.setattr("provision.cli.hosts.scan_host_key", lambda target: scans.append(1) or real_scan(target))
        r = CliRunner().invoke(app, ["hosts", "trust", h.spec, "--yes", "--known-hosts", str(kh)])
        assert r.exit_code == 0, r.output
        assert len(scans) == 1                                   # scanned once: what is recorded is what was shown
        offered = real_scan(t)
        shown = f"{h.spec} offers ssh-ed25519 {fingerprint(offered)}"
        assert shown in r.output
        assert f"REPLACES the recorded key ssh-ed25519 {fingerprint(stale)}" in r.output
        assert f"replaced ssh-ed25519 {fingerprint(stale)}" in r.output
        lines = kh.read_text().splitlines()
        assert lines == [f"other.example ssh-ed25519 {stale.get_base64()}",
                         f"{name} ssh-ed25519 {offered.get_base64()}"]

        r = CliRunner().invoke(app, ["hosts", "trust", h.spec, "--yes", "--known-hosts", str(kh)])
        assert r.exit_code == 0 and "Already trusted" in r.output and kh.read_text().splitlines() == lines

        h.rekey()                                                # the operator declines a changed key
        r = CliRunner().invoke(app, ["hosts", "trust", h.spec, "--known-hosts", str(kh)], input="n\n")
        assert r.exit_code == 1 and "REPLACES the recorded key" in r.output
        assert kh.read_text().splitlines() == lines


@pytest.mark.parametrize("spec,expect", [
    ("h:99999", "port 99999 is out of range (1–65535)"),
    ("h:0", "port 0 is out of range"),
    ("h:-1", "bad port '-1'"),
    ("h:22x", "bad port '22x'"),
    ("[::1]:65536", "port 65536 is out of range"),
    ("-oProxyCommand=id", "bad host name"),
    ("u;id@h", "bad user name"),
])
def test_host_spec_refused(spec, expect):
    with pytest.raises(InputError, match=expect.replace("(", r"\(").replace(")", r"\)")) as e:
        Target.parse(spec)
    assert e.value.exit_code == 2 and e.value.where == f"host {spec!r}"


def test_host_spec_accepted():
    assert Target.parse("root@10.0.0.1:2222").port == 2222
    assert Target.parse("[::1]:2200").host == "::1"
    assert Target.parse("gpu-01.example.com").port == 22
    with pytest.raises(InputError, match="out of range"):
        Target(host="h", port=99999)              # inventories build Targets directly: checked there too
