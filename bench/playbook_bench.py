"""The playbooks against the CLI, side by side in one run on N loopback inventory hosts (one sshd, a root each, two
generations of tiny real wheels): `provision status|rollback -i` and `ansible-playbook status.yml|rollback.yml`
over 1 host and N hosts, each the median of --repeat runs, with their ratios. The controller's interpreter and
ansible-playbook start in every run, as an operator's do.
Usage: python bench/playbook_bench.py [--json] [--repeat N] [--fleet N]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))       # the tests' maker of real tiny wheels

from machine import Machine, describe  # noqa: E402
from provision import apply as applymod, lock as lockmod  # noqa: E402
from provision.bundled import PLAYBOOKS  # noqa: E402
from provision.inventory import load_inventory  # noqa: E402
from provision.loopback import LoopbackHost  # noqa: E402
from provision.runner import stop_masters  # noqa: E402
from provision.transport import trust_host  # noqa: E402
from wheelhouse import make_wheel, write_lock  # noqa: E402


def run(argv: list, env: dict) -> float:
    t0 = time.perf_counter()
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, argv[:3]))} failed: {p.stdout[-800:]} {p.stderr[-800:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--fleet", type=int, default=8)
    args = ap.parse_args()
    machine, n, fig = Machine(), args.fleet, {}
    with LoopbackHost() as host, tempfile.TemporaryDirectory() as d:
        d, t = Path(d), host.target
        trust_host(t)
        hosts = [f"h{i}" for i in range(1, n + 1)]
        inv = d / "inv.yml"
        inv.write_text(f"all:\n  vars: {{ansible_host: {t.host}, ansible_port: {t.port}, ansible_user: {t.user}, "
                       f"ansible_ssh_private_key_file: {t.key_file}, ansible_python_interpreter: /usr/bin/python3}}\n"
                       "  hosts:\n" + "".join(f"    {h}: {{provision_root: {d / h}}}\n" for h in hosts))
        for name, version in (("stack-a", "1.0"), ("stack-b", "2.0")):
            lk = write_lock(d / f"{name}.yaml", name, [make_wheel(d / "wheels", "alpha", version)])
            rep = applymod.apply_fleet(load_inventory(inv, t.known_hosts), lockmod.load(lk), forks=n)
            if not rep.ok:
                raise SystemExit(f"setup apply failed: {[r.error for r in rep.reports if r.error]}")
        cp = Path(tempfile.mkdtemp(prefix="pv-", dir="/tmp"))
        bindir = os.path.dirname(sys.executable)
        env = {**os.environ, "ANSIBLE_SSH_COMMON_ARGS": f"-o UserKnownHostsFile={t.known_hosts} "
               "-o StrictHostKeyChecking=yes", "ANSIBLE_SSH_CONTROL_PATH_DIR": str(cp), "ANSIBLE_FORKS": str(n),
               "ANSIBLE_HOME": str(d / "ansible"), "PATH": bindir + os.pathsep + os.environ["PATH"],
               "PROVISION_WHEELHOUSE": str(d)}
        cli = [sys.executable, "-m", "provision", "-i", inv, "--known-hosts", t.known_hosts]
        play = [os.path.join(bindir, "ansible-playbook"), "-i", inv]
        for label, limit in (("1_host", "h1"), (f"{n}_hosts", "all")):
            for verb in ("status", "rollback"):
                walls = {"cli": [], "playbook": []}
                for _ in range(args.repeat):
                    for how in ("cli", "playbook"):    # each rollback undone by the next: back, then --to 2
                        if how == "cli":
                            walls[how].append(run([*cli[:3], verb, limit, *cli[3:], "--forks", str(n)], env))
                        else:
                            walls[how].append(run([*play, PLAYBOOKS / f"{verb}.yml", "--limit", limit], env))
                        if verb == "rollback":
                            run([*cli[:3], "rollback", limit, *cli[3:], "--to", "2", "--forks", str(n)], env)
                for how in walls:
                    fig[f"{verb}_{label}_{how}_s"] = statistics.median(walls[how])
        stop_masters(cp)
    fig.update(machine.figures())
    if args.json:
        print(json.dumps(fig, indent=2))
        return
    print(f"{describe(fig)}: medians of {args.repeat}; ratios from this one run")
    for label in ("1_host", f"{n}_hosts"):
        for verb in ("status", "rollback"):
            c, p = fig[f"{verb}_{label}_cli_s"], fig[f"{verb}_{label}_playbook_s"]
            print(f"{verb:<8} {label.replace('_', ' '):<8}  provision {c:6.2f} s   ansible-playbook {p:6.2f} s   "
                  f"= {p / c:.2f}x")


if __name__ == "__main__":
    main()
