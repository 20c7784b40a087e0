"""Self-distillation pieces: batched left-padded greedy answers equal one-at-a-time greedy decoding;
the shape bench runs end to end on a small shape (CPU: eager calls, no graphs)."""
import math

import torch

from conftest import random_pair
from provision.engine.generate import Engine
from provision.engine.shape_bench import shape_bench
from provision.engine.train_eagle3 import answer


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
