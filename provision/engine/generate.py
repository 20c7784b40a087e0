"""Decoding: plain, and EAGLE-3 tree speculation (draft tree → one masked verification →
greedy or lossless sampling acceptance → KV compaction). Batch 1, static shapes, the step's state in
device tensors: on CUDA every step replays a captured graph; the one host read per step is what it emitted.
On CPU in bfloat16, every target step runs the same rows over one span, and greedy emits only exact rows."""
from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch import Tensor

from . import kernels
from .draft import Eagle3Draft
from .errors import EngineError
from .model import Transformer
from .settings import DEFAULTS


@dataclass
class Result:
    tokens: list                                       # generated ids (prompt excluded)
    accept_lengths: list = field(default_factory=list)  # tokens per verification, bonus included
    seconds: float = 0.0
    prompt_tokens: int = 0
    finish_reason: str = "length"
    margins: list = field(default_factory=list)         # plain greedy, on request: per token, see Engine.stream

    @property
    def accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0


MARGIN_TOP = 4                                         # tokens a margin names: the emitted one and the next three


def step_margin(logits: Tensor) -> Tensor:
    """[V] logits → float32 [1 + 2k] (k = MARGIN_TOP): max |logit|, the k largest logits' ids, and each one's
    gap below the largest (0 first), as the step computed them (in its dtype)."""
    top = logits.topk(MARGIN_TOP)
    v = top.values.float()
    return torch.cat([logits.abs().max().float().view(1), top.indices.float(), v[0] - v])


def probs_from_logits(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """[..., V] logits → sampling distribution after temperature and nucleus (top_p) filtering."""
    p = torch.softmax(logits.float() / max(temperature, 1e-5), dim=-1)
    if top_p < 1.0:
        sp, si = p.sort(dim=-1, descending=True)
        drop = (sp.cumsum(-1) - sp) > top_p              # keep the smallest prefix reaching top_p
        sp = sp.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter_(-1, si, sp)
        p = p / p.sum(-1, keepdim=True)
    return p


class StepGraphs:
    """One CUDA graph per (step, span bucket): the first call runs the step for real and captures it, later
    calls replay it. Off CUDA, or disabled, steps run eagerly. Steps read and write only static tensors.
    The graphs share one memory pool; `seconds` is the time spent capturing them."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.on = enabled and device.type == "cuda"
        self.graphs: dict = {}
        self.pool = torch.cuda.graph_pool_handle() if self.on else None
        self.seconds = 0.0

    def run(self, key, fn):
        if not self.on:
            return fn()
        hit = self.graphs.get(key)
        if hit is not None:
            hit[0].replay()
            return hit[1]
        t0 = time.perf_counter()
        side, main = torch.cuda.Stream(), torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            out = fn()                              # the real step; it also warms up library handles
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            static = fn()                           # recorded, not run
        self.graphs[key] = (graph, static)
        self.seconds += time.perf_counter() - t0
        return out


class Emitter:
    """Brings steps' emitted ids (and, on request, a few float32 values each) to the host in order: on CUDA
    through pinned memory and an event per step, so that `depth` steps can be queued before the host waits."""

    def __init__(self, device: torch.device, size: int, depth: int = 2, nvals: int = 1 + 2 * MARGIN_TOP):
        self.cuda, self.depth = device.type == "cuda", depth
        self.host = torch.empty(depth, size, dtype=torch.long, pin_memory=self.cuda)
        self.vals = torch.empty(depth, nvals, dtype=torch.float32, pin_memory=self.cuda)
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(depth)]
        self.queued: deque = deque()
        self.pushed = 0

    def push(self, ids: Tensor, vals: Optional[Tensor] = None):
        if len(self.queued) == self.depth:
            raise RuntimeError("emitter full")               # a bug in the caller, never the user's input
        slot, k = self.pushed % self.depth, ids.numel()
        self.host[slot, :k].copy_(ids.view(-1), non_blocking=True)
        if vals is not None:
            self.vals[slot, : vals.numel()].copy_(vals.view(-1), non_blocking=True)
        if self.cuda:
            self.events[slot].record()
        self.queued.append((slot, k))
        self.pushed += 1

    def pop(self, vals: bool = False):
        """The oldest step's ids; with `vals`, (ids, its values)."""
        slot, k = self.queued.popleft()
        if self.cuda:
            self.events[slot].synchronize()
        ids = self.host[slot, :k].tolist()
        return (ids, self.vals[slot].tolist()) if vals else ids

    def clear(self):
        self.queued.clear()


class Engine:
    """A target, an optional EAGLE-3 draft, their static caches and step state (one sequence at a time)."""

    def __init__(self, target: Transformer, draft: Optional[Eagle3Draft] = None, tokenizer=None,
                 max_seq_len: int = DEFAULTS.max_seq_len, steps: int = DEFAULTS.steps, topk: int = DEFAULTS.topk,
                 num_draft_tokens: int = DEFAULTS.num_draft_tokens, stop_ids=None, graphs: bool = True):
        self.target, self.draft, self.tokenizer = target.eval(), draft, tokenizer
        self.device = target.output.weight.device
        self.max_seq_len = min(max_seq_len, target.args.max_position_embeddings)
        eos = getattr(tokenizer, "eos_id", None)
        self.stop_ids = set(stop_ids if stop_ids is not None else [] if eos is None else [eos])   # end of turn
        self.use_graphs = graphs
        self.dtype_note = ""                          # why the loader chose the dtype (`auto`), else empty
        # shared rows: on CPU below float32 the GEMM kernel (and its rounding) depends on the row count, so
        # plain decoding and verification both run num_draft_tokens rows over the whole cache (see _spec_rows)
        self.shared_rows = self.device.type == "cpu" and target.output.weight.dtype != torch.float32
        self.configure(steps, topk, num_draft_tokens)

    def configure(self, steps: int, topk: int, num_draft_tokens: int = 0):
        """Tree shape: `steps` draft forwards of `topk` beams; verify `num_draft_tokens` (root included)."""
        most = 1 + topk + (steps - 1) * topk * topk
        n = num_draft_tokens or (steps + 1 if topk == 1 else min(most, 2 * steps * topk))
        if steps < 1 or topk < 1 or not 2 <= n <= most:
            raise EngineError(f"tree settings steps={steps} topk={topk} num_draft_tokens={n}: need steps, topk >= 1 "
                              f"and 2 <= num_draft_tokens <= {most}")
        self.steps, self.topk, self.n_tree = steps, topk, n
        self.rows = n if self.shared_rows else 1      # rows of every plain decoding step
        self.max_emit = min(n, 2 * steps + 1 if self.shared_rows else steps + 1)   # tokens one step can emit
        if self.shared_rows:
            kernels.prepack([self.target] + ([self.draft] if self.draft is not None else []), rows=n)
        S, dev = self.max_seq_len, self.device
        self.t_slots = S + n                          # context + one verification tree
        self.target.setup_caches(self.t_slots)
        self.t_arange = torch.arange(self.t_slots, device=dev)
        if self.draft is not None:
            self.d_ctx = S + steps + 2                # context + padded extend
            self.draft.setup_caches(self.d_ctx + steps * topk, self.target.tok_embeddings)
            self.d_arange = torch.arange(self.d_ctx + steps * topk, device=dev)
        self.ar = torch.arange(max(n, 2 * steps + 1, topk * topk), device=dev)   # 2*steps+1: see _spec_rows
        # step state: context length n (the slot of the token fed next), that token (plain: the next input;
        # speculation: the tree's root), and the draft's logits and state for the root's children
        p = self.target.output.weight
        self.n_t = torch.zeros(1, dtype=torch.long, device=dev)
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        if self.draft is not None:
            self.dlog = torch.zeros(self.draft.args.draft_vocab_size, dtype=p.dtype, device=dev)
            self.dhid = torch.zeros(1, self.draft.args.dim, dtype=p.dtype, device=dev)
            self.root_score, self.root_beam = torch.zeros(1, device=dev), torch.full((1,), -1, device=dev)
        L, aux = min(steps + 1, n), len(self.target.args.aux_layers) * self.target.args.dim
        # a sampled acceptance runs between two graphs and hands over: count, tokens, nodes, target features
        self.acc = (torch.zeros((), dtype=torch.long, device=dev), torch.zeros(L, dtype=torch.long, device=dev),
                    torch.zeros(L, dtype=torch.long, device=dev), torch.zeros(1, n, aux, dtype=p.dtype, device=dev))
        self.graphs = StepGraphs(dev, self.use_graphs)                # the caches moved: graphs start afresh
        if self.graphs.on:                                  # GEMVs and attention per shape: measured, kept
            rows = sorted({1, topk, n, L})                  # decode, draft, verification, draft extension
            kernels.tune([self.target] + ([self.draft] if self.draft is not None else []),
                         rows=[r for r in rows if kernels.rows_bucket(r) in kernels.CONFIGS])
            for m, top in ((self.target, self.t_slots), (self.draft, getattr(self, "d_ctx", 0))):
                if m is not None:
                    a = m.args
                    kernels.tune_attention(a.n_head, a.n_local_heads, a.head_dim, p.dtype, dev, rows,
                                           [256 << i for i in range(max(1, (top - 1).bit_length() - 7))])
        self.emit = Emitter(dev, L + 1)
        self.fused = self.draft is not None and self._fused_agrees()

    def capture(self) -> dict:
        """Capture every greedy step's graph now, plain and speculative, one per span bucket up to the whole
        context (at most two kinds × (log2(max_seq_len / 256) + 2) buckets, in one shared pool), so that no
        request pays a capture. Leaves the step state undefined: every request starts with a prefill."""
        if not self.graphs.on:
            return {"graphs": 0, "seconds": 0.0}
        t0, before, seen = time.perf_counter(), len(self.graphs.graphs), set()
        S, N = self.max_seq_len, self.n_tree
        with torch.inference_mode():
            for n in range(1, S):
                if self._target_span(n + 1) not in seen:
                    seen.add(self._target_span(n + 1))
                    self._decode(n, 0.0, 1.0, None)
                spans = (self._target_span(n + N), self._span(n + self.steps + 1, self.d_ctx))
                if self.draft is not None and n + N <= S and spans not in seen:
                    seen.add(spans)
                    self.n_t.fill_(n)
                    self._spec_step(n, 0.0, 1.0, None)
        torch.cuda.synchronize(self.device)
        return {"graphs": len(self.graphs.graphs) - before, "seconds": round(time.perf_counter() - t0, 3)}

    def _w(self, x: int) -> int:
        """Attention span covering slots [0, x), rounded up to 64: few distinct shapes, short attention."""
        return -(-x // 64) * 64

    def _target_span(self, x: int) -> int:
        """The target's attention span for slots [0, x): the whole cache with shared rows (one reduction length)."""
        return self.t_slots if self.shared_rows else self._span(x, self.t_slots)

    def _span(self, x: int, cap: int) -> int:
        """Span of a graphed step covering slots [0, x): powers of two from 256 (few graphs), else `_w`."""
        if not self.graphs.on:
            return min(self._w(x), cap)
        w = 256
        while w < x:
            w *= 2
        return min(w, cap)

    # ---- plain decoding -------------------------------------------------------------------
    def _prefill(self, ids: list, capture: bool):
        T = len(ids)
        pos = torch.arange(T, device=self.device)
        mask = self.t_arange[None, : self._w(T)] <= pos[:, None]              # [T, W] causal
        return self.target(torch.tensor([ids], device=self.device), pos, mask, pos, capture=capture)

    def _pick(self, logits: Tensor, temperature: float, top_p: float, g) -> Tensor:
        if temperature <= 0:
            return kernels.argmax(logits)
        return torch.multinomial(probs_from_logits(logits, temperature, top_p), 1, generator=g).squeeze(-1)

    def _decode_fn(self, W: int, greedy: bool, margins: bool = False):
        R = self.rows                                 # the one token repeated R times (identical rows)
        def step():
            n = self.n_t.expand(R)
            logits = self.target(self.tok.view(1, 1).expand(1, R), n, (self.t_arange[:W] <= n[:1])[None].expand(R, W),
                                 n)[0, 0]
            if greedy:
                self.tok.copy_(kernels.argmax(logits))
            return (logits, step_margin(logits)) if margins else (logits, None)
        return step

    def _decode(self, n: int, temperature: float, top_p: float, g, margins: bool = False):
        """Queue one step feeding `tok` at position n; `tok` becomes the next token. No host sync. Returns
        the step's margin tensor (with `margins`, greedy only), else None."""
        self.n_t.fill_(n)
        W, greedy = self._target_span(n + 1), temperature <= 0
        logits, margin = self.graphs.run(("decode", W, greedy, margins), self._decode_fn(W, greedy, margins))
        if not greedy:
            self.tok.copy_(self._pick(logits, temperature, top_p, g))
        return margin

    def _decode_loop(self, n: int, left: int, temperature, top_p, g, margins: Optional[list] = None) -> Iterator[list]:
        """Plain steps from `tok` at position n, up to `left` tokens. Two steps stay queued: the device
        runs the next while the host reads one and the caller consumes it. `margins` collects each emitted
        token's margin (see `stream`), brought back with it."""
        total, issued, want = max(0, min(left, self.max_seq_len - n)), 0, margins is not None
        for _ in range(total):
            while issued < total and len(self.emit.queued) < 2:
                self.emit.push(self.tok, self._decode(n + issued, temperature, top_p, g, want))
                issued += 1
            yield self._popped(margins), 0

    def _popped(self, margins: Optional[list]) -> list:
        """The oldest queued step's ids; its values go to `margins` when that is a list."""
        if margins is None:
            return self.emit.pop()
        ids, vals = self.emit.pop(vals=True)
        k = MARGIN_TOP
        top = tuple((int(t), g) for t, g in zip(vals[1: 1 + k], vals[1 + k: 1 + 2 * k]))
        margins.append((top[1][1], vals[0], top))
        return ids

    def _plain(self, ids, max_new, temperature, top_p, g, margins: Optional[list] = None) -> Iterator[list]:
        self.emit.clear()
        logits = self._prefill(ids, False)[0, -1]
        self.tok.copy_(self._pick(logits, temperature, top_p, g))
        self.emit.push(self.tok, step_margin(logits) if margins is not None else None)
        yield self._popped(margins), 0
        yield from self._decode_loop(len(ids), max_new - 1, temperature, top_p, g, margins)

    # ---- speculation ----------------------------------------------------------------------
    def _draft_tree(self, W: int, N: Optional[int] = None):
        """Grow `steps` levels of `topk` beams from the root `tok`; keep the best N-1 nodes (N = n_tree) by path
        log-prob. Returns tokens [N] (root first), parent [N], ancestor matrix [N, N] (parents first)."""
        K, N, dr, n = self.topk, N if N is not None else self.n_tree, self.draft, self.n_t
        score, di = torch.log_softmax(self.dlog.float(), -1).topk(K)           # level 1: [K]
        tok = dr.to_target(di)
        c_tok, c_score, c_par = [tok], [score], [self.ar.new_full((K,), -1)]
        beam_idx, hid = self.ar[:K], self.dhid.expand(K, -1)                    # [K], [K, H]
        anc = torch.zeros(K, self.steps * K, dtype=torch.bool, device=self.device)
        ctx = (self.d_arange[:W] < n).expand(K, -1)                             # [K, W]; scratch slots follow
        for s in range(1, self.steps):
            own = (s - 1) * K + self.ar[:K]
            anc = anc.clone()
            anc[self.ar[:K], own] = self.ar[:K] >= 0                           # True, as a device tensor
            pos = (n + (s - 1)).expand(K)
            logits, h = dr(tok[None], hid[None], pos, torch.cat([ctx, anc], -1), W + own)
            cs, ci = torch.log_softmax(logits[0].float(), -1).topk(K)          # [K, K]
            child = (score[:, None] + cs).flatten()                              # [K*K]
            base = sum(len(x) for x in c_tok)
            c_tok.append(dr.to_target(ci).flatten())
            c_score.append(child)
            c_par.append(beam_idx.repeat_interleave(K))
            score, sel = child.topk(K)
            par = sel // K
            tok, hid, anc, beam_idx = c_tok[-1][sel], h[0][par], anc[par], base + sel
        c_tok, c_score, c_par = torch.cat(c_tok), torch.cat(c_score), torch.cat(c_par)
        # stable sort: on ties a parent (lower index, score >= child's) wins, so the kept set is a tree
        keep = c_score.sort(descending=True, stable=True).indices[: N - 1].sort().values
        pos_of = torch.zeros(len(c_tok), dtype=torch.long, device=self.device)
        pos_of[keep] = self.ar[1:N]
        cp = c_par[keep]
        parent = torch.cat([self.ar[:1], torch.where(cp < 0, 0, pos_of[cp.clamp(min=0)])])   # [N]
        tokens = torch.cat([self.tok, c_tok[keep]])
        return tokens, parent, self._ancestors(parent, self.steps)

    def _draft_tree_fused(self, tk, W: int, Wt: int) -> tuple:
        """_draft_tree and the verification's inputs in Triton kernels (two per level, one for the tree): the same
        tree, but for ties. Returns tokens, parent, ancestors [N, N], positions, slots, mask [N, Wt]."""
        K, S, dr, n, dev = self.topk, self.steps, self.draft, self.n_t, self.device
        M = K + (S - 1) * K * K
        cand = (torch.empty(M, dtype=torch.long, device=dev), torch.empty(M, device=dev),
                torch.empty(M, dtype=torch.long, device=dev))
        beams = (torch.empty(K, device=dev), *(torch.empty(K, dtype=torch.long, device=dev) for _ in range(3)),
                 torch.empty(K, self.dhid.shape[-1], dtype=self.dhid.dtype, device=dev))
        mask = torch.empty(K, W + S * K, dtype=torch.bool, device=dev)          # context, then scratch slots
        mask[:, :W] = self.d_arange[:W] < n
        tk.expand(*tk.topk_logprob(self.dlog[None], K), self.root_score, self.root_beam, dr.d2t, cand, 0, beams,
                  self.dhid, mask, W, 0, root=True)
        pos, slots = n + self.ar[:S], W + self.ar[: S * K]
        for s in range(1, S):
            logits, h = dr(beams[1][None], beams[4][None], pos[s - 1].expand(K), mask, slots[(s - 1) * K: s * K])
            tk.expand(*tk.topk_logprob(logits[0], K), beams[0], beams[2], dr.d2t, cand, K + (s - 1) * K * K, beams,
                      h[0], mask, W, s * K, root=False)
        return tk.tree(cand, self.tok, n, self.n_tree, S, Wt)

    def _tree_ops(self):
        return kernels.tree_ops(self.device) if self.fused else None

    @torch.inference_mode()
    def _fused_agrees(self) -> bool:
        """Whether the Triton tree bookkeeping (where there is some) runs here and gives what the torch one
        gives: one tree from random draft state and its acceptance, compared at configure."""
        tk = kernels.tree_ops(self.device)
        if tk is None:
            return False
        g = torch.Generator(device=self.device).manual_seed(0)
        self.dlog.normal_(generator=g)
        self.dhid.normal_(generator=g)
        self.n_t.fill_(1)
        Wd, Wt, N = self._span(self.steps + 2, self.d_ctx), self._target_span(1 + self.n_tree), self.n_tree
        try:
            tokens, parent, A = self._draft_tree(Wd)
            got = self._draft_tree_fused(tk, Wd, Wt)
            tgt = torch.randint(0, self.target.args.vocab_size, (N,), generator=g, device=self.device)
            tgt[parent[1:]] = tokens[1:]                                         # a path the target agrees with
            count, out, path = self._accepted(*self._accept_greedy(
                torch.nn.functional.one_hot(tgt, self.target.args.vocab_size).float(), tokens, parent, A))
            res, p, *_ = tk.accept(tgt, tokens, parent, A, self.n_t, path.shape[0])
        except kernels.triton_errors() + (RuntimeError,):
            return False
        want = (tokens, parent, A, self.n_t + A.sum(-1) - 1, self._tree_mask(A, self.n_t, Wt), count, out, path)
        return all(torch.equal(x, y) for x, y in zip((*got[:4], got[5], res[0], res[1:], p), want))

    def _ancestors(self, parent: Tensor, depth: int) -> Tensor:
        """[N, N] bool: A[i, j] when node j is node i or one of its ancestors (trees at most `depth` deep)."""
        eye = torch.eye(len(parent), dtype=torch.bool, device=self.device)
        A = eye
        for _ in range(depth):
            A = eye | A[parent]
        return A

    def _tree_mask(self, A: Tensor, n, W: int) -> Tensor:
        """[N, W] attention mask of a tree at slots n..n+N-1: the context [0, n) and each node's ancestors."""
        N, col = len(A), self.t_arange[:W]
        rel = col - n
        return (col < n)[None] | (A[:, rel.clamp(0, N - 1)] & ((rel >= 0) & (rel < N))[None])

    def _accept_greedy(self, logits, tokens, parent, A):
        tgt = kernels.argmax(logits)                                             # [N]
        correct = (tokens == tgt[parent]) | (self.ar[: len(tokens)] == 0)       # the root is given
        acc = ~(A & ~correct[None]).any(-1)                                      # nodes on the accepted path
        return acc, tgt

    def _accept_sample(self, logits, tokens, parent, A, temperature, top_p, g):
        """Lossless for deterministic candidates: try each child t in order with prob p(t)/residual."""
        N, V = logits.shape
        p = probs_from_logits(logits, temperature, top_p)                       # [N, V]
        cur = self.ar[0]
        done = torch.zeros((), dtype=torch.bool, device=self.device)
        acc = torch.zeros(N, dtype=torch.bool, device=self.device)
        acc[0] = True
        choice = torch.zeros(N, dtype=torch.long, device=self.device)
        nodes = self.ar[:N]
        for _ in range(self.steps + 1):
            kids = (parent == cur) & (nodes != 0)                               # [N]
            pc = p[cur]                                                           # [V]
            pt = pc[tokens] * kids                                                # [N]
            residual = 1.0 - pt.cumsum(0) + pt
            u = torch.rand(N, generator=g, device=self.device)
            ok = kids & (u * residual < pt)
            first = ok & (ok.cumsum(0) == 1)
            has = first.any() & ~done
            child = first.int().argmax()
            killed = torch.zeros(V, device=self.device).index_add_(0, tokens, kids.float()) > 0
            rest = pc.masked_fill(killed, 0.0)
            rest = torch.where(rest.sum() > 0, rest, pc)
            fresh = torch.multinomial(rest, 1, generator=g)[0]
            choice[cur] = torch.where(done, choice[cur], torch.where(has, tokens[child], fresh))
            acc[child] = acc[child] | has
            done = done | ~has
            cur = torch.where(has, child, cur)
        return acc, choice

    def _verify(self, Wt: int, Wd: int):
        """Draft a tree at n and run it through the target in one masked forward (tree slots n..n+N-1)."""
        N, n, tk = self.n_tree, self.n_t, self._tree_ops()
        if tk:
            tokens, parent, A, pos, slots, mask = self._draft_tree_fused(tk, Wd, Wt)
        else:
            tokens, parent, A = self._draft_tree(Wd)
            pos, slots, mask = n + A.sum(-1) - 1, n + self.ar[:N], self._tree_mask(A, n, Wt)
        vlogits, vaux = self.target(tokens[None], pos, mask, slots, capture=True)
        return tokens, parent, A, vlogits[0], vaux

    def _accepted(self, acc: Tensor, choice: Tensor):
        """(accepted count, emitted tokens padded to L, their tree nodes)."""
        N, L = self.n_tree, min(self.steps + 1, self.n_tree)
        path = torch.where(acc, self.ar[:N], N).sort().values[:L].clamp(max=N - 1)   # [L]
        return acc.sum(), choice[path], path

    def _advance(self, Wd: int, count: Tensor, out: Tensor, path: Tensor, vaux: Tensor) -> Tensor:
        """Compact the target's KV to the accepted path; extend the draft over positions n..n+L-1 (padded);
        the last accepted token becomes the root and n grows by the count. Returns [count, tokens...]."""
        n, L = self.n_t, path.shape[0]
        self.target.move_kv(n + path, n + self.ar[:L])
        self._extend_draft(Wd, n, out, vaux[0, path], (count - 1).view(1))
        self.n_t.add_(count)
        return torch.cat([count.view(1), out])

    def _extend_draft(self, Wd: int, n, out: Tensor, feats: Tensor, last: Tensor):
        """Extend the draft over positions n.. (position j reads token out[j] and target features feats[j]);
        out[last] becomes the root, and the draft's logits and state there its next input."""
        dpos = n + self.ar[: out.shape[0]]
        dl, dh = self.draft(out[None], feats[None], dpos, self.d_arange[None, :Wd] <= dpos[:, None], dpos)
        torch.index_select(out, 0, last, out=self.tok)
        torch.index_select(dl[0], 0, last, out=self.dlog[None])
        torch.index_select(dh[0], 0, last, out=self.dhid)

    def _spec_greedy(self, Wt: int, Wd: int) -> Tensor:
        """One greedy speculative step (the acceptance in one Triton kernel where there is one)."""
        tokens, parent, A, vlogits, vaux = self._verify(Wt, Wd)
        tk = self._tree_ops()
        if not tk:
            return self._advance(Wd, *self._accepted(*self._accept_greedy(vlogits, tokens, parent, A)), vaux)
        L = min(self.steps + 1, self.n_tree)
        res, path, src, dst, last = tk.accept(kernels.argmax(vlogits), tokens, parent, A, self.n_t, L)
        self.target.move_kv(src, dst)
        self._extend_draft(Wd, self.n_t, res[1:], vaux[0, path], last)
        self.n_t.add_(res[0])
        return res

    def _spec_step(self, n_hi: int, temperature: float, top_p: float, g) -> Tensor:
        """Queue one speculative step (draft, verify, accept, compact, extend) at the context `n_t` holds on
        the device, at most n_hi (which picks the spans); no host sync."""
        Wt, Wd = self._target_span(n_hi + self.n_tree), self._span(n_hi + self.steps + 1, self.d_ctx)
        if temperature <= 0:
            return self.graphs.run(("spec", Wt, Wd), lambda: self._spec_greedy(Wt, Wd))
        tokens, parent, A, vlogits, vaux = self.graphs.run(("verify", Wt, Wd), lambda: self._verify(Wt, Wd))
        acc = self._accepted(*self._accept_sample(vlogits, tokens, parent, A, temperature, top_p, g))
        for buf, x in zip(self.acc, (*acc, vaux)):
            buf.copy_(x)
        return self.graphs.run(("advance", Wd), lambda: self._advance(Wd, *self.acc))

    def _spec_start(self, ids, temperature, top_p, g) -> Tensor:
        """Prefill the target and the draft; the first token becomes the root at slot len(ids). Returns it."""
        logits, aux = self._prefill(ids, True)
        n = len(ids)
        root = self._pick(logits[0, -1], temperature, top_p, g)
        # draft prefill: position i reads (token i+1, target features at i)
        pos = torch.arange(n, device=self.device)
        nxt = torch.cat([torch.tensor(ids[1:], device=self.device, dtype=torch.long), root.view(1)])
        dl, dh = self.draft(nxt[None], aux, pos, self.d_arange[None, : self._w(n)] <= pos[:, None], pos)
        self.n_t.fill_(n)
        self.tok.copy_(root)
        self.dlog.copy_(dl[0, -1])
        self.dhid.copy_(dh[0, -1:])
        return root

    def _spec(self, ids, max_new, temperature, top_p, g, stats) -> Iterator[list]:
        S, N = self.max_seq_len, self.n_tree
        self._spec_start(ids, temperature, top_p, g)
        n = len(ids)
        self.emit.clear()
        self.emit.push(self.tok)
        yield self.emit.pop(), 0
        produced, L = 1, min(self.steps + 1, N)
        if produced < max_new and n + N <= S:
            self.emit.push(self._spec_step(n, temperature, top_p, g))
        while self.emit.queued:
            # queue the next step before reading this one, if it is needed whatever this one accepts
            if len(self.emit.queued) == 1 and produced + 1 < max_new and n + L + N <= S:
                self.emit.push(self._spec_step(n + L, temperature, top_p, g))
            a, *emitted = self.emit.pop()                                        # the one host read per step
            stats.append(a)
            n, produced = n + a, produced + a
            if not self.emit.queued and produced < max_new and n + N <= S:
                self.emit.push(self._spec_step(n, temperature, top_p, g))
            yield emitted[:a], a
        yield from self._decode_loop(n, max_new - produced, temperature, top_p, g)   # context tail

    # ---- greedy speculation with shared rows -------------------------------------------------
    def _spec_rows(self, ids, max_new, stats) -> Iterator[list]:
        """Greedy speculation whose every emitted token comes from an exact row: one computed as a plain step
        computes it (same rows, span and kernels; its ancestors at the slots just before it; exact KV below).
        Each step verifies one tree of n_tree rows at slots c..: the chain [t_c, pending...] whose last token
        roots the drafted subtree. It emits the accepted path's exact prefix; the rest of the path (accepted,
        not yet exact) is the next step's pending chain, recomputed there in place. Host-synchronous."""
        R, W, S = self.n_tree, self.t_slots, self.max_seq_len
        c, head = len(ids), int(self._spec_start(ids, 0.0, 1.0, None))   # t_c = head; KV exact below slot c
        yield [head], 0
        pend, produced = [], 1
        while produced < max_new and c + self.steps < S:
            r = len(pend)
            self.n_t.fill_(c + r)                                    # the subtree's root: tok (pend[-1] or head)
            Wd = self._span(c + r + self.steps + 1, self.d_ctx)
            sub, sub_parent, _ = self._draft_tree(Wd, R - r)
            tokens = torch.cat([torch.tensor(([head] + pend)[:r], dtype=torch.long, device=self.device), sub])
            parent = torch.cat([self.ar[:1], self.ar[:r], sub_parent[1:] + r])   # chain 0..r, then the subtree
            A = self._ancestors(parent, r + self.steps)
            logits, aux = self.target(tokens[None], c + A.sum(-1) - 1, self._tree_mask(A, c, W), c + self.ar[:R],
                                      capture=True)
            acc, tgt = self._accept_greedy(logits[0], tokens, parent, A)
            path = acc.nonzero().view(-1)                           # the accepted chain, row 0 first
            out = tgt[path]                                         # out[j]: the token at slot c + j + 1
            exact = int((path == self.ar[: len(path)]).cumprod(0).sum())   # rows 0..exact-1 sit at c.. in order
            self._extend_draft(Wd, c, out, aux[0, path], self.ar[len(path) - 1: len(path)])   # (token j+1, features j)
            emitted, pend = out[:exact].tolist(), out[exact:].tolist()
            c, head, produced = c + exact, emitted[-1], produced + exact
            stats.append(exact)
            yield emitted, exact
        self.tok.fill_(head)
        yield from self._decode_loop(c, max_new - produced, 0.0, 1.0, None)   # context tail, plain from t_c

    # ---- public ---------------------------------------------------------------------------
    def stream(self, ids: list, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
               speculative: bool = True, seed: Optional[int] = None, stop_at_eos: bool = True,
               stats: Optional[list] = None, margins: Optional[list] = None) -> Iterator[list]:
        """Yield lists of new token ids; `stats` collects the accept length of each verification, `margins`
        (plain greedy decoding only) each emitted token's (top-1 minus top-2 logit, max |logit|, ((id, gap below
        the top-1 logit) for the MARGIN_TOP largest logits)) at its step."""
        if not ids:
            raise EngineError("empty prompt")
        if len(ids) >= self.max_seq_len:
            raise EngineError(f"prompt of {len(ids)} tokens does not fit the context of {self.max_seq_len}")
        V = self.target.args.vocab_size
        if min(ids) < 0 or max(ids) >= V:
            raise EngineError(f"token ids must lie in [0, {V})")
        plain = not speculative or self.draft is None
        if margins is not None and (temperature > 0 or not plain):
            raise EngineError("margins are reported for plain greedy decoding only (temperature 0, not speculative)")
        g = torch.Generator(device=self.device)
        g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(7), "little"))
        stats = stats if stats is not None else []
        max_new = min(max_new_tokens, self.max_seq_len - len(ids))
        if plain:
            gen = self._plain(ids, max_new, temperature, top_p, g, margins)
        elif self.shared_rows and temperature <= 0:
            gen = self._spec_rows(ids, max_new, stats)
        else:
            gen = self._spec(ids, max_new, temperature, top_p, g, stats)
        left = max_new
        with torch.inference_mode():
            for chunk, _ in gen:
                chunk = chunk[:left]
                ends = [i for i, t in enumerate(chunk) if t in self.stop_ids] if stop_at_eos else []
                if ends:
                    yield chunk[: ends[0] + 1]
                    return
                left -= len(chunk)
                yield chunk
                if left <= 0:
                    return

    def generate(self, ids: list, max_new_tokens: int = 64, margins: bool = False, **kw) -> Result:
        """The whole completion; `margins`: record each token's margin (plain greedy only, see `stream`)."""
        t0, stats, out, m = time.perf_counter(), [], [], [] if margins else None
        for chunk in self.stream(ids, max_new_tokens, stats=stats, margins=m, **kw):
            out.extend(chunk)
        reason = "stop" if out and out[-1] in self.stop_ids and kw.get("stop_at_eos", True) else "length"
        return Result(out, stats, time.perf_counter() - t0, len(ids), reason, m[: len(out)] if margins else [])
