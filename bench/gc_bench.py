"""Benchmark of gc's deletion: a generation-shaped tree (many small files in many package directories, a few
large ones) removed by a serial `shutil.rmtree` and by gc's own way (set aside by one rename, then the files
unlinked in parallel), on identical copies made in the same run; prints both times, their ratio, and the bytes
gc reported against du's before/after difference. The trees are made under TMPDIR (point it at the disk a host
root lives on to measure that filesystem).
Usage: python bench/gc_bench.py [--json] [--packages N] [--files N] [--repeat N]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from provision.agent import state  # noqa: E402
from machine import Machine, describe  # noqa: E402


def make_tree(gen: Path, packages: int, files: int) -> None:
    """venv/lib/python3/site-packages/<pkg>/<sub>/<file>.py: `packages` packages of `files` small files each,
    in subdirectories of 50, and one 8 MiB shared object per package every tenth package."""
    site = gen / "venv" / "lib" / "python3" / "site-packages"
    for p in range(packages):
        for f in range(files):
            d = site / f"pkg{p}" / f"sub{f // 50}"
            if f % 50 == 0:
                d.mkdir(parents=True, exist_ok=True)
            (d / f"m{f}.py").write_bytes(b"x = 1\n" * (1 + f % 200))
        if p % 10 == 0:
            (site / f"pkg{p}" / "_native.so").write_bytes(os.urandom(8 << 20))
    (gen / "manifest.json").write_text('{"status": "ready"}')


def du(path: Path) -> int:
    return int(subprocess.run(["du", "-s", "--block-size=1", str(path)], capture_output=True, text=True,
                              check=True).stdout.split()[0])


def serial_rmtree(path: Path) -> float:
    t0 = time.perf_counter()
    shutil.rmtree(path)
    return time.perf_counter() - t0


def once(base: Path, packages: int, files: int, serial_first: bool) -> dict:
    """Both copies made and synced first; which goes first alternates between runs."""
    root = base / "root"
    serial = base / "serial-copy"
    make_tree(root / "generations" / "0001-old", packages, files)
    make_tree(serial, packages, files)
    subprocess.run(["sync"], check=True)
    t_serial = serial_rmtree(serial) if serial_first else None
    before = du(root)
    t0 = time.perf_counter()
    item = ("generations", {"id": "0001-old"}, str(root / "generations" / "0001-old"), "gen-0001-old")
    out = {"bytes": 0, "shared_bytes": 0}
    errors: list[str] = []
    trash, paths = state.set_aside(str(root), [item], errors)
    sv = state.survey(paths)
    removed = state.remove_surveyed(sv, 16, errors)
    state.account(out, [item], sv, removed)
    os.rmdir(trash)
    os.rmdir(root / state.TRASH)
    t_gc = time.perf_counter() - t0
    if t_serial is None:
        t_serial = serial_rmtree(serial)
    return {"serial_s": t_serial, "gc_s": t_gc, "files": sum(len(n) for _, n in sv["files"][0]),
            "reported_bytes": out["bytes"], "du_freed_bytes": before - du(root), "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--packages", type=int, default=200)
    ap.add_argument("--files", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    runs, machine = [], Machine()
    for i in range(a.repeat):
        with tempfile.TemporaryDirectory(prefix="provision-gc-bench-") as d:
            runs.append(once(Path(d), a.packages, a.files, serial_first=i % 2 == 1))
    fig = {"files": runs[0]["files"], "serial_s": statistics.median(r["serial_s"] for r in runs),
           "gc_s": statistics.median(r["gc_s"] for r in runs), **machine.figures(),
           "reported_equals_du": all(r["reported_bytes"] == r["du_freed_bytes"] for r in runs),
           "runs": runs}
    fig["speedup"] = fig["serial_s"] / fig["gc_s"] if fig["gc_s"] else None
    if a.json:
        print(json.dumps(fig, indent=2))
        return
    print(f"{fig['files']} files: shutil.rmtree {fig['serial_s']:.2f}s, gc (rename aside, parallel unlink) "
          f"{fig['gc_s']:.2f}s: {fig['speedup']:.2f}x (median of {a.repeat}; {describe(fig)}); bytes gc reported "
          f"{'=' if fig['reported_equals_du'] else '≠'} du's difference")


if __name__ == "__main__":
    main()
