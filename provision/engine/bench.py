"""Baseline vs EAGLE-3 in one run: tokens/s of each, their ratio, mean acceptance length, and
whether greedy outputs are identical. `python -m provision.engine.bench [--device cuda] [--json]`"""
from __future__ import annotations

import argparse
import json

import torch

from .corpus import held_out_prompts
from .generate import Engine


def _sync(engine: Engine):
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def run_bench(engine: Engine, prompts: list[str], max_new_tokens: int = 128, repeats: int = 1) -> dict:
    """Greedy decode every prompt plainly and with speculation, interleaved (fair under noise)."""
    tok = engine.tokenizer
    enc = [tok.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    kw = dict(max_new_tokens=max_new_tokens, temperature=0.0, stop_at_eos=False)
    for spec in (False, True):                                   # warm-up (allocator, kernels)
        engine.generate(enc[0], max_new_tokens=8, speculative=spec, stop_at_eos=False)
    t_plain = t_spec = 0.0
    n_plain = n_spec = 0
    accepts, identical, outputs = [], True, []
    for _ in range(repeats):
        for ids in enc:
            _sync(engine)
            a = engine.generate(ids, speculative=False, **kw)
            _sync(engine)
            b = engine.generate(ids, speculative=True, **kw)
            _sync(engine)
            t_plain, n_plain = t_plain + a.seconds, n_plain + len(a.tokens)
            t_spec, n_spec = t_spec + b.seconds, n_spec + len(b.tokens)
            accepts += b.accept_lengths
            identical &= a.tokens == b.tokens
            outputs.append(b.tokens)
    base, eagle = n_plain / t_plain, n_spec / t_spec
    return {"device": str(engine.device), "prompts": len(enc), "max_new_tokens": max_new_tokens,
            "steps": engine.steps, "topk": engine.topk, "num_draft_tokens": engine.n_tree,
            "baseline_tok_s": round(base, 2), "eagle3_tok_s": round(eagle, 2), "ratio": round(eagle / base, 3),
            "accept_length": round(sum(accepts) / max(len(accepts), 1), 3),
            "greedy_identical": identical, "outputs": outputs[: len(enc)]}


def add_engine_args(ap: argparse.ArgumentParser):
    ap.add_argument("--model", help="target checkpoint directory (default: the bundled tiny pair)")
    ap.add_argument("--draft", help="EAGLE-3 draft directory (default: MODEL/draft)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--num-draft-tokens", type=int, default=16, help="verified tokens, root included")


def main(argv=None):
    from .errors import EngineError
    from .loading import load_engine

    ap = argparse.ArgumentParser(description=__doc__)
    add_engine_args(ap)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (0: torch default; 1 suits the tiny pair)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        eng = load_engine(a.model, a.draft, a.device, a.dtype, a.max_seq_len, a.steps, a.topk, a.num_draft_tokens)
        r = run_bench(eng, held_out_prompts(a.prompts), a.max_new_tokens, a.repeats)
    except EngineError as e:
        raise SystemExit(f"error: {e}")
    if a.json:
        print(json.dumps(r))
    else:
        print(f"baseline {r['baseline_tok_s']} tok/s  eagle3 {r['eagle3_tok_s']} tok/s  ratio {r['ratio']}  "
              f"accept length {r['accept_length']}  greedy identical {r['greedy_identical']}")


if __name__ == "__main__":
    main()
