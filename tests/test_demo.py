"""The demo's lock B: the CPU torch wheel it pins by name and sha256 is found (as pip finds it) or given,
checked, and named by file:// in a wheelhouse beside a copy of the lock; anything else is one line, exit 2.
The whole demo runs in CI from the installed wheel (.ci/run)."""
from __future__ import annotations

import hashlib
import tempfile

import pytest
from typer.testing import CliRunner

from provision import lock as lockmod
from provision import lockcheck
from provision.bundled import DEMO_LOCKS
from provision.cli import app
from provision.demo import scratch, wheelhouse_lock
from provision.errors import InputError

SHIPPED = lockmod.load(DEMO_LOCKS / "b.yaml")
TORCH = SHIPPED.package("torch")


def test_shipped_lock_b_launches_the_included_engine_and_pins_torch_without_a_url():
    assert SHIPPED.engine == {"kind": "included", "device": "cpu", "threads": 1}
    assert TORCH.version == "2.13.0+cpu" and TORCH.url is None and TORCH.sha256
    assert {"safetensors", "sympy", "typing-extensions", "setuptools"} <= set(SHIPPED.versions())
    assert [p.name for p in SHIPPED.packages if p.url is None] == ["torch"]


def test_engine_threads_is_checked_as_data():
    text = (DEMO_LOCKS / "b.yaml").read_text().replace("threads: 1 ", "threads: -1 ")
    with pytest.raises(InputError) as e:
        lockmod.loads(text, "b.yaml")
    assert str(e.value).startswith("b.yaml:") and "threads" in str(e.value)


def test_torch_found_by_pip_is_checked_and_named_beside_the_lock(tmp_path, monkeypatch):
    monkeypatch.delenv(lockmod.WHEELHOUSE_ENV, raising=False)    # the lock's own folder must suffice
    said = []
    out = wheelhouse_lock(DEMO_LOCKS / "b.yaml", tmp_path / "house", say=said.append)
    lk = lockmod.load(out)
    torch = lk.package("torch")
    wheel = tmp_path / "house" / TORCH.filename
    assert torch.url == wheel.resolve().as_uri()
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() == TORCH.sha256 == torch.sha256
    assert [(p.name, p.version, p.sha256, p.url) for p in lk.packages if p.name != "torch"] == \
        [(p.name, p.version, p.sha256, p.url) for p in SHIPPED.packages if p.name != "torch"]
    assert (lk.engine, lk.probes, lk.requires) == (SHIPPED.engine, SHIPPED.probes, SHIPPED.requires)
    assert len(said) == 1 and "found by pip download" in said[0] and "= the lock's pin" in said[0]
    assert lockcheck.check(lk).findings == []           # the closure holds torch's own Requires-Dist


def test_pip_finding_nothing_is_one_line(tmp_path, monkeypatch):
    for k, v in (("PIP_CONFIG_FILE", "/dev/null"), ("PIP_NO_INDEX", "1"), ("PIP_FIND_LINKS", str(tmp_path))):
        monkeypatch.setenv(k, v)
    with pytest.raises(InputError) as e:
        wheelhouse_lock(DEMO_LOCKS / "b.yaml", tmp_path / "house")
    assert "torch==2.13.0+cpu: no wheel found by pip download" in str(e.value)
    assert "pass --torch-wheel PATH" in str(e.value)


@pytest.mark.parametrize("name, where, expect", [
    (TORCH.filename, "b.yaml:", f"is not the lock's {TORCH.sha256}"),
    ("torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", "--torch-wheel:", f"is not {TORCH.filename}"),
])
def test_a_wrong_torch_wheel_is_refused_before_any_host_starts(tmp_path, monkeypatch, name, where, expect):
    fake = tmp_path / "given" / name
    fake.parent.mkdir()
    fake.write_bytes(b"not the wheel lock B pins")
    sandbox = tmp_path / "tmp"
    sandbox.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(sandbox))     # where the throwaway host would live
    r = CliRunner().invoke(app, ["demo", "--torch-wheel", str(fake)])
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "Traceback" not in r.output, r.output
    assert where in errors[0] and expect in errors[0], errors[0]
    assert list(sandbox.iterdir()) == []                        # nothing left behind


def test_the_throwaway_host_goes_where_there_is_room_or_one_line_says_where_none_is(tmp_path):
    full, roomy = tmp_path / "full", tmp_path / "new" / "roomy"
    assert scratch(need=1, places=[roomy]) == roomy and roomy.is_dir()     # made where it did not exist
    with pytest.raises(InputError) as e:
        scratch(need=1 << 60, places=[full, roomy])
    said = str(e.value)
    assert said.startswith("demo: the throwaway host needs about 1073741824.0 GiB free") and str(full) in said
    assert "\n" not in said and "TMPDIR" in said
