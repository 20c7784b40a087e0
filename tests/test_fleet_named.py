"""Acting only on what was named: with -i, HOST narrows the inventory like --limit (or is refused in one line),
and positionals mean the same with and without -i; usage errors are one line (JSON with --json)."""
from __future__ import annotations

import json
import os

import pytest
import typer.main
from typer.testing import CliRunner

from provision import apply as applymod, lock as lockmod
from provision.cli import app
from provision.inventory import load_inventory
from provision.loopback import free_port
from test_core import cli
from wheelhouse import write_lock

NAMED, OTHER, GONE = "gpu-named", "gpu-other", "gpu-gone"


@pytest.fixture(scope="module")
def fleet(sshd, wheels, tmp_path_factory):
    """Three inventory hosts: two on the session's sshd (own roots, generations 1 and 2 applied), one where
    nothing listens; (inventory, roots, the common options, the locks, a scratch folder)."""
    d = tmp_path_factory.mktemp("named")
    t = sshd.target
    roots = {NAMED: d / "root-named", OTHER: d / "root-other"}
    inv = d / "inv.yml"
    inv.write_text(f"all:\n  vars: {{ansible_host: {t.host}, ansible_user: {t.user}, "
                   f"ansible_ssh_private_key_file: {t.key_file}}}\n  hosts:\n"
                   f"    {NAMED}: {{ansible_port: {t.port}, provision_root: {roots[NAMED]}}}\n"
                   f"    {OTHER}: {{ansible_port: {t.port}, provision_root: {roots[OTHER]}}}\n"
                   f"    {GONE}: {{ansible_port: {free_port()}, provision_root: {d / 'root-gone'}}}\n")
    a = write_lock(d / "a.yaml", "stack-a", [wheels["alpha-1.0"]])
    b = write_lock(d / "b.yaml", "stack-b", [wheels["alpha-2.0"], wheels["beta-1.0"]])
    ts = load_inventory(inv, t.known_hosts, limit=f"{NAMED}:{OTHER}")
    for lk in (a, b):
        assert {r.status for r in applymod.apply_fleet(ts, lockmod.load(lk)).reports} == {"applied"}
    return inv, roots, ["-i", str(inv), "--known-hosts", str(t.known_hosts)], (a, b), d


def run(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output
    return r.exit_code, r.output


# Every verb that takes HOST, with what it needs besides; NAMED stands where HOST goes.
VERBS = {
    "plan": lambda f: ["plan", NAMED, "--lock", f[3][1]],
    "apply": lambda f: ["apply", NAMED, "--lock", f[3][1]],
    "adopt": lambda f: ["adopt", NAMED, "/nonexistent/env"],
    "rollback": lambda f: ["rollback", NAMED, "--dry-run"],
    "history": lambda f: ["history", NAMED],
    "status": lambda f: ["status", NAMED],
    "diff": lambda f: ["diff", NAMED, "1", "2"],
    "gc": lambda f: ["gc", NAMED, "--dry-run"],
    "logs": lambda f: ["logs", NAMED, "1"],
    "pack": lambda f: ["pack", NAMED, "1", "--out", f[4] / "pack"],
    "verify": lambda f: ["verify", NAMED, "2"],
    "probe": lambda f: ["probe", NAMED],
    "hosts trust": lambda f: ["hosts", "trust", NAMED, "--yes"],
    "hosts facts": lambda f: ["hosts", "facts", NAMED],
    "lock capture": lambda f: ["lock", "capture", NAMED, "--out", f[4] / "captured.yaml",
                               "--python", f[1][NAMED] / "current" / "venv"],
    "patches check": lambda f: ["patches", "check", NAMED],
    "patches apply": lambda f: ["patches", "apply", NAMED],
    "patches revert": lambda f: ["patches", "revert", NAMED],
    "contract": lambda f: ["contract", "LlamaForCausalLMEagle3", NAMED],
}
# What each says of the named host (exit code, text): the host's own answer, ok or not.
SAYS = {
    "plan": (0, f"Plan for {NAMED}"), "apply": (0, f"{NAMED}  noop           0002-stack-b"),
    "adopt": (0, f"{NAMED}: host is already managed"),
    "rollback": (0, f"Would roll back {NAMED}: current 0002-stack-b → 0001-stack-a"),
    "history": (0, f"generations on {NAMED}"), "status": (0, NAMED),
    "diff": (0, f"Diff on {NAMED}: 0001-stack-a → 0002-stack-b"), "gc": (0, f"{NAMED}: would remove"),
    "logs": (0, "0001-stack-a"), "pack": (0, f"Packed {NAMED}:0001-stack-a"),
    "verify": (0, f"0002-stack-b on {NAMED}: clean"), "probe": (0, f"0002-stack-b on {NAMED}: pass"),
    "hosts trust": (0, f"{NAMED} offers ssh-ed25519"), "hosts facts": (0, f"{NAMED}: "),
    "lock capture": (0, "lock adopted, 2 packages"),
    **{f"patches {m}": (1, f"sglang is not installed in {NAMED}:") for m in ("check", "apply", "revert")},
    "contract": (1, f"{NAMED}: LlamaForCausalLMEagle3: sglang is not installed"),
}


@pytest.mark.parametrize("verb", list(VERBS))
def test_host_with_inventory_acts_on_that_host_only(fleet, verb):
    inv, _, common, _, _ = fleet
    args = VERBS[verb](fleet)
    code, out = run(*args, *common)
    assert (code, SAYS[verb][1] in out) == (SAYS[verb][0], True), out
    assert OTHER not in out and GONE not in out and "cannot connect" not in out, out

    at = args.index(NAMED)                     # a name the inventory does not hold is refused, never ignored
    code, out = run(*args[:at], "gpu-typo", *args[at + 1:], *common)
    assert (code, out) == (2, f"error: {inv}: 'gpu-typo' names no host or group of the inventory\n")


@pytest.mark.parametrize("args,says", [
    (["diff", "--limit", NAMED, "1", "2"], f"Diff on {NAMED}: 0001-stack-a → 0002-stack-b"),
    (["diff", "--limit", NAMED, "1"], f"Diff on {NAMED}: 0001-stack-a → 0002-stack-b"),
    (["diff", NAMED, "1"], f"Diff on {NAMED}: 0001-stack-a → 0002-stack-b"),
    (["diff", "--limit", f"{NAMED}:{OTHER}", NAMED, "2", "1"], f"Diff on {NAMED}: 0002-stack-b → 0001-stack-a"),
    (["logs", "--limit", NAMED, "1"], "0001-stack-a: ready"),
    (["verify", "--limit", NAMED, "1"], f"0001-stack-a on {NAMED}: clean"),
    (["adopt", "--limit", NAMED, "/nonexistent/env"], f"{NAMED}: host is already managed"),
    (["status", "*-named", "--json"], f'"host": "{NAMED}"'),              # a pattern names hosts as --limit does
])
def test_positionals_mean_the_same_with_and_without_inventory(fleet, args, says):
    code, out = run(*args, *fleet[2])
    assert says in out and OTHER not in out, out
    assert code == 0, out


def test_named_host_errors_are_one_line(fleet):
    inv, _, common, _, _ = fleet
    for args, says in [
        (["status", NAMED, "--limit", OTHER], f"error: {inv}: '{NAMED}' and --limit '{OTHER}' name no host in common"),
        (["status", NAMED, "--local"], "error: --local: give --local (this machine) or -i (an inventory's hosts)"),
        (["diff", "--limit", NAMED], "error: A: required: the generation to diff from"),
        (["logs", "--limit", NAMED, "1", "2"], f"error: {inv}: '1' names no host or group"),   # every slot given
    ]:
        code, out = run(*args, *common)
        assert code == 2 and out.startswith(says) and len(out.splitlines()) == 1, (args, out)
    code, out = run("history", NAMED, "--local")
    assert (code, out) == (2, f"error: --local: acts on this machine: '{NAMED}' is one argument too many\n")


def test_rollback_of_a_named_host_leaves_the_others(fleet):
    _, roots, common, _, _ = fleet
    code, out = run("rollback", NAMED, *common)
    assert code == 0 and f"Rolled back {NAMED}: current 0002-stack-b → 0001-stack-a" in out and OTHER not in out
    assert [os.readlink(roots[n] / "current") for n in (NAMED, OTHER)] == ["generations/0001-stack-a",
                                                                          "generations/0002-stack-b"]
    code, out = run("rollback", NAMED, *common, "--to", "2")
    assert code == 0 and f"Switched forward {NAMED}" in out
    assert os.readlink(roots[NAMED] / "current") == "generations/0002-stack-b"


def test_usage_errors_are_one_line_and_json_with_json(fleet, tmp_path):
    inv, _, common, _, _ = fleet
    p = cli("plan", NAMED, *common, check=2)
    assert p.stderr.splitlines() == ["error: --lock: required: the lockfile to plan for (--lock FILE)"]
    p = cli("status", *common, "--json", "--bogus", check=2)
    assert json.loads(p.stdout) == {"error": "No such option: --bogus", "where": "--bogus", "exit_code": 2}
    assert len(p.stderr.splitlines()) == 1 and "Usage" not in p.stderr
    p = cli("status", *common, "--limit", "zzz", check=2)
    assert p.stderr == f"error: {inv}: --limit 'zzz' matches no host of the inventory\n"
    code, out = run("gc", "--local", "--root", tmp_path / "root", "--keep", "-2")
    assert code == 2 and len(out.splitlines()) == 1 and "'--keep'" in out and "greater than or equal to 1" in out


def test_one_forks_default_and_serial_zero_said():
    commands, forks = [typer.main.get_command(app)], {}
    while commands:
        c = commands.pop()
        commands += list(getattr(c, "commands", {}).values())
        forks.update({c.name: p.default for p in c.params if p.name == "forks"})
    assert len(forks) > 5 and len(set(forks.values())) == 1, forks
    code, out = run("apply", "--help")
    assert "(0, the default: all hosts in one batch)" in " ".join(out.split())


def test_unknown_host_key_hint_names_the_inventory_host(fleet, tmp_path):
    inv = fleet[0]
    kh = tmp_path / "known_hosts"
    code, out = run("status", NAMED, "-i", inv, "--known-hosts", kh, "--json")
    hint = f"provision hosts trust -i {inv} --limit {NAMED} --known-hosts {kh}"
    assert code == 1 and hint in json.loads(out)[0]["error"], out
    code, out = run(*hint.split()[1:], "--yes")
    assert code == 0 and "Recorded ssh-ed25519" in out
    code, out = run("status", NAMED, "-i", inv, "--known-hosts", kh, "--json")
    assert code == 0 and json.loads(out)[0]["result"]["current"] == "0002-stack-b"
