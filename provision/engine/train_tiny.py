"""Trains the bundled tiny pair on generated text: an 8-layer byte-level Llama target, then its
EAGLE-3 draft by distillation with training-time test (the draft unrolled on its own states).
    python -m provision.engine.train_tiny [--out DIR] [--target-steps N] [--draft-steps N] [--device cuda]
The bundled pair is this command's defaults on one GPU (about a minute there; hours on a small CPU). Its
640-token window holds a prompt and 512 new tokens: past the window it was trained on, a target's text and its
draft's acceptance fall apart (a 96-token window gave accept length 3.6 over the first 128 new tokens and 1.8
past 384)."""
from __future__ import annotations

import argparse
import json
import math
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from . import TINY_DIR
from .corpus import corpus
from .draft import DraftArgs, Eagle3Draft
from .loading import save_draft, save_target
from .model import ModelArgs, Transformer, apply_rope, rope_cache
from .tokenizer import ByteTokenizer

TARGET = dict(vocab_size=260, dim=128, n_layer=8, n_head=4, n_local_heads=2, intermediate_size=384,
              max_position_embeddings=1024)
DRAFT_VOCAB = 64


def batches(ids: torch.Tensor, B: int, T: int, g: torch.Generator, device):
    while True:
        start = torch.randint(0, len(ids) - T - 1, (B,), generator=g)
        yield torch.stack([ids[s:s + T] for s in start]).to(device)


def lr_at(step, total, peak, warm=50):
    return peak * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total)))


def train_target(model, data, steps, B, T, log):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    T1 = T + 1
    dev = model.output.weight.device
    mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    pos = torch.arange(T, device=dev)
    model.register_buffer("rope", rope_cache(T1, model.args).to(dev), persistent=False)
    for step, x in zip(range(steps), batches(data, B, T1, torch.Generator().manual_seed(1), dev)):
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, steps, 3e-3)
        logits = model(x[:, :-1], pos, mask, pos)
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"target step {step} loss {loss.item():.3f}")


def draft_unrolled(draft: Eagle3Draft, x, aux, ttt: int):
    """Training-time test: step k at position i reads (token i+1, step k-1's state at i-1) and
    attends to step-0 keys at j <= i-k plus its own chain's keys on the diagonal.

    x: [B, T+1] tokens; aux: [B, T, 3H]. Returns draft logits per step, each [B, T, Vd]."""
    B, T = aux.shape[:2]
    m, att, a = draft.midlayer, draft.midlayer.attention, draft.args
    emb = draft.embed_ids(x[:, 1:T + 1])                                # token i+1 at position i
    rope = draft.rope[:T]
    hidden = draft.fc(aux)
    i = torch.arange(T, device=x.device)
    ks, vs, outs = [], [], []
    h = hidden                                                      # carried from step k-1 to step k
    for k in range(ttt):
        if k:
            hidden = F.pad(h[:, :-1], (0, 0, 1, 0))                  # state of position i-1
        inp = torch.cat([m.input_layernorm(emb), m.hidden_norm(hidden)], -1)
        q, kk, v = att.wqkv(inp).split([a.n_head * a.head_dim, a.n_local_heads * a.head_dim,
                                        a.n_local_heads * a.head_dim], -1)
        q = apply_rope(q.view(B, T, a.n_head, -1).transpose(1, 2), rope)
        kk = apply_rope(kk.view(B, T, a.n_local_heads, -1).transpose(1, 2), rope)
        v = v.view(B, T, a.n_local_heads, -1).transpose(1, 2)
        ks.append(kk)
        vs.append(v)
        blocks = [i[None, :] <= i[:, None] - k] + [i[None, :] == i[:, None] - k + j for j in range(1, k + 1)]
        K = torch.cat(ks, 2).repeat_interleave(a.n_head // a.n_local_heads, 1)
        V = torch.cat(vs, 2).repeat_interleave(a.n_head // a.n_local_heads, 1)
        y = F.scaled_dot_product_attention(q, K, V, attn_mask=torch.cat(blocks, 1))
        res = m.hidden_norm(hidden) if m.norm_before_residual else hidden
        h = res + att.wo(y.transpose(1, 2).reshape(B, T, -1))
        h = h + m.feed_forward(m.ffn_norm(h))
        outs.append(draft.lm_head(draft.norm(h)))
    return outs


def ttt_loss(p, outs: list, w) -> torch.Tensor:
    """Cross-entropy of each unrolled step k to the target's distributions p [B, T, Vd] at positions >= k
    (step k's first k positions have no chain behind them), weighted by w [B, T], step k weighted 0.8^k."""
    loss = 0.0
    for k, lo in enumerate(outs):
        ce = -(p[:, k:] * torch.log_softmax(lo[:, k:], -1)).sum(-1)
        loss = loss + 0.8 ** k * (ce * w[:, k:]).sum() / w[:, k:].sum().clamp(min=1)
    return loss


def train_draft(target, draft, data, steps, B, T, ttt, d_ids, log, deadline: float = float("inf"),
                answer: torch.Tensor | None = None, time_schedule: bool = False, lr: float = 3e-3) -> int:
    """Distil the target into the draft for `steps` or until `deadline` (time.time()); with `time_schedule`
    the learning-rate schedule runs on steps or time, whichever is further along, so it completes.
    `answer` (bool per token of `data`) limits the loss to predicting answer tokens. Returns the steps run."""
    params = [p for n, p in draft.named_parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    dev = draft.fc.weight.device
    mask = torch.ones(T + 1, T + 1, dtype=torch.bool, device=dev).tril()
    pos = torch.arange(T + 1, device=dev)
    draft.register_buffer("rope", rope_cache(T + 1, draft.args).to(dev), persistent=False)
    # position i is trained on the target's distribution at i+1, i.e. on predicting token i+2
    counts = torch.ones(len(data)) if answer is None else F.pad(answer[1:].float(), (0, 1))
    windows = batches(torch.arange(len(data)), B, T + 1, torch.Generator().manual_seed(2), "cpu")
    ran, t0 = 0, time.time()
    for step, idx in zip(range(steps), windows):
        done = max(step, steps * (time.time() - t0) / (deadline - t0)) if time_schedule else step
        if done >= steps or time.time() > deadline:
            log(f"draft training stopped after {step} of {steps} steps: time budget spent")
            break
        for grp in opt.param_groups:
            grp["lr"] = lr_at(done, steps, lr)
        x, w = data[idx].to(dev), counts[idx[:, 1:]].to(dev)                 # [B, T+1], [B, T]
        with torch.no_grad():
            logits, aux = target(x, pos, mask, pos, capture=True)     # [B, T+1, V], [B, T+1, 3H]
            p = torch.softmax(logits[:, 1:, d_ids], -1)              # target's next-next token on the draft vocab
        loss = ttt_loss(p, draft_unrolled(draft, x, aux[:, :T], ttt), w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"draft step {step} loss {loss.item():.3f} lr {lr_at(done, steps, lr):.2e}")
        ran = step + 1
    return ran


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=TINY_DIR)
    ap.add_argument("--target-steps", type=int, default=1500)
    ap.add_argument("--draft-steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=640,
                    help="training window: a prompt and 512 new tokens stay inside what the pair has seen")
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--docs", type=int, default=6000)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    t0 = time.time()
    log = lambda s: print(f"[{time.time() - t0:6.1f}s] {s}", flush=True)  # noqa: E731
    tok = ByteTokenizer()
    ids = []
    for doc in corpus(args.docs, seed=0):
        ids += tok.encode(doc) + [tok.eos_id]
    data = torch.tensor(ids)
    log(f"corpus: {len(ids)} tokens")

    target = Transformer(ModelArgs(**TARGET)).to(args.device)
    train_target(target, data, args.target_steps, args.batch, args.seq, log)
    target.requires_grad_(False)

    freq = Counter(ids)
    d_ids = torch.tensor(sorted(t for t, _ in freq.most_common(DRAFT_VOCAB)))   # draft id → target id
    draft = Eagle3Draft(DraftArgs(**{**TARGET, "n_layer": 1}, draft_vocab_size=len(d_ids))).to(args.device)
    d_ids = d_ids.to(args.device)
    draft.d2t.copy_(d_ids - torch.arange(len(d_ids), device=d_ids.device))
    draft.embed = target.tok_embeddings
    train_draft(target, draft, data, args.draft_steps, args.batch, args.seq, args.ttt, d_ids, log)

    out = Path(args.out)
    save_target(target, out, dtype=torch.float16, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    save_draft(draft, out / "draft", dtype=torch.float16)
    (out / "byte_tokenizer.json").write_text(json.dumps({"type": "byte", "bos_id": tok.bos_id,
                                                         "eos_id": tok.eos_id}) + "\n")
    log(f"saved to {out}")


if __name__ == "__main__":
    main()
