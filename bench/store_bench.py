"""Benchmark of the host's file store: a cached build that links from the store against today's build that copies
every file, `cp -a` of the same venv and uv's own hardlink install, and the removal of each, in one run on one disk.
A lock over every wheel in a directory (real wheels, the one `--wheels` names) is applied once to fill the caches
and the store; then, all of it cached, one generation is built with the store and one with copies (the same CLI
without CAP_LINUX_IMMUTABLE, as a host without the attribute builds); `cp -a` copies the store build's venv and
`uv pip install --link-mode=hardlink` installs the same requirements from the same uv cache into a fresh venv;
each tree is then removed the way gc removes (set aside, surveyed, unlinked in parallel). The disk is synced
before each step; the page cache is warm for every step (each reads what the first apply read). The root is made
under TMPDIR. Usage: python bench/store_bench.py --wheels DIR [--json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from provision.agent import state, store  # noqa: E402
from provision.layout import Layout  # noqa: E402
from machine import Machine, describe  # noqa: E402

DROP = ["setpriv", "--inh-caps=-linux_immutable", "--bounding-set=-linux_immutable"]


def write_lock(path: Path, name: str, wheels: list[Path]) -> Path:
    """A lock naming each wheel by sha256 and file:// URL (its folder is the wheelhouse)."""
    import yaml

    pkgs = []
    for w in wheels:
        n, v = w.name.split("-")[:2]
        pkgs.append({"name": n.replace("_", "-"), "version": v, "filename": w.name, "url": w.resolve().as_uri(),
                     "sha256": hashlib.sha256(w.read_bytes()).hexdigest()})
    data = {"lock": 1, "name": name, "platform": {"python": "%d.%d" % sys.version_info[:2], "cuda": {"source": "none"}},
            "requires": [f"{p['name']}=={p['version']}" for p in pkgs], "packages": pkgs, "patches": [],
            "engine": {}, "probes": {}}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def apply(root: Path, lock: Path, env: dict, prefix=()) -> dict:
    """`provision apply --local` as an operator runs it; its JSON report and the wall time."""
    subprocess.run(["sync"], check=True)
    t0 = time.perf_counter()
    p = subprocess.run([*prefix, sys.executable, "-m", "provision.cli", "apply", "--local", "--root", str(root),
                        "--lock", str(lock), "--json"], capture_output=True, text=True, cwd=REPO, env=env)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"apply {lock.name} failed: {p.stderr[-2000:] or p.stdout[-2000:]}")
    rep = json.loads(p.stdout)
    steps = {s["name"]: s.get("seconds") or 0.0 for s in rep.get("steps") or []}
    return {"wall": wall, "build": rep["build"], "steps": steps, "generation": rep["generation"],
            "build_seal": steps.get("build", 0.0) + steps.get("seal", 0.0)}


def timed(argv, **kw) -> float:
    subprocess.run(["sync"], check=True)            # what earlier steps wrote is on disk before the clock starts
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, **kw)
    return time.perf_counter() - t0


def du(path: Path) -> int:
    return int(subprocess.run(["du", "-s", "--block-size=1", str(path)], capture_output=True, text=True,
                              check=True).stdout.split()[0])


def gc_remove(lay: Layout, path: Path) -> float:
    """Remove one tree as gc does (set aside by one rename, surveyed, unlinked in parallel; store links through
    the attribute), then the store entries nothing links any more; seconds."""
    subprocess.run(["sync"], check=True)
    t0 = time.perf_counter()
    errors: list[str] = []
    trash, paths = state.set_aside(lay, [("tree", {}, str(path), path.name)], errors)
    sv = state.survey(paths)
    state.remove_surveyed(sv, 16, errors)
    shutil.rmtree(trash, ignore_errors=True)
    left = [p for p, st in store.entries(lay.file_store) if st.st_nlink == 1]
    for p in left:
        store.unlink(p)
    if errors:
        raise SystemExit("removal of %s: %s" % (path, errors[:3]))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", required=True, type=Path, help="a directory of real wheels, installed together")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    wheels = sorted(args.wheels.resolve().glob("*.whl"))
    if not wheels:
        raise SystemExit(f"no wheels in {args.wheels}")
    if not shutil.which("setpriv") or os.geteuid() != 0:
        raise SystemExit("run as root with setpriv installed (the copy build drops CAP_LINUX_IMMUTABLE)")
    env = {**os.environ, "PROVISION_WHEELHOUSE": str(args.wheels.resolve()), "PYTHONPATH": str(REPO)}
    machine = Machine()
    base = Path(tempfile.mkdtemp(prefix="store-bench-"))
    root = base / "root"
    lay = Layout(str(root))
    try:
        locks = [write_lock(base / f"{n}.yaml", n, wheels) for n in ("warm", "store", "copy")]
        warm = apply(root, locks[0], env)                      # fills the wheel cache, uv's cache and the store
        cached = apply(root, locks[1], env)                    # the store build, all cached
        copied = apply(root, locks[2], env, prefix=DROP)       # today's build: uv copies every file
        assert cached["build"]["isolation"] == "store" and copied["build"]["isolation"] == "copy"
        venv = root / "generations" / cached["generation"] / "venv"
        files = sum(1 for _ in venv.rglob("*"))
        size = du(root / "generations" / copied["generation"] / "venv")
        cp = base / "cp-a"
        t_cp = timed(["cp", "-a", str(venv), str(cp)])
        uvv = base / "uv-hardlink"
        subprocess.run(["uv", "venv", "-q", "--python", sys.executable, str(uvv)], check=True)
        reqs = root / "generations" / cached["generation"] / "requirements.txt"
        t_uv = timed(["uv", "pip", "install", "--python", str(uvv / "bin" / "python"), "--no-deps", "--require-hashes",
                      "--offline", "--no-index", "--link-mode", "hardlink", "-r", str(reqs)],
                     env={**env, "UV_CACHE_DIR": lay.uv_cache, "UV_NO_CONFIG": "1"})
        removal = {"cp -a copy": gc_remove(lay, cp), "uv hardlink venv": gc_remove(lay, uvv),
                   "copy build": gc_remove(lay, root / "generations" / copied["generation"]),
                   "store build": gc_remove(lay, root / "generations" / cached["generation"])}
        out = {"wheels": [w.name for w in wheels], "files": files, "venv_bytes": size,
               "first_build_with_store": {"build_seal": warm["build_seal"], "store": warm["build"].get("store")},
               "cp_a": t_cp, "uv_hardlink": t_uv,
               "copy_build": {"build": copied["steps"].get("build"), "seal": copied["steps"].get("seal"),
                              "build_seal": copied["build_seal"], "apply": copied["wall"]},
               "store_build": {"build": cached["steps"].get("build"), "seal": cached["steps"].get("seal"),
                               "build_seal": cached["build_seal"], "apply": cached["wall"],
                               "store": cached["build"].get("store"), "figures": cached["build"]},
               "removal": removal, "machine": machine.figures()}
    finally:
        for files_dir in base.glob("**/store/files"):
            for p, _ in store.entries(str(files_dir)):
                try:
                    with open(p, "rb") as f:
                        store.set_immutable(f.fileno(), False)
                except OSError:
                    pass
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    gib = out["venv_bytes"] / (1 << 30)
    print(f"{len(wheels)} wheels, {files} files, {gib:.2f} GiB installed; TMPDIR {base.parent}")
    print(f"  {describe(out['machine'])}")
    sb, cb = out["store_build"], out["copy_build"]
    rows = [("cp -a of the venv", t_cp), ("uv pip install --link-mode=hardlink", t_uv),
            ("copy build (build + seal)", cb["build_seal"]), ("store build, cached (build + seal)", sb["build_seal"])]
    for name, t in rows:
        print(f"  {name:<40} {t:7.2f}s   {t / t_uv:6.1f}x uv hardlink   {t / t_cp:5.2f}x cp -a")
    print(f"  store build: build {sb['build']:.2f}s + seal {sb['seal']:.2f}s; copy build: build {cb['build']:.2f}s "
          f"+ seal {cb['seal']:.2f}s; copy/store {cb['build_seal'] / sb['build_seal']:.1f}x")
    print("  removal (as gc removes):")
    for name, t in removal.items():
        print(f"    {name:<38} {t:7.2f}s   {t / removal['cp -a copy']:5.2f}x the cp -a copy's")


if __name__ == "__main__":
    main()
