"""lock resolve against an index the test builds (file:// and a loopback HTTP server)."""
from __future__ import annotations

import functools
import http.server
import threading
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name, parse_wheel_filename
from typer.testing import CliRunner

from provision import lock as lockmod
from provision import resolve
from provision.cli import app
from wheelhouse import make_wheel, sha256


# ---- a PEP 503 index over tiny real wheels (tests/wheelhouse.py writes them)

def make_index(root: Path, wheels: list[Path]) -> Path:
    """A PEP 503 simple index: files in root/files, one page per project in root/simple/<name>/."""
    files = root / "files"
    files.mkdir(parents=True, exist_ok=True)
    by_name: dict[str, list[Path]] = {}
    for w in wheels:
        dest = files / w.name
        dest.write_bytes(w.read_bytes())
        by_name.setdefault(canonicalize_name(parse_wheel_filename(w.name)[0]), []).append(dest)
    simple = root / "simple"
    for name, ws in by_name.items():
        (simple / name).mkdir(parents=True, exist_ok=True)
        links = "".join(f'<a href="../../files/{w.name}#sha256={sha256(w)}">{w.name}</a><br>\n' for w in ws)
        (simple / name / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
    (simple / "index.html").write_text("<html><body>" + "".join(f'<a href="{n}/">{n}</a>' for n in by_name) + "</body></html>")
    return simple


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("index")
    b = root / "build"
    make_index(root, [
        make_wheel(b, "app", "1.0", ["lib>=1", 'winonly; sys_platform == "win32"', "gpu==1.0"]),
        make_wheel(b, "lib", "1.0"), make_wheel(b, "lib", "2.0"), make_wheel(b, "winonly", "1.0"),
        make_wheel(b, "gpu", "1.0", ["gpudep", "lib"]),    # stands in for torch: only 1.0, no +cu130 build
        make_wheel(b, "gpudep", "1.0"),                     # stands in for nvidia-*-cu12: only gpu needs it
        make_wheel(b, "plugin", "1.0", ["gpu==1.0"]), make_wheel(b, "plugin", "2.0", ["gpu>=2"]),
        make_wheel(b, "native", "1.0", tag="cp312-cp312-win_amd64"),   # no wheel for Linux
        make_wheel(b, "newlibc", "1.0", tag="cp312-cp312-manylinux_2_28_x86_64"),
        make_wheel(b, "newlibc", "2.0", tag="cp312-cp312-manylinux_2_34_x86_64"),   # needs glibc ≥ 2.34
    ])
    return root


@pytest.fixture(scope="module")
def http_index(index):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a):
            pass

    handler = functools.partial(Quiet, directory=str(index))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}/simple"
    srv.shutdown()


def write_lock(path: Path, requires: list[str], indexes: dict[str, str], extra: str = "") -> Path:
    idx = "".join(f"\n  {k}: {v}" for k, v in indexes.items())
    req = "".join(f"\n- '{r}'" for r in requires)
    path.write_text(f"lock: 1\nname: t\nplatform:\n  python: '3.12'\n  cuda: {{version: '13.0.1', source: none}}\n"
                    f"indexes:{idx}\nrequires:{req}\n{extra}engine: {{kind: none}}\n")
    return path


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(resolve, "CACHE", tmp_path / "cache")


def test_closure_with_hashes_markers_and_index_names(index, tmp_path):
    lk = lockmod.load(write_lock(tmp_path / "l.yaml", ["app==1.0"], {"local": f"file://{index}/simple"}))
    data, res = resolve.resolve_data(lk)
    pkgs = {p["name"]: p for p in data["packages"]}
    assert set(pkgs) == {"app", "lib", "gpu", "gpudep"}          # winonly's marker is false on Linux
    assert pkgs["lib"]["version"] == "2.0"
    assert pkgs["lib"]["sha256"] == sha256(index / "files" / "lib-2.0-py3-none-any.whl")
    assert pkgs["lib"]["filename"] == "lib-2.0-py3-none-any.whl"
    assert pkgs["lib"]["index"] == "local" and pkgs["lib"]["url"].startswith("file://")
    assert data["unresolved"] == [] and res.indexes_down == {}
    again = lockmod.from_data(data)                                # what resolve writes is a valid lock
    assert again.package("app").sha256


def test_unserved_local_version_is_unresolved_and_its_own_deps_left_out(index, tmp_path):
    lk = lockmod.load(write_lock(tmp_path / "l.yaml", ["gpu==1.0+cu130", "app==1.0", "plugin"],
                                 {"local": f"file://{index}/simple"}))
    data, _ = resolve.resolve_data(lk)
    names = {p["name"]: p["version"] for p in data["packages"]}
    assert "gpu" not in names and "gpudep" not in names           # never invented, nor what only it needs
    assert names["lib"] == "2.0"                                   # still needed by app
    assert names["plugin"] == "1.0"                                # chosen compatible with gpu 1.0 (the proxy)
    [u] = data["unresolved"]
    assert u["name"] == "gpu" and u["requirement"] == "gpu==1.0+cu130"
    assert "no wheel matching ==1.0+cu130" in u["reason"]


def test_unreachable_index_and_no_platform_wheel(index, http_index, tmp_path):
    lk = lockmod.load(write_lock(tmp_path / "l.yaml", ["lib==1.0", "native==1.0"],
                                 {"gone": "http://127.0.0.1:9/simple", "web": http_index}))
    data, res = resolve.resolve_data(lk)
    assert "gone" in res.indexes_down
    assert [p["name"] for p in data["packages"]] == ["lib"]
    assert data["packages"][0]["index"] == "web" and data["packages"][0]["url"].startswith(http_index.rsplit("/", 1)[0])
    [u] = data["unresolved"]
    assert u["name"] == "native" and "index gone (http://127.0.0.1:9/simple) unreachable" in u["reason"]


def test_glibc_sets_the_newest_manylinux_a_wheel_may_need(index, tmp_path):
    def chosen(glibc: str | None) -> dict:
        src = write_lock(tmp_path / "l.yaml", ["newlibc"], {"local": f"file://{index}/simple"})
        if glibc:
            src.write_text(src.read_text().replace("python: '3.12'\n", f"python: '3.12'\n  glibc: '{glibc}'\n"))
        [p] = resolve.resolve_data(lockmod.load(src))[0]["packages"]
        return p

    assert chosen(None)["filename"] == "newlibc-1.0-cp312-cp312-manylinux_2_28_x86_64.whl"    # default 2.28
    assert chosen("2.33")["version"] == "1.0"
    assert chosen("2.34")["filename"] == "newlibc-2.0-cp312-cp312-manylinux_2_34_x86_64.whl"
    assert chosen("2.39")["version"] == "2.0"


@pytest.mark.parametrize("value, why", [("2.34", "quote it"), ("'2.5'", "a glibc version"),
                                        ("'2.34.1'", "a glibc version"), ("'3.1'", "a glibc version")])
def test_glibc_is_a_quoted_version_from_2_17(value, why):
    with pytest.raises(lockmod.LockError, match=f"platform.glibc: .*{why}"):
        lockmod.loads(f"lock: 1\nname: t\nplatform:\n  python: '3.12'\n  glibc: {value}\n")


def test_resolver_conflict_is_one_error_line(index, tmp_path):
    lk = lockmod.load(write_lock(tmp_path / "l.yaml", ["plugin==2.0"], {"local": f"file://{index}/simple"}))
    with pytest.raises(resolve.ResolveError, match="resolution failed"):
        resolve.resolve(lk)


def test_cli_resolve_then_check(index, http_index, tmp_path):
    src = write_lock(tmp_path / "l.yaml", ["app==1.0"], {"web": http_index})
    out = tmp_path / "out.yaml"
    r = CliRunner().invoke(app, ["lock", "resolve", str(src), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "4 packages, 0 unresolved" in r.output
    r = CliRunner().invoke(app, ["lock", "check", str(out)])
    assert r.exit_code == 0, r.output
    assert "0 errors" in r.output
    # METADATA came over HTTP into the cache; the same check now works offline.
    assert list((resolve.CACHE / "metadata").glob("*.METADATA"))
    r = CliRunner().invoke(app, ["lock", "check", "--offline", str(out)])
    assert r.exit_code == 0, r.output


def test_platform_tags_prefer_cpython_manylinux():
    lk = lockmod.loads("lock: 1\nname: t\nplatform: {python: '3.12'}\n")
    tags = resolve.platform_tags(lk)
    rank = lambda f: resolve.wheel_rank(f, tags)  # noqa: E731
    assert rank("x-1-cp312-cp312-manylinux_2_28_x86_64.whl") < rank("x-1-cp310-abi3-manylinux2014_x86_64.whl") \
        < rank("x-1-py3-none-any.whl")
    assert rank("x-1-cp312-cp312-manylinux_2_34_x86_64.whl") is None       # the default glibc is 2.28
    newer = resolve.platform_tags(lockmod.loads("lock: 1\nname: t\nplatform: {python: '3.12', glibc: '2.34'}\n"))
    assert resolve.wheel_rank("x-1-cp312-cp312-manylinux_2_34_x86_64.whl", newer) \
        < resolve.wheel_rank("x-1-cp312-cp312-manylinux_2_28_x86_64.whl", newer)
    assert resolve.wheel_rank("x-1-cp312-cp312-manylinux_2_35_x86_64.whl", newer) is None
    assert rank("x-1-cp311-cp311-manylinux_2_28_x86_64.whl") is None
    assert rank("x-1-cp312-cp312-win_amd64.whl") is None
