"""The fleet engine's overhead, side by side in one run: this checkout's `provision` against another revision's
(default 61294c2, the last one whose fleet verbs ran on provision's own thread pool), on N loopback inventory
hosts (one sshd, a root each, per engine), each figure the median of --repeat runs of the whole command as an
operator types it (interpreter start included), the two engines taking turns:

- `plan -i` of N hosts;
- `apply -i` of a cached 3-package lock to N hosts (a new lock name each run, so each host builds a new
  generation; every wheel is already in the host's cache);
- `rollback -i` of N hosts, and of one host (`rollback h1 -i`), and of one host named without an inventory
  (`rollback USER@HOST:PORT --root ROOT`: the earlier engine reached it directly, this one through the same play).

Usage: python bench/core_bench.py --overhead [--against REV] [--repeat N] [--fleet N] [--json]
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))       # the tests' maker of real tiny wheels

from machine import Machine, describe  # noqa: E402
from provision.agent import store  # noqa: E402
from provision.loopback import LoopbackHost  # noqa: E402
from provision.transport import trust_host  # noqa: E402
from wheelhouse import make_wheel, write_lock  # noqa: E402

TARGETS = {"plan": 3.0, "apply": 10.0, "rollback": 3.0, "rollback_1": 2.0,
           "rollback_host": 2.0}   # seconds, this checkout's engine


def checkout(rev: str, into: Path) -> Path:
    """The package tree of revision `rev` (git archive), to run its CLI beside this one."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "provision"],
                          capture_output=True, check=True).stdout
    into.mkdir(parents=True)
    path = into / "rev.tar"
    path.write_bytes(data)
    with tarfile.open(path) as t:
        t.extractall(into, filter="data")
    return into


def run(src: Path, argv: list, env: dict) -> float:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "provision", *map(str, argv)], capture_output=True, text=True,
                       cwd=src, env=dict(env, PYTHONPATH=str(src)))
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{src}: provision {' '.join(map(str, argv[:4]))} failed ({p.returncode}): "
                         f"{p.stdout[-600:]} {p.stderr[-600:]}")
    return wall


def overhead(against: str, repeat: int, n: int) -> dict:
    fig: dict = {"against": against,
                 "this": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                        capture_output=True, text=True).stdout.strip()}
    d = Path(tempfile.mkdtemp(prefix="overhead-"))
    try:
        with LoopbackHost() as host:
            _measure(fig, host, d, against, repeat, n)
    finally:
        store.rmtree(str(d))      # the host roots' store links are immutable: a plain rmtree fails
    return fig


def _measure(fig: dict, host, d: Path, against: str, repeat: int, n: int) -> None:
    t = host.target
    trust_host(t)
    engines = {"this": ROOT, "against": checkout(against, d / "rev")}
    wheels = [make_wheel(d / "wheels", name, version) for name in ("alpha", "beta", "gamma")
              for version in ("1.0", "2.0")]
    lock_a = write_lock(d / "a.yaml", "stack-a", [w for w in wheels if "-1.0-" in w.name])
    lock_b = write_lock(d / "b.yaml", "stack-b", [w for w in wheels if "-2.0-" in w.name])
    hosts = [f"h{i}" for i in range(1, n + 1)]
    invs, envs = {}, {}
    for name in engines:
        inv = d / f"inv-{name}.yml"
        inv.write_text(f"all:\n  vars: {{ansible_host: {t.host}, ansible_port: {t.port}, ansible_user: {t.user}, "
                       f"ansible_ssh_private_key_file: {t.key_file}, ansible_python_interpreter: /usr/bin/python3}}\n"
                       "  hosts:\n" + "".join(f"    {h}: {{provision_root: {d / name / h}}}\n" for h in hosts))
        invs[name] = ["-i", inv, "--known-hosts", t.known_hosts, "--forks", n]
        envs[name] = {**os.environ, "PROVISION_HOME": str(d / f"home-{name}")}
        for lk in (lock_a, lock_b):    # two generations per host, every wheel in the host's cache
            run(engines[name], ["apply", *invs[name], "--lock", lk], envs[name])
    walls: dict[str, dict[str, list[float]]] = {k: {e: [] for e in engines} for k in TARGETS}
    for i in range(repeat):
        order = list(engines) if i % 2 == 0 else list(engines)[::-1]
        for name in order:
            src, inv, env = engines[name], invs[name], envs[name]
            walls["plan"][name].append(run(src, ["plan", *inv, "--lock", lock_a], env))
            renamed = d / f"c-{name}-{i}.yaml"
            renamed.write_text(lock_a.read_text().replace("name: stack-a", f"name: stack-c{i}", 1))
            walls["apply"][name].append(run(src, ["apply", *inv, "--lock", renamed], env))
            walls["rollback"][name].append(run(src, ["rollback", *inv], env))     # back to stack-b
            walls["rollback_1"][name].append(run(src, ["rollback", "h1", *inv], env))   # h1 forward again
            one = [f"{t.user}@{t.host}:{t.port}", "--key", t.key_file, "--known-hosts", t.known_hosts,
                   "--root", d / name / "h1"]
            walls["rollback_host"][name].append(run(src, ["rollback", *one], env))   # h1 back with the rest
    for k, by in walls.items():
        for name, w in by.items():
            fig[f"{k}_{name}_s"] = statistics.median(w)


def report(fig: dict, repeat: int, n: int) -> None:
    print(f"{describe(fig)}: medians of {repeat}; this checkout ({fig['this']}) against {fig['against']}, "
          "taking turns in one run")
    labels = {"plan": f"plan -i, {n} hosts", "apply": f"apply -i, {n} hosts (cached 3-package lock)",
              "rollback": f"rollback -i, {n} hosts", "rollback_1": "rollback h1 -i (one host)",
              "rollback_host": "rollback USER@HOST:PORT (one host, no inventory)"}
    width = max(map(len, labels.values()))
    print(f"{'':{width}} {fig['against']:>10} {fig['this']:>10}  ratio   target")
    for k, label in labels.items():
        old, new = fig[f"{k}_against_s"], fig[f"{k}_this_s"]
        ok = "met" if new <= TARGETS[k] else "MISSED"
        print(f"{label:{width}} {old:9.2f}s {new:9.2f}s  {new / old:5.2f}x  ≤ {TARGETS[k]:.0f} s {ok}")


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--against", default="61294c2")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--fleet", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    machine = Machine()
    fig = overhead(args.against, args.repeat, args.fleet)
    fig.update(machine.figures())
    if args.json:
        print(json.dumps(fig, indent=2))
    else:
        report(fig, args.repeat, args.fleet)


if __name__ == "__main__":
    main()
