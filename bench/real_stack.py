"""Benchmark of real stacks on a throwaway loopback host (real sshd, uv, wheels from PyPI): the host's fetch
alone, the CUDA 12.8 baseline (cold and cached), then a PyPI-only CUDA 13 lock, then back, then the SGLang 0.5.23
CUDA 13 lock. Prints cold apply, cached apply, reuse, rollback and gc; each cold apply's fetch beside the line
rate measured just before it (a plain download of the biggest wheel), with ratios and the load average; and the
plan from the baseline to the SGLang 0.5.23 lock as the host shows it.
Usage: python bench/real_stack.py [--python /path/to/python3.12] [--json] [--part all|fetch|upgrade|baseline|cuda13|sglang ...]
       [--workdir DIR] [--fetch-only]
--part baseline, --part cuda13: only that lock's cold and cached applies (each a piece of upgrade; for a host with
less disk). Each cached apply is timed beside `cp -a` of its venv and uv's hardlink install of its wheels, against
its target, and then once more under another name through playbooks/apply.yml (as `provision apply` runs it): the
play's seconds over the call's.
It downloads the wheels of the three locks (about 12 GB, and the baseline's 5 GB again for the fetch alone) into
fresh host roots, one per part, and removes each before the next part starts (the upgrade part peaks at about
50 GB on disk, the SGLang part at about 35 GB).
--fetch-only (as --part fetch): the host's parallel fetch alone (the baseline's 172 wheels into an empty cache)
between two plain downloads of the biggest wheel (the line rate before and after), with the ratio.
"""
from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from provision import apply as applymod  # noqa: E402
from provision import generations, replies  # noqa: E402
from provision import lock as lockmod  # noqa: E402
from provision.loopback import LoopbackHost  # noqa: E402
from provision.plan import plan_host, render_plan  # noqa: E402
from machine import Machine, describe  # noqa: E402
from provision.transport import connect, trust_host  # noqa: E402

LOCKS = Path(__file__).resolve().parent.parent / "lockfiles"
BASELINE, TARGET = LOCKS / "cuda12.8-sglang0.5.9.yaml", LOCKS / "cuda13-torch2.11-pypi.yaml"
SGLANG = LOCKS / "cuda13.0-sglang0.5.23.yaml"       # the stack the upgrade ships: SGLang's CUDA 13 build
TARGETS = {"baseline": 15.0, "cuda13": 10.0, "sglang": 30.0}   # seconds: a cached apply of each, on a 2-core host
PLAY_SLOWER = 0.05       # the most a real-stack apply through Ansible's play may add to the same apply as a call
SKIP = ["engine"]          # no GPU here: the engine probe would only skip; everything else runs


def find_python(minor: str) -> str | None:
    """An interpreter of `minor` that really runs (pyenv shims may not)."""
    cands = [shutil.which(f"python{minor}")] + sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{minor}*/bin/python{minor}")))
    for c in filter(None, cands):
        r = subprocess.run([c, "-c", "import sys;print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip() == minor:
            return c
    return None


def line_rate(url: str) -> tuple[float, int]:
    """Bytes per second of a plain streamed download of `url` (read and dropped), and its size."""
    t0, n = time.perf_counter(), 0
    with urllib.request.urlopen(url, timeout=60) as r:
        for chunk in iter(lambda: r.read(1 << 20), b""):
            n += len(chunk)
    return n / (time.perf_counter() - t0), n


def cpu_seconds() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def fetch_alone(lk: lockmod.Lock, biggest, work: Path, jobs: int) -> dict:
    """The host agent's fetch of every wheel of `lk` into an empty cache, between two line-rate measurements;
    with the CPU seconds per GB of each (this process's, all threads) and when half and 90 % of the bytes were in."""
    import contextlib
    import io

    from provision.agent import fetch as agentfetch

    pkgs = [{"name": p.name, "version": p.version, "sha256": p.sha256, "filename": p.filename, "url": p.url,
             **({"size": p.size} if p.size is not None else {})} for p in lk.packages]
    c0 = cpu_seconds()
    before, size = line_rate(biggest.url)
    c1 = cpu_seconds()
    events = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(events):         # the agent's progress events
        res = agentfetch.fetch(str(work / "cache"), pkgs, jobs)
    secs = time.perf_counter() - t0
    c2 = cpu_seconds()
    after, _ = line_rate(biggest.url)
    c3 = cpu_seconds()
    plain = plain_downloads([p.url for p in lk.packages], work / "plain")
    n, nbytes = res[0], res[1]
    rate = nbytes / secs
    progress = [e["_event"] for e in map(json.loads, events.getvalue().splitlines()) if "bytes" in e.get("_event", {})]

    def when(share: float) -> float | None:
        return next((round(e["seconds"], 1) for e in progress if e["bytes"] >= share * nbytes), None)

    return {"line_rate_Bps": [round(before), round(after)], "line_rate_wheel": biggest.filename,
            "line_rate_wheel_bytes": size, "jobs": jobs, "wheels": n, "bytes": nbytes, "fetch_s": round(secs, 2),
            "fetch_Bps": round(rate), "fetch_of_line_rate": round(rate / ((before + after) / 2), 3),
            "plain_same_bytes_s": round(plain, 2), "fetch_of_plain_same_bytes": round(secs / plain, 3),
            "half_in_s": when(0.5), "ninety_in_s": when(0.9),
            "cpu_s_per_GB": {"fetch": round((c2 - c1) / nbytes * 1e9, 2),
                             "plain_download": round((c1 - c0 + c3 - c2) / (2 * size) * 1e9, 2)},
            "load_average": os.getloadavg()[0], **res[3]}


SLOW_LINK = 50e6      # bytes per second of the rate-limited loopback link


def plain_downloads(urls: list[str], out: Path) -> float:
    """Seconds of one plain download of every url in turn (one curl, one connection it keeps, each file written
    under `out`), the files then removed: the same bytes as a fetch of them, fetched the plain way."""
    out.mkdir(parents=True, exist_ok=True)
    args = [a for i, u in enumerate(urls) for a in ("-o", str(out / str(i)), u)]
    subprocess.run(["sync"], check=True)
    t0 = time.perf_counter()
    subprocess.run(["curl", "-sSf", *args], check=True)
    secs = time.perf_counter() - t0
    shutil.rmtree(out)
    return secs


def plain_download(url: str, out: Path) -> float:
    """Seconds of one plain download of `url` into `out` (curl, one connection), the file then removed."""
    subprocess.run(["sync"], check=True)
    t0 = time.perf_counter()
    subprocess.run(["curl", "-sSf", "-o", str(out), url], check=True)
    secs = time.perf_counter() - t0
    out.unlink()
    return secs


def agent_fetch(pkg: dict, cache: Path, jobs: int) -> tuple[float, dict]:
    """Seconds of the host agent's fetch of `pkg` into an empty cache with `jobs` streams, and its figures."""
    import contextlib
    import io

    from provision.agent import fetch as agentfetch

    subprocess.run(["sync"], check=True)
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):         # the agent's progress events
        res = agentfetch.fetch(str(cache), [pkg], jobs)
    secs = time.perf_counter() - t0
    shutil.rmtree(cache)
    return secs, res[3]


def fetch_links(biggest, work: Path, jobs: int) -> dict:
    """On loopback, fast and rate-limited (SLOW_LINK, shared by all connections): one plain download (curl) of
    the biggest wheel beside the agent's fetch of the same bytes with `jobs` streams and with one, in one run,
    interleaved (three rounds on the fast link; a plain download last too); the ratios are of the medians. The
    wheel comes from its URL once (a plain download too)."""
    served = work / "served"
    served.mkdir(parents=True, exist_ok=True)
    src = served / biggest.filename
    t0 = time.perf_counter()
    subprocess.run(["curl", "-sSf", "-o", str(src), biggest.url], check=True)
    out = {"wheel": biggest.filename, "bytes": src.stat().st_size, "index_plain_s": round(time.perf_counter() - t0, 2),
           "jobs": jobs, "links": []}
    server = Path(__file__).resolve().parent / "fetch_server.py"
    for name, rate, rounds in (("loopback", None, 3), ("loopback at %d MB/s" % (SLOW_LINK / 1e6), SLOW_LINK, 1)):
        p = subprocess.Popen([sys.executable, str(server), str(served)] + (["--rate", str(rate)] if rate else []),
                             stdout=subprocess.PIPE, text=True)
        plain, many, one, ranges = [], [], [], []
        try:
            url = f"http://127.0.0.1:{p.stdout.readline().strip()}/{biggest.filename}"
            pkg = {"name": biggest.name, "version": biggest.version, "sha256": biggest.sha256,
                   "filename": biggest.filename, "url": url, "size": out["bytes"]}
            load = os.getloadavg()[0]
            for _ in range(rounds):     # interleaved: the machine's other load falls on each alike
                plain.append(plain_download(url, work / "plain"))
                secs, figs = agent_fetch(pkg, work / "cache", jobs)
                many.append(secs)
                ranges.append(figs.get("ranges"))
                one.append(agent_fetch(pkg, work / "cache", 1)[0])
            plain.append(plain_download(url, work / "plain"))
        finally:
            p.kill()
            p.wait()
        med = statistics.median
        out["links"].append({"link": name, "rate_Bps": rate, "rounds": rounds,
                             "plain_s": [round(x, 2) for x in plain], "fetch_s": [round(x, 2) for x in many],
                             "fetch_1_stream_s": [round(x, 2) for x in one], "ranges": ranges,
                             "fetch_of_plain": round(med(many) / med(plain), 3),
                             "fetch_1_stream_of_plain": round(med(one) / med(plain), 3),
                             "load_average": [round(load, 2), round(os.getloadavg()[0], 2)]})
    src.unlink()
    return out


def du(path: Path) -> int:
    """Bytes on disk under `path`, each hard-linked file counted once."""
    out = subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True)
    return int(out.stdout.split()[0]) if out.returncode == 0 else 0


def renamed(lk: lockmod.Lock, name: str, where: Path) -> lockmod.Lock:
    """The same closure under another name: a new generation, every wheel already in the host's cache."""
    data = copy.deepcopy(lk.raw)
    data["name"] = name
    path = where / f"{name}.yaml"
    path.write_text(lockmod.dump(data))
    return lockmod.load(path)


def commit() -> str:
    """The commit this checkout is at ("+dirty" where tracked files differ from it)."""
    repo = Path(__file__).resolve().parent.parent
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (head or "unknown") + ("+dirty" if dirty else "")


def step_seconds(rep) -> dict:
    return {s.name: round(s.seconds, 2) for s in rep.steps}


BUILD_PARTS = ("fetch_seconds", "venv_seconds", "install_seconds", "store_seconds", "read_only_seconds")


def probe_seconds(rep) -> dict:
    """Each probe's seconds in the new generation, by name (the flashinfer probe's JIT among them)."""
    return {r["name"]: r["seconds"] for r in (rep.probes or {}).get("results") or []
            if isinstance(r, dict) and isinstance(r.get("seconds"), (int, float))}


def build_seconds(b: dict) -> dict:
    """Where the build step's seconds went: the cache's re-hash, the fetch, the venv, uv's install, the links to
    the store and the read-only pass (the host's own figures)."""
    out = {k.replace("_seconds", ""): b[k] for k in BUILD_PARTS if isinstance(b.get(k), (int, float))}
    if isinstance((b.get("recheck") or {}).get("seconds"), (int, float)):
        out["recheck"] = b["recheck"]["seconds"]
    return out


def timed(argv: list, **kw) -> float:
    subprocess.run(["sync"], check=True)        # what earlier steps wrote is on disk before the clock starts
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, **kw)
    return time.perf_counter() - t0


def remove_root(root: Path) -> None:
    """A host root removed whole: its store's immutable entries made mutable first (rmtree cannot unlink them)."""
    from provision.agent import store

    for files in root.glob("**/store/files"):
        for path, _ in store.entries(str(files)):
            try:
                with open(path, "rb") as f:
                    store.set_immutable(f.fileno(), False)
            except OSError:
                pass
    shutil.rmtree(root, ignore_errors=True)


def removed(path: Path) -> None:
    subprocess.run(["chmod", "-R", "u+w", str(path)], capture_output=True)   # cp -a kept the read-only modes
    shutil.rmtree(path, ignore_errors=True)


def side_by_side(tr, row: dict, python: str, work: Path) -> None:
    """Beside a cached apply, on the same disk in the same run: `cp -a` of the venv it built, and uv's hardlink
    install of the same requirements from the host's uv cache into a fresh venv; each removed after."""
    from provision.layout import Layout

    lay = Layout(tr.target.root)
    gen = lay.gen(row["generation"])
    cp = work / "cp-a"
    row["cp_a_s"] = round(timed(["cp", "-a", gen.venv, str(cp)]), 2)
    removed(cp)
    uvv = work / "uv-hardlink"
    uv = shutil.which("uv")
    subprocess.run([uv, "venv", "-q", "--python", python, str(uvv)], check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "PIP_", "VIRTUAL_ENV"))}
    row["uv_hardlink_s"] = round(timed([uv, "pip", "install", "--python", str(uvv / "bin" / "python"), "--no-deps",
                                        "--require-hashes", "--offline", "--no-index", "--link-mode", "hardlink",
                                        "-r", gen.requirements],
                                       env={**env, "UV_CACHE_DIR": lay.uv_cache, "UV_NO_CONFIG": "1"}), 2)
    removed(uvv)
    row["of_cp_a"] = round(row["wall_s"] / row["cp_a_s"], 2)
    row["of_uv_hardlink"] = round(row["wall_s"] / row["uv_hardlink_s"], 2)


def apply(tr, lk, label: str, rows: list, quiet: bool, line=None) -> dict:
    """Apply `lk`; `line` (the biggest wheel): measure the line rate just before, for this phase's fetch."""
    def say(step, state, detail):
        if not quiet and state in ("done", "fail"):
            print(f"  [{label}] {step}: {detail}", file=sys.stderr, flush=True)

    rate = line_rate(line.url)[0] if line is not None else None
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    rep = applymod.apply(tr, lk, skip_probes=SKIP, progress=say)
    wall = time.perf_counter() - t0
    b = rep.build or {}
    row = {"phase": label, "lock": lk.name, "status": rep.status, "generation": rep.generation,
           "wall_s": round(wall, 2), "steps": step_seconds(rep), "build_steps": build_seconds(b),
           "fetched": b.get("fetched", 0), "cached": b.get("cached", 0), "bytes": b.get("fetched_bytes", 0),
           "fetch_s": b.get("fetch_seconds", 0.0), "install_s": b.get("install_seconds", 0.0),
           "probes": (rep.probes or {}).get("summary"), "probe_s": probe_seconds(rep), "load_average": [round(load, 2), round(os.getloadavg()[0], 2)]}
    if rate is not None:
        row["line_rate_Bps"] = round(rate)
    if rate and row["fetch_s"]:
        row["fetch_of_line_rate"] = round(row["bytes"] / row["fetch_s"] / rate, 3)
    rows.append(row)
    if not quiet:
        print(f"  [{label}] {json.dumps(row)}", file=sys.stderr, flush=True)
    return row


def cold_and_cached(tr, work: Path, locks: dict, rows: list, quiet: bool, key: str, label: str) -> None:
    """locks[key] applied cold, then again under a new name with every wheel cached, that cached apply beside `cp -a`
    of its venv and uv's hardlink install of its wheels, against its target (TARGETS[key])."""
    lk = locks[key]
    apply(tr, lk, f"cold: {label}", rows, quiet, line=locks["line"])
    row = apply(tr, renamed(lk, f"{lk.name}-again", work), f"cached: {label}", rows, quiet)
    side_by_side(tr, row, tr.target.python, work)
    row["target_s"] = TARGETS[key]
    through_play(tr.target, renamed(lk, f"{lk.name}-play", work), row, quiet)


def through_play(t, lk, row: dict, quiet: bool) -> None:
    """The same cached apply again under another name, through playbooks/apply.yml as `provision apply -i` runs it
    (Ansible's play: ansible-playbook's start, the stage task, the batch's tolerance, the switch task), beside
    the direct call just measured: the engine's overhead on a real stack, in the same run."""
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    fleet = applymod.apply_fleet([t], lk, skip_probes=SKIP)
    wall = time.perf_counter() - t0
    if not fleet.ok:
        sys.exit(f"the apply through the play failed: {fleet.to_json()}")
    rep = fleet.reports[0]
    row.update(through_play_s=round(wall, 2), play_of_call=round(wall / row["wall_s"], 3),
               play_steps=step_seconds(rep), play_probe_s=probe_seconds(rep),
               play_load_average=[round(load, 2), round(os.getloadavg()[0], 2)], play_slower_bound=PLAY_SLOWER)
    if not quiet:
        print(f"  [{row['phase']}, through the play] {wall:.2f} s ({wall / row['wall_s']:.2f}x the call)",
              file=sys.stderr, flush=True)


def baseline(tr, work: Path, locks: dict, fig: dict, rows: list, quiet: bool) -> None:
    """The CUDA 12.8 baseline alone on a fresh root (about 30 GB on disk at its peak): cold, then cached."""
    cold_and_cached(tr, work, locks, rows, quiet, "baseline", "baseline")


def cuda13(tr, work: Path, locks: dict, fig: dict, rows: list, quiet: bool) -> None:
    """The CUDA 13 lock alone on a fresh root (about 13 GB on disk at its peak): cold, then cached."""
    cold_and_cached(tr, work, locks, rows, quiet, "cuda13", "CUDA 13")


def upgrade(tr, work: Path, locks: dict, fig: dict, rows: list, quiet: bool) -> None:
    """The baseline cold and cached, the plan from it to the SGLang 0.5.23 lock, the CUDA 13 lock cold and cached,
    reuse, rollback, gc."""
    base = locks["baseline"]
    cold_and_cached(tr, work, locks, rows, quiet, "baseline", "baseline")
    fig["plan_baseline_to_sglang"] = render_plan(plan_host(tr, locks["sglang"]))
    cold_and_cached(tr, work, locks, rows, quiet, "cuda13", "CUDA 13")
    before = generations.history(tr).current
    apply(tr, base, "reuse: baseline", rows, quiet)
    t0 = time.perf_counter()
    rb = generations.rollback(tr, to=before)      # back to the CUDA 13 generation it left
    fig["rollback"] = {"wall_s": round(time.perf_counter() - t0, 3), "from": rb.from_,
                       "to": rb.to, "host_switch_s": rb.switch_seconds}
    root = Path(tr.target.root)
    fig["disk_before_gc"] = du(root)
    fig["cache_bytes"] = du(root / "cache")
    t0 = time.perf_counter()
    g = generations.gc(tr, keep=1)
    fig["gc"] = {"wall_s": round(time.perf_counter() - t0, 2),
                 **{k: v for k, v in replies.to_json(g).items() if isinstance(v, (int, float, str))}}
    fig["disk_after_gc"] = du(root)


def sglang(tr, work: Path, locks: dict, fig: dict, rows: list, quiet: bool) -> None:
    """The SGLang 0.5.23 lock on a fresh root (about 35 GB on disk at its peak): cold (every wheel fetched, the
    kernels compiled), then cached (a new generation, the host's kernel cache warm)."""
    cold_and_cached(tr, work, locks, rows, quiet, "sglang", "SGLang 0.5.23")


def streams() -> int:
    from provision.agent.fetch import streams as default

    return int(os.environ.get("PROVISION_FETCH_JOBS") or default())


def fetch(tr, work: Path, locks: dict, fig: dict, rows: list, quiet: bool) -> None:
    """The host agent's fetch alone (the baseline's wheels into an empty cache) against the line rate."""
    fig["fetch_alone"] = fetch_alone(locks["baseline"], locks["line"], Path(tr.target.root),
                                     streams())
    fig["fetch_links"] = fetch_links(locks["line"], work / "links", streams())


PARTS = {"fetch": fetch, "upgrade": upgrade, "baseline": baseline, "cuda13": cuda13, "sglang": sglang}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", help="the hosts' Python 3.12 (default: one found that runs)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--part", choices=("all", *PARTS), default=["all"], nargs="+",
                    help="fetch: the host's fetch alone against the line rate; upgrade: baseline cold and cached, "
                         "CUDA 13 lock, reuse, rollback, gc; sglang: the SGLang 0.5.23 lock cold and cached; all: "
                         "each in turn, each on a fresh host root removed before the next starts")
    ap.add_argument("--workdir", help="where the host roots go (default: a temp dir; needs ~50 GB free)")
    ap.add_argument("--fetch-only", action="store_true", help="the parallel fetch alone against the line rate")
    ap.add_argument("--jobs", type=int, help="streams (default: PROVISION_FETCH_JOBS, else the agent's choice for "
                                             "this machine's cores)")
    args = ap.parse_args()
    if args.jobs:
        os.environ["PROVISION_FETCH_JOBS"] = str(args.jobs)
    base = lockmod.load(BASELINE)
    locks = {"baseline": base, "line": max(base.packages, key=lambda p: p.name == "torch")}
    if args.fetch_only or args.part == ["fetch"]:
        work = Path(tempfile.mkdtemp(prefix="real-stack-fetch-", dir=args.workdir))
        try:
            fig: dict = {"commit": commit(), **fetch_alone(base, locks["line"], work, streams()),
                         "fetch_links": fetch_links(locks["line"], work / "links", streams())}
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps(fig, indent=2) if args.json else render_fetch(fig))
        return
    python = args.python or find_python("3.12")
    if not python:
        sys.exit("no Python 3.12 that runs; pass --python")
    locks.update(cuda13=lockmod.load(TARGET), sglang=lockmod.load(SGLANG))
    parts = [p for p in PARTS if p not in ("baseline", "cuda13")] if "all" in args.part else [p for p in PARTS if p in args.part]
    rows: list[dict] = []
    fig = {"commit": commit(), "python": python, "parts": parts, "line_rate_wheel": locks["line"].filename}
    work = Path(tempfile.mkdtemp(prefix="real-stack-", dir=args.workdir))
    machine = Machine()
    try:
        with LoopbackHost() as host:
            trust_host(host.target)
            t = host.target
            for part in parts:
                root = work / f"root-{part}"
                t.root, t.python = str(root), python
                tr = connect(t)
                try:
                    PARTS[part](tr, work, locks, fig, rows, args.json)
                finally:
                    tr.close()
                    remove_root(root)           # the next part starts from nothing
    finally:
        remove_root(work)
    fig["rows"] = rows
    fig.update(machine.figures())
    if args.json:
        print(json.dumps(fig, indent=2, default=str))
        return
    print(render(fig))


def render_links(fig: dict) -> str:
    lines = [f"one wheel, {fig['wheel']} ({fig['bytes'] / 1e9:.2f} GB), served on loopback: a plain download (curl, one "
             f"connection) beside the agent's fetch ({fig['jobs']} streams, and 1), interleaved in one run; ratios "
             f"of the medians", "| link | plain s | fetch s | fetch ÷ plain | fetch 1 stream s | 1 stream ÷ plain | "
             "requests per fetch | load average |", "|---|---|---|---|---|---|---|---|"]
    for r in fig["links"]:
        lines.append(f"| {r['link']} | {', '.join(map(str, r['plain_s']))} | {', '.join(map(str, r['fetch_s']))} | "
                     f"{r['fetch_of_plain']:.2f} | {', '.join(map(str, r['fetch_1_stream_s']))} | "
                     f"{r['fetch_1_stream_of_plain']:.2f} | {r['ranges']} | "
                     f"{r['load_average'][0]:.1f}–{r['load_average'][1]:.1f} |")
    return "\n".join(lines)


def render_fetch(fig: dict) -> str:
    return (render_links(fig["fetch_links"]) + "\n" if "fetch_links" in fig else "") + (f"fetch of {fig['wheels']} wheels ({fig['bytes'] / 1e9:.2f} GB) with {fig['jobs']} streams: "
            f"{fig['fetch_s']:.1f} s, {fig['fetch_Bps'] / 1e6:.0f} MB/s = {fig['fetch_of_line_rate']:.2f} x the line "
            f"rate ({fig['line_rate_Bps'][0] / 1e6:.0f} MB/s before, {fig['line_rate_Bps'][1] / 1e6:.0f} MB/s after: "
            f"a plain download of {fig['line_rate_wheel']}); a plain download of the same {fig['wheels']} wheels "
            f"one after another (curl, one connection) {fig['plain_same_bytes_s']:.1f} s: the fetch takes "
            f"{fig['fetch_of_plain_same_bytes']:.2f} x its time; CPU {fig['cpu_s_per_GB']['fetch']:.2f} s/GB "
            f"(a plain download {fig['cpu_s_per_GB']['plain_download']:.2f}); load average {fig['load_average']:.1f}")


def play(r: dict) -> str:
    if "through_play_s" not in r:
        return "–"
    ok = "within" if r["play_of_call"] <= 1 + r["play_slower_bound"] else "OVER"
    return f"{r['through_play_s']:.1f} ({r['play_of_call']:.2f}x; {ok} +{r['play_slower_bound']:.0%})"


def render(fig: dict) -> str:
    lines = [describe(fig), f"commit {fig['commit']}"]
    if "fetch_alone" in fig:
        lines.append(render_fetch(fig["fetch_alone"]))
    if "fetch_links" in fig:
        lines.append(render_links(fig["fetch_links"]))
    lines += ["", "| phase | packages fetched / cached | GB fetched | fetch s (MB/s) | line rate MB/s | install s | "
              "wall s | bound: bytes ÷ line rate + install | wall ÷ bound | load average |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in fig["rows"]:
        rate = r.get("line_rate_Bps")
        bound = (r["bytes"] / rate if rate else 0) + r["install_s"]
        mbps = (f"{r['bytes'] / r['fetch_s'] / 1e6:.0f}" + (f", {r['fetch_of_line_rate']:.0%} of the line rate"
                                                             if "fetch_of_line_rate" in r else "")
                if r["fetch_s"] else "–")
        ratio = f"{r['wall_s'] / bound:.2f}" if bound > 0 and (rate or not r["bytes"]) else "–"
        lines.append(f"| {r['phase']} ({r['status']}) | {r['fetched']} / {r['cached']} | {r['bytes'] / 1e9:.2f} | "
                     f"{r['fetch_s']:.1f} ({mbps}) | {rate / 1e6 if rate else 0:.0f} | {r['install_s']:.1f} | "
                     f"{r['wall_s']:.1f} | {bound:.1f} | {ratio} | {r['load_average'][0]:.1f}–"
                     f"{r['load_average'][1]:.1f} |")
    beside = [r for r in fig["rows"] if "cp_a_s" in r]
    if beside:
        lines += ["", "| cached apply | wall s | target s | cp -a of its venv s | uv hardlink install s | wall ÷ cp -a | "
                      "wall ÷ uv hardlink | through the play s (÷ the call) | steps s | build steps s | probes s | "
                      "load average |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in beside:
            met = "met" if r["wall_s"] <= r["target_s"] else "MISSED"
            lines.append(f"| {r['phase']} | {r['wall_s']:.1f} | {r['target_s']:.0f} ({met}) | {r['cp_a_s']:.1f} | "
                         f"{r['uv_hardlink_s']:.2f} | {r['of_cp_a']:.2f} | {r['of_uv_hardlink']:.1f} | "
                         f"{play(r)} | {r['steps']} | {r['build_steps']} | {r.get('probe_s', {})} | {r['load_average'][0]:.1f}–{r['load_average'][1]:.1f} |")
    if "rollback" in fig:
        rb = fig["rollback"]
        lines += ["", f"rollback {rb['from']} → {rb['to']}: {rb['wall_s']:.2f} s wall, host switch "
                      f"{(rb['host_switch_s'] or 0) * 1000:.1f} ms",
                  f"gc --keep 1: {fig['gc']['wall_s']:.1f} s; disk {fig['disk_before_gc'] / 1e9:.1f} GB → "
                  f"{fig['disk_after_gc'] / 1e9:.1f} GB (wheel and uv caches {fig['cache_bytes'] / 1e9:.1f} GB)"]
    lines.append("step seconds per phase: " + "; ".join(f"{r['phase']}: {r['steps']}" for r in fig["rows"]))
    if "plan_baseline_to_sglang" in fig:
        lines += ["", "plan on the baseline host, to the SGLang 0.5.23 lock:", fig["plan_baseline_to_sglang"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
