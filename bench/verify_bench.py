"""Benchmark of what isolation and verification cost, on a throwaway loopback host (real sshd, uv, the demo locks).

Prints, measured in this one run: a cached apply of demo lock B (CPU torch; its wheels and uv's unpacked copies
already on the host, under another lock name so that it builds), its build and install seconds, the seal, the
cache entries hashed again before the build used them, the disk the new generation owns (bytes of files no
other path links; and the filesystem's free space before and after), `verify --baseline` of it (bytes hashed
from disk, seconds, GB/s, and a first read of the same bytes from disk, each file's page cache dropped before
either: the ratio), and rollback with its check against
rollback --force. The host root is made under TMPDIR (point it at an XFS or btrfs mount to measure reflinks).
Runs on checkouts without verify too (then those figures are absent), so that before and after compare.
Usage: python bench/verify_bench.py [--json] [--repeat N]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from provision import apply as applymod  # noqa: E402
from provision import generations  # noqa: E402
from provision import lock as lockmod  # noqa: E402
from provision.bundled import DEMO_LOCKS  # noqa: E402
from provision.demo import wheelhouse_lock  # noqa: E402
from provision.loopback import LoopbackHost  # noqa: E402
from machine import Machine, describe  # noqa: E402
from provision.transport import connect, trust_host  # noqa: E402


def owned_bytes(path: Path) -> tuple[int, int]:
    """(bytes of the files under `path` that no other path links, bytes of all of them): what the generation
    costs on disk beyond what it shares."""
    own = total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for fn in filenames:
            st = os.lstat(os.path.join(dirpath, fn))
            total += st.st_blocks * 512
            if st.st_nlink == 1:
                own += st.st_blocks * 512
    return own, total


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def renamed(lock_path: Path, name: str, out: Path) -> Path:
    """The same lock under another name: another generation, built from the host's caches."""
    text = lock_path.read_text().replace(f"name: {lockmod.load(lock_path).name}\n", f"name: {name}\n", 1)
    out.write_text(text)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeat", type=int, default=3, help="cached applies and rollbacks (median reported)")
    args = ap.parse_args()
    fig, machine = {}, Machine()
    with LoopbackHost() as host:
        house = Path(host.dir) / "wheelhouse"
        b_path = wheelhouse_lock(DEMO_LOCKS / "b.yaml", house)
        a = lockmod.load(DEMO_LOCKS / "a.yaml")
        trust_host(host.target)
        tr = connect(host.target)
        skip = ["engine"]             # the engine probe times decoding, not the build: left out of every apply
        applymod.apply(tr, a, skip_probes=skip)
        applymod.apply(tr, lockmod.load(b_path), skip_probes=skip)      # the caches now hold B
        applies, builds, installs, seals, deltas = [], [], [], [], []
        gen = None
        for i in range(args.repeat):
            lk = lockmod.load(renamed(b_path, f"demo-b{i}", house / f"b{i}.yaml"))
            free0 = free_bytes(host.root)
            t0 = time.perf_counter()
            rep = applymod.apply(tr, lk, skip_probes=skip)
            applies.append(time.perf_counter() - t0)
            deltas.append(free0 - free_bytes(host.root))
            steps = {s.name: s.seconds for s in rep.steps}
            builds.append(steps["build"])
            installs.append(rep.build.get("install_seconds") or 0.0)
            if "seal" in steps:
                seals.append(steps["seal"])
            gen = rep.generation
            fig["isolation"] = rep.build.get("isolation", "hardlink")
            if rep.build.get("recheck"):
                fig["recheck"] = rep.build["recheck"]
        fig.update(cached_apply_b_s=statistics.median(applies), build_s=statistics.median(builds),
                   install_s=statistics.median(installs))
        if seals:
            fig["seal_s"] = statistics.median(seals)
        own, total = owned_bytes(Path(host.root) / "generations" / gen / "venv")
        fig.update(generation_own_bytes=own, generation_bytes=total, fs_used_per_apply=statistics.median(deltas))
        try:
            from provision import verify as verifymod
        except ImportError:
            verifymod = None
        if verifymod is not None:
            v = verifymod.verify(tr, gen, baseline=True)
            fig.update(verify_verdict=v["verdict"], verify_bytes=v["bytes"], verify_files=v["files"],
                       verify_s=v["seconds"], verify_gbs=v["rate_gbs"], read_s=v["read_seconds"],
                       read_gbs=v["read_rate_gbs"], verify_over_read=v["ratio"], cache=v.get("cache"))
        checked, forced, check_s = [], [], []
        for _ in range(args.repeat):           # current → the generation before it, and forward again
            t0 = time.perf_counter()
            out = generations.rollback(tr)
            checked.append(time.perf_counter() - t0)
            if out.check is not None:
                check_s.append(out.check.seconds)
                fig["rollback_check_files"] = out.check.files
            generations.rollback(tr, to=gen)
            if verifymod is not None:
                t0 = time.perf_counter()
                generations.rollback(tr, force=True)
                forced.append(time.perf_counter() - t0)
                generations.rollback(tr, to=gen, force=True)
        fig["rollback_s"] = statistics.median(checked)
        if forced:
            fig.update(rollback_force_s=statistics.median(forced), rollback_check_s=statistics.median(check_s))
        tr.close()
    fig.update(machine.figures())
    if args.json:
        print(json.dumps(fig, indent=2))
        return
    print(f"{describe(fig)}; isolation: {fig['isolation']}")
    print(f"cached apply of demo-b (median of {args.repeat})   {fig['cached_apply_b_s']:7.2f} s   build "
          f"{fig['build_s']:.2f} s (uv install {fig['install_s']:.2f} s)"
          + (f", seal {fig['seal_s']:.2f} s" if "seal_s" in fig else ""))
    if "recheck" in fig:
        rc = fig["recheck"]
        print(f"cache entries hashed again          {rc['seconds']:7.2f} s   {rc['checked']} entries, "
              f"{rc['bytes'] / 1e6:.0f} MB, before the build used them")
    print(f"disk the generation owns            {fig['generation_own_bytes'] / 2**20:7.1f} MiB of "
          f"{fig['generation_bytes'] / 2**20:.1f} MiB its files hold (files no other path links; reflinked "
          "files count whole)")
    print(f"free space taken per cached apply   {fig['fs_used_per_apply'] / 2**20:7.1f} MiB   (statvfs of the host "
          "root's filesystem; other writers on it count too)")
    if "verify_s" in fig:
        print(f"verify                              {fig['verify_s']:7.2f} s   {fig['verify_files']} files, "
              f"{fig['verify_bytes'] / 1e9:.2f} GB from disk, {fig['verify_gbs']:.2f} GB/s; a first read of the same "
              f"bytes from disk {fig['read_s']:.2f} s ({fig['read_gbs']:.2f} GB/s; {fig['cache']}): verify = "
              f"{fig['verify_over_read']:.2f}x a first read (target ≤ 2x)")
    print(f"rollback (median of {args.repeat})              {fig['rollback_s']:7.2f} s"
          + (f"   its check {fig['rollback_check_s']:.3f} s over {fig['rollback_check_files']} files; "
             f"rollback --force {fig['rollback_force_s']:.2f} s" if "rollback_force_s" in fig else ""))


if __name__ == "__main__":
    main()
