"""Faults whose outcome must be told truly, on real sshd hosts: history unwritable around a rollback and a
failed build's marking, a deleted current generation, a switch interrupted after its commit, generation
numbers after gc, a saved plan given for another host, and lock inputs (a stale override, a URL outside RFC
3986).

History is made unwritable with `chattr +i` (root ignores file modes). A switch interrupted between the
rename of `current` and its history line leaves exactly what history made unwritable during the switch
leaves: `current` renamed, the manifest `switching`, the event missing.
"""
from __future__ import annotations

import json
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from provision import apply as applymod
from provision import generations
from provision.agent import store
from provision import lock as lockmod
from provision.errors import ProvisionError
from provision.plan import plan_host
from provision.transport import connect
from test_core import cli, host_args
from test_faults import assert_settled, host_state
from wheelhouse import make_wheel, write_lock


@pytest.fixture
def locks(tmp_path, wheels):
    """a, b: two good locks; bad: one whose wheel's sha256 is wrong (its build fails after prepare)."""
    a = lockmod.load(write_lock(tmp_path / "a.yaml", "stack-a", [wheels["alpha-1.0"]]))
    b = lockmod.load(write_lock(tmp_path / "b.yaml", "stack-b", [wheels["alpha-1.0"], wheels["beta-1.0"]]))
    data = yaml.safe_load(Path(write_lock(tmp_path / "bad.yaml", "stack-bad",
                                          [wheels["alpha-1.0"], wheels["gamma-1.0"]])).read_text())
    data["packages"][1]["sha256"] = "0" * 64
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return a, b, lockmod.load(tmp_path / "bad.yaml")


@contextmanager
def session(target):
    tr = connect(target)
    try:
        yield tr
    finally:
        tr.close()


@contextmanager
def immutable(path: Path):
    subprocess.run(["chattr", "+i", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def events(tr, kind: str) -> list[dict]:
    return [e for e in generations.history(tr).events if e["event"] == kind]


def test_rollback_and_failed_marking_with_history_unwritable(target, locks):
    """The rename of `current` is the commit: a rollback whose history line cannot be written reports the
    switch (exit 0, a warning), a failed build's marking reports the marking; the next run records both."""
    a, b, bad = locks
    root = Path(target.root)
    with session(target) as tr:
        ga, gb = applymod.apply(tr, a).generation, applymod.apply(tr, b).generation
        with immutable(root / "history.jsonl"):
            p = cli("rollback", *host_args(target), check=0)
            assert f"→ {ga}" in p.stdout and "warning:" in p.stderr and "Operation not permitted" in p.stderr
            assert host_state(target)["current"] == ga
            with pytest.raises(ProvisionError) as e:
                applymod.apply(tr, bad)
            rep = e.value.report
            gbad = rep.generation
            assert not any("could not mark" in w for w in rep.warnings), rep.warnings
            assert any(f"marked {gbad} failed; recording it failed (history:" in w for w in rep.warnings)
            assert host_state(target)["generations"][gbad] == {"status": "failed", "venv": False}
        assert events(tr, "rollback") == [] and events(tr, "apply-failed") == []
        again = applymod.apply(tr, a)                       # history writable: the next run repairs it
        assert again.status == "noop" and set(again.recovered["repaired"]) == {ga, gbad}
        rb, failed = events(tr, "rollback"), events(tr, "apply-failed")
        assert [(e["from"], e["to"], e["repaired"]) for e in rb] == [(gb, ga, True)]
        assert [(e["generation"], e["repaired"]) for e in failed] == [(gbad, True)]
        assert applymod.apply(tr, a).recovered["repaired"] == []      # recorded once
        assert generations.rollback(tr, gb).to == gb                  # a later rollback works
    assert_settled(target, gb)


def test_deleted_current_generation(target, locks):
    """`current` naming a generation whose directory is gone: status says broken; apply takes a fresh
    number (never the missing one's), and a failed build leaves `current` where it was."""
    a, b, bad = locks
    root = Path(target.root)
    with session(target) as tr:
        applymod.apply(tr, a)
        gb = applymod.apply(tr, b).generation
        store.rmtree(str(root / "generations" / gb))        # by hand, through the store's immutable links
        st = generations.status(tr)
        assert st.current == gb and "missing" in st.broken and st.probe is None
        assert plan_host(tr, b).current_error
        table = cli("status", *host_args(target), check=0).stdout
        assert "broken" in table and "pass" not in table
        with pytest.raises(ProvisionError) as e:
            applymod.apply(tr, bad)
        gbad = e.value.report.generation
        assert int(gbad.split("-")[0]) > int(gb.split("-")[0])
        st = host_state(target)
        assert st["current"] == gb and gb not in st["generations"]
        assert st["generations"][gbad] == {"status": "failed", "venv": False}
        rep = applymod.apply(tr, b)
        assert rep.status == "applied" and rep.previous == gb
        assert int(rep.generation.split("-")[0]) > int(gbad.split("-")[0])
    assert_settled(target, rep.generation)


def test_switch_interrupted_after_its_commit(target, locks):
    """A generation left `switching` is settled by where `current` points before anything reads it:
    current → committed (the switch recorded once); not current → runnable again (never abandoned).
    plan predicts what apply does."""
    a, b, _ = locks
    root = Path(target.root)
    with session(target) as tr:
        ga = applymod.apply(tr, a).generation

        def progress(step, state, detail):
            if (step, state) == ("switch", "start"):
                subprocess.run(["chattr", "+i", str(root / "history.jsonl")], check=True)

        try:
            gb = applymod.apply(tr, b, progress=progress).generation
        finally:
            subprocess.run(["chattr", "-i", str(root / "history.jsonl")], check=True)
        assert host_state(target)["generations"][gb]["status"] == "switching"
        assert host_state(target)["current"] == gb
        assert plan_host(tr, b).action == "noop"                  # what apply then does
        rb = generations.rollback(tr)                                    # settles b first, then switches
        assert (rb.from_, rb.to) == (gb, ga) and rb.recovered.repaired == [gb]
        assert [e["to"] for e in events(tr, "apply")] == [ga, gb]
        assert host_state(target)["generations"][gb] == {"status": "ready", "venv": True}
        assert generations.rollback(tr, gb).to == gb                  # runnable: `rollback --to` it
        generations.rollback(tr, ga)

        # left `switching` while `current` names another generation: runnable again, its venv kept
        man = root / "generations" / gb / "manifest.json"
        m = json.loads(man.read_text())
        man.write_text(json.dumps(dict(m, status="switching", switch_event={"event": "apply", "to": gb,
                                                                              "switch_id": "never-committed"})))
        plan = plan_host(tr, b)
        assert (plan.action, plan.reuse) == ("reuse", gb)
        rep = applymod.apply(tr, b)
        assert rep.status == "reused" and rep.generation == gb and rep.recovered["settled"] == [gb]
        assert not events(tr, "abandoned")
        assert not [e for e in generations.history(tr).events if e.get("switch_id") == "never-committed"]
    assert_settled(target, gb)


def test_generation_numbers_only_grow(target, locks):
    """A number is never given twice under a root, even after gc removed the generation that had it."""
    a, b, bad = locks
    with session(target) as tr:
        applymod.apply(tr, a)
        with pytest.raises(ProvisionError) as e:
            applymod.apply(tr, bad)
        gbad = e.value.report.generation
        assert gbad in [g.id for g in generations.gc(tr).generations]
        gb = applymod.apply(tr, b).generation
        assert number(gb) == number(gbad) + 1
        with pytest.raises(ProvisionError) as e:
            applymod.apply(tr, bad)
        gbad = e.value.report.generation
        assert gbad in [g.id for g in generations.gc(tr).generations]
        (Path(target.root) / "last-number").unlink()   # history alone still knows
        with pytest.raises(ProvisionError) as e:
            applymod.apply(tr, bad)
        assert number(e.value.report.generation) == number(gbad) + 1
    assert_settled(target, gb)


def number(gen_id: str) -> int:
    return int(gen_id.split("-", 1)[0])


def test_saved_plan_for_another_host_or_root(target, locks, tmp_path):
    """A saved plan is checked against the command's host and root before any host is contacted: one line
    naming the plan file and the host it was made for, exit 2."""
    a, _, _ = locks
    saved = tmp_path / "plan.json"
    cli("plan", *host_args(target), "--lock", a.path, "--out", saved, check=0)
    planned = f"{target.user}@{target.host}:{target.port}"
    other_root = str(tmp_path / "other-root")
    for args in (["nobody@127.0.0.1:1", "--known-hosts", target.known_hosts],    # nothing listens there
                 ["--local", "--root", other_root],
                 [*host_args(target)[:-1], other_root]):
        p = cli("apply", *args, "--plan", saved, check=2)
        err = p.stderr.strip().splitlines()
        assert len(err) == 1 and str(saved) in err[0] and f"made for {planned}" in err[0], p.stderr
        assert "ssh" not in p.stderr.lower() and "changed since" not in p.stderr
    assert not Path(other_root).exists()
    cli("apply", *host_args(target), "--plan", saved, check=0)       # its own host and root: applied


def test_stale_override_named_by_plan_and_apply(target, tmp_path, wheels):
    """plan and apply name an override of a package the lock lacks, with its file:line."""
    data = yaml.safe_load(Path(write_lock(tmp_path / "o.yaml", "stack-o", [wheels["alpha-1.0"]])).read_text())
    data["overrides"] = [{"package": "gone", "pins": "alpha==0.9", "use": "alpha==1.0",
                          "reason": "alpha 1.0 works with gone; kept from an older lock"}]
    (tmp_path / "o.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    lk = lockmod.load(tmp_path / "o.yaml")
    stale = "override for gone, which is not in the closure"
    with session(target) as tr:
        assert any(stale in w and "o.yaml:" in w for w in plan_host(tr, lk).warnings)
        assert any(stale in w for w in applymod.apply(tr, lk).plan["warnings"])
    p = cli("apply", *host_args(target), "--lock", tmp_path / "o.yaml", check=0)
    assert stale in p.stderr


def test_url_outside_rfc3986_refused(tmp_path):
    """An index URL with a backtick fails `lock check`: one line naming file:line."""
    w = make_wheel(tmp_path / "wh", "delta", "1.0")
    text = Path(write_lock(tmp_path / "u.yaml", "stack-u", [w], indexes={"main": "https://example.org/si`id`mple"})
                ).read_text()
    p = cli("lock", "check", tmp_path / "u.yaml", check=2)
    line = next(i for i, s in enumerate(text.splitlines(), 1) if "`id`" in s)
    assert f"{tmp_path / 'u.yaml'}:{line}" in p.stderr and "RFC 3986" in p.stderr and "`" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
