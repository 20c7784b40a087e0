"""Inventories that Ansible would read one way or another (a host given twice, a duplicate key, an undefined child
group, hosts as a list) are refused before any host is contacted, in one line naming the file and line."""
from __future__ import annotations

import pytest

from test_core import cli

CASES = {
    "port-twice.ini": ("[a]\nh1 ansible_host=127.0.0.1 ansible_port={port}\n[b]\nh1 ansible_host=127.0.0.1 "
                       "ansible_port=1{port}\n",
                       4, "host 'h1' is listed twice with different ansible_port ({port} at line 2, 1{port} here); "
                          "list it once"),
    "port-twice-in-name.ini": ("[a]\n127.0.0.1:{port}\n[b]\n127.0.0.1:1{port}\n",
                               4, "host '127.0.0.1' is listed twice with different ansible_port ({port} at line 2, "
                                  "1{port} here); list it once"),
    "duplicate-key.yml": ("all:\n  hosts:\n    h1: {{ansible_host: 127.0.0.1, ansible_port: {port}}}\n"
                          "    h1: {{ansible_host: 127.0.0.1, ansible_port: 1{port}}}\n",
                          4, "invalid YAML: duplicate key 'h1' (first at line 3)"),
    "child-undefined.ini": ("[a]\nh1 ansible_host=127.0.0.1 ansible_port={port}\n[g:children]\na\nnope\n",
                            5, "group 'g' names child group 'nope', which is defined nowhere (no hosts, children or "
                               "vars)"),
    "child-undefined.yml": ("all:\n  children:\n    g:\n      hosts:\n        h1: {{ansible_host: 127.0.0.1, "
                            "ansible_port: {port}}}\n      children:\n        nope:\n",
                            7, "group 'g' names child group 'nope', which is defined nowhere (no hosts, children or "
                               "vars)"),
    "hosts-list.yml": ("all:\n  vars: {{ansible_host: 127.0.0.1, ansible_port: {port}}}\n  hosts:\n    - h1\n"
                       "    - h2\n",
                       4, "the hosts of group 'all' are a list; write them as a mapping (`name:` or `name: {{vars}}` "
                          "per line)"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_ambiguous_inventory_is_one_line_before_any_contact(listener, tmp_path, name):
    port, accepted = listener
    text, line, says = CASES[name]
    inv = tmp_path / name
    inv.write_text(text.format(port=port))
    for verb in ("status", "history"):
        p = cli(verb, "-i", inv, "--known-hosts", tmp_path / "kh", "--timeout", "1", check=2)
        assert p.stderr == f"error: {inv}:{line}: {says.format(port=port)}\n", p.stderr
    assert accepted == [], "a host was contacted before the inventory was understood"


def test_the_same_host_in_two_groups_alike_is_read_and_contacted(listener, tmp_path):
    """The control: a host listed twice with the same values is one host, and it is contacted (the listener
    counts it), so the refusals above are the inventory's, not the listener's."""
    port, accepted = listener
    inv = tmp_path / "twice-alike.ini"
    inv.write_text(f"[a]\nh1 ansible_host=127.0.0.1 ansible_port={port}\n[b]\nh1 ansible_host=127.0.0.1 "
                   f"ansible_port={port}\n[g:children]\na\nb\n")
    p = cli("history", "-i", inv, "--known-hosts", tmp_path / "kh", "--timeout", "1", check=1)
    assert p.stderr.startswith("error: h1: "), p.stderr
    assert len(accepted) >= 1


def test_an_inventory_ansible_cannot_read_is_one_line_without_its_warnings(tmp_path):
    inv = tmp_path / "broken.ini"
    inv.write_text("[a]\nh1 ansible_port\n")
    p = cli("status", "-i", inv, check=2)
    assert p.stderr == (f"error: {inv}: Ansible cannot read it: Failed to parse inventory: Expected key=value host "
                        "variable assignment, got: ansible_port\n"), p.stderr


LOCK = "provision/lockfiles/demo/a.yaml"
HOST_VERBS = {        # every verb that takes a host, given the misspelled host h9 and only what else it must have
    "plan": ["plan", "h9", "--lock", LOCK], "apply": ["apply", "h9", "--lock", LOCK], "adopt": ["adopt", "h9"],
    "rollback": ["rollback", "h9"], "history": ["history", "h9"], "status": ["status", "h9"],
    "diff": ["diff", "h9", "1"], "gc": ["gc", "h9"], "logs": ["logs", "h9"], "probe": ["probe", "h9"],
    "verify": ["verify", "h9"], "pack": ["pack", "h9", "--out", "{out}"],
    "hosts trust": ["hosts", "trust", "h9", "--yes"], "hosts facts": ["hosts", "facts", "h9"],
    "lock capture": ["lock", "capture", "h9", "--out", "{out}.yaml"],
    **{f"patches {m}": ["patches", m, "h9"] for m in ("check", "apply", "revert")},
    "contract": ["contract", "LlamaForCausalLMEagle3", "h9"], "unlock": ["unlock", "h9"],
}


@pytest.mark.parametrize("verb", list(HOST_VERBS))
def test_a_host_that_is_not_in_the_inventory_is_an_error_before_any_contact(listener, tmp_path, verb):
    """With -i, the first argument after the verb is the hosts, also when the verb's next argument is left out: a
    name the inventory lacks is one line naming it, never taken for that argument (which would act on every host)."""
    port, accepted = listener
    inv = tmp_path / "hosts.ini"
    inv.write_text("".join(f"h{i} ansible_host=127.0.0.1 ansible_port={port}\n" for i in range(1, 9)))
    argv = [a.format(out=tmp_path / "out") for a in HOST_VERBS[verb]]
    p = cli(*argv, "-i", inv, "--known-hosts", tmp_path / "kh", "--timeout", "1", check=2)
    assert p.stderr == f"error: {inv}: 'h9' names no host or group of the inventory\n", p.stderr
    assert accepted == [], "a host was contacted"


REACH = {        # what provision cannot reach a host with, refused in one line before any contact
    "ansible_connection=paramiko": "ansible_connection 'paramiko' is not one provision runs host steps over "
                                   "(ssh, local)",
    "ansible_become=true ansible_become_method=su": "ansible_become_method 'su': provision becomes another user "
                                                    "through sudo only",
    "ansible_become=maybe": "ansible_become 'maybe' is not a boolean",
    "ansible_become=true ansible_become_password=s3cret": "ansible_become_password: provision runs sudo without a "
                                                          "password (sudo -n); give root's sudo rule NOPASSWD for "
                                                          "this user, or connect as root",
    "ansible_ssh_common_args='-o ProxyJump={{ bastion }}'": "ansible_ssh_common_args is a template "
                                                           "('-o ProxyJump={{ bastion }}'); provision reads inventory "
                                                           "values as data: write the value itself",
}


@pytest.mark.parametrize("setting", list(REACH))
def test_a_connection_provision_cannot_make_is_one_line_before_any_contact(listener, tmp_path, setting):
    port, accepted = listener
    inv = tmp_path / "hosts.ini"
    inv.write_text(f"h1 ansible_host=127.0.0.1 ansible_port={port} {setting}\n")
    p = cli("status", "-i", inv, "--known-hosts", tmp_path / "kh", "--timeout", "1", check=2)
    assert p.stderr == f"error: {inv}: host h1: {REACH[setting]}\n", p.stderr
    assert accepted == [], "a host was contacted"


LIMITS = {   # --limit / HOST with -i: every host or group a pattern adds must be one of the inventory's
    ("--limit", "h1,h33"): "'h33' (in --limit 'h1,h33') names no host or group of the inventory",
    ("--limit", "h33:h1"): "'h33' (in --limit 'h33:h1') names no host or group of the inventory",
    ("--limit", "h1,gpu*"): "'gpu*' (in --limit 'h1,gpu*') names no host or group of the inventory",
    ("HOST", "h2,h33"): "'h33' (in 'h2,h33') names no host or group of the inventory",
}


@pytest.mark.parametrize("verb", ["status", "rollback"])
@pytest.mark.parametrize("how", list(LIMITS))
def test_a_pattern_naming_one_unknown_host_is_an_error_before_any_contact(listener, tmp_path, verb, how):
    """Ansible drops a name of a pattern that matches nothing: `--limit h1,h33` would act on h1 alone, silently."""
    port, accepted = listener
    inv = tmp_path / "hosts.ini"
    inv.write_text("".join(f"h{i} ansible_host=127.0.0.1 ansible_port={port}\n" for i in range(1, 9)))
    opt, pattern = how
    argv = [verb, "--limit", pattern] if opt == "--limit" else [verb, pattern]
    p = cli(*argv, "-i", inv, "--known-hosts", tmp_path / "kh", "--timeout", "1", check=2)
    assert p.stderr == f"error: {inv}: {LIMITS[how]}\n", p.stderr
    assert accepted == [], "a host was contacted"


def test_a_pattern_that_only_narrows_is_read_as_ansible_reads_it(listener, tmp_path):
    """The control: negations and intersections are not names to find (`h1,h2,!h2`, `all:&h1`), and a known name
    list is contacted."""
    port, accepted = listener
    inv = tmp_path / "hosts.ini"
    inv.write_text("".join(f"h{i} ansible_host=127.0.0.1 ansible_port={port}\n" for i in range(1, 3)))
    for pattern in ("h1,h2,!h2", "all:&h1", "h1,!h33"):
        p = cli("status", "--limit", pattern, "-i", inv, "--known-hosts", tmp_path / "kh", "--timeout", "1",
                "--json", check=None)
        assert "names no host" not in p.stderr and p.returncode != 2, (pattern, p.stderr)
    assert len(accepted) >= 3
