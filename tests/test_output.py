"""Output an operator reads: plan and apply print a summary (headline changes, counts per kind) with --full for
every line; apply prints a line per phase (-v: per package); the build log stays in the generation and `logs`
shows it; `diff` ends with its own total; `status` keeps an unreachable host's error out of the table."""
from __future__ import annotations

import socket

import pytest
import yaml

from test_core import cli as core_cli, host_args
from wheelhouse import make_wheel, write_lock

def cli(*args, check=0):
    return core_cli(*args, check=check)


@pytest.fixture
def stacks(tmp_path):
    """Lock a: app 1.0 and libs one..five 1.0; lock b: app 2.0 (its one `requires`), libs one..four 2.0, six."""
    wh = tmp_path / "wh"
    libs = ("one", "two", "three", "four")
    a = [make_wheel(wh, "app", "1.0")] + [make_wheel(wh, n, "1.0") for n in libs + ("five",)]
    b = [make_wheel(wh, "app", "2.0")] + [make_wheel(wh, n, "2.0") for n in libs] + [make_wheel(wh, "six", "1.0")]
    out = []
    for name, ws in (("a", a), ("b", b)):
        path = write_lock(tmp_path / f"{name}.yaml", f"stack-{name}", ws)
        data = yaml.safe_load(path.read_text())
        data["requires"] = [f"app=={'1.0' if name == 'a' else '2.0'}"]
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        out.append(path)
    return out


def test_plan_summary_full_and_apply_progress(target, stacks):
    a, b = stacks
    cli("apply", *host_args(target), "--lock", a)
    short = cli("plan", *host_args(target), "--lock", b).stdout
    full = cli("plan", *host_args(target), "--lock", b, "--full").stdout
    every = ["~ app", "~ one", "~ two", "~ three", "~ four", "- five", "+ six"]
    assert all(line in full for line in every) and "more package lines" not in full
    assert "~ app    1.0 → 2.0  (upgrade)" in short                            # the lock's requires: a headline
    assert not any(line in short for line in every[1:])
    assert "packages: 1 to add, 5 to change (5 upgrades), 1 to remove" in short
    assert "  … 6 more package lines (--full lists every one)" in short
    assert short.splitlines()[-1] == full.splitlines()[-1] == "Plan: 1 to add, 5 to change, 1 to remove."

    p = cli("apply", *host_args(target), "--lock", b)
    err = p.stderr
    assert "… 6 more package lines" in err and "- five" not in err              # the summary, once
    phases = [line.strip() for line in err.splitlines() if line.startswith("    build: ")]
    assert any(x.startswith("build: fetch") for x in phases) and any("installing 6 packages" in x for x in phases)
    assert any(x.startswith("build: install: installed 6 packages in") for x in phases)
    assert not any("==2.0" in x for x in phases), phases                        # no per-package line without -v

    log = cli("logs", *host_args(target)).stdout                               # the healthy generation's build log
    assert "0002-stack-b: ready" in log and "/generations/0002-stack-b/build.log" in log
    assert "+ six==1.0" in log and "$ " in log and "uv pip install" in log

    cli("rollback", *host_args(target))
    p = cli("apply", *host_args(target), "--lock", b, "-v", "--full")               # a reuse: nothing to install
    assert "- five" in p.stderr
    diff = cli("diff", *host_args(target), "1", "2").stdout.strip().splitlines()
    assert diff[0].startswith("Diff on ") and "  - five   1.0" in diff and not diff[-1].startswith("Plan:")
    assert diff[-1] == "Diff: 1 added, 5 changed, 1 removed."


def test_verbose_apply_prints_each_package(target, stacks):
    a, _ = stacks
    err = cli("apply", *host_args(target), "--lock", a, "-v").stderr
    lines = [line.split("build: install:", 1)[1].strip() for line in err.splitlines() if "build: install:" in line]
    assert any(x.startswith("+ one==1.0") for x in lines) and any(x.startswith("+ app==1.0") for x in lines)


def test_status_keeps_an_unreachable_hosts_error_under_the_table(target, tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    inv = tmp_path / "hosts.ini"
    inv.write_text(f"[gpu]\nup ansible_host={target.host} ansible_port={target.port} ansible_user={target.user} "
                   f"provision_root={target.root}\n"
                   f"gone ansible_host=127.0.0.1 ansible_port={port} ansible_user={target.user}\n")
    p = cli("status", "-i", inv, "--key", target.key_file, "--known-hosts", target.known_hosts, check=1)
    row = next(line for line in p.stdout.splitlines() if "gone" in line)
    assert "unreachable" in row and "connect" not in row.replace("unreachable", "")
    last = p.stderr.splitlines()[-1]      # before the table: each host as it finished
    assert last.startswith("gone: unreachable: ") and "Connection refused" in last, p.stderr
    assert [line for line in p.stderr.splitlines() if ": unreachable: " in line] == [last], p.stderr


def test_fleet_view_keeps_per_package_lines_out_of_logs(capsys):
    """A fleet's progress in logs: a phase line per host, never a per-package (detail) one, and a detail line
    neither ends nor fails the step it belongs to."""
    from provision.cli import core

    printer = core.FleetPrinter(False, ["h1"])
    printer.tty = False
    say = printer.for_host("h1")
    say("build", "start", "")
    say("build", "detail", "install: + alpha==1.0 (from file:///cache/alpha.whl)")
    say("build", "info", "fetch: all 3 wheels cached")
    say("build", "done", "3 packages with uv")
    lines = [line.split() for line in capsys.readouterr().err.splitlines()]
    assert [line[:3] for line in lines] == [["h1", "·", "build"], ["h1", "✓", "build"]], lines
