"""Speculative decoding is lossless: greedy output equals plain greedy output across tree
settings and prompt lengths, for a random pair (mostly rejections) and the bundled tiny pair."""
import pytest
import torch

from conftest import DEVICE, random_pair
from provision.engine import kernels
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
    return load_engine(device=DEVICE, dtype="float32", max_seq_len=512)


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


# ---- shared rows (CPU below float32): plain and verification steps run the same rows over one span ----------

def test_linear_rows_are_independent_at_a_fixed_row_count():
    """What shared rows rely on: within one product of R rows, row i depends on row i alone (the engine's linear,
    bfloat16 weights laid out for R rows, SmolLM2-135M's weight shapes). Across row counts it need not hold (on an
    AMX CPU, 1 row and 28+ rows of some of these shapes round differently): so every step runs the same rows."""
    g = torch.Generator().manual_seed(0)
    for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]:
        for R in (16, 32):
            lin = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
            kernels.prepack([lin], R)
            x, x2 = (torch.randn(1, R, k, generator=g).to(torch.bfloat16) for _ in range(2))
            x2[0, R // 2] = x[0, R // 2]                          # row R/2 kept, every other row replaced
            with torch.inference_mode():
                y, y2 = kernels.linear(x, lin.weight), kernels.linear(x2, lin.weight)
                torch.testing.assert_close(y, torch.nn.functional.linear(x, lin.weight), rtol=1e-2, atol=1e-2)
            assert torch.equal(y2[0, R // 2], y[0, R // 2]), (n, k, R)
    with torch.no_grad():
        lin.weight.mul_(2)                                        # a weight written after its layout: not used
    with torch.inference_mode():
        assert torch.equal(kernels.linear(x, lin.weight), torch.nn.functional.linear(x, lin.weight))


def test_attention_rows_are_independent_on_cpu():
    """The CPU fused attention below float32 (query heads grouped by KV head, additive mask built once): within one
    call of R rows, row i depends on row i alone, as shared rows need; and it computes attention (against the
    bmm, softmax, bmm reference) whether given the boolean mask or the prepared one."""
    from provision.engine.model import gqa_attention
    g = torch.Generator().manual_seed(0)
    R, W, h, kv, hd = 16, 272, 9, 3, 64
    q, q2 = (torch.randn(1, h, R, hd, generator=g).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, kv, W, hd, generator=g).to(torch.bfloat16) for _ in range(2))
    q2[:, :, 5] = q[:, :, 5]                                        # row 5 kept, every other row replaced
    mask = torch.arange(W)[None] <= 100 + torch.arange(R)[:, None]
    mask[3, 7] = False
    with torch.inference_mode():
        prepared = kernels.attention_mask(mask, torch.bfloat16, h // kv)
        assert prepared.shape == (h // kv * R, W) and prepared.dtype == torch.bfloat16
        y, y2 = kernels.attention(q, k, v, prepared), kernels.attention(q2, k, v, prepared)
        assert torch.equal(kernels.attention(q, k, v, mask), y)
        ref = gqa_attention(q.float(), k.float(), v.float(), mask)  # float32: torch's reference path
    assert y.shape == (1, R, h, hd) and torch.equal(y2[:, 5], y[:, 5])
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    assert kernels.attention_mask(mask, torch.float32, 3) is mask   # float32 keeps the boolean mask


@pytest.mark.parametrize("T, W", [(8, 48), (5, 16)])                # a whole cache's span, and a shorter one
def test_lean_layer_computes_the_forward_bits(T, W):
    """On CPU below float32 the target runs TransformerBlock.lean: every output and every key and value it writes
    equals, bit for bit, what the block's forward computes from the same inputs (the same kernels in one order)."""
    target, _ = random_pair(n_layer=3, n_head=6, n_kv=2, dim=96, device="cpu")
    target = target.to(torch.bfloat16)
    target.setup_caches(48)
    kernels.prepack([target], T)
    g = torch.Generator().manual_seed(1)
    slots = torch.arange(20, 20 + T)
    mask = torch.arange(W)[None] <= slots[:, None]
    with torch.inference_mode():
        rope = target.rope[slots].to(torch.bfloat16)
        prepared = kernels.attention_mask(mask, torch.bfloat16, 3)
        assert prepared is not mask
        cos, sin = rope[:, None].unbind(-2)
        x, f = torch.randn(1, T, 96, generator=g).to(torch.bfloat16), None
        for i, layer in enumerate(target.layers):
            want = layer(x, rope, prepared, slots, residual=f)
            cache = target.kv_store[i].clone()
            target.kv_store[i, ..., slots, :] = torch.randn(2, 1, 2, T, 16, generator=g).to(torch.bfloat16)
            got = layer.lean(x, cos, sin, prepared, slots, f)         # it must write this layer's keys and values
            assert all(torch.equal(a, b) for a, b in zip(want, got))
            assert torch.equal(target.kv_store[i], cache)
            x, f = want[1], want[2]
        assert not torch.equal(*got[1:]) and got[2].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_is_the_first_maximum(dtype):
    """kernels.argmax keeps torch.argmax's contract, ties included (bfloat16 logits tie often)."""
    g = torch.Generator().manual_seed(0)
    for shape in [(49152,), (16, 49152), (4, 17)]:
        x = torch.randint(-3, 4, shape, generator=g).to(dtype)   # many ties
        assert torch.equal(kernels.argmax(x), x.argmax(-1))
        x = torch.randn(shape, generator=g).to(dtype)
        x[..., 9] = x[..., -2] = x.max() + 1                       # two maxima: the first one wins
        assert (kernels.argmax(x) == 9).all()


@pytest.mark.skipif(DEVICE != "cpu", reason="shared rows are the CPU path")
@pytest.mark.parametrize("tree", TREES + [(6, 8, 32)])
def test_shared_rows_greedy_tiny_pair_bfloat16(tree):
    e = load_engine(device="cpu", dtype="bfloat16", max_seq_len=512)
    assert e.shared_rows
    e.configure(*tree)
    accepts = []
    for p in ["t", *held_out_prompts(3)]:
        ids = e.tokenizer.encode(p)
        plain = e.generate(ids, 48, temperature=0, speculative=False, stop_at_eos=False).tokens
        spec = e.generate(ids, 48, temperature=0, stop_at_eos=False)
        assert spec.tokens == plain, p
        accepts += spec.accept_lengths
    assert sum(accepts) / len(accepts) > 1.5 and max(accepts) <= e.max_emit


@pytest.mark.skipif(DEVICE != "cpu", reason="shared rows are the CPU path")
def test_shared_rows_context_end_bfloat16():
    target, draft = random_pair(vocab=96, draft_vocab=48)
    e = Engine(target.to(torch.bfloat16), draft.to(torch.bfloat16), max_seq_len=160)
    e.configure(3, 2, 6)
    ids = [i % 96 for i in range(150)]
    plain = e.generate(ids, 100, temperature=0, speculative=False).tokens
    assert e.generate(ids, 100, temperature=0).tokens == plain and len(plain) == 10
    sampled = e.generate(ids[:20], 30, temperature=0.8, seed=1)                  # sampling: the usual tree
    assert len(sampled.tokens) == 30
