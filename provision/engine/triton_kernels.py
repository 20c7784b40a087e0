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
def _gemv_kernel(x_ptr, w_ptr, y_ptr, K, MR, stride_x, stride_w, stride_y, M: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr):
    # y[m, n] = sum_k x[m, k] * w[n, k] for BN rows n of w and the MR <= M rows m of x; K % BK == 0 and N % BN == 0
    # (checked by the caller). DOT: on tensor cores (M >= 16), else as broadcast products summed in float
    _after_previous(PDL)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rm = tl.arange(0, M)
    w_row = w_ptr + rn[:, None] * stride_w + rk[None, :]                  # [BN, BK]
    x_row = x_ptr + tl.minimum(rm, MR - 1)[:, None] * stride_x + rk[None, :]   # [M, BK]; padding rows repeat
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
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=(rm < MR)[:, None])


def skinny(x: Tensor, w: Tensor, bn: int, bk: int, warps: int, dot: bool = False) -> Tensor:
    """x [..., K] with M = x.numel() // K rows (computed as the next power of two; >= 16 with dot), w [N, K]
    → [..., N]."""
    K, N = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(N // bn,)](x2, w, y, K, M, x2.stride(0), w.stride(0), y.stride(0), M=triton.next_power_of_2(M),
                             BN=bn, BK=bk, DOT=dot, num_warps=warps, **_launch())
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
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, h_ptr, y_ptr, D, stride_y, eps, ADD: tl.constexpr, BD: tl.constexpr,
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
    tl.store(y_ptr + row * stride_y + c, (w * n).to(y_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None, out: Tensor | None = None):
    """RMSNorm of x (or of h = x + residual, returned too) over the last dim, one kernel; written into `out`
    when given (x's shape, rows at a stride: a column block of a wider tensor)."""
    D = x.shape[-1]
    xc = x.contiguous()
    y = torch.empty_like(xc) if out is None else out
    h = torch.empty_like(xc) if residual is not None else xc
    rc = residual.contiguous() if residual is not None else xc
    _rms_norm_kernel[(xc.numel() // D,)](xc, rc, weight, h, y, D, y.stride(-2) if y.dim() > 1 else D, eps,
                                         ADD=residual is not None, BD=triton.next_power_of_2(D), num_warps=8,
                                         **_launch())
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


# ---- the speculative tree's bookkeeping: one kernel where torch takes a dozen small ones --------------------

@triton.jit
def _topk_logprob_kernel(x_ptr, V, stride_x, val_ptr, idx_ptr, K: tl.constexpr, BV: tl.constexpr,
                         PDL: tl.constexpr):
    # row r of x [R, V]: the K largest log-probs (log_softmax in float), ordered by (value desc, index asc)
    _after_previous(PDL)
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_x
    c = tl.arange(0, BV)
    m_v = tl.full((BV,), float("-inf"), tl.float32)
    s_v = tl.zeros((BV,), tl.float32)
    for v0 in range(0, V, BV):                                   # online max and sum, lane by lane
        x = tl.load(x_row + v0 + c, mask=v0 + c < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_v, x)
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_v = s_v * tl.exp(m_v - base) + tl.exp(x - base)
        m_v = m_new
    mx = tl.max(m_v, axis=0)
    log_sum = tl.log(tl.sum(s_v * tl.exp(m_v - mx), axis=0))
    pv = tl.max(tl.full((BV,), float("inf"), tl.float32), axis=0)  # the previous pick: (value, index)
    pi = tl.min(tl.full((BV,), -1, tl.int32), axis=0)
    for k in tl.static_range(K):
        bv = tl.max(tl.full((BV,), float("-inf"), tl.float32), axis=0)
        bi = tl.min(tl.full((BV,), 2147483647, tl.int32), axis=0)
        for v0 in range(0, V, BV):
            idx = v0 + c
            x = tl.load(x_row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            after = (idx < V) & ((x < pv) | ((x == pv) & (idx > pi)))     # strictly after the previous pick
            xa = tl.where(after, x, float("-inf"))
            cm = tl.max(xa, axis=0)
            ci = tl.min(tl.where(after & (xa == cm), idx, 2147483647), axis=0)
            take = (cm > bv) | (bi == 2147483647)                          # an earlier chunk wins ties
            bv, bi = tl.where(take, cm, bv), tl.where(take, ci, bi)
        tl.store(val_ptr + row * K + k, (bv - mx) - log_sum)
        tl.store(idx_ptr + row * K + k, tl.minimum(bi, V - 1).to(tl.int64))
        pv, pi = bv, bi


def topk_logprob(x: Tensor, k: int) -> tuple:
    """x [R, V] logits → (values [R, k] float32, indices [R, k]) of log_softmax(x.float()).topk(k): one program
    a row, k + 1 passes over it; over 8192 entries (a row per program gets slow), torch's kernels."""
    R, V = x.shape
    if V > 8192:
        return torch.log_softmax(x.float(), -1).topk(k)
    val = torch.empty(R, k, dtype=torch.float32, device=x.device)
    idx = torch.empty(R, k, dtype=torch.long, device=x.device)
    _topk_logprob_kernel[(R,)](x, V, x.stride(0), val, idx, K=k, BV=min(1024, triton.next_power_of_2(V)),
                               num_warps=4, **_launch())
    return val, idx


@triton.jit
def _expand_kernel(cs_ptr, ci_ptr, score_ptr, beam_ptr, d2t_ptr, ctok_ptr, cscore_ptr, cpar_ptr, base,
                   nscore_ptr, ntok_ptr, nbeam_ptr, npar_ptr, h_ptr, stride_h, hid_ptr, H, mask_ptr, stride_m, col0,
                   own0, P: tl.constexpr, K: tl.constexpr, ROOT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                   SK: tl.constexpr, BSK: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr):
    # one level of the draft tree: the P beams' K children (log-probs cs [P, K], draft ids ci [P, K]) become
    # candidates base.. (target id, path score, parent candidate); the K best children (value desc, index asc)
    # become the beams: score, target id, candidate index, row of their parent; their draft state h[parent row];
    # their mask rows' scratch part [col0, col0 + SK): the parent's (none at the root) and their own slot own0 + k
    _after_previous(PDL)
    j = tl.arange(0, BC)
    ok = j < P * K
    r = j // K
    child = tl.load(score_ptr + r, mask=ok, other=0.0) + tl.load(cs_ptr + j, mask=ok, other=0.0)
    child = tl.where(ok, child, float("-inf"))
    d = tl.load(ci_ptr + j, mask=ok, other=0)
    tok = d + tl.load(d2t_ptr + d, mask=ok, other=0)
    par = tl.load(beam_ptr + r, mask=ok, other=0)
    i = tl.arange(0, BC)[:, None]
    other = tl.where(i < P * K, tl.load(score_ptr + i // K, mask=i < P * K, other=0.0)
                     + tl.load(cs_ptr + i, mask=i < P * K, other=0.0), float("-inf"))
    ahead = ((other > child[None, :]) | ((other == child[None, :]) & (i < j[None, :]))) & (i < P * K)
    rank = tl.sum(ahead.to(tl.int32), axis=0)
    k = tl.arange(0, BK)
    okk = k < K
    tl.debug_barrier()                                           # every read of score and beam is done
    tl.store(npar_ptr + k, tl.zeros((BK,), tl.int64), mask=okk)   # defined even for NaN scores (no rank k)
    tl.store(ntok_ptr + k, tl.zeros((BK,), tl.int64), mask=okk)
    tl.store(nbeam_ptr + k, tl.zeros((BK,), tl.int64), mask=okk)
    tl.debug_barrier()
    tl.store(ctok_ptr + base + j, tok, mask=ok)
    tl.store(cscore_ptr + base + j, child, mask=ok)
    tl.store(cpar_ptr + base + j, par, mask=ok)
    sel = ok & (rank < K)
    tl.store(nscore_ptr + rank, child, mask=sel)
    tl.store(ntok_ptr + rank, tok, mask=sel)
    tl.store(nbeam_ptr + rank, base + j, mask=sel)
    tl.store(npar_ptr + rank, r, mask=sel)
    tl.debug_barrier()
    pr = tl.load(npar_ptr + k, mask=okk, other=0)
    for h0 in range(0, H, BH):
        hh = h0 + tl.arange(0, BH)
        okh = okk[:, None] & (hh < H)[None, :]
        tl.store(hid_ptr + k[:, None] * H + hh[None, :], tl.load(h_ptr + pr[:, None] * stride_h + hh[None, :],
                                                                 mask=okh), mask=okh)
    a = tl.arange(0, BSK)
    oka = okk[:, None] & (a < SK)[None, :]
    if ROOT:
        old = tl.zeros((BK, BSK), tl.int32) != 0
    else:
        old = tl.load(mask_ptr + pr[:, None] * stride_m + col0 + a[None, :], mask=oka, other=0) != 0
    tl.debug_barrier()
    new = old | (a[None, :] == own0 + k[:, None])
    tl.store(mask_ptr + k[:, None] * stride_m + col0 + a[None, :], new.to(tl.uint8), mask=oka)


def expand(cs: Tensor, ci: Tensor, score: Tensor, beam: Tensor, d2t: Tensor, cand: tuple, base: int, beams: tuple,
           h: Tensor, mask: Tensor, col0: int, own0: int, root: bool):
    """One level of the draft tree in one kernel (see _expand_kernel): cand = (tokens, scores, parents) of all
    candidates, written at base..; beams = (score, token, candidate index, parent row, state [K, H]), rewritten;
    mask [K, col0 + SK] bool, its scratch columns rewritten. Reads score and beam before writing beams."""
    P, K = cs.shape
    SK = mask.shape[1] - col0
    H = h.shape[-1]
    m8 = mask.view(torch.uint8)
    _expand_kernel[(1,)](cs, ci, score, beam, d2t, *cand, base, *beams[:4], h, h.stride(0), beams[4], H, m8,
                         m8.stride(0), col0, own0, P=P, K=K, ROOT=root, BC=triton.next_power_of_2(P * K),
                         BK=triton.next_power_of_2(K), SK=SK, BSK=triton.next_power_of_2(SK),
                         BH=min(1024, triton.next_power_of_2(H)), num_warps=4, **_launch())


@triton.jit
def _tree_kernel(ctok_ptr, cscore_ptr, cpar_ptr, M, root_ptr, n_ptr, posof_ptr, tok_ptr, par_ptr, anc_ptr, pos_ptr,
                 slot_ptr, mask_ptr, W, N: tl.constexpr, DEPTH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BW: tl.constexpr, PDL: tl.constexpr):
    # keep the N-1 best candidates (score desc, index asc: a parent before its children), in candidate order, under
    # the root: tokens, parents, ancestors A [N, N] (self included), positions n + depth, slots n + i, and the
    # verification mask [N, W]: the context [0, n) and each node's ancestors at slots n..n+N-1
    _after_previous(PDL)
    i = tl.arange(0, BM)
    oki = i < M
    sc = tl.load(cscore_ptr + i, mask=oki, other=float("-inf"))
    ii = tl.arange(0, BM)[:, None]
    so = tl.load(cscore_ptr + ii, mask=ii < M, other=float("-inf"))
    ahead = ((so > sc[None, :]) | ((so == sc[None, :]) & (ii < i[None, :]))) & (ii < M)
    keep = oki & (tl.sum(ahead.to(tl.int32), axis=0) < N - 1)
    node = tl.cumsum(keep.to(tl.int32), axis=0)                  # the kept candidates' nodes 1..N-1
    keep = keep & (node < N)                                     # (NaN scores rank nothing: stay in bounds)
    tl.store(posof_ptr + i, node, mask=oki)
    t = tl.arange(0, BN)
    okt = t < N
    tl.store(tok_ptr + t, tl.zeros((BN,), tl.int64), mask=okt)   # every node defined, whatever the scores
    tl.store(par_ptr + t, tl.zeros((BN,), tl.int64), mask=okt)
    tl.debug_barrier()
    cp = tl.load(cpar_ptr + i, mask=oki, other=-1)
    pnode = tl.where(cp < 0, 0, tl.load(posof_ptr + tl.minimum(tl.maximum(cp, 0), M - 1), mask=oki, other=0))
    tl.store(tok_ptr + node, tl.load(ctok_ptr + i, mask=oki, other=0), mask=keep)
    tl.store(par_ptr + node, pnode.to(tl.int64), mask=keep)
    tl.store(tok_ptr, tl.load(root_ptr))                          # node 0: the root (its parent: itself, 0)
    tl.debug_barrier()
    col = tl.arange(0, BN)
    cur = tl.where(okt, t, 0)
    A = col[None, :] == cur[:, None]
    depth = tl.zeros((BN,), tl.int64)
    for _ in tl.static_range(DEPTH):
        depth += (cur != 0).to(tl.int64)
        cur = tl.minimum(tl.maximum(tl.load(par_ptr + cur).to(tl.int32), 0), N - 1)
        A = A | (col[None, :] == cur[:, None])
    n = tl.load(n_ptr)
    tl.store(anc_ptr + t[:, None] * N + col[None, :], A.to(tl.uint8), mask=okt[:, None] & (col < N)[None, :])
    tl.store(pos_ptr + t, n + depth, mask=okt)
    tl.store(slot_ptr + t, n + t, mask=okt)
    tl.debug_barrier()
    for w0 in range(0, W, BW):
        w = w0 + tl.arange(0, BW)
        rel = w - n
        inside = (rel >= 0) & (rel < N)
        a = tl.load(anc_ptr + t[:, None] * N + rel[None, :], mask=okt[:, None] & inside[None, :], other=0)
        m = (w < n)[None, :] | (a != 0)
        tl.store(mask_ptr + t[:, None] * W + w[None, :], m.to(tl.uint8), mask=okt[:, None] & (w < W)[None, :])


def tree(cand: tuple, root: Tensor, n: Tensor, N: int, depth: int, W: int) -> tuple:
    """The verification tree from the candidates (tokens, scores, parents [M]) in one kernel: tokens [N] (root
    first), parents [N], ancestors [N, N] bool, positions [N], slots [N], mask [N, W] bool (see _tree_kernel)."""
    M, dev = cand[0].shape[0], root.device
    tok, par, pos, slot = (torch.empty(N, dtype=torch.long, device=dev) for _ in range(4))
    anc = torch.empty(N, N, dtype=torch.bool, device=dev)
    mask = torch.empty(N, W, dtype=torch.bool, device=dev)
    posof = torch.empty(M, dtype=torch.int32, device=dev)
    _tree_kernel[(1,)](*cand, M, root, n, posof, tok, par, anc.view(torch.uint8), pos, slot, mask.view(torch.uint8), W,
                       N=N, DEPTH=depth, BM=triton.next_power_of_2(M), BN=triton.next_power_of_2(N), BW=128,
                       num_warps=4, **_launch())
    return tok, par, anc, pos, slot, mask


@triton.jit
def _accept_kernel(tgt_ptr, tok_ptr, par_ptr, anc_ptr, n_ptr, res_ptr, path_ptr, src_ptr, dst_ptr, last_ptr,
                   N: tl.constexpr, L: tl.constexpr, BN: tl.constexpr, BL: tl.constexpr, PDL: tl.constexpr):
    # greedy acceptance: node i is accepted when each of its ancestors (itself included, the root aside) is the
    # target's choice after its parent; the accepted path (L entries, padded with node N-1), its count, the
    # emitted tokens (the target's choices on it), the KV moves (slots n + path → n + 0..L-1), the last index
    _after_previous(PDL)
    i = tl.arange(0, BN)
    ok = i < N
    tgt = tl.load(tgt_ptr + i, mask=ok, other=0)
    par = tl.load(par_ptr + i, mask=ok, other=0)
    wrong = ok & (i != 0) & (tl.load(tok_ptr + i, mask=ok, other=0) != tl.load(tgt_ptr + par, mask=ok, other=0))
    A = tl.load(anc_ptr + i[:, None] * N + i[None, :], mask=ok[:, None] & ok[None, :], other=0) != 0
    acc = ok & (tl.sum((A & wrong[None, :]).to(tl.int32), axis=1) == 0)
    count = tl.sum(acc.to(tl.int32), axis=0)
    rank = tl.cumsum(acc.to(tl.int32), axis=0) - 1
    d = tl.arange(0, BL)
    okd = d < L
    p = tl.sum(tl.where(acc[None, :] & (rank[None, :] == d[:, None]), i[None, :], 0), axis=1)
    p = tl.where(d < count, p, N - 1)
    n = tl.load(n_ptr)
    tl.store(path_ptr + d, p.to(tl.int64), mask=okd)
    tl.store(src_ptr + d, n + p, mask=okd)
    tl.store(dst_ptr + d, n + d, mask=okd)
    tl.store(res_ptr + 1 + d, tl.load(tgt_ptr + p, mask=okd, other=0), mask=okd)
    tl.store(res_ptr, count.to(tl.int64))
    tl.store(last_ptr, (count - 1).to(tl.int64))


def accept(tgt: Tensor, tokens: Tensor, parent: Tensor, anc: Tensor, n: Tensor, L: int) -> tuple:
    """Greedy acceptance of a verified tree in one kernel (see _accept_kernel): [count, tokens [L]...], path [L],
    KV move sources and destinations [L], last [1] (the index of the new root)."""
    N, dev = tokens.shape[0], tokens.device
    res = torch.empty(1 + L, dtype=torch.long, device=dev)
    path, src, dst = (torch.empty(L, dtype=torch.long, device=dev) for _ in range(3))
    last = torch.empty(1, dtype=torch.long, device=dev)
    _accept_kernel[(1,)](tgt, tokens, parent, anc.view(torch.uint8), n, res, path, src, dst, last, N=N, L=L,
                         BN=triton.next_power_of_2(N), BL=triton.next_power_of_2(L), num_warps=4, **_launch())
    return res, path, src, dst, last
