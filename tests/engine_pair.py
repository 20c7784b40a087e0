"""Test helper: small engine checkpoints for the engine probe, written with the engine's own savers.

`agreeing`: target and draft both always predict byte 0 (every drafted token is accepted, so
speculation must pay off); otherwise a random draft, which accepts next to nothing."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from provision.engine.draft import DraftArgs, Eagle3Draft
from provision.engine.loading import save_draft, save_target
from provision.engine.model import ModelArgs, Transformer


def make_pair(d: Path, agreeing: bool, dim: int = 128, n_layer: int = 8) -> Path:
    torch.manual_seed(0)
    kw = dict(vocab_size=260, dim=dim, n_head=4, n_local_heads=2, intermediate_size=3 * dim,
              max_position_embeddings=1024)
    target = Transformer(ModelArgs(n_layer=n_layer, **kw))
    draft = Eagle3Draft(DraftArgs(n_layer=1, draft_vocab_size=260, **kw))
    for m in (target, draft):
        for p in m.parameters():
            torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
            if p.dim() == 1:
                p.data += 1.0
    if agreeing:
        with torch.no_grad():
            target.output.weight.zero_()      # all logits equal: greedy picks id 0
            draft.lm_head.weight.zero_()      # so does the draft (d2t maps draft 0 → target 0)
    draft.d2t.zero_()
    d.mkdir(parents=True, exist_ok=True)
    save_target(target, d, eos_token_id=257, bos_token_id=256)
    save_draft(draft, d / "draft", aux_layer_ids=[2, n_layer // 2, n_layer - 3])
    (d / "byte_tokenizer.json").write_text(json.dumps({"bos_id": 256, "eos_id": 257}))
    return d
