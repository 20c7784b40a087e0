"""The host channel: agents get one JSON payload on stdin, ship with their shared helpers, and nothing
proportional to a lock ever reaches a command line; big locks apply over real SSH."""
from __future__ import annotations

import ast
import base64
import dataclasses
import json
import os
import stat
import sys
import zlib
from pathlib import Path


from provision import agent, apply as applymod, lock as lockmod
from provision.facts import gather
from provision.transport import SSH, Local
from wheelhouse import make_wheel, write_lock

AGENTS = Path(agent.__file__).parent


class Recording(SSH):
    """An SSH transport that also records every command line it sends."""

    argvs: list[list[str]] = []

    def run(self, argv, **kw):
        self.argvs.append([str(a) for a in argv])
        return super().run(argv, **kw)

    def spawn(self, argv):
        self.argvs.append([str(a) for a in argv])
        return super().spawn(argv)


def test_agents_are_stdlib_only_and_import_only_each_other():
    """Every module the bundle ships (the agents, host.py, the steps' declarations, the layout) is stdlib-only and
    imports only the others."""
    bundled = json.loads(zlib.decompress(base64.b64decode(agent.bundle())))
    shipped = {Path(rel).stem for rel in bundled} | {Path(rel).parts[1] for rel in bundled if len(Path(rel).parts) > 2}
    assert "provision/layout.py" in bundled and "provision/steps/state.py" in bundled
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for path in [*AGENTS.glob("*.py"), *(AGENTS.parent / "steps").glob("*.py"), AGENTS.parent / "layout.py"]:
        if path == AGENTS / "__init__.py":   # the controller's part; not shipped
            continue
        tree = ast.parse(path.read_text())
        # torch and the libraries under test are imported lazily by the GPU probes, inside the generation
        lazy = ("gpu_probes.py", "jit.py", "collective.py", "allreduce.py")
        nodes = tree.body if path.name in lazy else list(ast.walk(tree))
        for n in nodes:
            if isinstance(n, ast.ImportFrom) and n.level:          # relative: another shipped module
                assert (n.module or "").split(".")[0] in shipped | {""}, (path.name, n.module)
            elif isinstance(n, ast.ImportFrom) and n.module:
                assert n.module.split(".")[0] in stdlib, (path.name, n.module)
            elif isinstance(n, ast.Import):
                assert all(a.name.split(".")[0] in stdlib for a in n.names), (path.name, ast.dump(n))


def test_command_line_is_constant_and_payload_goes_on_stdin():
    payload = {"op": "dists", "pad": "x" * 300_000}          # larger than one argv element may be
    out = Local().run_agent("host", payload, python=sys.executable)
    assert out["executable"] and out["dists"]
    assert agent.command("python3") == ["python3", "-I", "-c", agent.host.BOOT]
    assert len(agent.host.BOOT) < 2000


def test_agent_error_and_crash_are_one_line(tmp_path):
    import pytest
    from provision.errors import HostError

    with pytest.raises(HostError, match="unknown op 'nope'"):
        Local().run_agent("build", {"op": "nope", "root": str(tmp_path)})
    with pytest.raises(HostError, match="KeyError"):
        Local().run_agent("cache", {"op": "have", "root": str(tmp_path)})


def test_lock_of_300_packages_and_2mb_yaml_over_ssh(target, tmp_path):
    house = tmp_path / "house"
    wheels = [make_wheel(house, f"pkg{i:03d}", "1.0") for i in range(300)]
    big = write_lock(tmp_path / "big.yaml", "big", wheels)
    lk = lockmod.load(big)
    assert len(lk.packages) == 300
    # the same closure with one package changed and a 2 MB description: a lock of >= 2 MB of YAML
    wheels2 = wheels[:-1] + [make_wheel(house, "pkg299", "2.0")]
    huge = write_lock(tmp_path / "huge.yaml", "huge", wheels2,
                      description=" ".join(f"changelog entry {i}: reviewed." for i in range(80_000)))
    assert huge.stat().st_size >= 2 << 20
    Recording.argvs = []
    tr = Recording(target)
    try:
        rep = applymod.apply(tr, lk, skip_probes=["engine"])
        assert rep.status == "applied", rep.error
        assert rep.build["pushed"] == 300 and rep.build["installer"] == "uv"
        rep2 = applymod.apply(tr, lockmod.load(huge), skip_probes=["engine"])
        assert rep2.status == "applied", rep2.error
        assert rep2.build["pushed"] == 1          # 299 wheels came from the host's cache
    finally:
        tr.close()
    root = Path(target.root)
    venv_py = root / "current" / "venv" / "bin" / "python"
    assert os.path.exists(venv_py) and (root / "current").resolve().name == "0002-huge"
    longest = max(len(" ".join(a)) for a in Recording.argvs)
    assert longest < 2048, longest
    joined = "\n".join(" ".join(a) for a in Recording.argvs)
    assert "pkg000" not in joined and "changelog" not in joined
    # the host root and what is under it: dirs 0750, files 0640 (group may read, others nothing)
    for p in [root, root / "generations", root / "current" / "lock.yaml", root / "history.jsonl"]:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode & 0o007 == 0, (p, oct(mode))
    cached = next((root / "cache" / "wheels").glob("*/pkg000-1.0-*.whl"))
    assert stat.S_IMODE(cached.stat().st_mode) & 0o007 == 0


TEMPLATE = "{{ lookup('pipe', 'touch pwned') }}"


def _pwned(*dirs: Path) -> list[Path]:
    return [p for d in dirs for p in Path(d).rglob("pwned")]


def test_ansible_never_renders_data(target, tmp_path, monkeypatch):
    """Values that reach Ansible are data: a template in them is passed on literally, never run."""
    from provision import runner

    monkeypatch.chdir(tmp_path)
    res = runner.run_playbook("build", [target], {"cuda_source": "apt", "cuda_apt_package": TEMPLATE}, label="t")
    assert res.error and "No package matching '{{ lookup('pipe'" in res.error   # apt got the literal text
    assert not _pwned(tmp_path, res.run_dir, Path(target.root))
    assert not any(Path(target.root, "tmp").glob("ansible-*"))   # its temp dir went with it


def test_templates_in_a_lock_and_in_host_replies_run_nothing(target, tmp_path, wheels, monkeypatch):
    """Every string field of a lock holds a template (the schema refuses those it must, in one line), and a
    host whose interpreter path is a template: the apply succeeds, nothing is run."""
    from provision.errors import LockError

    monkeypatch.chdir(tmp_path)
    base = lockmod.load(write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]])).raw
    refused = accepted = 0
    for path in _string_fields(base):
        data = _with(base, path, TEMPLATE)
        f = tmp_path / "t.yaml"
        f.write_text(_yaml(data))
        try:
            lockmod.load(f)
            accepted += 1
        except LockError as e:
            assert "t.yaml:" in str(e)
            refused += 1
    assert refused >= 5
    # what the schema lets through reaches the host and Ansible as data: description and the apt package's
    # neighbours; the interpreter the host reports lives under a directory named like a template
    weird = tmp_path / TEMPLATE.replace("/", "_")
    weird.mkdir()
    os.symlink(sys.executable, weird / "python3")
    t = dataclasses.replace(target, python=str(weird / "python3"))
    lk_path = write_lock(tmp_path / "d.yaml", "desc", [wheels["alpha-1.0"]], description=TEMPLATE,
                         platform={"python": "%d.%d" % sys.version_info[:2],
                                   "cuda": {"source": "apt", "version": "12.8", "package": "openssh-server"}})
    tr = SSH(t)
    try:
        facts_python = gather(tr).python_executable
        assert TEMPLATE.replace("/", "_") in facts_python          # the host really replies with it
        rep = applymod.apply(tr, lockmod.load(lk_path), skip_probes=["nvcc", "engine"])
    finally:
        tr.close()
    assert rep.status == "applied", rep.error
    assert rep.build["run_dir"]                                      # Ansible ran (the apt step)
    assert not _pwned(tmp_path, rep.build["run_dir"], Path(target.root))


def _string_fields(data, path=()):
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _string_fields(v, path + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _string_fields(v, path + (i,))
    elif isinstance(data, str):
        yield path


def _with(data, path, value):
    import copy

    out = copy.deepcopy(data)
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


def _yaml(data) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


def test_parallel_fetch_into_the_cache_with_readable_progress(target, tmp_path):
    """Wheels served over http by this machine: fetched in parallel into the host's cache with count, bytes,
    rate and time left; a second lock with the same wheels fetches nothing (a cache entry is trusted)."""
    import functools
    import http.server
    import re
    import threading

    served = tmp_path / "index"
    wheels = [make_wheel(served, f"w{i:02d}", "1.0", body="x = %r\n" % ("y" * 200_000)) for i in range(24)]
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *a: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    data = lockmod.load(write_lock(tmp_path / "a.yaml", "served", wheels)).raw
    for p in data["packages"]:
        p["url"] = f"{base}/{p['filename']}"
    lk = lockmod.from_data(data, str(tmp_path / "a.yaml"))
    again = lockmod.from_data(dict(data, name="served-again"), str(tmp_path / "b.yaml"))
    lines: list[tuple[str, str, str]] = []
    tr = SSH(target)
    try:
        rep = applymod.apply(tr, lk, skip_probes=["engine"], progress=lambda *a: lines.append(a))
        rep2 = applymod.apply(tr, again, skip_probes=["engine"])
    finally:
        tr.close()
        srv.shutdown()
    assert rep.status == "applied" and rep.build["fetched"] == 24 and rep.build["fetched_bytes"] > 24 * 200_000
    assert rep2.build["fetched"] == 0 and rep2.build["cached"] == 24
    info = [d for s, state, d in lines if s == "build" and state == "info"]
    assert any(re.match(r"fetch: 24 wheels, [\d.]+ MiB in [\d.]+s \([\d.]+ ([KMG]i)?B/s\)", d) for d in info), info
    assert any(d.startswith("install: ") for d in info), info
    running = [d for s, state, d in lines if s == "build" and state == "detail" and re.match(r"fetch \d+/24 · ", d)]
    assert running and all("/s" in d for d in running)      # count, bytes of about total, rate (and time left)
    done = [(s, d) for s, state, d in lines if state == "done"]
    assert [s for s, _ in done][:2] == ["recover", "facts"] and ("build" in [s for s, _ in done])


def test_a_host_whose_login_shell_prints_a_banner_still_runs_agents():
    """A test host's sessions read only its own HOME's rc files (none by default); one that greets on stdout and
    stderr at every login does not disturb the agents' replies."""
    from provision.loopback import LoopbackHost
    from provision.transport import connect, trust_host

    with LoopbackHost() as h:
        home = h.dir / "home"
        (home / ".bashrc").write_text('echo "welcome to the host"\necho "motd" >&2\n')
        trust_host(h.target)
        tr = connect(h.target)
        try:
            assert tr.check(["sh", "-c", 'echo "$HOME"']).splitlines() == ["welcome to the host", str(home)]
            assert tr.run_agent("state", {"op": "history", "root": h.root})["generations"] == []
            assert tr.run_agent("facts", {"op": "gather", "root": h.root, "python": "3.11"})["pythons"]
        finally:
            tr.close()


def test_ssh_negotiates_a_cipher_the_server_offers():
    """The ssh client picks the cipher (its own preference and the operator's ssh config): a server that offers
    only one is still reached."""
    from provision.loopback import LoopbackHost
    from provision.transport import connect, trust_host

    for config in ("", "Ciphers aes128-ctr\n"):
        with LoopbackHost(sshd_config=config) as h:
            trust_host(h.target)
            tr = connect(h.target)
            try:
                assert tr.check(["echo", "ok"]).strip() == "ok"
            finally:
                tr.close()


def test_agents_run_with_the_inventorys_python_interpreter(target, tmp_path):
    from provision import generations
    from provision.inventory import load_inventory
    from provision.transport import connect

    inv = tmp_path / "hosts.ini"
    inv.write_text(f"[gpu]\ngpu0 ansible_host={target.host} ansible_port={target.port} ansible_user={target.user} "
                   f"ansible_ssh_private_key_file={target.key_file} ansible_python_interpreter=/usr/bin/python3 "
                   f"provision_root={target.root}\n")
    (t,) = load_inventory(inv, known_hosts=target.known_hosts)
    tr = connect(t)
    try:
        assert tr.run_agent("host", {"op": "dists"})["executable"] == "/usr/bin/python3"
        with tr.hold():      # the host lock's agent too
            assert generations.history(tr).generations == []
    finally:
        tr.close()
