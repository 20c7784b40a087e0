"""A model shape with random weights, timed in one run against the copy-bandwidth roofline: plain decode,
target forward at 1/16/64 tokens, a draft step and a whole speculative step (each replayed from a CUDA
graph on GPUs), and transformers on the same weights (static cache, one CUDA graph per step) as the peer."""
from __future__ import annotations

import statistics
import time

import torch

from . import kernels
from .draft import DraftArgs, Eagle3Draft
from .generate import Engine, StepGraphs
from .model import ModelArgs, Transformer
from .settings import DEFAULTS, EngineSettings

SHAPES = {  # name → (target args, draft intermediate size)
    "llama3-8b": dict(vocab_size=128256, dim=4096, n_layer=32, n_head=32, n_local_heads=8, intermediate_size=14336,
                      rope_base=500000.0, max_position_embeddings=8192),
    "tiny": dict(vocab_size=512, dim=128, n_layer=4, n_head=4, n_local_heads=2, intermediate_size=256,
                 max_position_embeddings=1024),
}
TREES = ((5, 4, 16), (4, 4, 16), (3, 4, 16), (2, 4, 10), (3, 2, 6))   # tree shapes timed beside SHAPE_TREE
# the deepest tree of the default width whose step stays within 1.3 plain steps on the 8B shape (1x H200)
SHAPE_TREE = DEFAULTS.replace(steps=2)


def random_pair(shape: str, device, dtype, draft_vocab: int = 32000):
    torch.manual_seed(0)
    ta = ModelArgs(**SHAPES[shape])
    with torch.device(device):
        target = Transformer(ta).to(dtype)
        da = DraftArgs(**{**SHAPES[shape], "n_layer": 1}, draft_vocab_size=min(draft_vocab, ta.vocab_size))
        draft = Eagle3Draft(da).to(dtype)
    for p in list(target.parameters()) + list(draft.parameters()):
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
        else:
            p.data.fill_(1.0)
    return target.eval(), draft.eval()


class Timed:
    """fn captured in a CUDA graph (on CUDA) and timed per replay; plain calls elsewhere."""

    def __init__(self, fn, device):
        self.fn, self.cuda = fn, device.type == "cuda"
        if self.cuda:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = fn()

    def __call__(self):
        return self.graph.replay() if self.cuda else self.fn()

    def seconds(self, reps: int) -> float:
        self()
        _sync(self.cuda)
        t0 = time.perf_counter()
        for _ in range(reps):
            self()
        _sync(self.cuda)
        return (time.perf_counter() - t0) / reps


def per_call(fn, reps: int, cuda: bool) -> float:
    """Seconds per call of fn (queued back to back, as a generation loop does), after one untimed call."""
    fn()
    _sync(cuda)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(cuda)
    return (time.perf_counter() - t0) / reps


def _sync(cuda: bool):
    if cuda:
        torch.cuda.synchronize()


def _median_seconds(fn, reps: int, warmup: int = 5) -> float:
    """Median over `reps` calls of fn, each timed with device events after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev) / 1e3


def copy_bandwidth(device, nbytes: int = 2 << 30, reps: int = 40) -> float:
    """Bytes/s of a device-to-device copy between two `nbytes` buffers (bytes read + bytes written), the
    median of `reps` warmed-up copies: the roofline's denominator. Random data, never zeros."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    t = _median_seconds(lambda: b.copy_(a), reps)
    return 2 * nbytes / t


def read_bandwidth(device, nbytes: int = 2 << 30, reps: int = 40) -> float:
    """Bytes/s of reading one `nbytes` buffer (a sum), for reference: what a GEMV could at best stream."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    return nbytes / _median_seconds(lambda: a.sum(dtype=torch.float32), reps)


@torch.inference_mode()
def shape_bench(shape: str = "llama3-8b", device="cuda", dtype=torch.bfloat16, prompt: int = 128,
                new: int = 256, tree: EngineSettings = SHAPE_TREE, peer: bool = True, trees=None, log=print) -> dict:
    """`tree`: the speculation tree timed throughout (its steps, topk and num_draft_tokens); `trees`: more
    (steps, topk, num_draft_tokens) shapes whose speculative step is timed too (default: TREES on CUDA, none
    elsewhere)."""
    steps, topk, num_draft_tokens = tree.steps, tree.topk, tree.num_draft_tokens
    dev = torch.device(device)
    target, draft = random_pair(shape, dev, dtype)
    eng = Engine(target, draft, None, max_seq_len=prompt + new + 64, steps=steps, topk=topk,
                 num_draft_tokens=num_draft_tokens)
    # bytes a decode step must read: every weight but the embedding table (one row of it is read)
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters()) \
        - target.tok_embeddings.weight.numel() * target.tok_embeddings.weight.element_size()
    cuda = dev.type == "cuda"
    bw = copy_bandwidth(dev) if cuda else float("nan")
    r = {"shape": shape, "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
         "dtype": str(dtype).removeprefix("torch."), "weight_gb": round(weight_bytes / 1e9, 3),
         "copy_bandwidth_tb_s": round(bw / 1e12, 3),
         "read_bandwidth_tb_s": round(read_bandwidth(dev) / 1e12, 3) if cuda else float("nan"),
         "roofline_tok_s": round(bw / weight_bytes, 1),
         "prompt": prompt, "new_tokens": new, "steps": steps, "topk": topk, "num_draft_tokens": num_draft_tokens}
    log(f"{shape}: a decode step reads {r['weight_gb']} GB of weights; device-to-device copy of 2 GiB buffers "
        f"(read + write, median of 40) {r['copy_bandwidth_tb_s']} TB/s; read alone {r['read_bandwidth_tb_s']} TB/s; "
        f"roofline {r['roofline_tok_s']} tok/s")
    ids = torch.randint(0, target.args.vocab_size, (prompt,)).tolist()
    # plain decode: the engine's own step (mask, forward, argmax; a graph replay on CUDA), at context `prompt`
    list(eng.stream(ids, 1, speculative=False))                  # prefill: the step state holds the next input
    t_step = per_call(lambda: eng._decode(prompt, 0.0, 1.0, None), new, cuda)
    r["plain_tok_s"] = round(1 / t_step, 1)
    r["plain_pct_roofline"] = round(100 * r["plain_tok_s"] / r["roofline_tok_s"], 1)
    log(f"plain decode {r['plain_tok_s']} tok/s = {r['plain_pct_roofline']} % of roofline")
    # target forward at T tokens (verification widths), at context `prompt`
    for T in (1, 16, 64):
        x = torch.randint(0, target.args.vocab_size, (1, T), device=dev)
        p = prompt + torch.arange(T, device=dev)
        m = eng.t_arange[None, :] <= p[:, None]
        r[f"forward_{T}_ms"] = round(1e3 * Timed(lambda: target(x, p, m, p, capture=True), dev).seconds(20), 3)
    for T in (16, 64):
        r[f"forward_{T}_vs_1"] = round(r[f"forward_{T}_ms"] / r["forward_1_ms"], 3)
    log(f"target forward 1/16/64 tokens: {r['forward_1_ms']} / {r['forward_16_ms']} / {r['forward_64_ms']} ms")
    # one draft step (topk beams) and the engine's whole speculative step, at context `prompt`
    n = prompt
    hid = torch.randn(1, topk, target.args.dim, device=dev, dtype=dtype)
    xk = torch.randint(0, target.args.vocab_size, (1, topk), device=dev)
    pk = torch.full((topk,), n, device=dev)
    mk = torch.cat([(eng.d_arange[: eng.d_ctx] < n).expand(topk, -1),
                    torch.eye(topk, steps * topk, dtype=torch.bool, device=dev)], -1)
    r["draft_step_ms"] = round(1e3 * Timed(lambda: draft(xk, hid, pk, mk, eng.d_ctx + eng.ar[:topk]), dev)
                               .seconds(20), 3)
    list(eng.stream(ids, 1))                                     # target and draft prefill
    r["spec_step_ms"] = round(1e3 * per_call(lambda: spec_step(eng, n), 20, cuda), 3)
    r["spec_step_in_plain_steps"] = round(r["spec_step_ms"] / (1e3 * t_step), 3)
    log(f"draft step {r['draft_step_ms']} ms; speculative step ({num_draft_tokens}-token tree) "
        f"{r['spec_step_ms']} ms = {r['spec_step_in_plain_steps']} plain steps")
    r.update(stream_figures(eng, ids, new))
    log(f"Engine.stream: plain {r['stream_plain_tok_s']} tok/s, speculative {r['stream_spec_tok_s']} tok/s "
        f"(accept length {r['stream_accept_length']}, random draft); same tokens for the first "
        f"{r['stream_same_prefix']} of {new}")
    r["triton"] = kernels._tk() is not None and cuda
    if r["triton"]:
        r["plain_tok_s_without"] = without(eng, prompt, new)
        log(f"plain decode without each load-time choice: {r['plain_tok_s_without']}")
    r["tuning"] = list(kernels.TIMINGS)
    for tree in (TREES if cuda else ()) if trees is None else trees:
        eng.configure(*tree)
        list(eng.stream(ids, 1))
        ms = 1e3 * per_call(lambda: spec_step(eng, n), 20, cuda)
        r.setdefault("trees", []).append({"steps": tree[0], "topk": tree[1], "num_draft_tokens": tree[2],
                                          "spec_step_ms": round(ms, 3),
                                          "in_plain_steps": round(ms / (1e3 * t_step), 3)})
        log(f"tree steps={tree[0]} topk={tree[1]} tokens={tree[2]}: {r['trees'][-1]['in_plain_steps']} plain steps")
    if peer:
        try:
            r.update(transformers_graph_peer(target, dev, dtype, prompt, new, ids))
            r["plain_vs_transformers"] = round(r["plain_tok_s"] / r["transformers_tok_s"], 3)
            log(f"transformers (static cache, CUDA graph, same weights) {r['transformers_tok_s']} tok/s")
        except Exception as e:  # noqa: BLE001 - the peer is reported, never fatal
            r["transformers_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"transformers peer not measured: {r['transformers_error']}")
    return r


def without(eng: Engine, prompt: int, new: int) -> dict:
    """Plain decode tok/s with each family of Triton kernels chosen at load time left out in turn (fresh graphs),
    and with Triton off altogether: what each contributes, in the same run."""
    def tok_s():
        eng.graphs = StepGraphs(eng.device)
        return round(1 / per_call(lambda: eng._decode(prompt, 0.0, 1.0, None), new, True), 1)
    out = {}
    for name, table in (("attention", kernels.ATTN), ("gemv", kernels.CHOICE)):
        saved = dict(table)
        table.clear()
        out[name] = tok_s()
        table.update(saved)
    if kernels._tk().PDL["on"]:
        kernels.use_pdl(False)
        out["pdl"] = tok_s()
        kernels.use_pdl(True)
    kernels.use_triton(False)
    out["triton"] = tok_s()
    kernels.use_triton(True)
    eng.graphs = StepGraphs(eng.device)
    return out


def spec_step(eng: Engine, n: int):
    """One greedy speculative step of the engine at context n (the step itself advances the context)."""
    eng.n_t.fill_(n)
    eng._spec_step(n, 0.0, 1.0, None)


def stream_figures(eng: Engine, ids: list, new: int) -> dict:
    """The real generation loop, greedy: plain and speculative tok/s (after one warm-up run that captures the
    graphs), and how many leading tokens the two agree on (all of them, up to numerics of different widths)."""
    out = {}
    for spec in (False, True):
        eng.generate(ids, new, speculative=spec)
        res = eng.generate(ids, new, speculative=spec)
        out["spec" if spec else "plain"] = res
    plain, spec = out["plain"], out["spec"]
    same = next((i for i, (a, b) in enumerate(zip(plain.tokens, spec.tokens)) if a != b), len(plain.tokens))
    return {"stream_plain_tok_s": round(len(plain.tokens) / plain.seconds, 1),
            "stream_spec_tok_s": round(len(spec.tokens) / spec.seconds, 1),
            "stream_accept_length": round(spec.accept_length, 2), "stream_same_prefix": same}


def transformers_graph_peer(target: Transformer, dev, dtype, prompt: int, new: int, ids: list) -> dict:
    """transformers' LlamaForCausalLM holding our weights, one decode step per CUDA graph replay."""
    import transformers
    from transformers import StaticCache

    from .loading import hf_config, hf_state

    cfg = transformers.LlamaConfig(**{k: v for k, v in hf_config(target.args).items() if k != "architectures"})
    with torch.device(dev):
        hf = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    hf.load_state_dict(hf_state(target), strict=False, assign=True)
    cache = StaticCache(config=cfg, max_cache_len=prompt + new + 8)
    x = torch.tensor([ids], device=dev)
    logits = hf(x, cache_position=torch.arange(prompt, device=dev), past_key_values=cache, use_cache=True).logits
    tok = logits[:, -1].argmax(-1).view(1, 1)
    pos = torch.full((1,), prompt, device=dev)

    def step():
        out = hf(tok, position_ids=pos.view(1, 1), cache_position=pos, past_key_values=cache, use_cache=True).logits
        tok.copy_(out[:, -1].argmax(-1).view(1, 1))
        pos.add_(1)
    t = Timed(step, dev)
    pos.fill_(prompt)
    return {"transformers_tok_s": round(1 / t.seconds(new), 1), "transformers_version": transformers.__version__}


def main(argv=None):
    import argparse
    import json
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", help="write the JSON here too")
    a = ap.parse_args(argv)
    r = shape_bench(a.shape, a.device, torch.bfloat16 if a.device != "cpu" else torch.float32)
    r["torch"], r["cuda"] = torch.__version__, torch.version.cuda
    print(json.dumps(r, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            f.write(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
