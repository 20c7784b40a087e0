"""plan is exactly what apply will do: for each kind of lock change, the plan's action and lines, then the
same change applied for real (local host root, real uv/pip installs) does what the plan said."""
from __future__ import annotations

import re
import shutil
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import yaml

from provision import apply as applymod
from provision import generations
from provision import lock as lockmod
from provision.errors import ProvisionError
from provision.facts import Facts
from provision.plan import make_plan, plan_host, render_plan, stack_of_lock
from provision.transport import Local, Target
from provision.units import human_size
from wheelhouse import make_wheel, write_lock

PY = "%d.%d" % sys.version_info[:2]
SERIES = Path(applymod.__file__).parent / "patches" / "sglang-0.5.9"


def generation(lk: lockmod.Lock) -> dict:
    """The store's record of a generation built from `lk` (as the facts agent lists it)."""
    return {"id": "0001-base", "number": 1, "status": "ready", "lock_digest": lk.digest, "venv_ok": True,
            "stack": asdict(stack_of_lock(lk)), "lock_name": lk.name}


def host_facts(lk: lockmod.Lock, **over) -> Facts:
    """Facts of a host whose current generation was built from `lk` and runs (its reply, `over` changed)."""
    reply = {"root": "/r", "current": "0001-base", "generations": [generation(lk)],
             "current_dists": dict(lk.versions()), "current_python": f"{PY}.0", "pythons": {PY: "/usr/bin/python3"},
             "disk_free_bytes": 1 << 40, "cached_wheels": [p.sha256 for p in lk.packages]}
    reply.update(over)
    return Facts.from_reply(reply, "h")


@pytest.fixture
def base(tmp_path, wheels):
    (tmp_path / "series").mkdir()
    shutil.copytree(SERIES, tmp_path / "series" / "sglang-0.5.9")
    path = write_lock(tmp_path / "base.yaml", "base", [wheels["alpha-1.0"], wheels["beta-1.0"]],
                      patches=["series/sglang-0.5.9"])
    return path


def variant(path: Path, name: str, edit) -> lockmod.Lock:
    data = yaml.safe_load(path.read_text())
    edit(data)
    out = path.with_name(f"{name}.yaml")
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return lockmod.load(out)


def test_every_kind_of_lock_change_is_a_plan_line_and_a_build(base, tmp_path):
    lk = lockmod.load(base)
    assert make_plan(host_facts(lk), lk).action == "noop"
    other = make_wheel(tmp_path / "rebuilt", "alpha", "1.0", body="REBUILT = True\n")
    from wheelhouse import sha256

    def rehash(d):
        d["packages"][0].update(url=other.resolve().as_uri(), sha256=sha256(other))

    kinds = {
        "hash": rehash,
        "package": lambda d: d["packages"].pop(1),
        "probe": lambda d: d["probes"].update(timeout=600),
        "index": lambda d: d.update(indexes={"extra": "https://example.invalid/simple"}),
        "engine": lambda d: d["engine"].update(dtype="bfloat16"),
        "toolkit": lambda d: d["platform"].update(cuda={"version": "13.0.1", "source": "wheels"}),
        "driver": lambda d: d["platform"].update(driver={"min": "580.65.06"}),
        "python": lambda d: d["platform"].update(python="3.99"),
        "lock": lambda d: d.update(description="same stack, new words"),
    }
    for kind, edit in kinds.items():
        new = variant(base, f"v-{kind}", edit)
        plan = make_plan(host_facts(lk), new)
        assert plan.action == "build", (kind, plan.action)
        assert [c.category for c in plan.changes] == [kind], (kind, plan.changes)
        assert len(re.findall(r"(?m)^  [~+-] ", render_plan(plan))) == 1, render_plan(plan)
    assert "host has no working Python 3.99" in make_plan(host_facts(lk), variant(base, "py", kinds["python"])).errors[0]

    # the content of a patch changes, the lock does not
    before = host_facts(lk)
    patch = tmp_path / "series" / "sglang-0.5.9" / "0001-torch-symm-mem-sm120.patch"
    patch.write_text(patch.read_text() + "\n")
    plan = make_plan(before, lockmod.load(base))
    assert plan.action == "build" and [(c.category, c.name, c.action) for c in plan.changes] == [
        ("patch", "sglang-0.5.9", "change")]


def test_broken_current_and_reuse_are_plan_lines(base):
    lk = lockmod.load(base)
    broken = host_facts(lk, current_error="No module named 'encodings'", current_dists=None)
    plan = make_plan(broken, lk)
    assert plan.action == "build" and plan.changes[0].category == "lock"
    text = render_plan(plan)
    assert "current generation 0001-base is broken: No module named 'encodings'" in text
    assert "+ alpha" not in text                       # not a silent "+ everything"

    older = generation(lk)
    gens = [older, dict(older, id="0002-other", number=2, lock_digest="0" * 64)]
    facts = host_facts(lk, generations=gens, current="0002-other")
    plan = make_plan(facts, lk)
    assert plan.action == "reuse" and plan.reuse == "0001-base"
    assert "reuse (probe): generation 0001-base already holds this lock: apply probes it" in render_plan(plan)
    older["venv_ok"] = False                            # collected venv: not reusable
    facts = host_facts(lk, generations=gens, current="0002-other")
    assert make_plan(facts, lk).action == "build"


def action_of(rep: applymod.ApplyReport) -> str:
    if rep.status in ("noop", "reused"):
        return {"noop": "noop", "reused": "reuse"}[rep.status]
    return "build" if any(s.name == "build" for s in rep.steps) else "none"


def predict_and_apply(tr, lk) -> tuple[str, str, applymod.ApplyReport]:
    planned = plan_host(tr, lk)
    try:
        rep = applymod.apply(tr, lk)
    except ProvisionError as e:
        rep = e.report
    return planned.action, action_of(rep), rep


def test_plan_predicts_apply_on_a_real_host(base, tmp_path, wheels):
    tr = Local(Target(host="local", root=str(tmp_path / "root")))
    a = lockmod.load(write_lock(tmp_path / "a.yaml", "a", [wheels["alpha-1.0"]]))
    other = make_wheel(tmp_path / "rebuilt", "alpha", "1.0", body="REBUILT = True\n")
    a_rehashed = lockmod.load(write_lock(tmp_path / "a2.yaml", "a", [other]))
    a_probes = lockmod.load(write_lock(tmp_path / "a3.yaml", "a", [other], probes={"timeout": 600}))
    steps = [(a, "build"), (a, "noop"), (a_rehashed, "build"), (a_probes, "build"), (a, "reuse"),
             (a_probes, "reuse")]
    for lk, want in steps:
        planned, did, rep = predict_and_apply(tr, lk)
        assert (planned, did) == (want, want), (lk.path, planned, did, rep.error)
        assert rep.status in ("applied", "noop", "reused"), rep.error
    h = generations.history(tr)
    assert [g.id for g in h.generations] == ["0001-a", "0002-a", "0003-a"] and h.current == "0003-a"

    # the current interpreter breaks: plan says so and apply rebuilds (never "No changes")
    (tmp_path / "root" / "generations" / "0003-a" / "venv" / "bin" / "python").unlink()
    assert "current generation 0003-a is broken" in render_plan(plan_host(tr, a_probes))
    planned, did, rep = predict_and_apply(tr, a_probes)
    assert (planned, did) == ("build", "build") and rep.status == "applied"

    # a Python the host lacks is refused before anything is fetched or created
    py = lockmod.load(write_lock(tmp_path / "py.yaml", "py", [wheels["beta-1.0"]], python="3.99"))
    planned, did, rep = predict_and_apply(tr, py)
    assert planned == "build" and did == "none" and rep.failed_step == "plan"
    assert "no working Python 3.99" in rep.error
    assert [g.id for g in generations.history(tr).generations][-1] == "0004-a"


def test_a_package_without_url_builds_from_the_hosts_cache_and_plan_says_so(tmp_path, wheels):
    """A lock may name a wheel by hash alone (no url): plan refuses it exactly when apply could not fetch it."""
    tr = Local(Target(host="local", root=str(tmp_path / "root")))
    first = lockmod.load(write_lock(tmp_path / "a.yaml", "a", [wheels["alpha-1.0"]]))
    rep = applymod.apply(tr, first)                      # alpha 1.0 is now in the host's wheel cache
    assert rep.status == "applied", rep.status

    def without_url(name, ws):
        path = write_lock(tmp_path / f"{name}.yaml", name, ws)
        data = yaml.safe_load(path.read_text())
        del data["packages"][0]["url"]
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return lockmod.load(path)

    cached = without_url("b", [wheels["alpha-1.0"], wheels["beta-1.0"]])
    planned = plan_host(tr, cached)
    assert planned.action == "build" and planned.errors == []
    assert applymod.apply(tr, cached).status == "applied"

    missing = without_url("c", [wheels["gamma-1.0"]])
    planned = plan_host(tr, missing)
    assert planned.errors == ["gamma==1.0 has no url in the lock and is not in the host's wheel cache"]
    with pytest.raises(ProvisionError):
        applymod.apply(tr, missing)
    assert tr.target.host and (tmp_path / "root" / "current").resolve().name.endswith("-b")


def test_disk_check_of_a_build_from_cached_wheels_counts_only_the_install(tmp_path, wheels):
    """Every wheel already in the host's cache and its files in the host's store: the disk a build needs is
    the generation's own files and directories alone (nothing to fetch, every wheel file linked from the store);
    free space that holds it is enough, one byte less is refused; the reserve is only a warning."""
    from provision.facts import gather
    import zipfile

    from provision.plan import BLOCK, MIN_FREE_BYTES, download_estimate

    tr = Local(Target(host="local", root=str(tmp_path / "root")))
    ws = [wheels["alpha-1.0"], wheels["beta-1.0"]]
    assert applymod.apply(tr, lockmod.load(write_lock(tmp_path / "a.yaml", "a", ws))).status == "applied"
    cached = lockmod.load(write_lock(tmp_path / "b.yaml", "b", ws))     # the same wheels, another build
    facts = gather(tr, python=cached.platform.python)
    dl = download_estimate(facts, cached)
    install = sum(-(-i.file_size // BLOCK) * BLOCK for w in ws for i in zipfile.ZipFile(w).infolist())
    listed = sum(len([i for i in zipfile.ZipFile(w).infolist() if not i.filename.endswith("RECORD")]) for w in ws)
    assert (dl["wheels"], dl["bytes"], dl["isolation"], dl["entered"]["files"]) == (0, 0, "store", 0), dl
    assert dl["linked"]["files"] == listed and dl["disk_needed"] == dl["own"]["bytes"] < install + (1 << 20), dl
    need = dl["disk_needed"]
    for free, refused in ((need, False), (need - 1, True)):
        plan = make_plan(replace(facts, disk_free_bytes=free), cached)
        assert plan.action == "build"
        assert bool([e for e in plan.errors if "free under" in e]) == refused, (free, plan.errors)
        assert any(f"less than {human_size(MIN_FREE_BYTES)} to spare" in w for w in plan.warnings) != refused


def test_disk_check_of_wheels_not_at_hand_counts_those_the_store_holds_as_linked(tmp_path, wheels):
    """A lock whose wheels are only URLs (their files not at hand to list): the plan guesses each one's installed
    size from its download, and where the host's cache and store hold that wheel already, the guess is linked,
    not new data; the disk a build needs is then the generation's own files alone, as when the files are listed."""
    from provision.facts import gather

    from provision.plan import UNPACK_FACTOR, download_estimate, files_line

    tr = Local(Target(host="local", root=str(tmp_path / "root")))
    ws = [wheels["alpha-1.0"], wheels["beta-1.0"]]
    assert applymod.apply(tr, lockmod.load(write_lock(tmp_path / "a.yaml", "a", ws))).status == "applied"
    path = write_lock(tmp_path / "b.yaml", "b", ws)
    data = yaml.safe_load(path.read_text())
    for pkg, w in zip(data["packages"], ws):
        pkg["url"], pkg["size"] = f"https://wheels.invalid/{w.name}", w.stat().st_size
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    remote = lockmod.load(path)
    dl = download_estimate(gather(tr, python=remote.platform.python), remote)
    guess = UNPACK_FACTOR * sum(w.stat().st_size for w in ws)
    assert (dl["estimated"], dl["wheels"], dl["entered"]["bytes"], dl["linked"]["bytes"]) == (2, 0, 0, guess), dl
    assert dl["disk_needed"] == dl["own"]["bytes"], dl
    assert files_line(dl).startswith(f"0+ (~{human_size(guess)}) linked from the store, 0+ (~0 B) copied into it") \
        and files_line(dl).endswith("; 2 packages not at hand to list: files uncounted, sizes guessed as 3x the "
                                    "download"), files_line(dl)
