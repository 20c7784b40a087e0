"""Which implementation runs each hot op of a forward: torch everywhere; on CUDA without autograd, Triton's
fused RMSNorm and SiLU·up, and its GEMV wherever a timing at load time beat cuBLAS for that (M, N, K).
PROVISION_ENGINE_TRITON=0 (or `use_triton(False)`) keeps torch alone."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

CONFIGS = {1: [(1, 2048, 4), (2, 2048, 8), (2, 1024, 4), (4, 1024, 8), (4, 512, 4), (8, 512, 4), (8, 256, 4),
               (16, 256, 8)],                                                     # (rows, k-chunk, warps)
           2: [(4, 256, 4), (8, 256, 8), (4, 512, 8)],
           4: [(2, 256, 4), (4, 256, 8), (4, 128, 4)]}
CHOICE: dict = {}       # (M, N, K, dtype) → config where Triton beat cuBLAS at load time
TIMINGS: list = []      # what each tuning measured, for the bench
_state = {"on": os.environ.get("PROVISION_ENGINE_TRITON", "1") != "0", "tk": None}


def use_triton(on: bool):
    _state["on"] = on


def _tk():
    """The Triton kernels module, or None where Triton is absent or turned off."""
    if not _state["on"]:
        return None
    if _state["tk"] is None:
        try:
            from . import triton_kernels
            _state["tk"] = triton_kernels
        except Exception:  # noqa: BLE001 - no Triton (or no compiler for it): torch alone
            _state["tk"] = False
    return _state["tk"] or None


def _fast(x: Tensor):
    return _tk() if x.is_cuda and not torch.is_grad_enabled() else None


def linear(x: Tensor, w: Tensor) -> Tensor:
    tk = _fast(x)
    cfg = CHOICE.get((x.numel() // x.shape[-1], *w.shape, x.dtype)) if tk else None
    return tk.skinny(x, w, *cfg) if cfg else F.linear(x, w)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    """weight * RMSNorm(h) in float, h = x (+ residual); returns (h, normed) when residual is given."""
    tk = _fast(x)
    if tk:
        return tk.rms_norm(x, weight, eps, residual)
    h = x if residual is None else x + residual
    y = weight * F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype)
    return y if residual is None else (h, y)


def silu_mul(gu: Tensor) -> Tensor:
    """[..., 2H] = [gate | up] → silu(gate) * up."""
    tk = _fast(gu)
    if tk:
        return tk.silu_mul(gu)
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def rope_into_cache(qkv: Tensor, rope: Tensor, slots: Tensor, k_cache: Tensor, v_cache: Tensor):
    """One kernel for batch 1: rotate q and k (qkv [1, T, h+2kv, hd], rope [T, 2, hd]), write k and v into the
    caches at `slots`, return q [1, h, T, hd]. None where it does not apply (the caller does it with torch)."""
    tk = _fast(qkv)
    hd = qkv.shape[-1]
    if not tk or qkv.shape[0] != 1 or hd & (hd - 1) or rope.dtype != qkv.dtype:
        return None
    return tk.rope_kv(qkv, rope, slots, k_cache, v_cache)


def masked_softmax(s: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention probabilities: softmax over the last dim of s * scale where mask (broadcast over s's leading
    dims: [T, W] or [B, 1, 1, T, W]), computed in float, returned in s's dtype."""
    tk = _fast(s)
    if tk and mask.dim() == 2:
        return tk.masked_softmax(s, mask, scale)
    return torch.softmax(torch.where(mask, s * scale, float("-inf")), dim=-1, dtype=torch.float32).to(s.dtype)


def _agrees(y: Tensor, ref: Tensor) -> bool:
    """Within bf16 rounding of the reference: ‖y − ref‖ / ‖ref‖ < 1e-2."""
    return bool(((y.float() - ref.float()).norm() / ref.float().norm()) < 1e-2)


def _seconds(fn, weights: list, reps: int = 5) -> float:
    """Seconds per fn(w), from replays of one CUDA graph of fn over distinct weights (none served from L2;
    no launch gaps, as in the engine's own graphs)."""
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        for w in weights:
            fn(w)                                   # compile, library handles
    main.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for w in weights:
            fn(w)
    graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / (reps * len(weights))


@torch.inference_mode()
def tune(modules: list, rows=(1,)):
    """Time cuBLAS and each Triton GEMV config on every weight shape of `modules` (their nn.Linear weights)
    at M = each of `rows`; record in CHOICE the configs that won. Off CUDA or without Triton: nothing."""
    by_shape: dict = {}
    for m in modules:
        for mod in m.modules():
            if isinstance(mod, torch.nn.Linear) and mod.weight.is_cuda:
                by_shape.setdefault((*mod.weight.shape, mod.weight.dtype), []).append(mod.weight)
    tk = _tk() if by_shape else None
    if tk is None:
        return
    for (N, K, dt), ws in by_shape.items():
        ws = ws[:8]
        for M in rows:
            if (M, N, K, dt) in CHOICE or any(t["m"] == M and t["n"] == N and t["k"] == K for t in TIMINGS):
                continue
            x = torch.randn(M, K, dtype=dt, device=ws[0].device)
            base = _seconds(lambda w: F.linear(x, w), ws)
            best, best_t = None, base
            for bn, bk, warps in CONFIGS.get(M, []):
                if N % bn or K % bk or not _agrees(tk.skinny(x, ws[0], bn, bk, warps), F.linear(x, ws[0])):
                    continue
                t = _seconds(lambda w: tk.skinny(x, w, bn, bk, warps), ws)
                if t < best_t:
                    best, best_t = (bn, bk, warps), t
            if best:
                CHOICE[(M, N, K, dt)] = best
            TIMINGS.append({"m": M, "n": N, "k": K, "cublas_us": round(base * 1e6, 2),
                            "best_us": round(best_t * 1e6, 2), "triton": list(best) if best else None})
