"""Benchmark of `pack` against reading the same bytes, on a real environment (default: the one running this).

Prints, measured in this one run: the host agent's pack of the environment (every file read once: hashed against
its RECORD, deflated or stored into its wheel) with its seconds, files, bytes and wheel bytes; the first read of
the same files from disk (each file's page cache dropped first) that the agent times after it; then a read of the
same files from the page cache (read once more to fill it, then timed). The ratios are pack ÷ first read and pack
÷ cached read; the CPU seconds the pack's processes took say what more cores would do. The longest silence
between the agent's progress events is printed too.
Usage: python bench/pack_bench.py [--venv PATH] [--level 0-9] [--jobs N] [--json]
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from machine import Machine, describe  # noqa: E402
from provision.agent import record  # noqa: E402
from provision.transport import Local, Target  # noqa: E402
from provision.units import human_size  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--venv", default=sys.prefix, help="the environment to pack (default: this interpreter's)")
    ap.add_argument("--level", type=int, default=None, help="deflate level (default: the host's choice)")
    ap.add_argument("--jobs", type=int, default=None, help="worker processes (default: one per core)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    machine = Machine()
    events = []
    tr = Local(Target(host="local"))
    with tempfile.TemporaryDirectory(prefix="pack-bench-") as out:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        res = tr.run_agent("pack", {"op": "pack", "venv": args.venv, "out": out, "allow_drift": True,
                                    "level": args.level, "jobs": args.jobs, "progress_every": 2.0},
                           on_event=lambda ev: events.append((time.perf_counter(), ev)), timeout=None)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        tr.close()
    paths = [str(p) for p in record_paths(args.venv)]
    record.read_all(paths)                  # into the page cache (the agent dropped it after its first read)
    cached_s, cached_bytes = record.read_all(paths)
    s = res["seconds"]
    stamps = [t0] + [t for t, _ in events] + [t0 + wall]
    fig = {"venv": args.venv, "files": res["files"], "bytes": res["bytes"], "wheels": len(res["wheels"]),
           "wheel_bytes": sum(w["size"] for w in res["wheels"]), "level": res["level"],
           "level_auto": res["level_auto"], "jobs": res["jobs"],
           "deflated": sum(w["deflated"] for w in res["wheels"]), "stored": sum(w["stored"] for w in res["wheels"]),
           "plan_s": s["plan"], "pack_s": s["pack"], "first_read_s": s["read"], "cache": res["cache"],
           "cached_read_s": cached_s, "cached_read_bytes": cached_bytes,
           "pack_over_first_read": (s["plan"] + s["pack"]) / s["read"],
           "pack_over_cached_read": (s["plan"] + s["pack"]) / cached_s,
           "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
           "events": len(events), "longest_silence_s": max(b - a for a, b in zip(stamps, stamps[1:])),
           "drifted_dists": len(res["drift"]), **machine.figures()}
    if args.json:
        print(json.dumps(fig, indent=2))
        return
    print(describe(fig))
    gb = fig["bytes"] / 1e9
    print(f"pack of {fig['venv']}: {fig['files']} files, {human_size(fig['bytes'])} read, checked against RECORD and "
          f"packed in {fig['plan_s'] + fig['pack_s']:.2f} s on {fig['jobs']} processes (reading the RECORDs "
          f"{fig['plan_s']:.2f} s of it) into {fig['wheels']} wheels, {human_size(fig['wheel_bytes'])} "
          f"({fig['deflated']} members deflated, "
          f"{fig['stored']} stored; level {fig['level']}{', the host chose' if fig['level_auto'] else ''})")
    print(f"first read of the same bytes   {fig['first_read_s']:7.2f} s   ({fig['cache']})")
    print(f"cached read of the same bytes  {fig['cached_read_s']:7.2f} s   (read once more, then timed)")
    print(f"pack ÷ first read {fig['pack_over_first_read']:.2f}x (target ≤ 2x); pack ÷ cached read "
          f"{fig['pack_over_cached_read']:.2f}x; the agent's CPU {fig['cpu_s']:.1f} s ({fig['cpu_s'] / gb:.1f} "
          f"CPU-s per GB); {fig['events']} progress events, the longest silence {fig['longest_silence_s']:.1f} s")


def record_paths(venv: str):
    """The files the pack read: every file a RECORD lists with a hash (bytecode left out, as pack leaves it)."""
    from provision.agent.pack import skipped

    lst = record.listing(venv)
    return sorted({w[2] for w in lst["work"] if not skipped(w[1])})


if __name__ == "__main__":
    main()
