"""Triton kernels for the CUDA decode path: a GEMV / skinny GEMM for a few rows (weights streamed once, no
split-K), attention for a few query rows (flash-decoding), RMSNorm with the residual add, SiLU·up, rope with the
KV write, masked softmax; all launched programmatically on Hopper. Imported only where Triton is."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PDL = {"on": False}     # programmatic dependent launch (Hopper on): set by kernels.py


def _launch() -> dict:
    """Launch options every kernel here takes: with PDL, each starts while the previous one drains."""
    return {"PDL": PDL["on"], "launch_pdl": PDL["on"]}


@triton.jit
def _after_previous(PDL: tl.constexpr):
    # launched programmatically: wait until the previous kernel's writes are visible, then let the next kernel's
    # programs launch (they wait the same way), so launch and ramp-up overlap this kernel's tail
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, K, stride_x, stride_w, stride_y, M: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr):
    # y[m, n] = sum_k x[m, k] * w[n, k] for BN rows n of w; K % BK == 0 and N % BN == 0 (checked by the caller).
    # DOT: on tensor cores (M >= 16), else as broadcast products summed in float
    _after_previous(PDL)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rm = tl.arange(0, M)
    w_row = w_ptr + rn[:, None] * stride_w + rk[None, :]                  # [BN, BK]
    x_row = x_ptr + rm[:, None] * stride_x + rk[None, :]                  # [M, BK]
    if DOT:
        acc = tl.zeros((M, BN), dtype=tl.float32)
    else:
        acc = tl.zeros((M, BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        w = tl.load(w_row + k0)
        x = tl.load(x_row + k0)
        if DOT:
            acc += tl.dot(x, tl.trans(w))
        else:
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if DOT:
        y = acc
    else:
        y = tl.sum(acc, axis=2)                                            # [M, BN]
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], y.to(y_ptr.dtype.element_ty))


def skinny(x: Tensor, w: Tensor, bn: int, bk: int, warps: int, dot: bool = False) -> Tensor:
    """x [..., K] with M = x.numel() // K rows (a power of two; >= 16 with dot), w [N, K] → [..., N]."""
    K, N = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, K)
    y = torch.empty(x2.shape[0], N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(N // bn,)](x2, w, y, K, x2.stride(0), w.stride(0), y.stride(0), M=x2.shape[0], BN=bn, BK=bk,
                             DOT=dot, num_warps=warps, **_launch())
    return y.view(*x.shape[:-1], N)


@triton.jit
def _attend_kernel(q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, pm_ptr, pa_ptr, W, T, CHUNK, stride_kh, stride_m, scale,
                   G: tl.constexpr, H: tl.constexpr, HD: tl.constexpr, R: tl.constexpr, BW: tl.constexpr,
                   SPLIT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    # program (kv head c, chunk s): the G*T query rows r = (j, t) of heads c*G + j (contiguous in q [h, T, HD])
    # attend to cache slots [s*CHUNK, s*CHUNK + CHUNK) ∩ [0, W) where mask[t] keeps them; online softmax in
    # float. One chunk: o [T, H, HD] is written; several: (max, sum, acc) partials for _attend_combine_kernel
    _after_previous(PDL)
    c, s = tl.program_id(0), tl.program_id(1)
    r = tl.arange(0, R)
    ok_r = r < G * T
    t = r % T
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + (c * G * T + r)[:, None] * HD + d[None, :], mask=ok_r[:, None], other=0.0)
    m_i = tl.full((R,), float("-inf"), tl.float32)
    l_i = tl.zeros((R,), tl.float32)
    acc = tl.zeros((R, HD), tl.float32)
    kb, vb = k_ptr + c * stride_kh, v_ptr + c * stride_kh
    for w0 in range(s * CHUNK, tl.minimum(s * CHUNK + CHUNK, W), BW):
        col = w0 + tl.arange(0, BW)
        ok_c = col < W
        kt = tl.load(kb + col[:, None] * HD + d[None, :], mask=ok_c[:, None], other=0.0)     # [BW, HD]
        if IEEE:
            sc = tl.dot(q, tl.trans(kt), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(kt))
        keep = tl.load(m_ptr + t[:, None] * stride_m + col[None, :], mask=ok_r[:, None] & ok_c[None, :],
                       other=0) != 0
        sc = tl.where(keep, sc * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)               # a row with nothing kept yet
        p = tl.exp(sc - base[:, None])
        alpha = tl.exp(m_i - base)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(vb + col[:, None] * HD + d[None, :], mask=ok_c[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
    if SPLIT:
        row = (c * tl.num_programs(1) + s) * R + r
        tl.store(pm_ptr + row, m_i)
        tl.store(pm_ptr + tl.num_programs(0) * tl.num_programs(1) * R + row, l_i)
        tl.store(pa_ptr + row[:, None] * HD + d[None, :], acc)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptr + (t * H + c * G + r // T)[:, None] * HD + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=ok_r[:, None])


@triton.jit
def _attend_combine_kernel(pm_ptr, pa_ptr, o_ptr, NS, T, G: tl.constexpr, H: tl.constexpr, HD: tl.constexpr,
                           R: tl.constexpr, PDL: tl.constexpr):
    # kv head c: merge the NS chunks' partials (max, sum, acc) of its rows into o [T, H, HD]
    _after_previous(PDL)
    c = tl.program_id(0)
    r = tl.arange(0, R)
    d = tl.arange(0, HD)
    m = tl.full((R,), float("-inf"), tl.float32)
    l = tl.zeros((R,), tl.float32)
    acc = tl.zeros((R, HD), tl.float32)
    for s in range(0, NS):
        row = (c * NS + s) * R + r
        ms = tl.load(pm_ptr + row)
        m_new = tl.maximum(m, ms)
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        a, b = tl.exp(m - base), tl.exp(ms - base)
        l = l * a + tl.load(pm_ptr + tl.num_programs(0) * NS * R + row) * b
        acc = acc * a[:, None] + tl.load(pa_ptr + row[:, None] * HD + d[None, :]) * b[:, None]
        m = m_new
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(o_ptr + (r % T * H + c * G + r // T)[:, None] * HD + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(r < G * T)[:, None])


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, chunk: int) -> Tensor:
    """Attention for a few query rows, GQA without repeating K/V: q [1, h, T, hd] (contiguous), k, v [1, kv, W, hd]
    views of the caches (slots contiguous), mask [T, W] bool. Each kv head's span is cut in `chunk`-slot pieces,
    one program each (merged by a second kernel when there are several; chunk: a multiple of 64). Returns
    [1, T, h, hd]."""
    _, h, T, hd = q.shape
    kv, W = k.shape[1], mask.shape[-1]
    G, R = h // kv, max(16, triton.next_power_of_2(h // kv * T))
    ns = triton.cdiv(W, chunk)
    o = torch.empty(1, T, h, hd, dtype=q.dtype, device=q.device)
    pm = torch.empty(2 * kv * ns * R if ns > 1 else 1, dtype=torch.float32, device=q.device)
    pa = torch.empty(kv * ns * R * hd if ns > 1 else 1, dtype=torch.float32, device=q.device)
    m8 = mask.view(torch.uint8)
    _attend_kernel[(kv, ns)](q, k, v, m8, o, pm, pa, W, T, chunk, k.stride(1), m8.stride(0), hd ** -0.5, G=G, H=h,
                             HD=hd, R=R, BW=64, SPLIT=ns > 1, IEEE=q.dtype == torch.float32, num_warps=4,
                             **_launch())
    if ns > 1:
        _attend_combine_kernel[(kv,)](pm, pa, o, ns, T, G=G, H=h, HD=hd, R=R, num_warps=4, **_launch())
    return o


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, h_ptr, y_ptr, D, eps, ADD: tl.constexpr, BD: tl.constexpr,
                     PDL: tl.constexpr):
    # one row: h = x (+ r); y = w * to_dtype(h * rsqrt(mean(h²) + eps)), the float math of RMSNorm.forward
    _after_previous(PDL)
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
                                         BD=triton.next_power_of_2(D), num_warps=8, **_launch())
    return y if residual is None else (h, y)


@triton.jit
def _silu_mul_kernel(gu_ptr, y_ptr, Hd, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # gu: [rows, 2*Hd] = [gate | up]; y: [rows, Hd] = silu(gate) * up
    _after_previous(PDL)
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
    _silu_mul_kernel[(g2.shape[0], triton.cdiv(Hd, 1024))](g2, y, Hd, BLOCK=1024, num_warps=4, **_launch())
    return y.view(*gu.shape[:-1], Hd)


@triton.jit
def _rope_kv_kernel(qkv_ptr, rope_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, T, S,
                    H: tl.constexpr, KV: tl.constexpr, HD: tl.constexpr, PDL: tl.constexpr):
    # program (t, head) of qkv [T, H+2KV, HD]: q and k heads rotated (rotate-half), q → q[head, t],
    # k → k_cache[head-H, slot[t]], v → v_cache[head-H-KV, slot[t]]
    _after_previous(PDL)
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
                                k_cache.shape[2], H=heads - 2 * kv, KV=kv, HD=hd, num_warps=1, **_launch())
    return q


@triton.jit
def _masked_softmax_kernel(s_ptr, m_ptr, p_ptr, T, W, scale, BW: tl.constexpr, PDL: tl.constexpr):
    # row r of scores s [rows, W] (rows ordered (..., t)): p = softmax(where(mask[t], s * scale, -inf)) in float
    _after_previous(PDL)
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
                                               BW=triton.next_power_of_2(W), num_warps=4 if W <= 2048 else 8,
                                               **_launch())
    return p
