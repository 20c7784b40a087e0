"""The EAGLE-3 draft: fc 3H→H, one decoder layer over [norm(embed), norm(hidden)] (2H), norm,
lm_head over the draft vocabulary, and `d2t` mapping draft ids to target ids.
Embeddings are shared from the target; the draft has its own static KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor

from .kernels import linear
from .model import Attention, FeedForward, KVCache, ModelArgs, RMSNorm, rope_cache


@dataclass
class DraftArgs(ModelArgs):
    draft_vocab_size: int = 32000
    target_hidden: int = 0            # width of the fused target features (3H); 0 = 3 * dim
    norm_before_residual: bool = False  # residual from hidden_norm(hidden) instead of hidden

    def __post_init__(self):
        super().__post_init__()
        if not self.target_hidden:
            self.target_hidden = 3 * self.dim


class Eagle3Layer(nn.Module):
    """The midlayer: attention whose q/k/v read [input_layernorm(embed), hidden_norm(hidden)]."""

    def __init__(self, args: DraftArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.hidden_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, in_dim=2 * args.dim)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.intermediate_size)
        self.norm_before_residual = args.norm_before_residual

    def forward(self, emb: Tensor, hidden: Tensor, rope, mask, slots) -> tuple:
        """emb, hidden: [B, T, H] → the layer's output as two branches (h, f), summed by the final norm."""
        H = emb.shape[-1]
        x = emb.new_empty(*emb.shape[:-1], 2 * H)                                      # [B, T, 2H]
        self.input_layernorm(emb, out=x[..., :H])
        normed = self.hidden_norm(hidden, out=x[..., H:])
        base = normed if self.norm_before_residual else hidden
        h, hn = self.ffn_norm(base, residual=self.attention(x, rope, mask, slots))
        return h, self.feed_forward(hn)


class Eagle3Draft(nn.Module):
    def __init__(self, args: DraftArgs, own_embed: bool = False):
        super().__init__()
        self.args = args
        self.fc = nn.Linear(args.target_hidden, args.dim, bias=False)
        self.midlayer = Eagle3Layer(args)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(args.draft_vocab_size, dtype=torch.long))  # target = id + d2t[id]
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim) if own_embed else None
        self.embed: nn.Embedding | None = None     # the target's, shared (used unless embed_tokens is set)
        self.max_slots = 0

    def setup_caches(self, max_slots: int, embed: nn.Embedding, batch: int = 1):
        p = self.fc.weight
        self.embed = embed
        self.midlayer.attention.kv_cache = KVCache(batch, max_slots, self.args.n_local_heads,
                                                   self.args.head_dim, p.dtype, p.device)
        self.register_buffer("rope", rope_cache(max_slots, self.args).to(p.device, p.dtype), persistent=False)
        self.max_slots = max_slots

    def forward(self, idx: Tensor, hidden: Tensor, pos: Tensor, mask: Tensor, slots: Tensor):
        """idx: [B, T] target ids; hidden: [B, T, 3H] target features or [B, T, H] draft states.

        Returns draft-vocab logits [B, T, Vd] and the pre-norm states [B, T, H] fed to the next step.
        """
        if hidden.shape[-1] != self.args.dim:
            hidden = linear(hidden, self.fc.weight)
        h, f = self.midlayer(self.embed_ids(idx), hidden, self.rope[pos].to(hidden.dtype), mask, slots)
        h, normed = self.norm(h, residual=f)                                             # h + f, and its norm
        return linear(normed, self.lm_head.weight), h

    def embed_ids(self, idx: Tensor) -> Tensor:
        return (self.embed_tokens if self.embed_tokens is not None else self.embed)(idx)

    def to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]
