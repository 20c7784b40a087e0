"""Triton kernels for the CUDA decode path: a GEMV / skinny GEMM for a few rows (weights streamed once,
no split-K), RMSNorm with the residual add fused, and SiLU(gate)·up. Imported only where Triton is."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, K, stride_x, stride_w, stride_y,
                   M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # y[m, n] = sum_k x[m, k] * w[n, k] for BN rows n of w; K % BK == 0 and N % BN == 0 (checked by the caller)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    w_row = w_ptr + rn[:, None] * stride_w + rk[None, :]                  # [BN, BK]
    acc = tl.zeros((M, BN, BK), dtype=tl.float32)
    rm = tl.arange(0, M)
    x_row = x_ptr + rm[:, None] * stride_x + rk[None, :]                  # [M, BK]
    for k0 in range(0, K, BK):
        w = tl.load(w_row + k0).to(tl.float32)
        x = tl.load(x_row + k0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
    y = tl.sum(acc, axis=2)                                                # [M, BN]
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], y.to(y_ptr.dtype.element_ty))


def skinny(x: Tensor, w: Tensor, bn: int, bk: int, warps: int) -> Tensor:
    """x [..., K] with M = x.numel() // K rows (a power of two), w [N, K] → [..., N]."""
    K, N = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, K)
    y = torch.empty(x2.shape[0], N, dtype=x.dtype, device=x.device)
    _skinny_kernel[(N // bn,)](x2, w, y, K, x2.stride(0), w.stride(0), y.stride(0),
                               M=x2.shape[0], BN=bn, BK=bk, num_warps=warps)
    return y.view(*x.shape[:-1], N)


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, h_ptr, y_ptr, D, eps, ADD: tl.constexpr, BD: tl.constexpr):
    # one row: h = x (+ r); y = w * to_dtype(h * rsqrt(mean(h²) + eps)), the float math of RMSNorm.forward
    row = tl.program_id(0)
    c = tl.arange(0, BD)
    ok = c < D
    h = tl.load(x_ptr + row * D + c, mask=ok, other=0.0)
    if ADD:
        h = (h.to(tl.float32) + tl.load(r_ptr + row * D + c, mask=ok, other=0.0).to(tl.float32)).to(h.dtype)
        tl.store(h_ptr + row * D + c, h, mask=ok)
    hf = h.to(tl.float32)
    n = (hf * tl.rsqrt(tl.sum(hf * hf, axis=0) / D + eps)).to(h.dtype).to(tl.float32)
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * D + c, (w * n).to(y_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    """RMSNorm of x (or of h = x + residual, returned too) over the last dim, one kernel."""
    D = x.shape[-1]
    xc = x.contiguous()
    y = torch.empty_like(xc)
    h = torch.empty_like(xc) if residual is not None else xc
    rc = residual.contiguous() if residual is not None else xc
    _rms_norm_kernel[(xc.numel() // D,)](xc, rc, weight, h, y, D, eps, ADD=residual is not None,
                                         BD=triton.next_power_of_2(D), num_warps=8)
    return y if residual is None else (h, y)


@triton.jit
def _silu_mul_kernel(gu_ptr, y_ptr, Hd, BLOCK: tl.constexpr):
    # gu: [rows, 2*Hd] = [gate | up]; y: [rows, Hd] = silu(gate) * up
    row, blk = tl.program_id(0), tl.program_id(1)
    c = blk * BLOCK + tl.arange(0, BLOCK)
    ok = c < Hd
    g = tl.load(gu_ptr + row * 2 * Hd + c, mask=ok, other=0.0)
    u = tl.load(gu_ptr + row * 2 * Hd + Hd + c, mask=ok, other=0.0)
    s = (g.to(tl.float32) * tl.sigmoid(g.to(tl.float32))).to(g.dtype)      # silu in float, rounded as torch's
    tl.store(y_ptr + row * Hd + c, (s.to(tl.float32) * u.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=ok)


def silu_mul(gu: Tensor) -> Tensor:
    Hd = gu.shape[-1] // 2
    g2 = gu.contiguous().view(-1, 2 * Hd)
    y = torch.empty(g2.shape[0], Hd, dtype=gu.dtype, device=gu.device)
    _silu_mul_kernel[(g2.shape[0], triton.cdiv(Hd, 1024))](g2, y, Hd, BLOCK=1024, num_warps=4)
    return y.view(*gu.shape[:-1], Hd)


@triton.jit
def _rope_kv_kernel(qkv_ptr, rope_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, T, S,
                    H: tl.constexpr, KV: tl.constexpr, HD: tl.constexpr):
    # program (t, head) of qkv [T, H+2KV, HD]: q and k heads rotated (rotate-half), q → q[head, t],
    # k → k_cache[head-H, slot[t]], v → v_cache[head-H-KV, slot[t]]
    t, head = tl.program_id(0), tl.program_id(1)
    half = tl.arange(0, HD // 2)
    src = qkv_ptr + (t * (H + 2 * KV) + head) * HD
    a = tl.load(src + half).to(tl.float32)
    b = tl.load(src + HD // 2 + half).to(tl.float32)
    if head < H + KV:
        r = rope_ptr + t * 2 * HD
        cos_a, cos_b = tl.load(r + half).to(tl.float32), tl.load(r + HD // 2 + half).to(tl.float32)
        sin_a, sin_b = tl.load(r + HD + half).to(tl.float32), tl.load(r + HD + HD // 2 + half).to(tl.float32)
        a, b = a * cos_a - b * sin_a, b * cos_b + a * sin_b
    slot = tl.load(slot_ptr + t)
    if head < H:
        dst = q_ptr + (head * T + t) * HD
    elif head < H + KV:
        dst = k_ptr + ((head - H) * S + slot) * HD
    else:
        dst = v_ptr + ((head - H - KV) * S + slot) * HD
    tl.store(dst + half, a.to(q_ptr.dtype.element_ty))
    tl.store(dst + HD // 2 + half, b.to(q_ptr.dtype.element_ty))


def rope_kv(qkv: Tensor, rope: Tensor, slots: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
    """qkv [1, T, h+2kv, hd]; rope [T, 2, hd]; caches [1, kv, S, hd] (contiguous) → q [1, h, T, hd]."""
    _, T, heads, hd = qkv.shape
    kv = k_cache.shape[1]
    q = torch.empty(1, heads - 2 * kv, T, hd, dtype=qkv.dtype, device=qkv.device)
    _rope_kv_kernel[(T, heads)](qkv.contiguous(), rope.contiguous(), slots, q, k_cache, v_cache, T,
                                k_cache.shape[2], H=heads - 2 * kv, KV=kv, HD=hd, num_warps=1)
    return q


@triton.jit
def _masked_softmax_kernel(s_ptr, m_ptr, p_ptr, T, W, scale, BW: tl.constexpr):
    # row r of scores s [rows, W] (rows ordered (..., t)): p = softmax(where(mask[t], s * scale, -inf)) in float
    r = tl.program_id(0)
    c = tl.arange(0, BW)
    ok = c < W
    keep = tl.load(m_ptr + (r % T) * W + c, mask=ok, other=0) != 0
    x = tl.load(s_ptr + r * W + c, mask=ok, other=0.0).to(tl.float32) * scale
    x = tl.where(keep & ok, x, float("-inf"))
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(p_ptr + r * W + c, (e / tl.sum(e, axis=0)).to(p_ptr.dtype.element_ty), mask=ok)


def masked_softmax(s: Tensor, mask: Tensor, scale: float) -> Tensor:
    """s [..., T, W] scores; mask [T, W] bool → softmax over W of the kept, scaled scores, in s's dtype."""
    T, W = mask.shape
    sc = s.contiguous()
    p = torch.empty_like(sc)
    _masked_softmax_kernel[(sc.numel() // W,)](sc, mask.contiguous().view(torch.uint8), p, T, W, scale,
                                               BW=triton.next_power_of_2(W), num_warps=4 if W <= 2048 else 8)
    return p
