"""`provision pack`: a generation back into a hashed wheelhouse that a host with no route to any index rebuilds
exactly; drift against RECORD refused or recorded; wheel names, scripts, data files and patched files as shipped."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from provision.agent import record
from provision.agent.pack import compress_tags, unshebang, wheel_name
from provision.loopback import LoopbackHost
from provision.transport import trust_host
from test_core import cli, host_args
from wheelhouse import make_wheel, sha256, write_lock

PY = "cp%d%d" % sys.version_info[:2]
PLATFORM_TAGS = [f"{PY}-{PY}-manylinux_2_17_x86_64", f"{PY}-{PY}-manylinux2014_x86_64"]


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def rich_wheel(outdir: Path, name="tool", version="1.0", build="1") -> Path:
    """A platform wheel with a build tag, a console script, a script, a data file, a header and a module a
    patch series targets."""
    mod, info, data = name.replace("-", "_"), f"{name.replace('-', '_')}-{version}.dist-info", f"{name}-{version}.data"
    files = {
        f"{mod}/__init__.py": b"def main():\n    print('tool main')\n",
        f"{mod}/target.py": b"SUPPORTED = (9, 10)\n\n\ndef size(cc):\n    return SUPPORTED.index(cc)\n",
        f"{data}/scripts/tool-helper": b"#!python\nprint('helper')\n",
        f"{data}/data/share/tool/notes.txt": b"data file\n",
        f"{data}/headers/tool.h": b"#define TOOL 1\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": ("Wheel-Version: 1.0\nGenerator: provision-tests\nRoot-Is-Purelib: false\n"
                          + "".join(f"Tag: {t}\n" for t in PLATFORM_TAGS) + f"Build: {build}\n").encode(),
        f"{info}/entry_points.txt": f"[console_scripts]\ntool = {mod}:main\n".encode(),
    }
    record_text = "".join(f"{p},{_hash(d)},{len(d)}\n" for p, d in files.items()) + f"{info}/RECORD,,\n"
    files[f"{info}/RECORD"] = record_text.encode()
    path = outdir / wheel_name(name, version, PLATFORM_TAGS, build)
    with zipfile.ZipFile(path, "w") as z:
        for p, d in files.items():
            z.writestr(zipfile.ZipInfo(p, date_time=(2020, 1, 1, 0, 0, 0)), d)
    return path


def series(folder: Path) -> Path:
    d = folder / "patches" / "tool-1.0"
    d.mkdir(parents=True)
    (d / "series.yaml").write_text("series: 1\npackage: tool\nversion: '==1.0'\npatches:\n  - file: 0001-cc12.patch\n"
                                   "    description: capability 12\n    reason: the table lacks 12\n")
    (d / "0001-cc12.patch").write_text("--- a/tool/target.py\n+++ b/tool/target.py\n@@ -1,4 +1,4 @@\n"
                                       "-SUPPORTED = (9, 10)\n+SUPPORTED = (9, 10, 12)\n \n \n def size(cc):\n")
    return d


def site_hashes(venv: Path) -> dict:
    """{path under site-packages: sha256} of every installed file outside the dist-infos (where installers
    write their own INSTALLER/RECORD), bytecode left out."""
    site = Path(record.site_packages(str(venv)))
    out = {}
    for p in site.rglob("*"):
        rel = p.relative_to(site).as_posix()
        if p.is_file() and ".dist-info/" not in rel and "__pycache__" not in rel:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def test_wheel_names_follow_pep_425_and_427():
    assert compress_tags(["py2-none-any", "py3-none-any"]) == "py2.py3-none-any"
    assert compress_tags(["cp312-cp312-manylinux_2_27_x86_64", "cp312-cp312-manylinux_2_28_x86_64"]) == \
        "cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64"
    assert wheel_name("Foo.Bar-baz", "2.9.1+cu130", ["py3-none-any"], "7") == \
        "foo_bar_baz-2.9.1+cu130-7-py3-none-any.whl"
    two = ["py3-none-any", "py2-none-any"]                            # WHEEL's order
    assert wheel_name("x", "1", two) == "x-1-py3.py2-none-any.whl"
    assert wheel_name("x", "1", two, source="X-1-py2.py3-none-any.whl") == "x-1-py2.py3-none-any.whl"
    assert wheel_name("x", "1", two, source="x-1-py3-none-any.whl") == "x-1-py3.py2-none-any.whl"  # not these tags


def test_only_the_installers_interpreter_line_goes_back_to_python():
    venv = {"/opt/x/venv/bin"}
    assert unshebang(b"#!/opt/x/venv/bin/python\nprint(1)\n", venv) == b"#!python\nprint(1)\n"
    assert unshebang(b"#!/opt/x/venv/bin/python3.12\nprint(1)\n", venv) == b"#!python\nprint(1)\n"
    long = {"/very/long/bin"}
    assert unshebang(b"#!/bin/sh\n'''exec' /very/long/bin/python \"$0\" \"$@\"\n' '''\nprint(1)\n", long) == \
        b"#!python\nprint(1)\n"                                   # pip's trampoline
    assert unshebang(b"#!/bin/sh\n'''exec' '/very/long/bin/python' \"$0\" \"$@\"\n' '''\nprint(1)\n", long) == \
        b"#!python\nprint(1)\n"                                   # uv's
    for shipped in (b"#!/usr/bin/env python3\nprint(1)\n", b"#!/usr/bin/python3\nprint(1)\n",
                    b"#!/opt/other/bin/python\nprint(1)\n", b"#!/opt/x/venv/bin/pip\n", b"#!/bin/bash\necho hi\n",
                    b"#!/bin/sh\n'''exec' /elsewhere/bin/python \"$0\" \"$@\"\n' '''\nprint(1)\n", b"\x7fELF\x02"):
        assert unshebang(shipped, venv | long) == shipped             # not the installer's: byte for byte


@pytest.fixture
def offline_host(tmp_path):
    """A host in a network namespace of its own: no route to any index, nor to the controller's loopback."""
    h = LoopbackHost(netns=True)
    kh = tmp_path / "known_hosts"
    try:
        h.start()
        t = h.target
        t.known_hosts = kh
        trust_host(t)
        yield h, kh
    finally:
        h.cleanup()


def test_pack_managed_generation_and_rebuild_offline(target, tmp_path, wheels, offline_host):
    house = tmp_path / "src"
    house.mkdir()
    tool = rich_wheel(house)
    series(house)
    lk = write_lock(house / "stack.yaml", "stack", [tool, wheels["alpha-1.0"]], patches=["patches/tool-1.0"])
    cli("apply", *host_args(target), "--lock", lk, check=0)
    src_root = Path(target.root)
    src_venv = src_root / "current" / "venv"
    patched = record.site_packages(str(src_venv)) + "/tool/target.py"
    assert "(9, 10, 12)" in Path(patched).read_text()

    out = tmp_path / "house"
    shipped = zipfile.ZipFile(tool).read("tool/target.py")
    p = cli("pack", *host_args(target), "--out", out, check=0)     # over SSH: the wheels come back by hash
    assert "patch series patches/tool-1.0 not found here" in p.stderr     # the host keeps no series: say so
    with zipfile.ZipFile(out / tool.name) as z:                   # as shipped: from the host's cached wheel
        assert z.read("tool/target.py") == shipped
    for cached in (src_root / "cache" / "wheels").glob(f"*/{tool.name}"):
        cached.unlink()                                             # gone: the series, reversed, brings it back
    p = cli("pack", *host_args(target), "--out", out, "--base", lk, "--force", check=0)   # the lock it was applied from
    assert "Packed" in p.stdout and "÷ first read" in p.stdout, p.stdout
    packed = yaml.safe_load((out / "lock.yaml").read_text())
    assert packed["patches"] == ["patches/tool-1.0"] and (out / "patches" / "tool-1.0" / "series.yaml").is_file()
    by_name = {q["name"]: q for q in packed["packages"]}
    assert by_name["tool"]["filename"] == tool.name                 # build tag and compressed platform tags
    for q in packed["packages"]:
        assert hashlib.sha256((out / q["filename"]).read_bytes()).hexdigest() == q["sha256"]
        assert q["url"] == (out / q["filename"]).as_uri()
    with zipfile.ZipFile(out / tool.name) as z:
        names = set(z.namelist())
        assert z.read("tool/target.py") == shipped
        assert z.read("tool-1.0.data/scripts/tool-helper").startswith(b"#!python\n")
        assert {"tool-1.0.data/data/share/tool/notes.txt", "tool-1.0.data/headers/tool.h"} <= names
        assert not any(n.endswith(("INSTALLER", "REQUESTED", "direct_url.json")) or n.endswith("/tool")
                       for n in names)                               # the console script is the installer's
        assert z.testzip() is None and z.getinfo("tool/__init__.py").compress_type in (zipfile.ZIP_STORED,
                                                                                     zipfile.ZIP_DEFLATED)
        assert z.getinfo("tool-1.0.data/scripts/tool-helper").external_attr >> 16 & 0o111
    assert cli("lock", "check", out / "lock.yaml", "--offline", check=0)

    h, kh = offline_host
    other = ["root@%s" % h.address, "--key", h.dir / "client_ed25519", "--known-hosts", kh, "--root", h.root]
    reach = subprocess.run(["ip", "netns", "exec", h.netns, sys.executable, "-c",
                            "import socket; socket.create_connection(('pypi.org', 443), timeout=3)"],
                           capture_output=True, text=True)
    assert reach.returncode != 0                                    # really offline
    env = {**os.environ, "PROVISION_WHEELHOUSE": str(out)}
    a = subprocess.run([sys.executable, "-m", "provision.cli", "apply", *map(str, other), "--lock",
                        str(out / "lock.yaml"), "--wheels-from", "controller"], capture_output=True, text=True,
                       env=env, cwd=Path(__file__).parent.parent)
    assert a.returncode == 0, a.stderr
    new_venv = Path(h.root) / "current" / "venv"
    assert site_hashes(new_venv) == site_hashes(src_venv)           # patched file included: the series re-applied
    for venv in (src_venv, new_venv):
        chk = record.check(str(venv))
        assert {n: d["changed"] for n, d in chk["dists"].items() if d["changed"] or d["missing"]} == \
            {"tool": ["tool/target.py"]}                             # only what the series changes
    run = subprocess.run([str(new_venv / "bin" / "tool")], capture_output=True, text=True)
    assert run.stdout == "tool main\n"                              # regenerated by the installer
    assert (new_venv / "bin" / "tool-helper").read_text() == f"#!{new_venv.resolve()}/bin/python\nprint('helper')\n"
    assert (new_venv / "share" / "tool" / "notes.txt").read_text() == "data file\n"


@pytest.fixture
def adopted(tmp_path, wheels):
    """A hand-made venv (uv, from the test wheels, offline) adopted as generation 0 of a local root."""
    venv = tmp_path / "env"
    subprocess.run(["uv", "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    subprocess.run(["uv", "pip", "install", "-q", "--offline", "--no-index", "--python", str(venv / "bin" / "python"),
                    "--link-mode", "copy", "--cache-dir", str(tmp_path / "uv-cache"),   # an edit reaches no other venv
                    str(wheels["alpha-1.0"]), str(wheels["beta-1.0"])], check=True)
    root = tmp_path / "root"
    cli("adopt", "--local", venv, "--root", root, check=0)
    return venv, root


def test_adopted_drift_refused_then_recorded_with_base_and_extra(adopted, tmp_path, wheels):
    venv, root = adopted
    site = Path(record.site_packages(str(venv)))
    (site / "alpha" / "__init__.py").write_text("__version__ = 'edited by hand'\n")
    out = tmp_path / "house"
    p = cli("pack", "--local", "--root", root, "--out", out, check=1)
    assert "no longer match their RECORD: alpha: alpha/__init__.py" in p.stderr and "--allow-drift" in p.stderr
    said = [x for x in p.stderr.strip().splitlines() if not x.lstrip().startswith("local  · pack ")]   # progress
    assert len(said) == 1 and said[0].startswith("error: local: "), p.stderr
    assert not any(out.iterdir())             # the wheels it wrote as it read are gone with the refusal

    base = write_lock(tmp_path / "base.yaml", "gpu-base", [], engine={"kind": "none"}, probes={"min_speedup": 1.0},
                      requires=[])
    wrong = write_lock(tmp_path / "wrong.yaml", "wrong", [], python="3.99")
    assert "runs Python" in cli("pack", "--local", "--root", root, "--out", out, "--allow-drift", "--base", wrong,
                                check=2).stderr
    p = cli("pack", "--local", "--root", root, "--out", out, "--allow-drift", "--base", base,
            "--with", wheels["gamma-1.0"], check=0)
    assert "drift alpha: alpha/__init__.py" in p.stdout
    data = yaml.safe_load((out / "lock.yaml").read_text())
    assert data["name"] == "gpu-base" and data["probes"] == {"min_speedup": 1.0}
    pk = {q["name"]: q for q in data["packages"]}
    assert pk["alpha"]["drift"] == ["alpha/__init__.py"] and "drift" not in pk["beta"]
    assert pk["gamma"]["sha256"] == hashlib.sha256(wheels["gamma-1.0"].read_bytes()).hexdigest()
    with zipfile.ZipFile(out / pk["alpha"]["filename"]) as z:              # packed as found, RECORD made anew
        assert z.read("alpha/__init__.py") == b"__version__ = 'edited by hand'\n"
        rec = z.read("alpha-1.0.dist-info/RECORD").decode()
        assert _hash(b"__version__ = 'edited by hand'\n") in rec
    cli("lock", "check", out / "lock.yaml", "--offline", check=0)

    bad = dict(data, packages=[dict(pk["alpha"], drift="alpha/__init__.py")])    # the field is checked
    (out / "bad.yaml").write_text(yaml.safe_dump(bad))
    assert "packages.0.drift" in cli("lock", "check", out / "bad.yaml", check=2).stderr

    # `--local` runs pack.yml (`connection: local`) without loading paramiko; `--json` gives the figures
    code = ("import sys, json; from provision.cli import app\n"
            "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
            "print(json.dumps([rc, [m for m in ('paramiko', 'ansible_runner') if m in sys.modules]]))")
    r = subprocess.run([sys.executable, "-c", code, "pack", "--local", "--root", str(root), "--out",
                        str(tmp_path / "h2"), "--allow-drift", "--json"], capture_output=True, text=True,
                       cwd=Path(__file__).parent.parent)
    lines = r.stdout.strip().splitlines()
    assert json.loads(lines[-1]) == [0, ["ansible_runner"]], r.stderr
    rep = json.loads("\n".join(lines[:-1]))
    assert rep["distributions"] == 2 and rep["seconds"]["read"] > 0 and rep["ratio"] > 0
    beta = pk["beta"]["filename"]
    assert (tmp_path / "h2" / beta).read_bytes() == (out / beta).read_bytes()   # the same env packs to the same bytes


def test_scripts_rebuild_as_shipped(tmp_path):
    """A script the wheel ships with its own interpreter line is packed byte for byte; only the line the installer
    wrote for `#!python` goes back to `#!python`: packed, rebuilt elsewhere, every file hashes the same."""
    shipped = {"scripts-1.0.data/scripts/by-env": b"#!/usr/bin/env python3\nprint('by env')\n",
               "scripts-1.0.data/scripts/by-installer": b"#!python\nprint('by installer')\n"}
    whl = make_wheel(tmp_path / "src", "scripts", "1.0", extra=shipped)
    lk = write_lock(tmp_path / "src" / "lock.yaml", "scripts", [whl])
    roots = tmp_path / "a", tmp_path / "b"
    cli("apply", "--local", "--root", roots[0], "--lock", lk, check=0)
    out = tmp_path / "house"
    cli("pack", "--local", "--root", roots[0], "--out", out, check=0)
    with zipfile.ZipFile(out / whl.name) as z:
        assert {arc: z.read(arc) for arc in shipped} == shipped
    cli("apply", "--local", "--root", roots[1], "--lock", out / "lock.yaml", check=0)

    venvs = [(r / "current" / "venv").resolve() for r in roots]
    assert site_hashes(venvs[0]) == site_hashes(venvs[1])
    for v in venvs:
        assert (v / "bin" / "by-env").read_bytes() == shipped["scripts-1.0.data/scripts/by-env"]
        assert (v / "bin" / "by-installer").read_bytes() == f"#!{v}/bin/python\nprint('by installer')\n".encode()
    run = subprocess.run([str(venvs[1] / "bin" / "by-installer")], capture_output=True, text=True)
    assert run.stdout == "by installer\n"


def test_packed_wheel_names_spell_tags_as_the_source_wheel(tmp_path):
    tags = ["cp311-none-any", "py2-none-any", "py3-none-any"]
    whl = make_wheel(tmp_path / "src", "order", "1.0", tag="py3.py2.cp311-none-any", wheel_tags=tags)
    lk = write_lock(tmp_path / "src" / "lock.yaml", "order", [whl])
    root = tmp_path / "root"
    cli("apply", "--local", "--root", root, "--lock", lk, check=0)
    out = tmp_path / "house"
    cli("pack", "--local", "--root", root, "--out", out, check=0)
    packed = yaml.safe_load((out / "lock.yaml").read_text())["packages"]
    assert [q["filename"] for q in packed] == [whl.name] and (out / whl.name).is_file()


def test_pack_refuses_a_folder_that_is_not_empty(adopted, tmp_path, wheels):
    venv, root = adopted
    out = tmp_path / "house"
    out.mkdir()
    alpha = wheels["alpha-1.0"].name
    (out / "lock.yaml").write_text("mine\n")
    (out / alpha).write_bytes(b"another alpha")
    p = cli("pack", "--local", "--root", root, "--out", out, check=2)
    assert len(p.stderr.strip().splitlines()) == 1 and f"{out} is not empty (" in p.stderr and "--force" in p.stderr
    assert (out / "lock.yaml").read_text() == "mine\n" and (out / alpha).read_bytes() == b"another alpha"
    assert sorted(x.name for x in out.iterdir()) == sorted(["lock.yaml", alpha])     # nothing written

    cli("pack", "--local", "--root", root, "--out", out, "--force", check=0)
    packed = {q["name"]: q for q in yaml.safe_load((out / "lock.yaml").read_text())["packages"]}
    assert packed["alpha"]["sha256"] == sha256(out / alpha)

    mine = tmp_path / "with"             # the --with wheels already in DIR are what it was meant to hold
    mine.mkdir()
    gamma = mine / wheels["gamma-1.0"].name
    gamma.write_bytes(wheels["gamma-1.0"].read_bytes())
    cli("pack", "--local", "--root", root, "--out", mine, "--with", gamma, check=0)
    assert {q["name"] for q in yaml.safe_load((mine / "lock.yaml").read_text())["packages"]} == \
        {"alpha", "beta", "gamma"}


def test_hash_mismatches_name_both_hashes_whole(tmp_path):
    """A wheel brought back by hash (pack's fetch, the host's cache) and a patched file that changed since apply:
    each refusal names both sha256 in full (cut short, two different hashes can look the same)."""
    from provision.agent.cache import AgentError, store

    data = b"packed wheel bytes"
    got = hashlib.sha256(data).hexdigest()
    want = got[:16] + "0" * 48                      # the same first 16 characters
    with pytest.raises(AgentError) as e:
        store(str(tmp_path / "x-1.0-py3-none-any.whl"), want, [data], "x")
    assert f"file is {got}, the lock says {want};" in str(e.value)
    assert not list(tmp_path.iterdir())

    house = tmp_path / "src"
    house.mkdir()
    series(house)
    lk = write_lock(house / "stack.yaml", "stack", [rich_wheel(house)], patches=["patches/tool-1.0"])
    root = tmp_path / "root"
    cli("apply", "--local", "--root", root, "--lock", lk, check=0)
    patched = Path(record.site_packages(str(root / "current" / "venv"))) / "tool" / "target.py"
    before = hashlib.sha256(patched.read_bytes()).hexdigest()
    patched.write_text("SUPPORTED = ()\n")
    p = cli("probe", "--local", "--root", root, "--only", "patches", "--json", check=1)
    now = hashlib.sha256(b"SUPPORTED = ()\n").hexdigest()
    assert f"sha256 {now} ≠ manifest {before}" in json.dumps(json.loads(p.stdout), ensure_ascii=False), p.stdout
