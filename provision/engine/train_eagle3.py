"""Trains an EAGLE-3 draft for a served checkpoint by self-distillation: the target answers chat prompts
(templated ones and ones it writes itself) greedily, and if asked also sampled, then the draft learns the
target's next-token distributions on the answers with training-time test; it may start from a saved draft.
`python -m provision.engine.train_eagle3 --model DIR --out DIR`"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from .corpus import chat_prompts, mentions_held_out
from .draft import DraftArgs, Eagle3Draft
from .loading import load_draft, load_target, save_draft
from .tokenizer import load_tokenizer, stop_ids
from .train_tiny import train_draft


@torch.inference_mode()
def answer(target, prompts: list[list[int]], max_new: int, stops: set, temperature: float = 0.0,
           gen: torch.Generator | None = None) -> list[list[int]]:
    """Answers for a batch of prompts, left-padded into one static cache (RoPE is relative): greedy, or
    sampled at `temperature` (then `gen`, a generator on the target's device, draws)."""
    B, L = len(prompts), max(len(p) for p in prompts)
    dev = target.output.weight.device
    target.setup_caches(L + max_new, batch=B)
    ids = torch.zeros(B, L, dtype=torch.long, device=dev)
    valid = torch.zeros(B, L + max_new, dtype=torch.bool, device=dev)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = torch.tensor(p)
        valid[b, L - len(p):L] = True
    pos = torch.arange(L, device=dev)
    causal = pos[None, :] <= pos[:, None]
    mask = (causal & valid[:, None, :L]) | torch.eye(L, dtype=torch.bool, device=dev)   # pads see themselves
    pick = (lambda lo: lo.argmax(-1)) if temperature <= 0 else (  # noqa: E731
        lambda lo: torch.multinomial(torch.softmax(lo.float() / temperature, -1), 1, generator=gen)[:, 0])
    tok = pick(target(ids, pos, mask[:, None], pos)[:, -1])
    out = [tok]
    stop = torch.tensor(sorted(stops), dtype=torch.long, device=dev)
    ended = torch.isin(tok, stop)
    for t in range(L, L + max_new - 1):
        if t % 32 == 0 and bool(ended.all()):                     # every answer has ended
            break
        valid[:, t] = True
        p = pos.new_full((1,), t)
        tok = pick(target(tok[:, None], p, valid[:, None, None, : t + 1], p)[:, -1])
        out.append(tok)
        ended |= torch.isin(tok, stop)
    rows = torch.stack(out, 1).tolist()
    cut = [next((i + 1 for i, x in enumerate(r) if x in stops), len(r)) for r in rows]
    return [r[:c] for r, c in zip(rows, cut)]


def self_prompts(target, tok, n: int, batch: int, stops: set, gen: torch.Generator, log) -> list[str]:
    """`n` distinct user messages the target writes itself, sampled after the chat template's user header;
    unfinished ones and those that name a held-out benchmark topic are dropped."""
    text = tok.chat_template.render([{"role": "user", "content": "\x00"}])
    head = tok.encode(text[: text.index("\x00")], bos=False)
    out: dict[str, None] = {}
    for _ in range(4 * -(-n // batch)):
        for r in answer(target, [head] * batch, 64, stops, temperature=1.0, gen=gen):
            msg = tok.decode(r[:-1]).strip() if r[-1] in stops else ""
            if len(msg.split()) >= 3 and not mentions_held_out(msg):
                out[msg] = None
        log(f"self-written prompts: {min(len(out), n)}/{n}")
        if len(out) >= n:
            break
    log(f"for example: {list(out)[:3]}")
    return list(out)[:n]


def start_draft(target, init: Path | None, freq: Counter, vocab: int | None, device) -> Eagle3Draft:
    """The draft training starts from: the one saved in `init`, or random weights. Its vocabulary is the
    `vocab` most frequent trained tokens (`freq`), or with `init` and no `vocab` the saved draft's own; a
    saved draft moved to another vocabulary keeps its output rows for the tokens both have, and starts the
    others from the target's output rows, scaled to its own. Either way it reads the target's embeddings."""
    d_ids = None if vocab is None else torch.tensor(sorted(t for t, _ in freq.most_common(vocab)), device=device)
    if init:
        draft = load_draft(init, target, device)
        if d_ids is not None:
            draft = revocab(draft, d_ids, target.output.weight)
    else:
        ta = target.args
        da = DraftArgs(vocab_size=ta.vocab_size, dim=ta.dim, n_layer=1, n_head=ta.n_head,
                       n_local_heads=ta.n_local_heads, head_dim=ta.head_dim, intermediate_size=ta.intermediate_size,
                       norm_eps=ta.norm_eps, rope_base=ta.rope_base, rope_scaling=ta.rope_scaling,
                       max_position_embeddings=ta.max_position_embeddings, draft_vocab_size=len(d_ids))
        draft = Eagle3Draft(da).to(device)
        draft.d2t.copy_(d_ids - torch.arange(len(d_ids), device=device))
    draft.embed = target.tok_embeddings
    return draft


@torch.no_grad()
def revocab(draft: Eagle3Draft, d_ids: torch.Tensor, target_out: torch.Tensor) -> Eagle3Draft:
    """The draft with its output layer over the target ids `d_ids` (sorted): rows of tokens it already has are
    kept, the others are the target's output rows times the mean ratio of the draft's row norms to the
    target's over the shared tokens."""
    old = draft.d2t + torch.arange(draft.args.draft_vocab_size, device=draft.d2t.device)
    where = torch.full((draft.args.vocab_size,), -1, dtype=torch.long, device=old.device)
    where[old] = torch.arange(len(old), device=old.device)
    have = where[d_ids] >= 0
    if not have.any():
        raise SystemExit("error: the new draft vocabulary shares no token with the saved draft's")
    w_old = draft.lm_head.weight
    shared = d_ids[have]
    scale = w_old[where[shared]].norm(dim=1).mean() / target_out[shared].norm(dim=1).mean()
    w = (target_out[d_ids] * scale).to(w_old.dtype)
    w[have] = w_old[where[shared]]
    out = Eagle3Draft(replace(draft.args, draft_vocab_size=len(d_ids)), own_embed=draft.embed_tokens is not None)
    out = out.to(w_old.device)
    out.load_state_dict({k: v for k, v in draft.state_dict().items() if k not in ("lm_head.weight", "d2t")},
                        strict=False)
    out.lm_head.weight.copy_(w)
    out.d2t.copy_(d_ids - torch.arange(len(d_ids), device=d_ids.device))
    return out


def self_distill(target, tok, stops: set, a, log):
    """The corpus: the target's answers to the chat prompts (greedy, then `a.sampled` sampled ones each), as
    (tokens, whether each is in an answer, what it holds)."""
    messages = chat_prompts(a.prompts)
    templated = len(messages)
    if a.self_prompts:
        gen = torch.Generator(a.device).manual_seed(0)
        messages += self_prompts(target, tok, a.self_prompts, a.gen_batch, stops, gen, log)
    prompts = [tok.encode(tok.chat_template.render([{"role": "user", "content": p}]), bos=False) for p in messages]
    from .generate import Engine
    single = Engine(target, None, tok, max_seq_len=512, stop_ids=stops)
    want = [single.generate(p, 48).tokens for p in prompts[:2]]
    log(f"batched greedy answers equal single-sequence greedy: {answer(target, prompts[:2], 48, stops) == want}")
    convs, answers = [], []
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))     # similar lengths share a batch
    sampler = torch.Generator(a.device).manual_seed(1)
    until = time.time() + 60 * a.gen_minutes
    for temperature in [0.0] + [a.temperature] * a.sampled:
        for s in range(0, len(order), a.gen_batch):
            if time.time() > until:
                log("answering stopped: --gen-minutes spent")
                break
            batch = [prompts[i] for i in order[s:s + a.gen_batch]]
            for p, r in zip(batch, answer(target, batch, a.max_new, stops, temperature, sampler)):
                convs.append(p + r)
                answers.append([False] * len(p) + [True] * len(r))
            log(f"answered {len(convs)}/{len(prompts) * (1 + a.sampled)} prompts (temperature {temperature})")
    data = torch.tensor([t for c in convs for t in c])
    is_answer = torch.tensor([x for m in answers for x in m])
    return data, is_answer, {"conversations": len(convs), "prompts": len(prompts),
                             "self_written_prompts": len(messages) - templated, "sampled_answers_per_prompt": a.sampled,
                             "temperature": a.temperature if a.sampled else None, "max_new": a.max_new}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, required=True, help="target checkpoint (with its tokenizer)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=20000, help="templated chat prompts (at most all of them)")
    ap.add_argument("--self-prompts", type=int, default=0, help="prompts the target writes itself")
    ap.add_argument("--max-new", type=int, default=320)
    ap.add_argument("--sampled", type=int, default=0,
                    help="answers to each prompt sampled at --temperature, besides the greedy one")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--gen-batch", type=int, default=128)
    ap.add_argument("--gen-minutes", type=float, default=float("inf"), help="stop answering prompts after this long")
    ap.add_argument("--draft-vocab", type=int,
                    help="draft vocabulary size (default 4096; with --init, the saved draft's own)")
    ap.add_argument("--init", type=Path, help="continue training this draft instead of starting from random weights")
    ap.add_argument("--save-corpus", type=Path, help="also save the self-distillation corpus to this file")
    ap.add_argument("--corpus", type=Path, help="train on a corpus saved by --save-corpus instead of answering prompts")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--ttt", type=int, default=5, help="training-time test depth (draft steps unrolled)")
    ap.add_argument("--max-minutes", type=float, default=float("inf"), help="stop training after this long")
    ap.add_argument("--answer-loss", action="store_true",
                    help="train (and pick the draft vocabulary) on answer tokens only, not on prompts")
    ap.add_argument("--time-schedule", action="store_true",
                    help="run the learning-rate schedule on elapsed time when --max-minutes ends training first")
    a = ap.parse_args(argv)
    t0 = time.time()
    log = lambda s: print(f"[{time.time() - t0:6.1f}s] {s}", flush=True)  # noqa: E731
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    tok = load_tokenizer(a.model)
    if tok is None or getattr(tok, "chat_template", None) is None:
        raise SystemExit(f"error: {a.model}: needs a tokenizer and a chat template")
    stops = set(stop_ids(a.model))
    target = load_target(a.model, a.device).requires_grad_(False)
    if a.corpus:
        try:
            saved = torch.load(a.corpus)
            data, is_answer, about = saved["data"].long(), saved["is_answer"], saved["about"]
        except (OSError, RuntimeError, KeyError, TypeError, AttributeError) as e:
            raise SystemExit(f"error: --corpus {a.corpus}: not a corpus saved by --save-corpus ({e})") from None
        log(f"corpus from {a.corpus}")
    else:
        data, is_answer, about = self_distill(target, tok, stops, a, log)
        if a.save_corpus:
            torch.save({"data": data.int(), "is_answer": is_answer, "about": about}, a.save_corpus)
    log(f"self-distillation corpus: {about['conversations']} conversations, {len(data)} tokens, "
        f"{int(is_answer.sum())} in answers")
    target.setup_caches(a.seq + 1)                                         # the RoPE table; no caches
    for layer in target.layers:
        layer.attention.kv_cache = None
    trained = is_answer if a.answer_loss else torch.ones_like(is_answer)
    freq = Counter(data[trained].tolist())
    draft = start_draft(target, a.init, freq, a.draft_vocab or (None if a.init else 4096), a.device)
    d_ids = draft.d2t + torch.arange(draft.args.draft_vocab_size, device=a.device)
    log(f"draft vocabulary covers {sum(freq[int(t)] for t in d_ids) / int(trained.sum()):.1%} of the trained tokens")
    done = train_draft(target, draft, data, a.steps, a.batch, a.seq, a.ttt, d_ids, log,
                       deadline=t0 + 60 * a.max_minutes, answer=is_answer if a.answer_loss else None,
                       time_schedule=a.time_schedule, lr=a.lr)
    save_draft(draft, a.out, dtype=torch.float16)
    (a.out / "training.json").write_text(json.dumps({
        "target": str(a.model.name), **about, "corpus": str(a.corpus) if a.corpus else None, "tokens": len(data), "answer_tokens": int(is_answer.sum()), "steps": done,
        "steps_planned": a.steps, "lr": a.lr, "init": str(a.init) if a.init else None,
        "batch": a.batch, "seq": a.seq, "ttt": a.ttt, "draft_vocab": len(d_ids), "seconds": round(time.time() - t0),
        "command": "python -m provision.engine.train_eagle3 " + " ".join(argv if argv is not None else sys.argv[1:])},
        indent=2) + "\n")
    log(f"saved to {a.out}")


if __name__ == "__main__":
    main()
