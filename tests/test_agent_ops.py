"""The host steps of a build are agents of their own, each with its OPS: `cache` (have, push), `fetch` (fetch), `build`
(build), `tool` (unpack); each answers its own operations only, through the one bundle the controller ships."""
from __future__ import annotations

import base64
import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from provision import agent, build as buildmod
from provision.errors import HostError
from provision.transport import Local, Target


def test_each_build_step_is_an_agent_answering_its_own_operations(tmp_path, wheels):
    root = tmp_path / "root"
    tr = Local(Target(host="h", root=str(root)))
    w = wheels["alpha-1.0"]
    sha = hashlib.sha256(w.read_bytes()).hexdigest()
    f = {"sha256": sha, "filename": w.name, "label": "alpha==1.0"}
    assert buildmod.push(tr, str(root), [(f, w)])["sent"] == 1                        # cache: have, then push
    assert tr.run_agent("cache", {"op": "have", "root": str(root), "files": [f]})["missing"] == []

    pkg = {"name": "alpha", "version": "1.0", "sha256": sha, "filename": w.name}
    figs = tr.run_agent("fetch", {"op": "fetch", "root": str(root), "packages": [pkg]})
    assert (figs["fetched"], figs["cached"], figs["recheck"]["checked"]) == (0, 1, 1), figs
    lost = dict(pkg, sha256="0" * 64)
    with pytest.raises(HostError, match="alpha==1.0 is not in the host's cache and has no URL to fetch"):
        tr.run_agent("fetch", {"op": "fetch", "root": str(root), "packages": [lost]})

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        info = tarfile.TarInfo("engine.py")
        info.size = 2
        t.addfile(info, io.BytesIO(b"x\n"))
    ask = {"op": "unpack", "root": str(root), "name": "abc123"}
    assert tr.run_agent("tool", ask)["complete"] is False
    done = tr.run_agent("tool", dict(ask, tar=base64.b64encode(buf.getvalue()).decode()))
    assert done["complete"] and (Path(done["path"]) / "engine.py").read_text() == "x\n", done

    for name, op in (("build", "have"), ("build", "unpack"), ("cache", "build"), ("tool", "push"), ("fetch", "build")):
        with pytest.raises(HostError, match=f"unknown op '{op}'"):
            tr.run_agent(name, {"op": op, "root": str(root)})


def test_the_bundle_carries_every_agent():
    import json
    import zlib

    files = json.loads(zlib.decompress(base64.b64decode(agent.bundle())))
    assert {f"provision/agent/{n}.py" for n in ("cache", "fetch", "build", "tool")} <= set(files)
