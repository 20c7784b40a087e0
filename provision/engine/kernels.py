"""Which implementation runs each hot op of a forward: torch everywhere; on CUDA without autograd, Triton's
fused RMSNorm and SiLU·up, and wherever a timing at load time found it faster: its GEMV (per (M, N, K)) and its
attention for a few rows (per span); on CPU, bfloat16 weights laid out once for oneDNN.
PROVISION_ENGINE_TRITON=0 keeps torch alone; PROVISION_ENGINE_PDL=0, PDL."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

CONFIGS = {1: [(1, 2048, 4), (2, 2048, 8), (2, 1024, 4), (4, 1024, 8), (4, 512, 4), (8, 512, 4), (8, 256, 4),
               (16, 256, 8)],                                                     # (rows, k-chunk, warps)
           2: [(4, 256, 4), (8, 256, 8), (4, 512, 8)],
           4: [(2, 256, 4), (4, 256, 8), (4, 128, 4)],
           8: [(2, 128, 4), (4, 128, 8), (8, 64, 8)],
           16: [(16, 256, 4, True), (16, 512, 4, True), (32, 256, 4, True), (16, 128, 4, True),   # tensor cores
                (16, 1024, 8, True), (32, 512, 8, True), (64, 256, 8, True),
                (2, 64, 4), (4, 64, 8), (4, 128, 8)]}       # rows: the next power of two of a product's rows
CHUNKS = (64, 128, 256, 512, 1024)   # attention: slots per program (one program per kv head and chunk)
CHOICE: dict = {}       # (M, N, K, dtype) → config where Triton beat cuBLAS at load time
ATTN: dict = {}         # (rows, kv heads, head dim, dtype, span) → chunk where Triton beat bmm-softmax-bmm
TIMINGS: list = []      # what each tuning measured, for the bench
_state = {"on": os.environ.get("PROVISION_ENGINE_TRITON", "1") != "0", "tk": None,
          "pdl": os.environ.get("PROVISION_ENGINE_PDL", "1") != "0"}


def use_triton(on: bool):
    _state["on"] = on


def use_pdl(on: bool):
    """Programmatic dependent launch for the Triton kernels (each starts while the previous drains), where the
    GPU has it (compute capability 9.0 on)."""
    _state["pdl"] = on
    if _state["tk"]:
        _state["tk"].PDL["on"] = on and os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() \
            and torch.cuda.get_device_capability() >= (9, 0)


def _tk():
    """The Triton kernels module, or None where Triton is absent or turned off."""
    if not _state["on"]:
        return None
    if _state["tk"] is None:
        try:
            from . import triton_kernels
            _state["tk"] = triton_kernels
            use_pdl(_state["pdl"])
        except Exception:  # noqa: BLE001 - no Triton (or no compiler for it): torch alone
            _state["tk"] = False
    return _state["tk"] or None


def _fast(x: Tensor):
    return _tk() if x.is_cuda and not torch.is_grad_enabled() else None


def linear(x: Tensor, w: Tensor) -> Tensor:
    packed = getattr(w, "onednn", None)                   # (version, layout), set by prepack: CPU, bfloat16
    if packed is not None and packed[0] == w._version and not torch.is_grad_enabled():   # not written since
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed[1], None, "none", [], "")
    tk = _fast(x)
    cfg = CHOICE.get((x.numel() // x.shape[-1], *w.shape, x.dtype)) if tk else None
    return tk.skinny(x, w, *cfg) if cfg else F.linear(x, w)


def tree_ops(device: torch.device):
    """The Triton kernels that build the speculative tree (topk_logprob, expand, tree) on CUDA, else None."""
    return _tk() if device.type == "cuda" else None


def _cpu_fused(dtype, mask: Tensor) -> bool:
    return not mask.is_cuda and dtype != torch.float32 and mask.dim() == 2 and not torch.is_grad_enabled()


def attention_mask(mask: Tensor, dtype, group: int) -> Tensor:
    """The mask [T, W] as `attention` takes it, built once per forward: for CPU's fused attention below float32,
    additive (0 / -inf in `dtype`, as torch turns a boolean mask) and repeated for the `group` query heads that
    share a KV head, rows (head j, token t); else the boolean mask itself."""
    if mask.dtype != torch.bool or not _cpu_fused(dtype, mask):
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf")).repeat(group, 1)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor):
    """q [1, h, T, hd], k/v [1, kv, W, hd] cache views, mask [T, W] → [1, T, h, hd] from one Triton attention
    (two with a split span) where it was measured faster than bmm, softmax, bmm; on CPU below float32, torch's
    fused attention over each KV head's group of query rows (mask from `attention_mask`; each query row reduced
    on its own, in one order for one span); else None."""
    if not q.is_cuda and _cpu_fused(q.dtype, mask):
        B, h, T, hd = q.shape
        g = h // k.shape[1]
        mask = attention_mask(mask, q.dtype, g)                # as it came when already prepared
        y = F.scaled_dot_product_attention(q.reshape(B, k.shape[1], g * T, hd), k, v, attn_mask=mask)
        return y.view(B, h, T, hd).transpose(1, 2)
    tk = _fast(q)
    if not tk or q.shape[0] != 1 or mask.dim() != 2 or k.stride(-2) != k.shape[-1]:
        return None
    chunk = ATTN.get((q.shape[1] // k.shape[1] * q.shape[2], k.shape[1], q.shape[-1], q.dtype, _bucket(mask.shape[-1])))
    return tk.attend(q.contiguous(), k, v, mask.contiguous(), chunk) if chunk else None


def gqa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Grouped-query attention without repeating K/V: the g query heads sharing a KV head become g*T rows.

    q: [B, h, T, hd]; k, v: [B, kv, W, hd]; mask: [T, W] or [B, 1, T, W] bool. Returns [B, T, h, hd]."""
    y = attention(q, k, v, mask)                                      # one Triton kernel where it won
    if y is not None:
        return y
    B, h, T, hd = q.shape
    kv = k.shape[1]
    g = h // kv
    qg = q.reshape(B, kv, g * T, hd)                                  # head kv*g + j → group kv, rows (j, t)
    s = (qg @ k.transpose(-1, -2)).view(B, kv, g, T, -1)
    p = masked_softmax(s, mask if mask.dim() == 2 else mask.unsqueeze(2), hd ** -0.5)   # mask [T, W] or [B,1,1,T,W]
    y = p.view(B, kv, g * T, -1) @ v                                  # [B, kv, g*T, hd]
    return y.view(B, h, T, hd).transpose(1, 2)


def _bucket(W: int) -> int:
    """The tuned span covering W: a power of two from 256."""
    return max(256, 1 << (W - 1).bit_length())


def prepack(modules: list, rows: int):
    """Lay every bfloat16 nn.Linear weight of `modules` (on CPU) out once for oneDNN's GEMM at `rows` rows: at 16
    rows about 1.6x faster than torch's own call, which lays the weight out again at every product. Each product's
    rows stay independent of one another. Where oneDNN has no bfloat16 GEMM (or no such op), nothing changes."""
    try:
        usable = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        usable = False
    for m in modules if usable else []:
        for mod in m.modules():
            w = getattr(mod, "weight", None)
            if isinstance(mod, torch.nn.Linear) and w.dtype == torch.bfloat16 and w.device.type == "cpu":
                w.onednn = (w._version, torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows))


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None, out: Tensor | None = None):
    """weight * RMSNorm(h) in float, h = x (+ residual); returns (h, normed) when residual is given. `out` (batch 1,
    x's shape, rows at a stride): where the normed rows go, a column block of a wider tensor."""
    tk = _fast(x)
    if tk and (out is None or out.shape[:-2].numel() == 1):
        return tk.rms_norm(x, weight, eps, residual, out)
    h = x if residual is None else x + residual
    if h.is_cuda:
        y = weight * F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype)
    else:                                   # the same: on CPU torch normalizes below float32 in float, then rounds
        y = weight * F.rms_norm(h, (h.shape[-1],), eps=eps)
    y = y if out is None else out.copy_(y)
    return y if residual is None else (h, y)


def argmax(x: Tensor) -> Tensor:
    """Index of the first maximum along the last dim. On CPU through max(dim), which keeps argmax's first-index
    contract and runs about 3x faster over a vocabulary (bfloat16 or float32)."""
    return x.argmax(-1) if x.is_cuda else x.max(-1).indices


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


def _race(fn, cand, items: list, cfgs) -> tuple:
    """Seconds per fn(item) over `items`, and the fastest cfg whose cand(item, cfg) agrees with fn(item) and beats
    it (or None)."""
    base = _seconds(fn, items)
    best, best_t = None, base
    for cfg in cfgs:
        try:
            if not _agrees(cand(items[0], cfg), fn(items[0])):
                continue
        except triton_errors() as e:       # a config this GPU's compiler refuses (resources) is no candidate
            TIMINGS.append({"kind": "refused", "config": list(cfg), "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        t = _seconds(lambda it: cand(it, cfg), items)
        if t < best_t:
            best, best_t = cfg, t
    return base, best, best_t


def triton_errors() -> tuple:
    """What Triton raises when it cannot compile or launch a kernel config (out of resources, say)."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources
    return CompilationError, OutOfResources


def _done() -> set:
    """(kind, m, n, k, dtype) of every race already run in this process."""
    return {(t["kind"], t.get("m"), t.get("n"), t.get("k"), getattr(torch, t.get("dtype", ""), None)) for t in TIMINGS}


def rows_bucket(M: int) -> int:
    """The CONFIGS key of a product of M rows: the next power of two (the kernel pads the rows)."""
    return 1 << (M - 1).bit_length()


def _cfgs(M: int, N: int, K: int, dt) -> list:
    """The GEMV configs that fit (M, N, K): tile sizes dividing the shape; tensor cores for half types only."""
    return [c for c in CONFIGS.get(rows_bucket(M), []) if not N % c[0] and not K % c[1]
            and (len(c) == 3 or dt != torch.float32)]


def _record(kind: str, M: int, N: int, K: int, dt, base: float, best, best_t: float):
    TIMINGS.append({"kind": kind, "m": M, "n": N, "k": K, "dtype": str(dt).removeprefix("torch."),
                    "torch_us": round(base * 1e6, 2),
                    "best_us": round(best_t * 1e6, 2), "triton": list(best) if best else None})


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
    done = _done()
    for (N, K, dt), ws in by_shape.items():
        for M in rows:
            if ("gemv", M, N, K, dt) in done:
                continue
            x = torch.randn(M, K, dtype=dt, device=ws[0].device)
            base, best, best_t = _race(lambda w: F.linear(x, w), lambda w, c: tk.skinny(x, w, *c), ws[:8],
                                       _cfgs(M, N, K, dt))
            if best:
                CHOICE[(M, N, K, dt)] = best
            _record("gemv", M, N, K, dt, base, best, best_t)


@torch.inference_mode()
def tune_attention(heads: int, kv: int, hd: int, dtype, device, rows, spans):
    """Time attention for T = each of `rows` query tokens over each span (a power of two) — bmm, masked softmax,
    bmm against the Triton kernel at each chunk size — on random caches; record in ATTN the chunks that won."""
    tk = _tk() if torch.device(device).type == "cuda" else None
    if tk is None:
        return
    for T in rows:
        G = heads // kv * T
        for W in spans:
            key = (G, kv, hd, dtype, W)
            if G > 64 or ("attention", G, W, hd, dtype) in _done():
                continue
            q = torch.randn(1, heads, T, hd, dtype=dtype, device=device)
            caches = [torch.randn(2, 1, kv, W, hd, dtype=dtype, device=device) for _ in range(8)]
            mask = torch.arange(W, device=device)[None, :] <= W - 64 + torch.arange(T, device=device)[:, None]
            base, best, best_t = _race(lambda c: gqa_attention(q, c[0], c[1], mask),
                                       lambda c, ch: tk.attend(q, c[0], c[1], mask, ch[0]), caches,
                                       [(ch,) for ch in CHUNKS if ch <= W])
            if best:
                ATTN[key] = best[0]
            _record("attention", G, W, hd, dtype, base, best, best_t)   # (kv heads: one model's)
