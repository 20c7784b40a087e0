"""Shared fixtures for the engine tests: the device (PROVISION_TEST_DEVICE) and random model pairs."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from provision.engine.draft import DraftArgs, Eagle3Draft
from provision.engine.model import ModelArgs, Transformer

DEVICE = os.environ.get("PROVISION_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    torch.set_num_threads(1)   # tiny models: one thread is faster, and steady on a small CI runner
else:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(autouse=True, scope="module")    # before the modules' own module-scoped models
def plain_sys_intern():
    """sys.intern as Python has it while an engine test runs. A test of this process that reached a host over
    ssh has loaded Ansible (provision's transport builds its ssh command line with Ansible's plugin), which
    wraps sys.intern in an object torch's compiler refuses when it first loads. The product never has both in
    one process: the engine runs in a generation's own interpreter."""
    wrapped = sys.intern
    plain = getattr(type(wrapped), "unpatched_implementation", None)
    if plain is None:
        yield
        return
    sys.intern = plain
    try:
        yield
    finally:
        sys.intern = wrapped


def random_pair(vocab=64, dim=64, n_layer=6, n_head=4, n_kv=2, draft_vocab=None, seed=0, scale=1.0,
                device=DEVICE):
    """A random target (float32) and a random EAGLE-3 draft sharing its embeddings."""
    torch.manual_seed(seed)
    ta = ModelArgs(vocab_size=vocab, dim=dim, n_layer=n_layer, n_head=n_head, n_local_heads=n_kv,
                   intermediate_size=2 * dim, max_position_embeddings=512)
    target = Transformer(ta)
    for p in target.parameters():
        torch.nn.init.normal_(p, std=scale * p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
        if p.dim() == 1:
            p.data += 1.0
    dv = draft_vocab or vocab
    da = DraftArgs(vocab_size=vocab, dim=dim, n_layer=1, n_head=n_head, n_local_heads=n_kv,
                   intermediate_size=2 * dim, max_position_embeddings=512, draft_vocab_size=dv)
    draft = Eagle3Draft(da)
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=scale * p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
        if p.dim() == 1:
            p.data += 1.0
    if dv < vocab:  # draft id i → target id 2i (a non-trivial d2t)
        draft.d2t.copy_(torch.arange(dv) * 2 - torch.arange(dv))
    return target.to(device), draft.to(device)


@pytest.fixture(scope="session")
def device():
    return DEVICE
