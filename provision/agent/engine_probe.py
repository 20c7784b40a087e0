"""Host agent helper (stdlib): the engine probe, end to end.

It launches the generation's engine (its own process group, always stopped; only an answer from its own process tree
is trusted), runs greedy prompts plain and speculative, and judges where their outputs part against the near-tie bound.
"""
import json
import math
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

from .gpu_probes import SAFE_ENV, result


def _post(url, body, timeout):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _healthy(base):
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _pdeathsig():
    """Engine child: die with the agent (Linux), in its own process group."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def listen_inodes(port):
    """Inodes of the sockets listening on TCP `port` (IPv4 and IPv6), from /proc/net."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                out.add(f[9])
    return out


def cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return "?"


def socket_owners(port):
    """{pid: command line} of the processes (that this user can see) holding a socket listening on `port`."""
    inodes = listen_inodes(port)
    owners = {}
    for pid in os.listdir("/proc") if inodes else []:
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir("/proc/%s/fd" % pid):
                link = os.readlink("/proc/%s/fd/%s" % (pid, fd))
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    owners[int(pid)] = cmdline(int(pid))
                    break
        except OSError:
            continue
    return owners


def describe_owners(port):
    owners = socket_owners(port)
    if owners:
        return ", ".join("pid %d (%s)" % kv for kv in sorted(owners.items()))
    return "a process this user cannot see" if listen_inodes(port) else "nothing (no listening socket)"


def in_tree(pid, root):
    """`pid` is `root`, in the session `root` leads (start_new_session), or descends from it."""
    for _ in range(64):
        if pid == root:
            return True
        try:
            with open("/proc/%d/stat" % pid) as f:
                state = f.read().rsplit(")", 1)[1].split()   # state ppid pgrp session ...
        except OSError:
            return False
        if int(state[3]) == root:
            return True
        pid = int(state[1])
        if pid <= 1:
            return False
    return False


class Server:
    """One engine process: started in its own group, always stopped (TERM, then KILL)."""

    def __init__(self, argv, env, log, cwd=None):
        self.log = log
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, env=env, text=True, cwd=cwd,
                                  start_new_session=True, preexec_fn=_pdeathsig)
        self.lines = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.append(line.rstrip())

    def wait_ready(self, base, deadline):
        """base: a fixed URL, or None to take it from the 'serving ... on http://...' line."""
        while time.time() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError("engine exited with %s: %s" % (self.p.returncode, self.tail()))
            if base is None:
                for l in self.lines:
                    m = re.search(r"(http://[0-9.:a-z]+)", l)
                    if m:
                        base = m.group(1)
            if base and _healthy(base):
                self.check_owner(base)
                return base
            time.sleep(0.2)
        raise RuntimeError("engine not healthy after %.0fs: %s" % (deadline - self.t0, self.tail()))

    def check_owner(self, base):
        """Trust no answer that the launched process (or its children) did not give: the socket behind
        `base` must be held by this engine's process tree."""
        from urllib.parse import urlparse

        u = urlparse(base)
        if u.hostname not in ("127.0.0.1", "localhost", "::1"):
            raise RuntimeError("engine announced %s: not a loopback address; refusing to trust it" % base)
        port = u.port
        if not any(in_tree(pid, self.p.pid) for pid in socket_owners(port)):
            raise RuntimeError("port %d answers, but not from the launched engine (pid %d): held by %s" %
                               (port, self.p.pid, describe_owners(port)))

    def tail(self):
        try:
            self.log.flush()
            with open(self.log.name, errors="replace") as f:
                lines = [l.strip() for l in f.read().splitlines() if l.strip()]
            return (lines[-1] if lines else "(no output)")[:300]
        except OSError:
            return "(no log)"

    def stop(self):
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
                self.p.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.p.pid, signal.SIGKILL)
                except OSError:
                    pass
                self.p.wait()
        return self.p.returncode


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
           "The quick brown fox jumps over the lazy dog. The quick brown", "1, 2, 3, 4, 5, 6,",
           "In the beginning"]


# Unit roundoff of the dtypes an engine computes in (half the spacing of numbers in [1, 2)).
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


def near_tie_bound(dtype, layers, scale):
    """The largest top-2 logit gap at which two correct evaluations of the same step, rounded differently, may
    pick different greedy tokens: 2·√(2L+2)·u·max|logit| (docs/probes.md derives it). None for an unknown dtype."""
    u = UNIT_ROUNDOFF.get(dtype)
    return None if u is None else 2.0 * math.sqrt(2 * layers + 2) * u * scale


def first_divergence(a, b):
    """Index of the first token where a and b differ (the shorter one's end counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def judge_divergence(plain, spec, report):
    """One prompt's plain and speculative greedy token ids, and the plain run's `margins` report (dtype, layers,
    gaps, scales, top): where they first differ, the plain step's logit gap between its token and the speculative
    one there (from `top`; beyond it, at least its last gap; without it, the top-2 gap) and the near-tie bound."""
    i = first_divergence(plain, spec)
    d = {"position": i, "plain_token": plain[i] if i < len(plain) else None,
         "spec_token": spec[i] if i < len(spec) else None, "dtype": report.get("dtype"),
         "layers": report.get("layers")}
    gaps, scales = report.get("gaps") or [], report.get("scales") or []
    if i >= len(plain) or i >= len(spec):
        d.update(near_tie=False, why="the outputs differ in length at token %d" % i)
        return d
    if i >= len(gaps) or i >= len(scales):
        d.update(near_tie=False, why="the engine reports no margin for token %d" % i)
        return d
    bound = near_tie_bound(d["dtype"], int(d["layers"] or 0), abs(scales[i]))
    top = report.get("top") or []
    cand = {int(t): float(g) for t, g in top[i]} if i < len(top) and top[i] else {}
    gap = cand.get(d["spec_token"], max(cand.values()) if cand else gaps[i])
    d.update(gap=gap, gap_at_least=bool(cand) and d["spec_token"] not in cand, top2_gap=gaps[i], scale=scales[i],
             bound=bound)
    if bound is None:
        d.update(near_tie=False, why="no unit roundoff known for dtype %r" % d["dtype"])
    else:
        d["near_tie"] = gap <= bound
    return d


def _included_round(base, prompts, max_tokens, timeout):
    """Baseline (speculative: false) and EAGLE-3 per prompt, interleaved, each twice; warm-up first, at the
    round's full length, so that what a fresh server does once (new cache spans, first-use allocations) is not
    timed. Where a prompt's greedy outputs differ, one more (untimed) plain run reports its margins, and the
    first divergence is judged against the near-tie bound."""
    url = base + "/v1/completions"
    for spec in (False, True):
        _post(url, {"prompt": prompts[0], "max_tokens": max_tokens, "temperature": 0, "speculative": spec}, timeout)
    t = {False: 0.0, True: 0.0}
    n = {False: 0, True: 0}
    accepts, mismatch, ratios, diverged = [], [], [], []
    for k, p in enumerate(prompts):
        outs, tps = {False: [], True: []}, {False: 0.0, True: 0.0}
        for spec in (False, True, True, False):   # each mode twice, in mirrored order; its faster run counts,
            t0 = time.perf_counter()              # so a stall from elsewhere on the host does not decide a ratio
            r = _post(url, {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "speculative": spec}, timeout)
            dt = time.perf_counter() - t0
            t[spec] += dt
            ch = r["choices"][0]
            outs[spec].append(ch.get("token_ids") if ch.get("token_ids") is not None else ch.get("text"))
            n[spec] += r["usage"]["completion_tokens"]
            tps[spec] = max(tps[spec], r["usage"]["completion_tokens"] / dt if dt else 0.0)
            if spec:
                accepts.append(float(r["usage"].get("accept_length") or 0.0))
        if tps[False]:
            ratios.append(tps[True] / tps[False])
        plain, spec = outs[False][0], outs[True][0]
        if outs[False][1] != plain or outs[True][1] != spec:
            mismatch.append(p)
            diverged.append({"prompt": k, "near_tie": False, "why": "greedy output changed between two runs of "
                                                                    "the same mode"})
        elif plain != spec:
            mismatch.append(p)
            diverged.append(dict(_judged(url, p, max_tokens, timeout, plain, spec), prompt=k))
    return t, n, accepts, mismatch, ratios, diverged


def _judged(url, prompt, max_tokens, timeout, plain, spec):
    """Ask the plain run again, with its margins, and judge where the two greedy outputs part."""
    if not isinstance(plain, list) or not isinstance(spec, list):
        return {"near_tie": False, "why": "the engine returns no token ids to compare"}
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "speculative": False, "margins": True}
    try:
        r = _post(url, body, timeout)
    except urllib.error.HTTPError as ex:
        return {"near_tie": False, "why": "the engine reports no margins (HTTP %d)" % ex.code}
    if r["choices"][0].get("token_ids") != plain:
        return {"near_tie": False, "why": "plain greedy output changed when its margins were asked for"}
    return judge_divergence(plain, spec, r.get("margins") or {})


def _sglang_round(base, prompts, max_tokens, timeout, spec):
    url = base + "/generate"
    _post(url, {"text": prompts[0], "sampling_params": {"temperature": 0, "max_new_tokens": 8}}, timeout)
    secs, toks, outs, accepts = 0.0, 0, [], []
    for p in prompts:
        t0 = time.perf_counter()
        r = _post(url, {"text": p, "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens}}, timeout)
        secs += time.perf_counter() - t0
        meta = r.get("meta_info") or {}
        toks += int(meta.get("completion_tokens") or 0)
        outs.append(r.get("output_ids") or r.get("text"))
        if spec and meta.get("spec_verify_ct"):
            accepts.append(meta["completion_tokens"] / meta["spec_verify_ct"])
    return secs, toks, outs, accepts


def p_engine(a):
    e = a["engine"]
    deadline_s = float(e.get("timeout") or 900)
    env = dict(os.environ, **SAFE_ENV, **(e.get("env") or {}))
    if a.get("cuda_home"):   # the generation's toolkit: what the engine's JIT (flashinfer, DeepGEMM) compiles with
        env.update(CUDA_HOME=a["cuda_home"], CUDA_PATH=a["cuda_home"])
    prompts = e.get("prompts") or PROMPTS
    max_tokens = int(e.get("max_tokens") or 64)
    req_timeout = float(e.get("request_timeout") or 300)
    min_speedup = float(e.get("min_speedup") or 1.0)
    figs = {"kind": e["kind"], "argv": e["argv"], "device": e.get("device"), "prompts": len(prompts),
            "max_tokens": max_tokens, "min_speedup": min_speedup}
    if e.get("log"):   # the generation's own dir: kept with it, shown by `provision logs`
        log = open(e["log"], "w+")
    else:
        log = tempfile.NamedTemporaryFile("w+", prefix="provision-engine-", suffix=".log", delete=False)
    figs["log"] = log.name
    servers = []
    t_start = time.time()

    def launch(argv, base):
        port = int(base.rsplit(":", 1)[1]) if base else None
        if port and listen_inodes(port):   # whatever answers there is not the engine this probe launches
            raise RuntimeError("port %d is already in use by %s: refusing to probe through it" %
                               (port, describe_owners(port)))
        s = Server(argv, env, log, cwd=e.get("cwd"))   # cwd: so `-m` finds the shipped code, not a checkout
        s.t0 = time.time()
        servers.append(s)
        url = s.wait_ready(base, t_start + deadline_s)
        figs.setdefault("ready_s", round(time.time() - s.t0, 1))
        return s, url

    try:
        if e["kind"] == "sglang":
            base = "http://127.0.0.1:%d" % int(e.get("port") or 30000)
            s, url = launch(e["argv"], base)
            st, nt, out_s, accepts = _sglang_round(url, prompts, max_tokens, req_timeout, True)
            s.stop()
            s, url = launch(e["baseline_argv"], base)
            sb, nb, out_b, _ = _sglang_round(url, prompts, max_tokens, req_timeout, False)
            s.stop()
            t, n = {False: sb, True: st}, {False: nb, True: nt}
            mismatch = [p for p, x, y in zip(prompts, out_b, out_s) if x != y]
            diverged = [{"prompt": k, "near_tie": False, "why": "SGLang reports no margins"}
                        for k, p in enumerate(prompts) if p in mismatch]
            ratios = []   # two launches, not interleaved: the totals' ratio is the figure
        else:
            s, url = launch(e["argv"], None)
            figs["url"] = url
            t, n, accepts, mismatch, ratios, diverged = _included_round(url, prompts, max_tokens, req_timeout)
    except (RuntimeError, urllib.error.URLError, OSError, ValueError, KeyError) as ex:
        return result("engine", "fail", "%s: %s" % (type(ex).__name__, ex), **figs)
    finally:
        figs["exit_codes"] = [s.stop() for s in servers]
        log.close()
    base_tps = n[False] / t[False] if t[False] else 0.0
    spec_tps = n[True] / t[True] if t[True] else 0.0
    acc = sum(accepts) / len(accepts) if accepts else 0.0
    # The gate uses the median of per-prompt ratios (baseline and speculative interleaved per prompt, each
    # mode's faster of two runs), so a request stalled by something else on the host cannot decide it alone.
    ratio = sorted(ratios)[len(ratios) // 2] if ratios else (spec_tps / base_tps if base_tps else 0.0)
    figs.update(baseline_tok_s=round(base_tps, 2), spec_tok_s=round(spec_tps, 2), speedup=round(ratio, 3),
                accept_length=round(acc, 3), greedy_identical=not mismatch, mismatched=mismatch[:3],
                identical_prompts=len(prompts) - len(mismatch), divergences=diverged)
    bad, far = [], [d for d in diverged if not d["near_tie"]]
    if far:
        bad.append("greedy output differs with speculation on %d of %d prompts, %d not at a near-tie: %s" %
                   (len(mismatch), len(prompts), len(far), _why(far[0], prompts)))
    if acc <= 1.0:
        bad.append("mean acceptance length %.2f ≤ 1.0: speculation accepts nothing (silent fallback)" % acc)
    if ratio < min_speedup:
        bad.append("speedup %.2f (median per prompt; totals %.1f ÷ %.1f tok/s) < min_speedup %.2f" %
                   (ratio, spec_tps, base_tps, min_speedup))
    if bad:
        return result("engine", "fail", "; ".join(bad), **figs)
    same = "identical greedy output" if not diverged else \
        "greedy identical on %d of %d prompts; %d divergence(s) at near-ties (%s, %s)" % (
            len(prompts) - len(diverged), len(prompts), len(diverged),
            ", ".join("gap %s%.3g ≤ bound %.3g" % ("≥ " if d["gap_at_least"] else "", d["gap"], d["bound"])
                      for d in diverged), diverged[0]["dtype"])
    return result("engine", "pass", "%s, accept length %.2f, speedup %.2f× ≥ %.2f" % (same, acc, ratio, min_speedup),
                  **figs)


def _why(d, prompts):
    """One divergence that is not a near-tie, in words."""
    where = "prompt %r" % prompts[d["prompt"]][:40]
    if "gap" in d and d.get("bound") is not None:
        return "%s at token %d (plain %s, speculative %s): their logit gap in the plain step %s%.3g > near-tie " \
               "bound %.3g (%s, %s layers, max |logit| %.3g)" % (
                   where, d["position"], d["plain_token"], d["spec_token"], "≥ " if d["gap_at_least"] else "",
                   d["gap"], d["bound"], d["dtype"], d["layers"], d["scale"])
    return "%s: %s" % (where, d["why"])
