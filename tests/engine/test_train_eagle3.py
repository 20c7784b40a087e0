"""Self-distillation pieces: batched left-padded greedy answers equal one-at-a-time greedy decoding,
sampled ones follow their generator; held-out topics stay out of training prompts; the training-time-test
loss counts weighted positions only; training continues from a saved draft; the shape bench runs end to end on a small shape (CPU: no graphs)."""
import math
import time
from collections import Counter

import torch

from conftest import random_pair
from provision.engine.generate import Engine
from provision.engine.shape_bench import shape_bench
from provision.engine.corpus import chat_prompts, held_out_chat_prompts, mentions_held_out
from provision.engine.loading import save_draft
from provision.engine.train_eagle3 import answer, start_draft
from provision.engine.train_tiny import train_draft, ttt_loss


def test_batched_answers_equal_single_greedy():
    target, _ = random_pair(vocab=96, dim=64, n_layer=3, device="cpu", scale=2.0)
    prompts = [[5, 9, 3], [7, 1, 2, 8, 8, 4, 6], [11]]
    single = Engine(target, None, None, max_seq_len=64)
    want = [single.generate(p, 12, stop_at_eos=False).tokens for p in prompts]
    stop = want[1][5]
    got = answer(target, prompts, 12, {stop})
    cut = lambda seq: seq[: seq.index(stop) + 1] if stop in seq else seq  # noqa: E731
    assert got == [cut(w) for w in want] and len(got[1]) <= 6


def test_shape_bench_small_shape():
    r = shape_bench("tiny", "cpu", torch.float32, prompt=16, new=8, peer=False, log=lambda s: None)
    for k in ("plain_tok_s", "forward_1_ms", "forward_16_ms", "forward_64_ms", "draft_step_ms", "spec_step_ms",
              "spec_step_in_plain_steps"):
        assert r[k] > 0 and math.isfinite(r[k]), k


def test_sampled_answers_follow_the_generator():
    target, _ = random_pair(vocab=96, dim=64, n_layer=3, device="cpu", scale=2.0)
    prompts = [[5, 9, 3], [7, 1, 2, 8]]
    draw = lambda seed, t: answer(target, prompts, 16, set(), temperature=t,  # noqa: E731
                                  gen=torch.Generator().manual_seed(seed))
    assert draw(1, 1.0) == draw(1, 1.0) != draw(2, 1.0)
    assert draw(1, 1e-4) == answer(target, prompts, 16, set())      # a cold temperature is greedy


def test_held_out_topics_stay_out_of_training_prompts():
    assert all(mentions_held_out(p) for p in held_out_chat_prompts(1000))
    assert not any(mentions_held_out(p) for p in chat_prompts(10**6))
    assert not mentions_held_out("Explain photosynthesis.") and mentions_held_out("Why do CLOUDS float?")


def test_ttt_loss_counts_weighted_positions_only():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, 8, 10, generator=g), -1)
    outs = [torch.randn(2, 8, 10, generator=g) for _ in range(3)]
    w = torch.ones(2, 8)
    plain = sum(0.8 ** k * -(p[:, k:] * torch.log_softmax(o[:, k:], -1)).sum(-1).mean() for k, o in enumerate(outs))
    assert torch.allclose(ttt_loss(p, outs, w), plain)
    w[:, 5:] = 0
    q = p.clone()
    q[:, 5:] = torch.softmax(torch.randn(2, 3, 10, generator=g), -1)   # changes only unweighted positions
    assert torch.allclose(ttt_loss(p, outs, w), ttt_loss(q, outs, w))
    assert not torch.allclose(ttt_loss(p, outs, torch.ones(2, 8)), ttt_loss(q, outs, torch.ones(2, 8)))


def test_train_draft_runs_its_steps_or_stops_at_the_deadline():
    target, draft = random_pair(vocab=32, dim=32, n_layer=3, device="cpu")
    target.setup_caches(17)                                        # the RoPE table; training uses no caches
    for layer in target.layers:
        layer.attention.kv_cache = None
    target.requires_grad_(False)
    draft.embed = target.tok_embeddings
    data = torch.randint(0, 32, (400,), generator=torch.Generator().manual_seed(0))
    run = lambda **kw: train_draft(target, draft, data, 4, 2, 16, 2, torch.arange(32), lambda s: None, **kw)  # noqa
    before = draft.fc.weight.clone()
    assert run() == 4 and not torch.equal(before, draft.fc.weight)
    assert run(deadline=time.time() - 1) == 0 == run(deadline=time.time() - 1, time_schedule=True)
    assert run(answer=data % 2 == 0, time_schedule=True, deadline=time.time() + 60) == 4


def test_training_continues_from_a_saved_draft(tmp_path):
    target, saved = random_pair(vocab=32, dim=32, n_layer=3, draft_vocab=12, device="cpu")
    save_draft(saved, tmp_path / "d")
    freq = Counter(range(32))
    fresh = start_draft(target, None, freq, 8, "cpu")
    assert fresh.args.draft_vocab_size == 8 and not torch.equal(fresh.fc.weight, saved.fc.weight)
    draft = start_draft(target, tmp_path / "d", freq, None, "cpu")         # the saved draft's own vocabulary
    assert torch.equal(draft.d2t, saved.d2t) and torch.equal(draft.lm_head.weight, saved.lm_head.weight)
    assert torch.equal(draft.fc.weight, saved.fc.weight) and draft.embed is target.tok_embeddings
    target.setup_caches(17)
    for layer in target.layers:
        layer.attention.kv_cache = None
    target.requires_grad_(False)
    data = torch.randint(0, 32, (400,), generator=torch.Generator().manual_seed(0))
    d_ids = draft.d2t + torch.arange(12)
    assert train_draft(target, draft, data, 3, 2, 16, 2, d_ids, lambda s: None, lr=1e-3) == 3
    assert 0 < (draft.fc.weight - saved.fc.weight).abs().max() < 0.05    # moved, from where it was


def test_a_saved_draft_moves_to_a_larger_vocabulary(tmp_path):
    target, saved = random_pair(vocab=32, dim=32, n_layer=3, draft_vocab=12, device="cpu")
    save_draft(saved, tmp_path / "d")
    old = (saved.d2t + torch.arange(12)).tolist()
    freq = Counter({t: 100 - t for t in range(32)})                      # the 20 most frequent: ids 0..19
    draft = start_draft(target, tmp_path / "d", freq, 20, "cpu")
    new = (draft.d2t + torch.arange(20)).tolist()
    assert new == list(range(20)) and draft.args.draft_vocab_size == 20
    kept = [t for t in new if t in old]
    assert kept and len(kept) < 20
    for t in new:                                                       # shared tokens keep their rows
        row = draft.lm_head.weight[new.index(t)]
        if t in old:
            assert torch.equal(row, saved.lm_head.weight[old.index(t)])
        else:                                                           # the others: the target's, scaled
            cos = torch.nn.functional.cosine_similarity(row, target.output.weight[t], dim=0)
            assert cos > 0.999
    assert torch.equal(draft.fc.weight, saved.fc.weight) and draft.embed is target.tok_embeddings
    assert torch.equal(draft.midlayer.attention.wqkv.weight, saved.midlayer.attention.wqkv.weight)
