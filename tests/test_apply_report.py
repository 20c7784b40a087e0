"""What apply and its fleet summary say of each host is the host's state, on real sshd hosts and real plays: a switch
whose history line was lost, a rollout stopped by Ctrl-C or by its play killed, and what --json leaves on stderr."""
from __future__ import annotations

import copy
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from provision import generations
from provision import lock as lockmod
from provision.transport import connect
from loophosts import write_inventory
from test_core import ROOT, cli, ctrl_c_as_at_a_terminal, host_args
from test_faults import StalledWheel, applied, assert_settled, host_state, lock_free
from wheelhouse import make_wheel, write_lock


@pytest.fixture
def stacks_ab(tmp_path, wheels):
    """Lock files A (alpha) and B (alpha, beta)."""
    return (write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]]),
            write_lock(tmp_path / "b.yaml", "stack-b", [wheels["alpha-1.0"], wheels["beta-1.0"]]))


def test_a_switch_whose_history_line_is_lost_is_said_with_what_to_run(target, stacks_ab):
    """History cannot be appended (chattr +i) through a whole apply: `current` switches (the rename commits), and the
    command says so with a warning that names the host, the record that failed and what records it; the same apply
    again is a no-op that records the switch once."""
    a, b = stacks_ab
    ga = applied(target, lockmod.load(a)).generation
    hist = Path(target.root) / "history.jsonl"
    subprocess.run(["chattr", "+i", str(hist)], check=True)
    try:
        p = cli("apply", *host_args(target), "--lock", b, check=0)
    finally:
        subprocess.run(["chattr", "-i", str(hist)], check=True)
    gb = host_state(target)["current"]
    assert gb != ga and f"current {ga} → {gb}" in p.stdout, p.stdout
    warned = [line for line in p.stderr.splitlines() if line.startswith(f"warning: {target.name}: switched to {gb}")]
    assert len(warned) == 1 and "recording it failed (history: " in warned[0], p.stderr
    assert "Operation not permitted" in warned[0] and "the same apply again" in warned[0], warned
    again = json.loads(cli("apply", *host_args(target), "--lock", b, "--json", check=0).stdout)
    assert again["status"] == "noop" and gb in again["recovered"]["repaired"], again
    tr = connect(target)
    try:
        switches = [e for e in generations.history(tr).events if e["event"] == "apply" and e["to"] == gb]
    finally:
        tr.close()
    assert [e.get("repaired") for e in switches] == [True], switches
    assert_settled(target, gb)


class SecondStalls:
    """A loopback HTTP server for one wheel: the first download gets the whole file; every later one half of it and
    then nothing until `release` is set (a host mid-fetch, while the host before it in the rollout has its wheel)."""

    def __init__(self, wheel: Path):
        import http.server

        data, self.stalled, self.release, self.served = wheel.read_bytes(), threading.Event(), threading.Event(), 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.served += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    if outer.served > 1 and not outer.release.is_set():
                        self.wfile.write(data[:len(data) // 2])
                        self.wfile.flush()
                        outer.stalled.set()
                        outer.release.wait(300)
                        self.wfile.write(data[len(data) // 2:])
                    else:
                        self.wfile.write(data)
                except OSError:
                    pass

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}/{wheel.name}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def rollout(target, wheels, tmp_path):
    """Hosts h1, h2 (roots on the session sshd) of an inventory, both on lock A, and lock B whose second wheel h1
    downloads whole and h2 waits on mid-download: (inventory, {host: root}, the CLI's host options, lock B, server)."""
    roots = {h: tmp_path / f"root-{h}" for h in ("h1", "h2")}
    inv = write_inventory(tmp_path / "inv.yml", target, roots)
    a = lockmod.load(write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]]))
    for h, root in roots.items():
        t = copy.deepcopy(target)
        t.root = str(root)
        applied(t, a)
    wheel = make_wheel(tmp_path / "slow", "slowpkg", "1.0", body="x = %r\n" % ("y" * 50000))
    slow = SecondStalls(wheel)
    b = write_lock(tmp_path / "b.yaml", "stack-b", [wheels["alpha-1.0"], wheel])
    b.write_text(b.read_text().replace(wheel.resolve().as_uri(), slow.url))
    yield inv, roots, ["-i", str(inv), "--known-hosts", str(target.known_hosts)], b, slow
    slow.close()


def current_of(root: Path) -> str | None:
    link = root / "current"
    return os.readlink(link).rsplit("/", 1)[-1] if link.is_symlink() else None


def test_ctrl_c_between_batches_prints_the_rollback_and_the_resume_command(rollout):
    """--serial 1: h1 has switched to B, h2 waits mid-download when Ctrl-C comes. The summary names h1 switched and
    prints the rollback command for it, and the command that resumes the rollout on h2; both do what they say."""
    inv, roots, common, b, slow = rollout
    opts = ["--lock", str(b), "--serial", "1", "--max-fail", "0"]
    p = subprocess.Popen([sys.executable, "-m", "provision.cli", "apply", *common, *opts], cwd=ROOT,
                         env={**os.environ, "COLUMNS": "200"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, preexec_fn=ctrl_c_as_at_a_terminal)
    try:
        assert slow.stalled.wait(180), "h2 never asked for the slow wheel"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130 and "Traceback" not in err, (out, err)
    assert (current_of(roots["h1"]), current_of(roots["h2"])) == ("0002-stack-b", "0001-stack-a")
    lines = out.splitlines()
    assert "  switched: h1" in lines and "  interrupted, not switched: h2" in lines, out
    back = shlex.split(lines[lines.index("Roll back the hosts that switched:") + 1])
    assert back == ["provision", "rollback", *common, "--limit", "h1"], out
    resume = shlex.split(lines[lines.index("Resume with the hosts not switched:") + 1])
    assert resume == ["provision", "apply", *common, *opts, "--limit", "h2"], out
    slow.release.set()
    cli(*resume[1:], check=0)                     # h2's interrupted build was abandoned: B is built anew
    gb2 = current_of(roots["h2"])
    assert current_of(roots["h1"]) == "0002-stack-b" and gb2.endswith("-stack-b") and gb2 != "0001-stack-a"
    cli(*back[1:], check=0)
    assert (current_of(roots["h1"]), current_of(roots["h2"])) == ("0001-stack-a", gb2)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(p))
        except (OSError, IndexError, ValueError):
            continue
    return out


def test_the_play_killed_mid_fetch_says_where_each_host_is(rollout):
    """ansible-playbook killed while h2 waits mid-download (h1 switched in batch 1): h2 is interrupted during its
    build with `current` where it was, never "not-attempted"; the rollout is not started again; the summary says
    where each host is, with the rollback and resume commands."""
    inv, roots, common, b, slow = rollout
    opts = ["--lock", str(b), "--serial", "1", "--max-fail", "0"]
    p = subprocess.Popen([sys.executable, "-m", "provision.cli", "apply", *common, *opts], cwd=ROOT,
                         env={**os.environ, "COLUMNS": "200"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        assert slow.stalled.wait(180), "h2 never asked for the slow wheel"
        plays = [c for c in children(p.pid) if b"ansible-playbook" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(plays) == 1, plays
        os.kill(plays[0], signal.SIGKILL)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 1 and "Traceback" not in err, (out, err)
    assert slow.served == 2, slow.served            # h2's build was not started again
    assert (current_of(roots["h1"]), current_of(roots["h2"])) == ("0002-stack-b", "0001-stack-a")
    lines = out.splitlines()
    rows = {line.split()[0]: line for line in lines if line.startswith("  h")}
    assert set(rows) == {"h1", "h2"}, (out, err)
    assert rows["h1"].split()[1:3] == ["applied", "0002-stack-b"], out
    assert rows["h2"].split()[1] == "interrupted", out
    assert "interrupted during build: ansible-playbook was killed before the play's end" in rows["h2"], out
    assert rows["h2"].endswith("; current left at 0001-stack-a"), out
    assert "  switched: h1" in lines and "  interrupted, not switched: h2" in lines, out
    assert shlex.split(lines[lines.index("Roll back the hosts that switched:") + 1]) == \
        ["provision", "rollback", *common, "--limit", "h1"], out
    assert shlex.split(lines[lines.index("Resume with the hosts not switched:") + 1]) == \
        ["provision", "apply", *common, *opts, "--limit", "h2"], out


def test_json_leaves_the_progress_on_stderr(target, stacks_ab, tmp_path):
    """`apply --json`, of an inventory and of one host: stdout is the one JSON object; each host's steps are said on
    stderr as they finish, as without --json."""
    a, b = stacks_ab
    roots = {h: tmp_path / f"root-{h}" for h in ("h1", "h2")}
    inv = write_inventory(tmp_path / "inv.yml", target, roots)
    p = cli("apply", "-i", inv, "--known-hosts", target.known_hosts, "--lock", a, "--json", check=0)
    out = json.loads(p.stdout)
    assert [r["status"] for r in out["reports"]] == ["applied", "applied"], out
    for h in roots:
        assert any(line.split()[:3] == [h, "✓", "switch"] for line in p.stderr.splitlines()), p.stderr
    p = cli("apply", *host_args(target), "--lock", b, "--json", check=0)
    assert json.loads(p.stdout)["status"] == "applied"
    steps = [line.split()[1] for line in p.stderr.splitlines() if line.startswith("  ✓ ")]
    assert steps == ["recover", "facts", "plan", "build", "patch", "seal", "probe", "switch"], p.stderr


@pytest.fixture
def small_home(tmp_path):
    """The controller's state (PROVISION_HOME: its run directories) and its temporary files on a 4 MiB tmpfs:
    (the mount, the environment a command runs with, fill(): the rest of the tmpfs taken by one file)."""
    home = tmp_path / "home"
    home.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(home)], check=True)

    def fill() -> None:
        with open(home / "filler", "ab") as f:
            try:
                while True:
                    f.write(b"x" * 65536)
                    f.flush()
            except OSError:
                pass
    try:
        yield home, {**os.environ, "PROVISION_HOME": str(home), "TMPDIR": str(home), "COLUMNS": "200"}, fill
    finally:
        subprocess.run(["umount", "-l", str(home)], check=True)


def test_a_full_controller_disk_is_one_line_naming_the_path(target, stacks_ab, small_home):
    home, env, fill = small_home
    a, b = stacks_ab
    fill()
    p = subprocess.run([sys.executable, "-m", "provision.cli", "apply", *host_args(target), "--lock", str(a)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {home / 'runs'}/") and last.endswith(": the controller's disk is full (ENOSPC)"), \
        p.stderr
    assert host_state(target)["current"] is None


def test_the_controller_disk_filling_mid_run_stops_the_play_before_the_switch(target, stacks_ab, small_home,
                                                                             tmp_path, wheels):
    """The controller's disk fills while the host waits mid-download: the play goes no further (the host stays on
    its generation, its lock is let go), and the command ends in one line that names the file it could not write,
    the full disk, the step and where `current` is."""
    home, env, fill = small_home
    a, _ = stacks_ab
    ga = applied(target, lockmod.load(a)).generation
    wheel = make_wheel(tmp_path / "slow", "slowpkg", "1.0", body="x = %r\n" % ("y" * 50000))
    slow = StalledWheel(wheel)
    try:
        lk = write_lock(tmp_path / "slow.yaml", "stack-slow", [wheels["alpha-1.0"], wheel])
        lk.write_text(lk.read_text().replace(wheel.resolve().as_uri(), slow.url))
        p = subprocess.Popen([sys.executable, "-m", "provision.cli", "apply", *host_args(target), "--lock", str(lk)],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert slow.requested.wait(120), "the host never asked for the slow wheel"
            fill()
            slow.release.set()
            out, err = p.communicate(timeout=120)
        finally:
            p.kill()
    finally:
        slow.close()
    assert p.returncode == 1 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: {target.name}: ") and f"{home}/" in last, err
    assert "the controller's disk is full (ENOSPC)" in last and last.endswith(f"current left at {ga}"), err
    lock_free(target.root)
    assert host_state(target)["current"] == ga


def test_plan_counts_a_corrupt_cache_entry_as_a_download(target, stacks_ab):
    """A cached wheel whose bytes no longer match its sha256 (written through) is a download in the plan, as the
    build's recheck finds it: the plan and the apply that follows say the same wheels come in."""
    a, b = stacks_ab
    applied(target, lockmod.load(a))
    lk = lockmod.load(b)
    alpha = next(p for p in lk.packages if p.name == "alpha")
    entry = Path(target.root) / "cache" / "wheels" / alpha.sha256 / alpha.filename
    subprocess.run(["chattr", "-i", str(entry)], capture_output=True)
    with open(entry, "r+b") as f:
        f.write(b"corrupt!")
    plan = json.loads(cli("plan", *host_args(target), "--lock", b, "--json", check=0).stdout)
    assert plan["download"]["wheels"] == 2, plan["download"]          # alpha (corrupt) and beta (never cached)
    rep = json.loads(cli("apply", *host_args(target), "--lock", b, "--json", check=0).stdout)
    build = rep["build"]
    assert build["recheck"]["healed"] == [alpha.filename], build["recheck"]
    assert build.get("pushed", 0) + build.get("fetched", 0) == 2, build


def read_lines(stream, into: list, seen: threading.Event, marker: str) -> None:
    """Each line of `stream` into `into`; `seen` set once one starts with `marker`."""
    for line in stream:
        into.append(line.rstrip("\n"))
        if line.startswith(marker):
            seen.set()


@pytest.mark.parametrize("verb", ["rollback", "status"])
def test_a_host_that_never_speaks_ssh_holds_back_no_other_row(target, stacks_ab, listener, tmp_path, verb):
    """An inventory of gpu0 and a host that accepts TCP and never says a word (its --timeout 30 s): gpu0's row is
    printed as it finishes, while the play still waits on the silent host; the silent host's row comes once it
    gives up (here: its connections closed)."""
    port, accepted = listener
    a, b = stacks_ab
    t = copy.deepcopy(target)
    applied(t, lockmod.load(a))
    applied(t, lockmod.load(b))
    inv = tmp_path / "inv.yml"
    inv.write_text(f"all:\n  vars: {{ansible_host: {t.host}, ansible_user: {t.user}, "
                   f"ansible_ssh_private_key_file: {t.key_file}}}\n  hosts:\n"
                   f"    gpu0: {{ansible_port: {t.port}, provision_root: {t.root}}}\n"
                   f"    hung: {{ansible_port: {port}, provision_root: {tmp_path / 'root-hung'}}}\n")
    p = subprocess.Popen([sys.executable, "-m", "provision.cli", verb, "-i", str(inv), "--known-hosts",
                          str(t.known_hosts), "--timeout", "30"], cwd=ROOT, env={**os.environ, "COLUMNS": "200"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, seen = [], threading.Event()
    stream, marker = (p.stdout, "Rolled back gpu0: ") if verb == "rollback" else (p.stderr, "gpu0: current 0002-")
    reader = threading.Thread(target=read_lines, args=(stream, lines, seen, marker), daemon=True)
    reader.start()
    try:
        assert seen.wait(120), lines
        assert p.poll() is None and accepted, "gpu0's row came only with the silent host's"
        for c in accepted:               # the silent host gives up now: its row is the last
            c.close()
        other = (p.stderr if verb == "rollback" else p.stdout).read()
        p.wait(60)
        reader.join(10)
    finally:
        p.kill()
    err = other if verb == "rollback" else "\n".join(lines)
    if verb == "status":
        assert "hung: unreachable (2/2 hosts)" in lines, lines
    assert p.returncode == 1 and "Traceback" not in err, (lines, other)
    hung = [line for line in err.splitlines() if line.startswith("hung: unreachable: ")]
    assert len(hung) == 1 and "no SSH banner" not in hung[0], (lines, other)     # it was still waiting
