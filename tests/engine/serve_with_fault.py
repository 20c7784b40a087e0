"""The engine's own server (`provision.engine.serve`) with one fault injected into the loaded engine, for tests
of the engine probe:  python serve_with_fault.py FAULT [serve arguments...]

    none      the engine as shipped
    accept    a broken accept rule: the root's first drafted child is accepted whatever the target picked there
    position  drafted tokens reach the target one position late (their verification rows get the wrong RoPE)
    rows      no shared rows: on CPU below float32 a plain step runs 1 row and a verification n rows, so the two
              round differently, as they do on a GPU (a healthy engine; greedy outputs may part at near-ties)

The faults wrap the engine's real methods; nothing of the engine is copied here."""
from __future__ import annotations

import sys

import torch

from provision.engine import loading, serve
from provision.engine.generate import Engine

FAULTS = ("none", "accept", "position", "rows")


def accept_fault(engine: Engine):
    real = Engine._accept_greedy

    def accept(logits, tokens, parent, A):
        acc, tgt = real(engine, logits, tokens, parent, A)
        # where the target refused node 1 (the root's first child), the path root → node 1 instead: one chain,
        # as the engine expects of any accept rule, so the engine runs on and emits what the fault makes of it
        return torch.where(acc[1], acc, engine.ar[: len(tokens)] <= 1), tgt
    engine._accept_greedy = accept


def position_fault(engine: Engine):
    """Every verification builds its tree mask as an argument of the target call that follows; that call's
    drafted rows (all but the root) get position + 1."""
    mask, forward = engine._tree_mask, engine.target.forward

    def tree_mask(*a, **kw):
        engine.late = True
        return mask(*a, **kw)

    def late_forward(idx, pos, *a, **kw):
        if engine.__dict__.pop("late", False):
            pos = pos + (torch.arange(pos.shape[0], device=pos.device) > 0)
        return forward(idx, pos, *a, **kw)
    engine._tree_mask, engine.target.forward = tree_mask, late_forward


def rows_fault(engine: Engine):
    engine.shared_rows = False
    engine.configure(engine.steps, engine.topk, engine.n_tree)


def main(argv: list) -> int:
    if not argv or argv[0] not in FAULTS:
        raise SystemExit(f"usage: serve_with_fault.py {{{'|'.join(FAULTS)}}} [serve arguments]")
    fault, real_load = argv[0], loading.load_engine

    def load(*a, **kw):
        engine = real_load(*a, **kw)
        if fault in ("accept", "position"):
            engine.fused = False          # the faults sit in the torch tree path: no fused tree bookkeeping
        if fault != "none":
            globals()[f"{fault}_fault"](engine)
        return engine
    loading.load_engine = load                       # serve.main imports it when called
    return serve.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
