"""Speculative sampling is lossless: on a 6-token vocabulary the first three sampled tokens follow
the target's exact joint distribution (chi-square, fixed seeds); a wrong distribution is rejected."""
import math

import pytest
import torch

from conftest import random_pair
from provision.engine.generate import Engine, probs_from_logits

V, PROMPT = 6, [1, 4, 2, 5]


def chi2_sf(x: float, k: int) -> float:
    """P(chi2_k >= x): the regularized upper incomplete gamma Q(k/2, x/2) (series / continued fraction)."""
    a, x = k / 2.0, x / 2.0
    if x < a + 1:
        term = total = 1.0 / a
        for n in range(1, 1000):
            term *= x / (a + n)
            total += term
        return 1.0 - total * math.exp(-x + a * math.log(x) - math.lgamma(a))
    b, c, d = x + 1 - a, 1e300, 1.0 / (x + 1 - a)
    h = d
    for n in range(1, 1000):
        an = -n * (n - a)
        b += 2
        d = 1.0 / (an * d + b)
        c = b + an / c
        h *= d * c
    return h * math.exp(-x + a * math.log(x) - math.lgamma(a))


def exact_joint(engine: Engine, temperature, top_p, depth=3) -> dict:
    """P(t1..t_depth | PROMPT) from plain target forwards (no speculation)."""
    out = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for seq, p in out.items():
            with torch.inference_mode():
                logits = engine._prefill(PROMPT + list(seq), False)[0, -1]
            q = probs_from_logits(logits, temperature, top_p).cpu().double()
            for t in range(V):
                nxt[seq + (t,)] = p * float(q[t])
        out = nxt
    return out


def chi2(counts: dict, probs: dict, n: int):
    """Chi-square statistic and dof, pooling cells with expected count < 5."""
    stat, pool_o, pool_e, cells = 0.0, 0, 0.0, 0
    for cell, p in probs.items():
        e, o = n * p, counts.get(cell, 0)
        if e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
        else:
            stat, cells = stat + (o - e) ** 2 / e, cells + 1
    if pool_e > 0:
        stat, cells = stat + (pool_o - pool_e) ** 2 / pool_e, cells + 1
    return stat, cells - 1


@pytest.mark.parametrize("temperature,top_p,n,depth", [(1.0, 1.0, 2000, 3), (0.8, 0.9, 1200, 2)])
def test_speculative_sampling_matches_target(temperature, top_p, n, depth):
    target, draft = random_pair(vocab=V, dim=32, n_layer=3, n_head=4, n_kv=2, seed=3, scale=2.0)
    e = Engine(target, draft, max_seq_len=32, steps=2, topk=2, num_draft_tokens=5)
    counts, accepts = {}, []
    for i in range(n):
        out = []
        for chunk in e.stream(PROMPT, depth, temperature=temperature, top_p=top_p, seed=i, stats=accepts):
            out += chunk
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    assert sum(a >= 2 for a in accepts) > 0.2 * len(accepts)        # drafts are often accepted
    assert sum(a == 1 for a in accepts) > 0.1 * len(accepts)        # and often rejected
    stat, dof = chi2(counts, exact_joint(e, temperature, top_p, depth), n)
    print("chi2", stat, dof, chi2_sf(stat, dof))
    assert chi2_sf(stat, dof) > 1e-3, (stat, dof)
    # power: the same samples against a slightly different distribution are rejected
    stat, dof = chi2(counts, exact_joint(e, temperature * 1.25, top_p, depth), n)
    print("power chi2", stat, dof, chi2_sf(stat, dof))
    assert chi2_sf(stat, dof) < 1e-3, (stat, dof)


def test_chi2_sf():
    assert abs(chi2_sf(3.841, 1) - 0.05) < 1e-3 and abs(chi2_sf(18.307, 10) - 0.05) < 1e-3
    assert abs(chi2_sf(124.342, 100) - 0.05) < 1e-3
