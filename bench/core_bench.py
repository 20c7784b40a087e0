"""Benchmark of the core verbs on a throwaway loopback host (real sshd, ansible-runner, uv, PyPI wheels).

Prints, measured in this one run (with the CPU it ran on and the load average at its start and end): first apply, no-op apply, plan, rollback (host-side switch, library
call and the operator's whole `provision rollback` command), re-applying the prior lock from scratch
(fresh root, empty wheel cache), pushing a file by hash (MiB/s, controller CPU-s per GiB), `plan`,
`apply` and `apply --wheels-from controller` over 1 and N inventory hosts (fresh roots and caches), with
the controller's CPU-seconds per added host, and a canary rollout over N hosts whose second batch fails (the
time from its first switch to the failing batch rolled back); with their ratios.
Usage: python bench/core_bench.py [--json] [--repeat N] [--fleet N]
       python bench/core_bench.py --overhead [--against REV] [--repeat N] [--fleet N] [--json]
         (the fleet engine's overhead against another revision's, side by side: bench/overhead.py)
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import tempfile
import subprocess
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
from provision.plan import plan_host  # noqa: E402
from provision.transport import connect, trust_host  # noqa: E402

LOCKS = DEMO_LOCKS
BENCH_B = Path(__file__).resolve().parent / "locks" / "b.yaml"   # pure-Python wheels only: a quick second generation


def timed(fn, *a, **kw):
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    return time.perf_counter() - t0, out


def main() -> None:
    if "--overhead" in sys.argv[1:]:
        import overhead
        return overhead.main([a for a in sys.argv[1:] if a != "--overhead"])
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeat", type=int, default=5, help="repeats for the fast verbs (median reported)")
    ap.add_argument("--fleet", type=int, default=8, help="hosts in the fleet figures (0: skip them)")
    ap.add_argument("--push-mib", type=int, default=256, help="size of the file pushed by hash (MiB)")
    args = ap.parse_args()
    a = lockmod.load(LOCKS / "a.yaml")
    machine = Machine()
    with LoopbackHost(login_rc=True) as host:     # sessions read the local user's rc files, as an operator's do
        b = lockmod.load(wheelhouse_lock(LOCKS / "b.yaml", Path(host.dir) / "wheelhouse"))   # its CPU torch
        trust_host(host.target)
        tr = connect(host.target)
        fig = {}
        fig["first_apply_s"], _ = timed(applymod.apply, tr, a)
        noop = [timed(applymod.apply, tr, a)[0] for _ in range(args.repeat)]
        fig["noop_apply_s"] = statistics.median(noop)
        fig["plan_s"] = statistics.median(timed(plan_host, tr, b)[0] for _ in range(args.repeat))
        fig["apply_b_s"], _ = timed(applymod.apply, tr, b)
        rb = []
        for _ in range(args.repeat):   # B → A, then forward again, several times
            rb.append(timed(generations.rollback, tr)[0])
            generations.rollback(tr, to="2")
        fig["rollback_s"] = statistics.median(rb)
        fig["rollback_host_switch_s"], fig["rollback_command_wall_s"] = rollback_command(host.target, tr, args.repeat)
        tr.close()
        # Re-applying the prior lock from scratch: a fresh root on the same host, empty cache.
        fresh = copy.deepcopy(host.target)
        fresh.root = host.root + "-fresh"
        tr2 = connect(fresh)
        fig["reapply_prior_from_scratch_s"], _ = timed(applymod.apply, tr2, a)
        fig["push_mib_s"], fig["push_controller_cpu_s_per_gib"] = push_figures(tr2, fresh.root,
                                                                              Path(host.dir), args.push_mib)
        tr2.close()
        if args.fleet:
            fig.update(fleet_figures(host, a, b, args.fleet))
            fig.update(canary_figures(host, args.fleet))
    with LoopbackHost(login_rc=False) as clean:   # sessions whose login shell reads no rc file
        trust_host(clean.target)
        tr = connect(clean.target)
        applymod.apply(tr, a)
        applymod.apply(tr, lockmod.load(BENCH_B))
        _, fig["rollback_command_wall_no_rc_s"] = rollback_command(clean.target, tr, args.repeat)
        tr.close()
    fig.update(machine.figures())
    fig["rollback_speedup_vs_reapply"] = fig["reapply_prior_from_scratch_s"] / fig["rollback_s"]
    fig["noop_fraction_of_first_apply"] = fig["noop_apply_s"] / fig["first_apply_s"]
    if args.json:
        print(json.dumps(fig, indent=2))
        return
    print(f"{describe(fig)}: the times below are as loaded as that; ratios are from this one run")
    print(f"first apply (demo-a)              {fig['first_apply_s']:7.2f} s")
    print(f"no-op apply (median of {args.repeat})        {fig['noop_apply_s']:7.2f} s   "
          f"= {100 * fig['noop_fraction_of_first_apply']:.1f}% of first apply (target ≤ 25%)")
    print(f"plan (median of {args.repeat})               {fig['plan_s']:7.2f} s")
    print(f"apply demo-b (CPU torch, engine)  {fig['apply_b_s']:7.2f} s")
    print(f"rollback (median of {args.repeat})           {fig['rollback_s']:7.2f} s   library call; host-side switch "
          f"{1000 * fig['rollback_host_switch_s']:.1f} ms")
    print(f"`provision rollback` command      {fig['rollback_command_wall_s']:7.2f} s   operator-visible wall time, "
          "interpreter start included (target ≤ 1 s); the login user's shell rc runs on each session")
    print(f"  … on a host whose login shell   {fig['rollback_command_wall_no_rc_s']:7.2f} s   reads no rc file "
          f"(host-side switch {1000 * fig['rollback_host_switch_s']:.1f} ms)")
    print(f"re-apply demo-a from scratch      {fig['reapply_prior_from_scratch_s']:7.2f} s")
    print(f"rollback is {fig['rollback_speedup_vs_reapply']:.1f}× faster than re-applying the prior lock (target ≥ 20×)")
    print(f"push by hash ({args.push_mib} MiB)            {fig['push_mib_s']:7.0f} MiB/s, controller "
          f"{fig['push_controller_cpu_s_per_gib']:.1f} CPU-s per GiB (what --wheels-from controller costs per host)")
    if args.fleet:
        n = args.fleet
        for verb in ("plan", "apply", "apply_ctl"):
            one, many = fig[f"{verb}_1_host_s"], fig[f"{verb}_{n}_hosts_s"]
            name = "apply --wheels-from controller" if verb == "apply_ctl" else verb
            c1, cn = fig[f"{verb}_1_host_cpu_s"], fig[f"{verb}_{n}_hosts_cpu_s"]
            cpu = (f"; controller CPU {c1:.2f} s / {cn:.2f} s = {(cn - c1) / max(1, n - 1):.3f} s per added host")
            print(f"`provision {name} -i` 1 host / {n} hosts  {one:6.2f} s / {many:6.2f} s   = {many / one:.2f}× one host"
                  + ("  (target ≤ 2×)" if verb == "plan" else "") + cpu)
        sizes = "+".join(str(len(b)) for b in fig["canary_batches"])
        print(f"canary rollout of {n} hosts ({sizes}), a probe failing in batch 2: first switch → failing batch "
              f"rolled back {fig['canary_first_switch_to_rollback_s']:6.2f} s  (batch 2 "
              f"{fig['canary_batch2_s']:.2f} s; from the failure known to the batch rolled back "
              f"{fig['canary_failure_to_rollback_s']:.2f} s, the slowest host's rollback "
              f"{fig['canary_rollback_s']:.2f} s; rolled back "
              f"{' '.join(fig['canary_rolled_back']) or '-'}; stopped before "
              f"the switch: {' '.join(fig['canary_stopped']) or '-'}; {fig['canary_untouched']} hosts untouched)")


def push_figures(tr, root: str, tmp: Path, mib: int) -> tuple[float, float]:
    """(MiB/s, the controller's CPU-seconds per GiB) of pushing one incompressible file into a host's store."""
    import hashlib

    from provision.build import push

    blob = tmp / "blob-1.0-py3-none-any.whl"
    with open(blob, "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(1 << 20))
    sha = hashlib.sha256(blob.read_bytes()).hexdigest()
    before = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    push(tr, root, [({"sha256": sha, "filename": blob.name}, blob)])
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF)
    blob.unlink()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return mib / wall, cpu / (mib / 1024)


def rollback_command(t, tr, repeat: int) -> tuple[float, float]:
    """Medians of (host-side switch, the whole `provision rollback` command as the operator runs it, interpreter
    start included); each rollback is undone by switching forward through the library."""
    host_side, wall = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = json.loads(cli("rollback", *host_args(t), "--json"))
        wall.append(time.perf_counter() - t0)
        host_side.append(out["switch_seconds"])
        generations.rollback(tr, to="2")
    return statistics.median(host_side), statistics.median(wall)


def cli(*args, env: dict | None = None) -> str:
    p = subprocess.run([sys.executable, "-m", "provision", *map(str, args)], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parent.parent, env=env)
    if p.returncode != 0:
        raise SystemExit(f"provision {args[0]} failed: {p.stderr.strip()}")
    return p.stdout


def timed_cli(*args, env: dict | None = None) -> tuple[float, float]:
    """(wall seconds, controller CPU seconds: the command and every process it waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    cli(*args, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def host_args(t) -> list:
    return [f"{t.user}@{t.host}:{t.port}", "--key", t.key_file, "--known-hosts", t.known_hosts,
            "--root", t.root]


def fleet_figures(host, a, b, n: int) -> dict:
    """`plan`, `apply` and `apply --wheels-from controller` through the CLI over 1 and n inventory hosts
    (fresh roots behind one sshd; each apply with an empty controller cache)."""
    t = host.target
    inv = Path(host.dir) / "fleet.yml"
    conn = "".join(f"    {k}: {v}\n" for k, v in (("ansible_host", t.host), ("ansible_port", t.port),
                                                   ("ansible_user", t.user), ("ansible_ssh_private_key_file", t.key_file)))
    groups = ""
    for g in ("fleet", "ctl"):
        groups += (f"    {g}:\n      hosts:\n"
                   + "".join(f"        {g}{i}: {{provision_root: {host.root}-{g}{i}}}\n" for i in range(n)))
    inv.write_text("all:\n  vars:\n" + conn + f"  hosts:\n    solo: {{provision_root: {host.root}-solo}}\n"
                   f"    solo-ctl: {{provision_root: {host.root}-solo-ctl}}\n  children:\n" + groups)
    common = ["-i", inv, "--known-hosts", t.known_hosts]
    fig = {}
    for key, limit, verb, extra in (("apply_1_host", "solo", "apply", []), (f"apply_{n}_hosts", "fleet", "apply", []),
                                    ("apply_ctl_1_host", "solo-ctl", "apply", ["--wheels-from", "controller"]),
                                    (f"apply_ctl_{n}_hosts", "ctl", "apply", ["--wheels-from", "controller"]),
                                    ("plan_1_host", "solo", "plan", []), (f"plan_{n}_hosts", "fleet", "plan", [])):
        lk = a if verb == "apply" else b
        with tempfile.TemporaryDirectory() as home:     # an empty controller cache for each run
            env = dict(os.environ, PROVISION_HOME=home)
            fig[key + "_s"], fig[key + "_cpu_s"] = timed_cli(verb, *common, "--limit", limit, "--lock", lk.path,
                                                            *extra, *(["--forks", str(n)] if verb == "apply" else []),
                                                            env=env)
    return fig

def canary_figures(host, n: int) -> dict:
    """`apply --serial 1,25%,100% --max-fail 0 --rollback-on-fail` over n inventory hosts (fresh roots on bench-b)
    to a renamed bench-b, where the second batch holds a host with a GPU that wedges once queried: its
    nvidia-smi (the recorded output of an H200) hangs for a few seconds, then fails the driver probe. Measures
    the time from the rollout's first switch to the end of the failing batch's rollback (the call's return)."""
    from provision.fleet import batches, parse_serial
    from provision.inventory import load_inventory

    t, d = host.target, Path(host.dir)
    recorded = Path(__file__).resolve().parent.parent / "tests" / "data" / "h200" / "nvidia-smi-query.csv"
    smi = d / "wedged" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\nd=$(dirname \"$0\")\n"
                   "if [ -e \"$d/queried\" ]; then sleep 3; echo 'Unable to determine the device handle for GPU "
                   "0000:00:06.0: Unknown Error'; exit 255; fi\n"
                   f"[ -e \"$d/armed\" ] && touch \"$d/queried\"\ncat {recorded}\n")
    smi.chmod(0o755)
    names = [f"canary{i}" for i in range(n)]
    groups = batches(names, parse_serial("1,25%,100%"))
    bad = groups[1][-1] if len(groups) > 1 else names[-1]
    inv = d / "canary.yml"
    inv.write_text(f"all:\n  vars: {{ansible_host: {t.host}, ansible_port: {t.port}, ansible_user: {t.user}, "
                   f"ansible_ssh_private_key_file: {t.key_file}}}\n  hosts:\n"
                   + "".join(f"    {h}: {{provision_root: {host.root}-{h}"
                             + (f", provision_nvidia_smi: {smi}" if h == bad else "") + "}\n" for h in names))
    ts = load_inventory(inv, t.known_hosts)
    before = lockmod.load(BENCH_B)
    run = applymod.apply_fleet(ts, before, wheels_from="controller")
    if not run.ok:
        raise SystemExit(f"canary: the first apply failed: {[r.error for r in run.reports if r.error]}")
    renamed = d / "bench-b-next.yaml"
    renamed.write_text(BENCH_B.read_text().replace(f"name: {before.name}", "name: bench-b-next", 1))
    (smi.parent / "armed").touch()
    marks: dict[str, float] = {}

    def progress_for(h):
        def mark(step, state, detail):
            if (step, state) == ("switch", "done"):
                marks.setdefault("first_switch", time.perf_counter())
        return mark

    def on_batch(b):
        marks[f"batch{b.number}"] = time.perf_counter()

    def on_row(r):
        if r.host == bad:
            marks["failed"] = time.perf_counter()

    run = applymod.apply_fleet(ts, lockmod.load(renamed), serial="1,25%,100%", max_fail="0", rollback_on_fail=True,
                               wheels_from="controller", progress_for=progress_for, on_batch=on_batch, on_row=on_row)
    end = time.perf_counter()
    if run.failed_batch != 2:
        raise SystemExit(f"canary: expected batch 2 to fail, got {run.failed_batch}")
    rolled = [r for r in run.reports if r.status == "rolled-back"]
    return {"canary_first_switch_to_rollback_s": end - marks["first_switch"], "canary_batch2_s": end - marks["batch2"],
            "canary_failure_to_rollback_s": end - marks["failed"],
            "canary_rollback_s": max((r.rollback.seconds for r in rolled), default=0.0),
            "canary_rolled_back": [r.host for r in rolled],
            "canary_stopped": [r.host for r in run.reports if r.status == "stopped"],
            "canary_untouched": sum(r.status == "not-attempted" for r in run.reports),
            "canary_batches": [b.hosts for b in run.batches]}


if __name__ == "__main__":
    main()
