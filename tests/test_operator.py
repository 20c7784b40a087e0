"""The built wheel is the product: it holds every file the package needs at run time."""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

from provision import bundled, lock as lockmod

PKG = Path(bundled.__file__).parent


def test_wheel_holds_every_file_of_the_package(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--disable-pip-version-check",
                    "-w", str(tmp_path), str(PKG.parent)], check=True, capture_output=True)
    (whl,) = tmp_path.glob("provision-*.whl")
    shipped = {n for n in zipfile.ZipFile(whl).namelist() if n.startswith("provision/")}
    present = {f"provision/{p.relative_to(PKG).as_posix()}" for p in PKG.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")}
    assert present - shipped == set()
    for needed in ("provision/playbooks/build.yml", "provision/patches/sglang-0.5.9/series.yaml",
                   "provision/lockfiles/demo/a.yaml", "provision/engine/tiny/draft/model.safetensors"):
        assert needed in shipped


def test_lock_outside_the_checkout_finds_the_shipped_series(tmp_path):
    data = yaml.safe_load((bundled.DEMO_LOCKS / "a.yaml").read_text())
    data["patches"] = ["patches/sglang-0.5.9"]
    path = tmp_path / "lock.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    lk = lockmod.load(path)
    assert lk.resolve_path(lk.patches[0]) == bundled.PATCHES / "sglang-0.5.9"
    assert bundled.find("../pyproject.toml") is None and bundled.find("/etc/passwd") is None


def provision(*args, code: str | None = None) -> subprocess.CompletedProcess:
    """The command as an operator runs it, output piped (not a terminal)."""
    argv = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "provision", *args]
    return subprocess.run(argv, capture_output=True, text=True, cwd=PKG.parent)


def test_version_completion_and_plain_help():
    assert provision("--version").stdout.strip() == f"provision {__import__('provision').__version__}"
    assert "--show-completion" in provision("--help").stdout
    assert "[user@]host[:port]" in provision("rollback", "--help").stdout


def test_piped_output_is_full_width_and_errors_are_json(tmp_path, sshd):
    t = sshd.target
    long_root = tmp_path / ("r" * 150)
    p = provision("history", f"{t.user}@{t.host}:{t.port}", "--key", t.key_file, "--known-hosts",
                  str(t.known_hosts), "--root", str(long_root), "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["generations"] == []
    p = provision("rollback", f"{t.user}@{t.host}:{t.port}", "--key", t.key_file, "--known-hosts",
                  str(t.known_hosts), "--root", str(long_root), "--json")
    err = json.loads(p.stdout)
    assert p.returncode == 1 and "nothing to roll back" in err["error"] and err["where"] == f"{t.user}@{t.host}:{t.port}"
    line = [ln for ln in p.stderr.splitlines() if "nothing to roll back" in ln]
    assert len(line) == 1 and len(line[0]) > 80          # one line, not wrapped at 80 columns
    p = provision("history", "somehost:99999", "--json")
    assert p.returncode == 2 and "out of range" in json.loads(p.stdout)["error"]


def test_missing_extra_is_named():
    code = ("import sys\n"
            "class NoSafetensors:   # as if the package were not installed\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'safetensors':\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, NoSafetensors())\n"
            "sys.argv = ['provision'] + sys.argv[1:]\n"
            "from provision.cli import main\nmain()\n")
    p = provision("engine", "generate", "hello", "--max-tokens", "2", code=code)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "install provision[engine]" in p.stderr and "safetensors" in p.stderr


def test_hosts_trust_json_needs_yes_and_reports_the_key(tmp_path, sshd):
    spec, kh = f"{sshd.target.user}@{sshd.target.host}:{sshd.target.port}", str(tmp_path / "kh")
    p = provision("hosts", "trust", spec, "--known-hosts", kh, "--json")
    assert p.returncode == 2 and "add --yes" in json.loads(p.stdout)["error"] and not Path(kh).exists()
    first = json.loads(provision("hosts", "trust", spec, "--known-hosts", kh, "--json", "--yes").stdout)
    assert first["recorded"] is True and first["fingerprint"].startswith("SHA256:")
    again = json.loads(provision("hosts", "trust", spec, "--known-hosts", kh, "--json", "--yes").stdout)
    assert again["recorded"] is False and again["fingerprint"] == first["fingerprint"]


def test_hosts_trust_a_whole_inventory(tmp_path, sshd):
    t, kh = sshd.target, tmp_path / "kh"
    inv = tmp_path / "hosts.yml"
    inv.write_text(f"all:\n  vars: {{ansible_host: {t.host}, ansible_port: {t.port}}}\n"
                   "  hosts:\n    a: {provision_root: /tmp/ra}\n    b: {provision_root: /tmp/rb}\n")
    rows = json.loads(provision("hosts", "trust", "-i", str(inv), "--known-hosts", str(kh), "--json", "--yes").stdout)
    assert [(r["host"], r["recorded"]) for r in rows] == [("a", True), ("b", False)]   # one sshd behind both
    assert len(kh.read_text().splitlines()) == 1


def test_fast_verbs_import_only_what_they_use(tmp_path, sshd):
    t = sshd.target
    host = [f"{t.user}@{t.host}:{t.port}", "--key", t.key_file, "--known-hosts", str(t.known_hosts),
            "--root", str(tmp_path / "root")]
    code = ("import atexit, sys\n"
            "out = sys.argv[1]\n"
            "atexit.register(lambda: open(out, 'w').write('\\n'.join(sorted(k for k, v in sys.modules.items() if v))))\n"
            "sys.argv = ['provision'] + sys.argv[2:]\n"
            "from provision.cli import main\nmain()\n")
    for verb in ("rollback", "history", "status"):
        out = tmp_path / f"{verb}.modules"
        p = provision(str(out), verb, *host, code=code)
        loaded = {m.split(".")[0] for m in out.read_text().split()}
        assert "Traceback" not in p.stderr and "ansible_runner" in loaded, p.stderr    # the verb's play
        assert not loaded & {"paramiko", "requests", "invoke", "pydantic", "torch"}, (verb, loaded)


def test_parameter_values_and_their_errors_are_typers(tmp_path):
    """Plain values are read without typer's validators; anything else gets typer's own value or error line."""
    root = ["--local", "--root", str(tmp_path / "root"), "--json"]
    for forks in ("3", "+3", " 3", "0x3"):
        p = provision("history", *root, "--forks", forks)
        want = (0, "") if forks in ("3", "+3", " 3") else (2, "Invalid value for '--forks': Input should be a valid "
                                                               "integer, unable to parse string as an integer")
        assert (p.returncode, want[1] in p.stderr) == (want[0], True), (forks, p.stderr)
    p = provision("apply", *root, "--lock", str(tmp_path / "none.yaml"), "--installer", "conda")
    assert p.returncode == 2 and "Invalid value for '--installer'" in p.stderr
    p = provision("history", "-i", str(tmp_path / "missing.yml"))
    assert p.returncode == 2 and p.stderr == f"error: {tmp_path / 'missing.yml'}: inventory not found\n"


def test_plan_out_that_cannot_be_written_is_refused_before_any_host_is_contacted(tmp_path):
    from provision.loopback import free_port

    lock = str(bundled.DEMO_LOCKS / "a.yaml")
    for out, why in ((tmp_path / "missing" / "plan.json", "No such file or directory"), (tmp_path, "Is a directory")):
        p = provision("plan", f"127.0.0.1:{free_port()}", "--lock", lock, "--out", str(out))   # nothing listens
        assert (p.returncode, p.stderr.strip()) == (2, f"error: --out: cannot write {out}: {why}")
