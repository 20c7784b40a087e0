"""Benchmark of the core verbs on a throwaway loopback host (real sshd, ansible-runner, uv, PyPI wheels).

Prints, measured in this one run: first apply, no-op apply, plan, rollback, and re-applying the
prior lock from scratch (fresh root, empty wheel cache), with their ratios.
Usage: python bench/core_bench.py [--json] [--repeat N]
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from provision import apply as applymod  # noqa: E402
from provision import lock as lockmod  # noqa: E402
from provision.bundled import DEMO_LOCKS  # noqa: E402
from provision.loopback import LoopbackHost  # noqa: E402
from provision.transport import connect, trust_host  # noqa: E402

LOCKS = DEMO_LOCKS


def timed(fn, *a, **kw):
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeat", type=int, default=5, help="repeats for the fast verbs (median reported)")
    args = ap.parse_args()
    a, b = lockmod.load(LOCKS / "a.yaml"), lockmod.load(LOCKS / "b.yaml")
    with LoopbackHost() as host:
        trust_host(host.target)
        tr = connect(host.target)
        fig = {}
        fig["first_apply_s"], _ = timed(applymod.apply, tr, a)
        noop = [timed(applymod.apply, tr, a)[0] for _ in range(args.repeat)]
        fig["noop_apply_s"] = statistics.median(noop)
        fig["plan_s"] = statistics.median(timed(applymod.plan, tr, b)[0] for _ in range(args.repeat))
        fig["apply_b_s"], _ = timed(applymod.apply, tr, b)
        rb = []
        for _ in range(args.repeat):   # B → A, then forward again, several times
            rb.append(timed(applymod.rollback, tr)[0])
            applymod.rollback(tr, to="2")
        fig["rollback_s"] = statistics.median(rb)
        tr.close()
        # Re-applying the prior lock from scratch: a fresh root on the same host, empty cache.
        fresh = copy.deepcopy(host.target)
        fresh.vars["provision_root"] = host.root + "-fresh"
        tr2 = connect(fresh)
        fig["reapply_prior_from_scratch_s"], _ = timed(applymod.apply, tr2, a)
        tr2.close()
    fig["rollback_speedup_vs_reapply"] = fig["reapply_prior_from_scratch_s"] / fig["rollback_s"]
    fig["noop_fraction_of_first_apply"] = fig["noop_apply_s"] / fig["first_apply_s"]
    if args.json:
        print(json.dumps(fig, indent=2))
        return
    print(f"first apply (demo-a)              {fig['first_apply_s']:7.2f} s")
    print(f"no-op apply (median of {args.repeat})        {fig['noop_apply_s']:7.2f} s   "
          f"= {100 * fig['noop_fraction_of_first_apply']:.1f}% of first apply (target ≤ 25%)")
    print(f"plan (median of {args.repeat})               {fig['plan_s']:7.2f} s")
    print(f"apply demo-b                      {fig['apply_b_s']:7.2f} s")
    print(f"rollback (median of {args.repeat})           {fig['rollback_s']:7.2f} s   (target ≤ 1 s)")
    print(f"re-apply demo-a from scratch      {fig['reapply_prior_from_scratch_s']:7.2f} s")
    print(f"rollback is {fig['rollback_speedup_vs_reapply']:.1f}× faster than re-applying the prior lock (target ≥ 20×)")


if __name__ == "__main__":
    main()
