"""The Triton kernels compute what the torch ops they replace compute (fresh random inputs, float64
reference): the GEMV for 1/2/4 rows and on tensor cores for 16+, attention for a few rows, RMSNorm, SiLU·up,
rope. Without a GPU they run in Triton's interpreter; without Triton this module is skipped."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
tk = pytest.importorskip("provision.engine.triton_kernels")
from provision.engine import kernels  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the half type of the tensor-core kernels' checks: Triton's interpreter multiplies bf16 tl.dot operands as raw
# bits (wrong results on CPU), float16 it computes right; on a GPU, bf16, the type the engine serves in
HALF = torch.bfloat16 if DEV == "cuda" else torch.float16


def rel(y, ref):
    return float((y.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("m", [1, 2, 4, 6, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_matches_matmul(m, dtype):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 512, generator=g).to(DEV, dtype)
    w = torch.randn(64, 512, generator=g).to(DEV, dtype)
    want = x.double() @ w.double().T
    for bn, bk, warps in [c for c in kernels.CONFIGS[kernels.rows_bucket(m)] if len(c) == 3]:   # 6 rows: padded
        y = tk.skinny(x, w, bn, min(bk, 512), warps)
        assert not y.isnan().any()
        assert rel(y, want) < (1e-5 if dtype == torch.float32 else 1e-2), (bn, bk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_silu_match_torch(dtype):
    g = torch.Generator().manual_seed(7)
    x, r = (torch.randn(3, 5, 96, generator=g).to(DEV, dtype) for _ in range(2))
    w = torch.randn(96, generator=g).to(DEV, dtype)
    with torch.enable_grad():       # grad enabled: the dispatcher picks the torch path, the reference
        want_h, want = kernels.rms_norm(x, w, 1e-5, r)
        want_silu = kernels.silu_mul(x)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    with torch.enable_grad():
        assert rel(tk.rms_norm(x, w, 1e-5), kernels.rms_norm(x, w, 1e-5)) < tol
    h, y = tk.rms_norm(x, w, 1e-5, r)
    assert rel(h, want_h) < tol and rel(y, want) < tol
    assert rel(tk.silu_mul(x), want_silu) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_kv_matches_torch(dtype):
    from provision.engine.model import ModelArgs, apply_rope, rope_cache
    h, kv, hd, T, S = 4, 2, 32, 5, 24
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(1, T, h + 2 * kv, hd, generator=g).to(DEV, dtype)
    slots = torch.randperm(S, generator=g)[:T].to(DEV)
    rope = rope_cache(S, ModelArgs(dim=h * hd, n_head=h, n_local_heads=kv, rope_base=500000.0))[slots.cpu()]
    rope = rope.to(DEV, dtype)
    kc, vc = (torch.randn(1, kv, S, hd, generator=g).to(DEV, dtype) for _ in range(2))
    want_q, want_k = apply_rope(qkv[:, :, : h + kv].transpose(1, 2), rope).split([h, kv], 1)
    want_kc, want_vc = kc.clone(), vc.clone()
    want_kc.index_copy_(2, slots, want_k)
    want_vc.index_copy_(2, slots, qkv[:, :, h + kv:].transpose(1, 2))
    q = tk.rope_kv(qkv, rope, slots, kc, vc)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel(q, want_q) < tol and rel(kc, want_kc) < tol and torch.equal(vc, want_vc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_softmax_matches_torch(dtype):
    g = torch.Generator().manual_seed(5)
    s = torch.randn(1, 2, 3, 4, 40, generator=g).to(DEV, dtype)
    mask = torch.rand(4, 40, generator=g) < 0.6
    mask[:, 0] = True                                         # every row keeps at least one score
    mask = mask.to(DEV)
    with torch.enable_grad():
        want = kernels.masked_softmax(s, mask, 0.125)
    got = tk.masked_softmax(s, mask, 0.125)
    assert rel(got, want) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(got == 0, ~mask.expand_as(got))       # masked scores get exactly zero weight


@pytest.mark.parametrize("m", [16, 32])
def test_skinny_on_tensor_cores_matches_matmul(m):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 512, generator=g).to(DEV, HALF)
    w = torch.randn(64, 512, generator=g).to(DEV, HALF)
    want = x.double() @ w.double().T
    for cfg in kernels.CONFIGS[16]:
        y = tk.skinny(x, w, cfg[0], min(cfg[1], 512), *cfg[2:])
        assert not y.isnan().any() and rel(y, want) < 1e-2, cfg


@pytest.mark.parametrize("T, W, chunk", [(1, 200, 64), (1, 256, 256), (4, 320, 128), (16, 128, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_attend_matches_torch(T, W, chunk, dtype):
    from provision.engine.model import gqa_attention
    h, kv, hd, S = 8, 2, 32, 512
    g = torch.Generator().manual_seed(T * W)
    q = torch.randn(1, h, T, hd, generator=g).to(DEV, dtype)
    kc, vc = (torch.randn(1, kv, S, hd, generator=g).to(DEV, dtype) for _ in range(2))
    mask = torch.rand(T, W, generator=g) < 0.7
    mask[:, 0] = True                                         # every row keeps at least one slot
    mask = mask.to(DEV)
    k, v = kc[:, :, :W], vc[:, :, :W]
    with torch.enable_grad():
        want = gqa_attention(q, k, v, mask)                   # bmm, masked softmax, bmm
    got = tk.attend(q, k, v, mask, chunk)
    assert got.shape == want.shape and not got.isnan().any()
    assert rel(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_topk_logprob_matches_torch():
    g = torch.Generator().manual_seed(11)
    for R, V, k in [(1, 41, 4), (4, 41, 4), (3, 2500, 5)]:            # one chunk; several chunks
        x = torch.randn(R, V, generator=g).to(DEV)
        want_v, want_i = torch.log_softmax(x.float(), -1).topk(k)
        v, i = tk.topk_logprob(x, k)
        assert torch.equal(i, want_i) and rel(v, want_v) < 1e-6


@pytest.mark.parametrize("tree", [(5, 4, 16), (3, 2, 6), (4, 3, 10), (3, 1, 4)])
def test_fused_tree_matches_torch(tree, monkeypatch):
    """The speculative tree from the Triton bookkeeping equals the torch one: tokens, parents, ancestors, and the
    verification's positions, slots and mask (random pair: no ties)."""
    from conftest import random_pair
    from provision.engine.generate import Engine
    target, draft = random_pair(vocab=96, draft_vocab=48, device=DEV)
    e = Engine(target, draft, max_seq_len=160, graphs=False)
    e.configure(*tree)
    ids = torch.randint(0, 96, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        e._spec_start(ids, 0.0, 1.0, None)
        n, Wd, Wt = e.n_t, 64, 128
        tokens, parent, A = e._draft_tree(Wd)
        want = (tokens, parent, A, n + A.sum(-1) - 1, n + e.ar[: e.n_tree], e._tree_mask(A, n, Wt))
        got = e._draft_tree_fused(tk, Wd, Wt)
    for name, x, y in zip(("tokens", "parent", "A", "pos", "slots", "mask"), got, want):
        assert torch.equal(x, y), name
    monkeypatch.setattr(kernels, "tree_ops", lambda device: tk)
    assert e._fused_agrees()                     # the engine's own check at configure says the same
    monkeypatch.setattr(tk, "accept", lambda *a: (torch.zeros(7, dtype=torch.long, device=DEV),) * 5)
    assert not e._fused_agrees()                 # and it notices a wrong kernel


def test_accept_matches_torch():
    """Greedy acceptance in one kernel: the torch path's count, tokens and path, on trees where the target agrees
    with a random part of the draft."""
    from conftest import random_pair
    from provision.engine.generate import Engine
    target, draft = random_pair(vocab=96, draft_vocab=48, device=DEV)
    e = Engine(target, draft, max_seq_len=160, graphs=False)
    e.configure(5, 4, 16)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 96, (21,), generator=g).tolist()
    with torch.inference_mode():
        e._spec_start(ids, 0.0, 1.0, None)
        tokens, parent, A = e._draft_tree(64)
        for trial in range(6):
            tgt = torch.randint(0, 96, (16,), generator=g).to(DEV)
            agree = torch.rand(16, generator=g).to(DEV) < trial / 5          # from none to all
            tgt[parent] = torch.where(agree, tokens, tgt[parent])             # where it agrees with child i
            logits = torch.nn.functional.one_hot(tgt, 96).float()
            count, out, path = e._accepted(*e._accept_greedy(logits, tokens, parent, A))
            res, p, src, dst, last = tk.accept(tgt, tokens, parent, A, e.n_t, 6)
            assert int(res[0]) == int(count) and int(last) == int(count) - 1
            assert torch.equal(res[1:], out) and torch.equal(p, path)
            assert torch.equal(src, e.n_t + path) and torch.equal(dst, e.n_t + e.ar[:6])
