"""Host agent (stdlib + optional torch): the collective probes, one process per GPU.

`nccl` and `symm-mem` check all-reduce sums across ranks of this agent (`op_collective`); `allreduce` starts ranks
of agent/allreduce.py and reads their report. `start_ranks` and `wait_agents` run any agent's ranks.
"""
import os
import subprocess
import sys
import tempfile
import time

from . import allreduce
from .gpu_probes import SAFE_ENV, need_cuda, result, torch_facts
from .host import answer, start_agent


def op_collective(a):
    """One rank of the NCCL or symmetric-memory probe, in a process per GPU ({op: collective, kind, rank, world,
    port, backend}); rank 0 answers with the rows."""
    import torch
    import torch.distributed as dist

    kind, rank, world, port, backend = a["kind"], int(a["rank"]), int(a["world"]), str(a["port"]), a["backend"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, rank=rank, world_size=world, device_id=dev if dev.type == "cuda" else None)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    rows, ok = [], True
    if kind == "nccl":
        sizes = [int(s) for s in os.environ.get("PROVISION_ALLREDUCE_SIZES", "1048576,16777216,268435456").split(",")]
        for dtype in (torch.bfloat16, torch.float32):
            for nbytes in sizes:
                n = nbytes // torch.tensor([], dtype=dtype).element_size()
                x = torch.full((n,), float(rank + 1), dtype=dtype, device=dev)
                dist.all_reduce(x)
                sync()
                want = world * (world + 1) / 2
                good = bool((x == want).all().item())
                ok &= good
                iters = 5
                x.fill_(1.0)
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(x)
                sync()
                dt = (time.perf_counter() - t0) / iters
                alg = nbytes / dt / 1e9
                rows.append({"dtype": str(dtype).split(".")[-1], "bytes": nbytes, "correct": good,
                             "us": round(dt * 1e6, 1), "algbw_GBps": round(alg, 3),
                             "busbw_GBps": round(alg * 2 * (world - 1) / world, 3)})
    else:
        import torch.distributed._symmetric_memory as symm_mem
        group = dist.group.WORLD
        if hasattr(symm_mem, "enable_symm_mem_for_group"):   # needed by older torch, a no-op later
            symm_mem.enable_symm_mem_for_group(group.group_name)
        for n in (4096, 1 << 20):
            t = symm_mem.empty(n, device=dev, dtype=torch.bfloat16)
            symm_mem.rendezvous(t, group.group_name)
            t.fill_(float(rank + 1))
            dist.barrier()
            sync()
            torch.ops.symm_mem.two_shot_all_reduce_(t, "sum", group.group_name)
            sync()
            good = bool((t.float() == world * (world + 1) / 2).all().item())
            ok &= good
            rows.append({"dtype": "bfloat16", "elements": n, "correct": good})
    dist.barrier()
    dist.destroy_process_group()
    return {"ok": ok, "rows": rows, "world": world, "backend": backend} if rank == 0 else {"rank": rank}


def free_port():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def run_workers(kind, world, backend, timeout=300):
    port = free_port()
    return wait_agents(start_ranks("collective", [{"op": "collective", "kind": kind, "rank": r, "world": world,
                                                 "port": port, "backend": backend} for r in range(world)]), timeout)


def start_ranks(agent, payloads):
    """One process per rank, each an agent of this bundle in this interpreter (the generation's)."""
    env = dict(os.environ, **SAFE_ENV)
    return [start_agent(sys.executable, agent, p, env=env) for p in payloads]


def wait_agents(procs, timeout):
    """Wait for agent processes started by `start_agent` (e.g. one per rank); the first one's answer. RuntimeError
    names the first that failed."""
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    answers = [answer(p, out, err) for p, (out, err) in zip(procs, outs)]
    failed = [r["error"] for r in answers if "error" in r]
    if failed:
        raise RuntimeError(str(failed[0])[:300])
    return answers[0]


def p_collective(a, name):
    kind = "nccl" if name == "nccl" else "symm"
    backend = a.get("allreduce_backend") or "nccl"
    world = len(a.get("gpus") or []) if backend == "nccl" else int(a.get("world") or 2)
    if backend == "nccl":
        if world < 2:
            return result(name, "skip", "one GPU on this host: no all-reduce across GPUs to test")
        early = need_cuda(name)
        if early:
            return early
        world = min(world, len(torch_facts()["devices"]))
    if kind == "symm":
        try:
            import torch.distributed._symmetric_memory  # noqa: F401
            import torch
            if not hasattr(torch.ops.symm_mem, "two_shot_all_reduce_"):
                raise AttributeError("torch.ops.symm_mem.two_shot_all_reduce_")
        except (ImportError, AttributeError, RuntimeError) as e:
            return result(name, "skip", "this torch has no symmetric-memory two-shot all-reduce (%s)" % e)
    try:
        r = run_workers(kind, world, backend, timeout=int(a.get("timeout") or 300))
    except (RuntimeError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return result(name, "fail", "%d ranks: %s" % (world, e), env=SAFE_ENV)
    figs = {"world": world, "backend": backend, "rows": r["rows"], "env": SAFE_ENV}
    if not r["ok"]:
        bad = [x for x in r["rows"] if not x["correct"]]
        return result(name, "fail", "wrong sum in %d of %d cases" % (len(bad), len(r["rows"])), **figs)
    if kind == "nccl":
        best = max(x["busbw_GBps"] for x in r["rows"])
        return result(name, "pass", "%d ranks, bf16+fp32 sums correct; bus bandwidth up to %.1f GB/s" % (world, best),
                      **figs)
    return result(name, "pass", "%d ranks, two-shot all-reduce sums correct" % world, **figs)


def p_allreduce(a):
    """All-reduce latency at decode sizes per path; the measuring lives in the shipped agent/allreduce.py."""
    backend = a.get("allreduce_backend") or "nccl"
    world = len(a.get("gpus") or []) if backend == "nccl" else int(a.get("world") or 2)
    if backend == "nccl":
        if world < 2:
            return result("allreduce", "skip", "one GPU on this host: no all-reduce across GPUs to measure")
        early = need_cuda("allreduce")
        if early:
            return early
        world = min(world, len(torch_facts()["devices"]))
    cfg = dict(a.get("allreduce") or {}, world=world, backend=backend, port=free_port())
    with tempfile.TemporaryDirectory(prefix="provision-allreduce-") as d:
        timeout, error = int(a.get("timeout") or 600), None
        try:
            wait_agents(start_ranks("allreduce", [{"op": "rank", "config": cfg, "rank": r, "dir": d}
                                                for r in range(world)]), timeout)
        except subprocess.TimeoutExpired:
            error = "still running after %ds (a hung kernel?)" % timeout
        except (RuntimeError, ValueError, IndexError) as e:
            error = str(e)
        return allreduce.finish(d, world, cfg.get("paths"), error)


OPS = {"collective": op_collective}
