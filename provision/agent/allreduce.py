"""Host agent (stdlib + torch): all-reduce latency at decode sizes, one process per GPU.

The probes agent starts one `rank` per GPU, as agents are started ({op: rank, config, rank, dir} on stdin); each
writes dir/rankN.json after each path; `finish()` turns those (also a hung run's) into the probe result;
`report()`, `sglang_paths()` are pure.
"""
import json
import math
import os
import time

# NVLink multicast stays off (it can wedge shared hosts); the symmetric-memory kernels used here need none.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
HIDDENS = (4096, 7168)
TOKENS = (1, 2, 3, 8, 16)
PATHS = ("nccl", "symm-one-shot", "symm-two-shot", "flashinfer-fusion")
OPS_PER_GRAPH = 8          # back-to-back all-reduces per captured graph; a sample is one replay ÷ 8
TOLERANCE = 1e-2           # ‖out − ref‖ / ‖ref‖ for bf16 sums (rounding lands near 2e-3)
MiB = 1 << 20


class Unavailable(Exception):
    """The path does not exist on this host (a skip, with the reason)."""


# ------------------------------------------------------------------ SGLang 0.5.9's choice (pure)
# Read from the sglang 0.5.9 wheel: distributed/parallel_state.py GroupCoordinator.all_reduce tries
# custom all-reduce (sgl-kernel; on unless --disable-custom-all-reduce), then torch symmetric memory
# (--enable-torch-symm-mem), else NCCL in place; layers/communicator.py replaces the all-reduce before
# each residual RMSNorm with flashinfer's trtllm fusion when --enable-flashinfer-allreduce-fusion passes
# its capability gate. tests/test_allreduce.py checks these tables against the real wheels (and flashinfer 0.6.4).
CUSTOM_AR_WORLD_SIZES = (2, 4, 6, 8)          # CustomAllreduce._SUPPORTED_WORLD_SIZES
CUSTOM_AR_MAX_BYTES = 8192 * 1024             # CustomAllreduce._MAX_CAR_SIZE (CUDA)
SYMM_MAX_SIZES = {9: {2: 64 * MiB, 4: 64 * MiB, 6: 128 * MiB, 8: 128 * MiB},   # all_reduce_utils.py
                  10: {2: 64 * MiB, 4: 64 * MiB, 6: 128 * MiB, 8: 128 * MiB}}
SYMM_MAX_SIZES_PATCHED = {**SYMM_MAX_SIZES, 12: SYMM_MAX_SIZES[9]}             # provision/patches/sglang-0.5.9/0001
MULTIMEM_WORLD_SIZES = {9: (4, 6, 8), 10: (6, 8)}                              # _WORLD_SIZES_MULTIMEM
FUSION_MAJORS = (9, 10)                       # communicator.py: is_sm90_supported() or is_sm100_supported()
FUSION_MAJORS_PATCHED = (9, 10, 12)           # provision/patches/sglang-0.5.9/0002
FUSION_MAX_TOKENS = 2048                      # FUSE_ALLREDUCE_MAX_BATCH_SIZE
FLASHINFER_COMM_MAJORS = (9, 10)              # flashinfer 0.6.4 jit/comm.py gen_trtllm_comm_module
CONFIGS = {
    "default": "SGLang defaults (custom all-reduce on)",
    "symm-mem": "--enable-torch-symm-mem --disable-custom-all-reduce",
    "fusion": "--enable-flashinfer-allreduce-fusion (the all-reduce before each residual RMSNorm)",
}


def _custom_ar(world, nbytes, topo):
    if world not in CUSTOM_AR_WORLD_SIZES:
        return None, "custom all-reduce refuses world size %d" % world
    if world > 2 and not topo.get("full_nvlink"):
        return None, "custom all-reduce needs full NVLink above 2 GPUs (these are not)"
    if topo.get("p2p") is False:
        return None, "custom all-reduce needs GPU peer access (P2P), which this host lacks"
    if nbytes > CUSTOM_AR_MAX_BYTES or nbytes % 16:
        return None, "custom all-reduce takes ≤ 8 MiB, 16-byte multiples"
    return "custom-ar", "sgl-kernel custom all-reduce (world %d, ≤ 8 MiB)" % world


def _symm(major, world, nbytes, topo, patched):
    table = SYMM_MAX_SIZES_PATCHED if patched else SYMM_MAX_SIZES
    if major < 9:
        return None, "torch symmetric memory disabled below capability 9"
    if major not in table:
        return "error", "KeyError %d in TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES: the server fails to start" % major
    if world not in table[major]:
        return None, "torch symmetric memory refuses world size %d" % world
    multicast = bool(topo.get("multicast"))
    if not multicast and not (patched and major == 12):
        return None, "torch symmetric memory disabled: no multicast object (NVLink multicast off or absent)"
    if nbytes % 4 or nbytes >= table[major][world]:
        return None, "torch symmetric memory takes < %d MiB" % (table[major][world] // MiB)
    if multicast and world in MULTIMEM_WORLD_SIZES.get(major, ()):
        return "symm-multimem", "torch symmetric memory, multimem kernel"
    return "symm-two-shot", "torch symmetric memory, two-shot kernel"


def sglang_paths(cc, world, nbytes, tokens, topo):
    """{config: {unpatched|patched: (path, why)}} for one all-reduce of `nbytes` (`tokens` rows)."""
    major = int(str(cc).split(".")[0])
    out = {}
    for config in CONFIGS:
        out[config] = {}
        for patched in (False, True):
            path, why = None, ""
            if config == "default":
                path, why = _custom_ar(world, nbytes, topo)
            elif config == "symm-mem":
                path, why = _symm(major, world, nbytes, topo, patched)
            else:
                majors = FUSION_MAJORS_PATCHED if patched else FUSION_MAJORS
                if major not in majors:
                    why = "the fusion gate admits SM%s only" % "/SM".join("%d0" % m for m in majors)
                elif tokens > FUSION_MAX_TOKENS:
                    why = "fusion takes ≤ %d tokens" % FUSION_MAX_TOKENS
                elif major not in FLASHINFER_COMM_MAJORS:
                    path, why = "error", ("flashinfer 0.6.4 builds its trtllm all-reduce for SM90/SM100 only: "
                                          "RuntimeError at the first fused all-reduce")
                else:
                    path, why = "flashinfer-fusion", "flashinfer trtllm all-reduce fusion"
            if path is None:
                path, why = "nccl", why + "; NCCL in place"
            out[config]["patched" if patched else "unpatched"] = (path, why)
    return out


# ------------------------------------------------------------------ report (pure)

def percentile(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100.0 * len(s)) - 1))]


def verdicts(paths):
    """{path: {status, reason}} from each path's rows: a wrong or missing sum fails, no setup skips."""
    out = {}
    for name, p in paths.items():
        if p.get("skip"):
            out[name] = {"status": "skip", "reason": p["skip"]}
            continue
        bad = [r for r in p["rows"] if not r.get("correct")]
        if p.get("error"):
            out[name] = {"status": "fail", "reason": p["error"]}
        elif bad:
            r = bad[0]
            out[name] = {"status": "fail", "reason": "wrong sum at hidden %d × %d tokens (relative error %s)%s" %
                         (r["hidden"], r["tokens"], r.get("rel_err"), "; %d case(s) wrong" % len(bad)
                          if len(bad) > 1 else "")}
        else:
            graphs = sum(bool(r.get("graph")) for r in p["rows"])
            out[name] = {"status": "pass", "reason": "%d sizes correct (%d CUDA-graph captured)" %
                         (len(p["rows"]), graphs)}
    return out


def report(paths, cc, world, topo, env=None):
    """The probe result {name, status, reason, figures} from every path's rows (merged over ranks)."""
    v = verdicts(paths)
    keys = []
    for p in paths.values():
        for r in p.get("rows", []):
            if (r["hidden"], r["tokens"]) not in keys:
                keys.append((r["hidden"], r["tokens"]))
    sizes, why = [], {}
    for h, t in keys:
        nbytes = h * t * 2
        lat = {}
        for name, p in paths.items():
            for r in p.get("rows", []) if v[name]["status"] == "pass" else []:
                if (r["hidden"], r["tokens"]) == (h, t):
                    lat[name] = {"median_us": r["median_us"], "p99_us": r["p99_us"]}
        choice = sglang_paths(cc, world, nbytes, t, topo)
        row = {"hidden": h, "tokens": t, "bytes": nbytes, "us": lat, "sglang": {}}
        for config, variants in choice.items():
            row["sglang"][config] = {}
            for variant, (path, reason) in variants.items():
                got = lat.get(path)
                row["sglang"][config][variant] = {"path": path, "median_us": got and got["median_us"]}
                why.setdefault(config, {}).setdefault(variant, {}).setdefault(reason, []).append(nbytes)
        if lat:
            best = min(lat, key=lambda k: lat[k]["median_us"])
            row["fastest"] = best
            if "nccl" in lat:
                row["fastest_vs_nccl"] = round(lat["nccl"]["median_us"] / lat[best]["median_us"], 2)
        sizes.append(row)
    figs = {"world": world, "compute_capability": cc, "topology": topo, "paths": v, "sizes": sizes,
            "sglang_why": {c: {k: sorted(r) for k, r in vs.items()} for c, vs in why.items()},
            "sglang_configs": CONFIGS,
            "method": "bf16 [tokens, hidden]; %d all-reduces per CUDA graph, median and p99 over replays "
                      "(per all-reduce), slowest rank; each result checked against a float64 sum of every "
                      "rank's input (relative error ≤ %g)" % (OPS_PER_GRAPH, TOLERANCE),
            "env": env or SAFE_ENV}
    failed = [n for n in v if v[n]["status"] == "fail"]
    passed = [n for n in v if v[n]["status"] == "pass"]
    skipped = [n for n in v if v[n]["status"] == "skip"]
    if failed:
        reason = "; ".join("%s: %s" % (n, v[n]["reason"]) for n in failed)
        return {"name": "allreduce", "status": "fail", "reason": reason, "figures": figs}
    if "nccl" not in passed:
        reason = "NCCL did not run: %s" % v.get("nccl", {}).get("reason", "not measured")
        return {"name": "allreduce", "status": "fail", "reason": reason, "figures": figs}
    wins = {}
    for s in sizes:
        wins.setdefault(s["fastest"], []).append(s.get("fastest_vs_nccl", 1.0))
    summary = ", ".join("%s fastest at %d of %d sizes (%.2f–%.2f× NCCL)" % (n, len(r), len(sizes), min(r), max(r))
                        for n, r in sorted(wins.items(), key=lambda kv: -len(kv[1])))
    reason = "%d ranks, %d path(s) correct (%s); %s" % (world, len(passed), ", ".join(passed), summary)
    if skipped:
        reason += "; skipped: " + ", ".join(skipped)
    return {"name": "allreduce", "status": "pass", "reason": reason, "figures": figs}


def merge(per_rank):
    """One {path: {rows|skip|error}} from every rank's: slowest rank's latency, every rank's correctness."""
    out = {}
    for name in per_rank[0]:
        ps = [r[name] for r in per_rank]
        skip = next((p["skip"] for p in ps if p.get("skip")), None)
        err = next((p["error"] for p in ps if p.get("error")), None)
        if skip:
            out[name] = {"skip": skip}
            continue
        rows = []
        for i, r0 in enumerate(ps[0]["rows"]):
            rs = [p["rows"][i] for p in ps if i < len(p["rows"])]
            row = dict(r0, correct=len(rs) == len(ps) and all(r["correct"] for r in rs),
                       rel_err=max(r["rel_err"] for r in rs))
            for k in ("median_us", "p99_us"):
                row[k] = max(r[k] for r in rs)
            rows.append(row)
        out[name] = {"rows": rows}
        if err:
            out[name]["error"] = err
    return out


# ------------------------------------------------------------------ one rank (torch)

def _inputs(torch, world, t, h, seed):
    """Every rank's input for one size, made alike on every rank (CPU generator), as bf16."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t, h, generator=g).to(torch.bfloat16) for _ in range(world)]


class Rank:
    def __init__(self, cfg, rank):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.rank, self.world = torch, dist, rank, cfg["world"]
        self.cuda = cfg["backend"] == "nccl"
        self.dev = torch.device("cuda", rank) if self.cuda else torch.device("cpu")
        if self.cuda:
            torch.cuda.set_device(self.dev)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
        dist.init_process_group(cfg["backend"], rank=rank, world_size=self.world,
                                device_id=self.dev if self.cuda else None)
        self.group = dist.group.WORLD
        self.iters = int(cfg.get("iters") or 400)
        self.hiddens = cfg.get("hiddens") or HIDDENS
        self.tokens = cfg.get("tokens") or TOKENS

    # -- paths: each setup returns op(x) -> out, or raises Unavailable ------------------------------

    def setup(self, name):
        torch = self.torch
        if name == "nccl":
            w = torch.empty(max(self.tokens), max(self.hiddens), dtype=torch.bfloat16, device=self.dev)

            def op(x):   # in place on a work buffer (SGLang reduces the activations in place)
                y = w.view(-1)[: x.numel()].view(x.shape)
                y.copy_(x)
                self.dist.all_reduce(y, group=self.group)
                return y
            return op
        if not self.cuda:
            raise Unavailable("no CUDA device (backend %s)" % self.dist.get_backend())
        if name.startswith("symm-"):
            return self._symm(name)
        return self._flashinfer(name)

    def _symm(self, name):
        torch = self.torch
        try:
            import torch.distributed._symmetric_memory as symm
        except ImportError as e:
            raise Unavailable("torch has no symmetric memory (%s)" % e)
        fn = "one_shot_all_reduce_out" if name == "symm-one-shot" else "two_shot_all_reduce_"
        if not hasattr(torch.ops.symm_mem, fn):
            raise Unavailable("torch %s has no torch.ops.symm_mem.%s" % (torch.__version__, fn))
        if hasattr(symm, "enable_symm_mem_for_group"):
            symm.enable_symm_mem_for_group(self.group.group_name)
        n = max(self.tokens) * max(self.hiddens)
        buf = symm.empty(n, device=self.dev, dtype=torch.bfloat16)
        symm.rendezvous(buf, self.group.group_name)
        out = torch.empty(n, device=self.dev, dtype=torch.bfloat16)
        gname = self.group.group_name

        def op(x):   # as SGLang's communicator: copy into the symmetric buffer, reduce, copy out
            b = buf[: x.numel()]
            b.copy_(x.view(-1))
            o = out[: x.numel()]
            if name == "symm-one-shot":
                torch.ops.symm_mem.one_shot_all_reduce_out(b, "sum", gname, o)
            else:
                torch.ops.symm_mem.two_shot_all_reduce_(b, "sum", gname)
                o.copy_(b)
            return o.view(x.shape)
        return op

    def _flashinfer(self, name):
        torch = self.torch
        try:
            import flashinfer.comm as fc
        except ImportError as e:
            raise Unavailable("flashinfer is not installed in this generation (%s)" % e)
        tmax, hmax = max(self.tokens), max(self.hiddens)
        # SGLang's call: trtllm_allreduce_fusion over an IPC workspace (here the plain all-reduce pattern)
        _, ws = fc.trtllm_create_ipc_workspace_for_all_reduce_fusion(
            self.rank, self.world, FUSION_MAX_TOKENS, hmax, group=self.group)
        out = torch.empty(tmax * hmax, device=self.dev, dtype=torch.bfloat16)

        def op(x):
            o = out[: x.numel()].view(x.shape)
            fc.trtllm_allreduce_fusion(
                allreduce_in=x, world_size=self.world, world_rank=self.rank, token_num=x.shape[0],
                hidden_dim=x.shape[1], workspace_ptrs=ws, launch_with_pdl=True,
                trigger_completion_at_end=False, fp32_acc=False,
                pattern_code=fc.AllReduceFusionPattern.kAllReduce, use_oneshot=None, allreduce_out=o,
                residual_in=None, residual_out=None, norm_out=None, quant_out=None, scale_out=None,
                rms_gamma=None, rms_eps=None, scale_factor=None, layout_code=None)
            return o
        return op

    # -- measuring ----------------------------------------------------------------------------------

    def measure(self, op, t, h, seed):
        """One size: capture (or run eagerly), check the sum against every rank's input, time."""
        torch = self.torch
        xs = _inputs(torch, self.world, t, h, seed)
        ref = torch.stack([x.double() for x in xs]).sum(0)
        x = xs[self.rank].to(self.dev)
        row = {"hidden": h, "tokens": t, "bytes": t * h * 2, "graph": False}
        if self.cuda:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    op(x)
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g):
                    for _ in range(OPS_PER_GRAPH):
                        y = op(x)
                run, per = g.replay, OPS_PER_GRAPH
                row["graph"] = True
            except Exception as e:  # noqa: BLE001 - a path that cannot be captured is timed eagerly
                row["capture_error"] = "%s: %s" % (type(e).__name__, (str(e).splitlines() or [""])[0][:200])
                torch.cuda.synchronize()

                def run():
                    run.y = op(x)
                run()
                y, per = run.y, 1
            # fresh inputs, poison in the output: one run must write every element with the new sum
            xs = _inputs(torch, self.world, t, h, seed + 100000)
            ref = torch.stack([v.double() for v in xs]).sum(0)
            x.copy_(xs[self.rank])
            y.fill_(float("nan"))
            self.dist.barrier()
            torch.cuda.synchronize()
            run()
            torch.cuda.synchronize()
            if not row["graph"]:
                y = run.y
        else:
            y = op(x)
            run, per = (lambda: op(x)), 1
        err = float((y.double().cpu() - ref).norm() / ref.norm())
        row["rel_err"] = err if err == err else None
        row["correct"] = err == err and err <= TOLERANCE
        samples = []
        self.dist.barrier()
        if self.cuda:
            torch.cuda.synchronize()
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.iters)]
            for _ in range(10):
                run()
            for a, b in ev:
                a.record()
                run()
                b.record()
            torch.cuda.synchronize()
            samples = [a.elapsed_time(b) * 1000.0 / per for a, b in ev]
        else:
            for _ in range(self.iters):
                t0 = time.perf_counter()
                run()
                samples.append((time.perf_counter() - t0) * 1e6)
        row["median_us"] = round(percentile(samples, 50), 2)
        row["p99_us"] = round(percentile(samples, 99), 2)
        return row

    def run_path(self, name):
        """{rows} or {skip}; every rank agrees to skip before any collective of the path runs."""
        try:
            op, why = self.setup(name), None
        except Unavailable as e:
            op, why = None, str(e)
        except Exception as e:  # noqa: BLE001 - a path that cannot start here is skipped, naming why
            op, why = None, "cannot start: %s: %s" % (type(e).__name__, (str(e).splitlines() or [""])[0][:200])
        whys = [None] * self.world
        self.dist.all_gather_object(whys, why)
        if any(whys):
            return {"skip": next(w for w in whys if w)}
        rows, error = [], None
        seed = 0
        for h in self.hiddens:
            for t in self.tokens:
                seed += 1
                try:
                    rows.append(self.measure(op, t, h, seed))
                except Exception as e:  # noqa: BLE001 - a crash mid-run fails the path
                    error = "hidden %d × %d tokens: %s: %s" % (h, t, type(e).__name__,
                                                               (str(e).splitlines() or [""])[0][:200])
                    break
        res = {"rows": rows}
        if error:
            res["error"] = error
        return res


def _full_nvlink(world):
    """Every GPU pair linked by NVLink (nvidia-ml-py), as SGLang's is_full_nvlink; None if unknown."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        hs = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(world)]
        for i in range(world):
            for j in range(i + 1, world):
                if pynvml.nvmlDeviceGetP2PStatus(hs[i], hs[j], pynvml.NVML_P2P_CAPS_INDEX_NVLINK) != \
                        pynvml.NVML_P2P_STATUS_OK:
                    return False
        return True
    except Exception:  # noqa: BLE001 - NVML absent or refusing: unknown
        return None


def topology(torch, world, cuda):
    """What SGLang's choice depends on: NVLink between every pair, peer access, multicast (off here)."""
    if not cuda:
        return {"full_nvlink": False, "p2p": False, "multicast": False}
    p2p = all(torch.cuda.can_device_access_peer(i, j) for i in range(world) for j in range(world) if i != j)
    return {"full_nvlink": _full_nvlink(world), "p2p": p2p,
            "multicast": os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") != "1"}


def _write(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def op_rank(a):
    """One rank: {config: {world, backend, port, hiddens?, tokens?, iters?, paths?}, rank, dir}."""
    os.environ.update(SAFE_ENV)
    cfg, rank = a["config"], int(a["rank"])
    mine_path = os.path.join(a["dir"], "rank%d.json" % rank)
    r = Rank(cfg, rank)
    torch = r.torch
    mine = {"paths": {}, "torch": torch.__version__, "backend": cfg["backend"], "iters": r.iters,
            "cc": "%d.%d" % torch.cuda.get_device_capability(rank) if r.cuda else "0.0",
            "topology": topology(torch, r.world, r.cuda)}
    _write(mine_path, mine)
    for name in cfg.get("paths") or PATHS:      # risky paths last: a hang loses only what follows it
        mine["paths"][name] = r.run_path(name)
        _write(mine_path, mine)
    r.dist.barrier()
    r.dist.destroy_process_group()
    return {"rank": rank, "paths": len(mine["paths"])}


def finish(d, world, paths=None, error=None):
    """The probe result from the rankN.json files in `d`; `error`: why the ranks did not all finish."""
    names = list(paths or PATHS)
    ranks = []
    for i in range(world):
        try:
            with open(os.path.join(d, "rank%d.json" % i)) as f:
                ranks.append(json.load(f))
        except (OSError, ValueError):
            return {"name": "allreduce", "status": "fail", "reason": "rank %d reported nothing: %s" %
                    (i, error or "no rank%d.json" % i), "figures": {"world": world}}
    done = [n for n in names if all(n in r["paths"] for r in ranks)]
    per_rank = [{n: r["paths"][n] for n in done} for r in ranks]
    merged = merge(per_rank) if done else {}
    if len(done) < len(names):
        stuck = names[len(done)]
        merged[stuck] = {"rows": [], "error": "did not finish: %s" % (error or "ranks ended early")}
        for n in names[len(done) + 1:]:
            merged[n] = {"skip": "not run: %s did not finish" % stuck}
    r0 = ranks[0]
    res = report(merged, r0["cc"], world, r0["topology"], SAFE_ENV)
    res["figures"].update(torch=r0["torch"], backend=r0["backend"], iters=r0["iters"])
    return res


OPS = {"rank": op_rank}
