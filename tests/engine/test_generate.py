"""Speculative decoding is lossless: greedy output equals plain greedy output across tree
settings and prompt lengths, for a random pair (mostly rejections) and the bundled tiny pair."""
import pytest
import torch

from conftest import DEVICE, random_pair
from provision.engine.corpus import held_out_prompts
from provision.engine.errors import EngineError
from provision.engine.generate import Engine
from provision.engine.loading import load_engine

TREES = [(1, 1, 2), (3, 1, 4), (3, 2, 6), (4, 3, 10), (5, 4, 16)]   # steps, topk, num_draft_tokens


@pytest.fixture(scope="module")
def random_engine():
    target, draft = random_pair(vocab=96, draft_vocab=48)
    return Engine(target, draft, max_seq_len=160)


@pytest.fixture(scope="module")
def tiny():
    return load_engine(device=DEVICE, max_seq_len=512)


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("plen", [1, 9, 70])
def test_greedy_random_pair(random_engine, tree, plen):
    e = random_engine
    e.configure(*tree)
    ids = torch.randint(0, 96, (plen,), generator=torch.Generator().manual_seed(plen)).tolist()
    plain = e.generate(ids, 40, temperature=0, speculative=False).tokens
    spec = e.generate(ids, 40, temperature=0)
    assert len(plain) == 40
    assert spec.tokens == plain
    assert all(1 <= a <= tree[0] + 1 for a in spec.accept_lengths)


@pytest.mark.parametrize("tree", TREES)
def test_greedy_tiny_pair(tiny, tree):
    tiny.configure(*tree)
    prompts = ["t", held_out_prompts(1)[0], " ".join(held_out_prompts(4))[:400]]
    accepts = []
    for p in prompts:
        ids = tiny.tokenizer.encode(p)
        plain = tiny.generate(ids, 48, temperature=0, speculative=False, stop_at_eos=False).tokens
        spec = tiny.generate(ids, 48, temperature=0, stop_at_eos=False)
        assert spec.tokens == plain, p
        accepts += spec.accept_lengths
    assert sum(accepts) / len(accepts) > 1.5      # the trained draft is really accepted


def test_context_end_and_eos(random_engine):
    e = random_engine
    e.configure(3, 2, 6)
    ids = [i % 96 for i in range(150)]           # 10 tokens of room left in a 160-token context
    plain = e.generate(ids, 100, temperature=0, speculative=False).tokens
    assert e.generate(ids, 100, temperature=0).tokens == plain and len(plain) == 10
    e.stop_ids = {plain[3]}
    out = e.generate(ids, 100, temperature=0)
    assert out.tokens == plain[:plain.index(plain[3]) + 1] and out.finish_reason == "stop"
    e.stop_ids = set()
    with pytest.raises(EngineError, match="does not fit"):
        e.generate([1] * 160, 4)
    with pytest.raises(EngineError, match="tree settings"):
        e.configure(2, 2, 9)
