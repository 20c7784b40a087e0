"""Baseline vs EAGLE-3 in one run: tokens/s of each, their ratio, mean acceptance length, and
whether greedy outputs are identical. `python -m provision.engine.bench [--device cuda] [--json]`"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from .corpus import held_out_prompts
from .errors import EngineError
from .generate import Engine


def _sync(engine: Engine):
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def run_bench(engine: Engine, prompts: list, max_new_tokens: int = 128, repeats: int = 1,
              stop_at_eos: bool = True, peer=None) -> dict:
    """Greedy decode every prompt plainly and with speculation, interleaved (fair under noise); each answer
    ends at the end-of-turn token unless `stop_at_eos` is off (then every answer is max_new_tokens long).
    With `peer` (from transformers_peer), it decodes each prompt too, right after the engine's two runs."""
    tok = engine.tokenizer
    enc = [tok.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    kw = dict(max_new_tokens=max_new_tokens, temperature=0.0, stop_at_eos=stop_at_eos)
    load0 = os.getloadavg()[0]
    capture = engine.capture()                                   # every step graph, before any timing
    t0 = time.perf_counter()
    for ids in enc:              # warm-up: each prompt's prefill shapes (kernels compiled per shape), each mode
        for spec in (False, True):
            engine.generate(ids, max_new_tokens=4, speculative=spec, stop_at_eos=False)
    warm, graphs = time.perf_counter() - t0, len(engine.graphs.graphs)
    t_plain = t_spec = 0.0
    n_plain = n_spec = 0
    accepts, identical, outputs, plain = [], True, [], []
    t_peer, n_peer, peer_same = 0.0, 0, True
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
            plain.append(a.tokens)
            if peer is not None:
                t0 = time.perf_counter()
                out = peer(ids, max_new_tokens)
                _sync(engine)
                t_peer, n_peer = t_peer + time.perf_counter() - t0, n_peer + len(out)
                peer_same &= out == (a.tokens if stop_at_eos else a.tokens[: len(out)])   # it stops at end of turn
    base, eagle = n_plain / t_plain, n_spec / t_spec
    r = {"device": str(engine.device), "dtype": str(engine.target.output.weight.dtype).removeprefix("torch."),
            "dtype_note": engine.dtype_note,
            "prompts": len(enc), "max_new_tokens": max_new_tokens, "stop_at_eos": stop_at_eos,
            "tokens": n_plain, "shared_rows": engine.shared_rows,
            "load_average_1min": {"start": round(load0, 2), "end": round(os.getloadavg()[0], 2)},
            "steps": engine.steps, "topk": engine.topk, "num_draft_tokens": engine.n_tree,
            "baseline_tok_s": round(base, 2), "eagle3_tok_s": round(eagle, 2), "ratio": round(eagle / base, 3),
            "accept_length": round(sum(accepts) / max(len(accepts), 1), 3),
            "greedy_identical": identical, "outputs": outputs[: len(enc)], "plain_outputs": plain[: len(enc)],
            "tree": "chain" if engine.topk == 1 else "tree",
            "capture_s": capture["seconds"], "warm_up_s": round(warm, 3), "graphs": len(engine.graphs.graphs),
            "graphs_captured_while_timed": len(engine.graphs.graphs) - graphs}
    if engine.device.type == "cuda":
        r.update(step_costs(engine, enc[0]))
    if peer is not None:
        r.update(transformers_tok_s=round(n_peer / t_peer, 2), transformers_same_tokens=peer_same,
                 plain_vs_transformers=round(base / (n_peer / t_peer), 3))
    return r


def step_costs(engine: Engine, ids: list, reps: int = 50) -> dict:
    """Milliseconds of one plain and one greedy speculative step at the prompt's context, steps queued back to
    back (graph replays), and their ratio."""
    from .shape_bench import per_call, spec_step
    n, cuda = len(ids), engine.device.type == "cuda"
    list(engine.stream(ids, 1, speculative=False))
    with torch.inference_mode():
        plain = per_call(lambda: engine._decode(n, 0.0, 1.0, None), reps, cuda)
    list(engine.stream(ids, 1))
    with torch.inference_mode():
        spec = per_call(lambda: spec_step(engine, n), reps, cuda)
    return {"plain_step_ms": round(1e3 * plain, 4), "spec_step_ms": round(1e3 * spec, 4),
            "spec_step_in_plain_steps": round(spec / plain, 3)}


def encode_prompts(engine: Engine, chat: bool, n: int) -> list:
    """Held-out prompts as token ids: chat messages through the model's template, or plain text."""
    from .corpus import held_out_chat_prompts
    tok = engine.tokenizer
    if not chat:
        return [tok.encode(p) for p in held_out_prompts(n)]
    if getattr(tok, "chat_template", None) is None:
        raise EngineError("--chat needs a model with a chat template")
    return [tok.encode_chat(tok.chat_template.render([{"role": "user", "content": p}]))
            for p in held_out_chat_prompts(n)]


def transformers_peer(model_dir, engine: Engine):
    """transformers' LlamaForCausalLM on the same weights, dtype and threads, as a bench peer: (ids, max new
    tokens) → its greedy tokens (it stops at the end of turn). Warmed up once."""
    import transformers
    dev = engine.device
    hf = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), dtype=engine.target.output.weight.dtype)
    hf = hf.to(dev).eval()
    kw = dict(do_sample=False, top_p=None, top_k=None, temperature=None)

    def generate(ids: list, max_new_tokens: int) -> list:
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids], device=dev), max_new_tokens=max_new_tokens, **kw)
        return out[0, len(ids):].tolist()
    generate([1, 2, 3], 8)
    return generate


def main(argv=None):
    from .loading import start_engine
    from .settings import add_arguments, from_arguments

    ap = argparse.ArgumentParser(description=__doc__)
    add_arguments(ap)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--fixed-length", action="store_true", help="decode max-new-tokens past the end of turn")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        eng = start_engine(a.model, a.draft, from_arguments(a))
        r = run_bench(eng, held_out_prompts(a.prompts), a.max_new_tokens, a.repeats, not a.fixed_length)
    except EngineError as e:
        raise SystemExit(f"error: {e}")
    if a.json:
        print(json.dumps(r))
    else:
        print(f"{r['dtype']} on {r['device']}" + (f"; {r['dtype_note']}" if r["dtype_note"] else ""))
        print(f"baseline {r['baseline_tok_s']} tok/s  eagle3 {r['eagle3_tok_s']} tok/s  ratio {r['ratio']}  "
              f"accept length {r['accept_length']}  greedy identical {r['greedy_identical']}  "
              f"graphs {r['graphs']} captured in {r['capture_s']} s")


if __name__ == "__main__":
    main()
