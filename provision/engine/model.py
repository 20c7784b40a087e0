"""The Llama-family target: GQA, RoPE (llama3 scaling), RMSNorm, SwiGLU, a static KV cache.
One forward serves prefill, decode and tree verification: it writes K/V in place at `slots` and
can return the hidden states feeding chosen layers (the EAGLE-3 auxiliary features)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from .kernels import attention, attention_mask, gqa_attention, linear, rms_norm, rope_into_cache, silu_mul


@dataclass
class ModelArgs:
    vocab_size: int = 32000
    dim: int = 4096                    # hidden_size
    n_layer: int = 32
    n_head: int = 32
    n_local_heads: int = -1            # key/value heads (GQA); -1 = n_head
    head_dim: int = 0                  # 0 = dim // n_head
    intermediate_size: int = 11008
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    aux_layers: list = field(default_factory=list)  # capture the input of these layers (index n_layer = final)

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if not self.head_dim:
            self.head_dim = self.dim // self.n_head
        if not self.aux_layers:
            self.aux_layers = default_aux_layers(self.n_layer)


def default_aux_layers(n_layer: int) -> list:
    """EAGLE-3's default: the hidden states feeding layers [2, N//2, N-3]."""
    return [min(2, n_layer - 1), n_layer // 2, max(n_layer - 3, 0)]


def rope_inv_freq(head_dim: int, base: float, scaling: Optional[dict]) -> Tensor:
    """Inverse frequencies [head_dim/2], with HF's `linear` and `llama3` scalings."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        lo, hi = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return torch.where(medium, smoothed, out)
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


def rope_cache(seq_len: int, args: ModelArgs) -> Tensor:
    """cos/sin table [seq_len, 2, head_dim] in the HF (rotate-half) layout."""
    inv = rope_inv_freq(args.head_dim, args.rope_base, args.rope_scaling).float()
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)                  # [S, hd]
    return torch.stack([emb.cos(), emb.sin()], dim=1)


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    # x: [B, h, T, hd] with rope [T, 2, hd], or [B, T, h, hd] with rope [T, 1, 2, hd]; gathered at the tokens' positions
    cos, sin = rope.unbind(-2)
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return rotate(x, cos, sin)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE in the rotate-half layout, cos and sin broadcast against x."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class KVCache(nn.Module):
    """Preallocated [B, kv_heads, S, hd] buffers, written in place at `slots` (views of `store` [2, B, kv, S, hd]
    when given: the target keeps all its layers' caches in one tensor, compacted in one move)."""

    def __init__(self, batch: int, slots: int, n_heads: int, head_dim: int, dtype, device=None, store=None):
        super().__init__()
        if store is None:
            store = torch.zeros(2, batch, n_heads, slots, head_dim, dtype=dtype, device=device)
        self.register_buffer("k_cache", store[0], persistent=False)
        self.register_buffer("v_cache", store[1], persistent=False)

    def update(self, slots: Tensor, k: Tensor, v: Tensor):
        # slots: [T]; k, v: [B, kv_heads, T, hd]
        self.k_cache.index_copy_(2, slots, k)
        self.v_cache.index_copy_(2, slots, v)
        return self.k_cache, self.v_cache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, residual: Optional[Tensor] = None, out: Optional[Tensor] = None):
        """weight * norm(x); with `residual`: (h, weight * norm(h)) for h = x + residual; written into `out`."""
        return rms_norm(x, self.weight, self.eps, residual, out)


class Attention(nn.Module):
    """GQA attention; `in_dim` differs from dim only in the EAGLE-3 draft layer (2H)."""

    def __init__(self, args: ModelArgs, in_dim: Optional[int] = None):
        super().__init__()
        self.n_head, self.n_kv, self.hd = args.n_head, args.n_local_heads, args.head_dim
        self.wqkv = nn.Linear(in_dim or args.dim, (self.n_head + 2 * self.n_kv) * self.hd, bias=False)
        self.wo = nn.Linear(self.n_head * self.hd, args.dim, bias=False)
        self.kv_cache: Optional[KVCache] = None

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor, slots: Tensor) -> Tensor:
        # x: [B, T, in_dim]; mask: [T, W] bool over cache slots [0, W); slots: [T]
        B, T, _ = x.shape
        h, kv, cache = self.n_head, self.n_kv, self.kv_cache     # cache is None only when training
        qkv = linear(x, self.wqkv.weight).view(B, T, h + 2 * kv, self.hd)
        q = rope_into_cache(qkv, rope, slots, cache.k_cache, cache.v_cache) if cache is not None else None
        if q is not None:                                        # one fused kernel did rope and the cache write
            k, v = cache.k_cache, cache.v_cache
        else:
            qk, v = qkv.split([h + kv, kv], 2)
            q, k = apply_rope(qk, rope[:, None]).split([h, kv], 2)   # rotated in qkv's layout [B, T, h|kv, hd]
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # [B, h|kv, T, hd] views
            if cache is not None:
                k, v = cache.update(slots, k, v)                 # [B, kv, S, hd]
        if cache is not None and mask.shape[-1] != k.shape[2]:
            k, v = k[:, :, : mask.shape[-1]], v[:, :, : mask.shape[-1]]   # attend to the mask's span only
        return linear(gqa_attention(q, k, v, mask).reshape(B, T, self.n_head * self.hd), self.wo.weight)


class FeedForward(nn.Module):
    """SwiGLU with the gate and up projections fused: w13 = [gate; up]."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return linear(silu_mul(linear(x, self.w13.weight)), self.w2.weight)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.intermediate_size)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor, slots: Tensor, residual: Optional[Tensor] = None):
        """Returns (input, h, f): the layer's input x (+ residual, the previous layer's feed-forward branch, added
        inside the norm's kernel), the residual stream after attention, and this layer's feed-forward branch;
        the layer's output is h + f, added by the next norm."""
        if residual is None:
            xn = self.attention_norm(x)
        else:
            x, xn = self.attention_norm(x, residual=residual)
        h, hn = self.ffn_norm(x, residual=self.attention(xn, rope, mask, slots))
        return x, h, self.feed_forward(hn)

    def lean(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, slots: Tensor, residual: Optional[Tensor]):
        """forward's computation with as few Python-level calls as it takes, where the attention runs on CPU below
        float32 (mask from attention_mask; cos, sin [T, 1, hd]): the same kernels on the same operands in the same
        order, so the same bits (tests compare); those calls cost about a tenth of a CPU step. Weights and caches
        come from `parts`, set by Transformer.setup_caches."""
        wn1, eps, wqkv, kc, vc, wo, wn2, w13, w2, nh, kv, hd = self.parts
        B, T, _ = x.shape
        if residual is None:
            xn = rms_norm(x, wn1, eps)
        else:
            x, xn = rms_norm(x, wn1, eps, residual)
        qkv = linear(xn, wqkv).view(B, T, nh + 2 * kv, hd)
        qk = rotate(qkv[:, :, : nh + kv], cos, sin)                        # [B, T, h+kv, hd]
        kc.index_copy_(2, slots, qk[:, :, nh:].transpose(1, 2))
        vc.index_copy_(2, slots, qkv[:, :, nh + kv:].transpose(1, 2))
        if mask.shape[-1] != kc.shape[2]:
            kc, vc = kc[:, :, : mask.shape[-1]], vc[:, :, : mask.shape[-1]]
        y = attention(qk[:, :, :nh].transpose(1, 2), kc, vc, mask).reshape(B, T, nh * hd)
        h, hn = rms_norm(x, wn2, eps, linear(y, wo))
        return x, h, linear(silu_mul(linear(hn, w13)), w2)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.max_slots = 0

    def setup_caches(self, max_slots: int, batch: int = 1):
        """Allocate the KV cache (`max_slots` entries) and the RoPE table once."""
        p, a = self.output.weight, self.args
        self.kv_store = torch.zeros(a.n_layer, 2, batch, a.n_local_heads, max_slots, a.head_dim, dtype=p.dtype,
                                    device=p.device)
        for i, layer in enumerate(self.layers):
            at, ff = layer.attention, layer.feed_forward
            at.kv_cache = KVCache(batch, max_slots, a.n_local_heads, a.head_dim, p.dtype, store=self.kv_store[i])
            layer.parts = (layer.attention_norm.weight, layer.attention_norm.eps, at.wqkv.weight, at.kv_cache.k_cache,
                           at.kv_cache.v_cache, at.wo.weight, layer.ffn_norm.weight, ff.w13.weight, ff.w2.weight,
                           a.n_head, a.n_local_heads, a.head_dim)
        # in the weights' dtype: the values a row rounded after its gather would have, without a cast per step
        self.register_buffer("rope", rope_cache(max_slots, self.args).to(p.device, p.dtype), persistent=False)
        self.max_slots = max_slots

    def move_kv(self, src: Tensor, dst: Tensor):
        """Compaction: copy every layer's cache entries at slots `src` to slots `dst` (index_select copies first)."""
        self.kv_store.index_copy_(4, dst, self.kv_store.index_select(4, src))

    def forward(self, idx: Tensor, pos: Tensor, mask: Tensor, slots: Tensor, capture: bool = False):
        """idx: [B, T] tokens; pos: [T] RoPE positions; mask: [T, S]; slots: [T] cache slots.

        Returns logits [B, T, V] and, with capture, aux hidden states [B, T, 3H].
        """
        x, f = self.tok_embeddings(idx), None
        rope = self.rope[pos].to(x.dtype)
        prepared = attention_mask(mask, x.dtype, self.args.n_head // self.args.n_local_heads)
        lean = prepared is not mask and self.max_slots > 0           # CPU below float32: TransformerBlock.lean
        cos, sin = rope[:, None].unbind(-2) if lean else (None, None)
        seen = {}
        for i, layer in enumerate(self.layers):
            if lean:
                x, h, f = layer.lean(x, cos, sin, prepared, slots, f)   # x: this layer's input
            else:
                x, h, f = layer(x, rope, mask, slots, residual=f)
            if capture and i in self.args.aux_layers:
                seen[i] = x
            x = h
        x, normed = self.norm(x, residual=f)
        seen[self.args.n_layer] = x
        logits = linear(normed, self.output.weight)
        if not capture:
            return logits
        return logits, torch.cat([seen[i] for i in self.args.aux_layers], dim=-1)
