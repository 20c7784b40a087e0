"""`pack` at read speed and `verify` heard while they run: each file read once into its wheel (deflated, or stored
when its content is compressed already; a file over 16 MiB deflated in pieces), the rebuilt generation the same
bytes; progress events at the interval PROVISION_PROGRESS_EVERY sets; ratios against a first read from disk."""
from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest

from provision import pack as packmod, verify as verifymod
from provision.agent import pack as agentpack, record
from provision.transport import Local, Target
from test_core import cli
from test_pack import site_hashes
from wheelhouse import make_wheel, write_lock

EVERY = 0.05       # seconds between progress events, lowered from the default for the test


def heavy_wheel(outdir: Path) -> Path:
    """A wheel with a module larger than the size pack reads in pieces, a gzip file, random bytes under a name
    that says nothing, an empty file."""
    rnd = random.Random(7)
    table = b"".join(b"ROW_%07d = (%d, %r)\n" % (i, i * 7, "x" * (i % 13)) for i in range(700_000))
    assert len(table) > agentpack.SPLIT
    return make_wheel(outdir, "heavy", "1.0", extra={
        "heavy/table.py": table,
        "heavy/blob.gz": gzip.compress(rnd.randbytes(300_000), mtime=0),
        "heavy/noise.dat": rnd.randbytes(400_000),
        "heavy/empty.txt": b"",
        "heavy/notes.txt": b"plain words, said again and again. " * 2000,
    })


@pytest.fixture(scope="module")
def heavy(tmp_path_factory):
    """A local root whose current generation holds the heavy wheel."""
    tmp = tmp_path_factory.mktemp("heavy")
    whl = heavy_wheel(tmp / "w")
    root = tmp / "root"
    cli("apply", "--local", "--root", root, "--lock", write_lock(tmp / "lock.yaml", "heavy", [whl]), check=0)
    return tmp, root, whl


def test_compressed_content_is_stored_the_rest_deflated_and_the_rebuild_is_the_same(heavy, monkeypatch):
    tmp, root, whl = heavy
    monkeypatch.setenv("PROVISION_PACK_LEVEL", "1")
    monkeypatch.setenv("PROVISION_PROGRESS_EVERY", str(EVERY))
    events = []
    tr = Local(Target(host="local", root=str(root)))
    try:
        rep = packmod.pack(tr, tmp / "house", progress=events.append)
    finally:
        tr.close()
    with zipfile.ZipFile(tmp / "house" / whl.name) as z:
        how = {i.filename: i.compress_type for i in z.infolist()}
        assert z.testzip() is None
        assert z.read("heavy/table.py") == zipfile.ZipFile(whl).read("heavy/table.py")    # deflated in pieces
    assert how["heavy/blob.gz"] == how["heavy/noise.dat"] == how["heavy/empty.txt"] == zipfile.ZIP_STORED
    assert how["heavy/table.py"] == how["heavy/notes.txt"] == zipfile.ZIP_DEFLATED
    assert rep["level"] == 1 and rep["members"]["deflated"] >= 2 and rep["members"]["stored"] >= 3
    s = rep["seconds"]
    assert rep["read_bytes"] == rep["bytes"] and rep["ratio"] == (s["plan"] + s["pack"]) / s["read"]
    assert rep["cache"].startswith("the page cache dropped")

    ticks = [e for e in events if e.get("step") == "pack" and e.get("phase") == "pack"]
    assert ticks, events                         # the phase's start (the meter's own ticks: the test at the end)
    assert all(e["every"] == EVERY for e in events)
    times = [e["seconds"] for e in events]
    assert times == sorted(times) and max(b - a for a, b in zip(times, times[1:])) <= 5.0
    assert ticks[0]["bytes"] < ticks[0]["bytes_total"] == rep["bytes"]              # heard before the end

    other = tmp / "other"                       # the packed lock rebuilds the same files
    cli("apply", "--local", "--root", other, "--lock", tmp / "house" / "lock.yaml", check=0)
    assert site_hashes(root / "current" / "venv") == site_hashes(other / "current" / "venv")


def test_stored_at_level_0_and_the_ratio_line_names_a_first_read(heavy, tmp_path):
    _, root, whl = heavy
    p = cli("pack", "--local", "--root", root, "--out", tmp_path / "h", check=0)
    assert "pack ÷ first read" in p.stdout and "a first read of the same" in p.stdout, p.stdout
    assert "the page cache dropped per file first" in p.stdout, p.stdout
    r = subprocess.run([sys.executable, "-m", "provision.cli", "pack", "--local", "--root", str(root), "--out",
                        str(tmp_path / "s"), "--json"], capture_output=True, text=True,
                       env={**os.environ, "PROVISION_PACK_LEVEL": "0"},
                       cwd=Path(__file__).resolve().parent.parent)
    rep = json.loads(r.stdout)
    assert rep["level"] == 0 and rep["members"]["deflated"] == 0
    with zipfile.ZipFile(tmp_path / "s" / whl.name) as z:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist()) and z.testzip() is None


def test_pieces_deflated_apart_are_one_stream_and_their_crcs_combine():
    rnd = random.Random(3)
    data = b"".join(b"%d," % rnd.randrange(1000) for _ in range(200_000))
    cut = [0, 7, 100_000, 100_001, len(data)]
    pieces = [data[a:b] for a, b in zip(cut, cut[1:])]
    stream = b"".join(agentpack.deflate(p, 1, last=i == len(pieces) - 1) for i, p in enumerate(pieces))
    assert zlib.decompress(stream, -15) == data
    crc = zlib.crc32(pieces[0])
    for p in pieces[1:]:
        crc = agentpack.crc32_combine(crc, zlib.crc32(p), len(p))
    assert crc == zlib.crc32(data)


def test_verify_is_heard_while_it_runs(heavy, monkeypatch):
    _, root, _ = heavy
    monkeypatch.setenv("PROVISION_PROGRESS_EVERY", str(EVERY))
    events = []
    tr = Local(Target(host="local", root=str(root)))
    try:
        v = verifymod.verify(tr, None, baseline=True, progress=events.append)
    finally:
        tr.close()
    assert v["verdict"] == "clean" and v["read_bytes"] == v["bytes"]
    phases = [e["phase"] for e in events]
    assert {"hash", "seal", "read"} <= set(phases)     # each phase told at its start; the ticks between: below
    assert all(e["step"] == "verify" and e["every"] == EVERY for e in events)
    times = [e["seconds"] for e in events]
    assert max(b - a for a, b in zip(times, times[1:])) <= 5.0


def test_the_meter_speaks_on_its_own_while_a_phase_runs(monkeypatch):
    """The meter's thread tells the phase every `every` seconds while nothing else is said (one long file), each
    event with the counts so far; none after the meter closes. (How long verify takes depends on the disk, so
    the ticks are heard here, from a phase held open, not from a verify that may end within one interval.)"""
    told = []
    monkeypatch.setattr(record, "event", lambda **e: told.append(e))
    with record.Meter("verify", EVERY) as m:
        m.phase("hash", files_total=2, bytes_total=30)
        m.add(1, 10)
        for _ in range(1000):                       # up to 10 s on a loaded machine; 3 intervals are enough
            if len(told) >= 4:
                break
            record.time.sleep(0.01)
    closed = len(told)
    record.time.sleep(3 * EVERY)
    assert len(told) == closed >= 4, told           # the start, then three of the meter's own
    assert told[0] == dict(told[0], phase="hash", files=0, bytes=0, files_total=2, bytes_total=30)
    assert all(e["step"] == "verify" and e["every"] == EVERY for e in told)
    counts = [e["bytes"] for e in told]
    assert counts == sorted(counts) and counts[-1] == 10
    secs = [e["seconds"] for e in told]
    assert secs == sorted(secs) and secs[-1] >= 3 * EVERY * 0.9
