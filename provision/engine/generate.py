"""Decoding: plain, and EAGLE-3 tree speculation (draft tree → one masked verification →
greedy or lossless sampling acceptance → KV compaction). Batch 1, static shapes: the only host
sync in a speculative step is reading the accepted length together with the accepted tokens."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch import Tensor

from .draft import Eagle3Draft
from .errors import EngineError
from .model import Transformer


@dataclass
class Result:
    tokens: list                                       # generated ids (prompt excluded)
    accept_lengths: list = field(default_factory=list)  # tokens per verification, bonus included
    seconds: float = 0.0
    prompt_tokens: int = 0
    finish_reason: str = "length"

    @property
    def accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0


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


class Engine:
    """A target, an optional EAGLE-3 draft, and their static caches (one sequence at a time)."""

    def __init__(self, target: Transformer, draft: Optional[Eagle3Draft] = None, tokenizer=None,
                 max_seq_len: int = 2048, steps: int = 4, topk: int = 1, num_draft_tokens: int = 0,
                 stop_ids=None):
        self.target, self.draft, self.tokenizer = target.eval(), draft, tokenizer
        self.device = target.output.weight.device
        self.max_seq_len = min(max_seq_len, target.args.max_position_embeddings)
        eos = getattr(tokenizer, "eos_id", None)
        self.stop_ids = set(stop_ids if stop_ids is not None else [] if eos is None else [eos])   # end of turn
        self.configure(steps, topk, num_draft_tokens)

    def configure(self, steps: int, topk: int, num_draft_tokens: int = 0):
        """Tree shape: `steps` draft forwards of `topk` beams; verify `num_draft_tokens` (root included)."""
        most = 1 + topk + (steps - 1) * topk * topk
        n = num_draft_tokens or (steps + 1 if topk == 1 else min(most, 2 * steps * topk))
        if steps < 1 or topk < 1 or not 2 <= n <= most:
            raise EngineError(f"tree settings steps={steps} topk={topk} num_draft_tokens={n}: need steps, topk >= 1 "
                              f"and 2 <= num_draft_tokens <= {most}")
        self.steps, self.topk, self.n_tree = steps, topk, n
        S, dev = self.max_seq_len, self.device
        self.t_slots = S + n                          # context + one verification tree
        self.target.setup_caches(self.t_slots)
        self.t_arange = torch.arange(self.t_slots, device=dev)
        if self.draft is not None:
            self.d_ctx = S + steps + 2                # context + padded extend
            self.draft.setup_caches(self.d_ctx + steps * topk, self.target.tok_embeddings)
            self.d_arange = torch.arange(self.d_ctx + steps * topk, device=dev)
        self.ar = torch.arange(max(n, steps + 1, topk * topk), device=dev)

    def _w(self, x: int) -> int:
        """Attention span covering slots [0, x), rounded up to 64: few distinct shapes, short attention."""
        return -(-x // 64) * 64
    # ---- plain decoding -------------------------------------------------------------------
    def _prefill(self, ids: list, capture: bool):
        T = len(ids)
        pos = torch.arange(T, device=self.device)
        mask = self.t_arange[None, : self._w(T)] <= pos[:, None]              # [T, W] causal
        return self.target(torch.tensor([ids], device=self.device), pos, mask, pos, capture=capture)

    def _pick(self, logits: Tensor, temperature: float, top_p: float, g) -> Tensor:
        if temperature <= 0:
            return logits.argmax(-1)
        return torch.multinomial(probs_from_logits(logits, temperature, top_p), 1, generator=g).squeeze(-1)

    def _plain(self, ids, max_new, temperature, top_p, g) -> Iterator[list]:
        tok = self._pick(self._prefill(ids, False)[0, -1], temperature, top_p, g)
        n = len(ids)
        for _ in range(max_new):
            t = int(tok)
            yield [t], 0
            if n >= self.max_seq_len:
                return
            pos = self.ar.new_full((1,), n)
            logits = self.target(tok.view(1, 1), pos, (self.t_arange[: self._w(n + 1)] <= n)[None], pos)
            tok = self._pick(logits[0, -1], temperature, top_p, g)
            n += 1

    # ---- speculation ----------------------------------------------------------------------
    def _draft_tree(self, n: int, root: Tensor, dlogits: Tensor, dh: Tensor):
        """Grow `steps` levels of `topk` beams; keep the best n_tree-1 nodes by path log-prob.

        Returns tokens [N] (root first), parent [N], ancestor matrix [N, N] (parents precede children).
        """
        K, N, dr = self.topk, self.n_tree, self.draft
        score, di = torch.log_softmax(dlogits.float(), -1).topk(K)             # level 1: [K]
        tok = dr.to_target(di)
        c_tok, c_score, c_par = [tok], [score], [self.ar.new_full((K,), -1)]
        beam_idx, hid = self.ar[:K], dh.expand(K, -1)                           # [K], [K, H]
        anc = torch.zeros(K, self.steps * K, dtype=torch.bool, device=self.device)
        W = min(self._w(n + self.steps + 1), self.d_ctx)                        # scratch slots follow [0, W)
        ctx = (self.d_arange[:W] < n).expand(K, -1)                             # [K, W]
        for s in range(1, self.steps):
            own = (s - 1) * K + self.ar[:K]
            anc = anc.clone()
            anc[self.ar[:K], own] = self.ar[:K] >= 0                           # True, as a device tensor
            pos = self.ar.new_full((K,), n - 1 + s)
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
        tokens = torch.cat([root.view(1), c_tok[keep]])
        eye = torch.eye(N, dtype=torch.bool, device=self.device)
        A = eye
        for _ in range(self.steps):
            A = eye | A[parent]
        return tokens, parent, A

    def _accept_greedy(self, logits, tokens, parent, A):
        tgt = logits.argmax(-1)                                                  # [N]
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

    def _spec_step(self, n: int, root, dlogits, dhid, temperature, top_p, g):
        """Draft a tree, verify it in one target forward, accept: (accepted count, emitted tokens padded
        to L, their tree nodes, target features [1, N, 3H]); all on the device."""
        N, L = self.n_tree, min(self.steps + 1, self.n_tree)
        tokens, parent, A = self._draft_tree(n, root, dlogits, dhid)
        depth = A.sum(-1) - 1
        mask = (self.t_arange[: self._w(n + N)] < n).expand(N, -1).clone()     # [N, W]: context + tree
        mask[:, n:n + N] = A
        vlogits, vaux = self.target(tokens[None], n + depth, mask, n + self.ar[:N], capture=True)
        if temperature <= 0:
            acc, choice = self._accept_greedy(vlogits[0], tokens, parent, A)
        else:
            acc, choice = self._accept_sample(vlogits[0], tokens, parent, A, temperature, top_p, g)
        path = torch.where(acc, self.ar[:N], N).sort().values[:L].clamp(max=N - 1)   # [L]
        return acc.sum(), choice[path], path, vaux

    def _advance(self, n: int, out, path, vaux):
        """Compact the target's KV to the accepted path; extend the draft over positions n..n+L-1
        (padded: the caller reads the row of the last accepted token)."""
        L = path.shape[0]
        for layer in self.target.layers:
            layer.attention.kv_cache.move(n + path, n + self.ar[:L])
        dpos = n + self.ar[:L]
        dmask = self.d_arange[None, : self._w(n + L)] <= dpos[:, None]
        return self.draft(out[None], vaux[0, path][None], dpos, dmask, dpos)

    def _spec(self, ids, max_new, temperature, top_p, g, stats) -> Iterator[list]:
        tg, dr, S = self.target, self.draft, self.max_seq_len
        logits, aux = self._prefill(ids, True)
        n = len(ids)
        root = self._pick(logits[0, -1], temperature, top_p, g)
        # draft prefill: position i reads (token i+1, target features at i)
        pos = torch.arange(n, device=self.device)
        nxt = torch.cat([torch.tensor(ids[1:], device=self.device, dtype=torch.long), root.view(1)])
        dl, dh = dr(nxt[None], aux, pos, self.d_arange[None, : self._w(n)] <= pos[:, None], pos)
        dlogits, dhid = dl[0, -1], dh[0, -1:]
        yield [int(root)], 0
        produced, N = 1, self.n_tree
        while produced < max_new and n + N <= S:
            count, out, path, vaux = self._spec_step(n, root, dlogits, dhid, temperature, top_p, g)
            a, *emitted = torch.cat([count.view(1), out]).tolist()               # the one host sync
            emitted = emitted[:a]
            stats.append(a)
            dl, dh = self._advance(n, out, path, vaux)
            dlogits, dhid = dl[0, a - 1], dh[0, a - 1:a]
            n, root = n + a, out[a - 1]
            produced += a
            yield emitted, a
        while produced < max_new and n < S:                                      # context tail: plain steps
            pos = self.ar.new_full((1,), n)
            logits = tg(root.view(1, 1), pos, (self.t_arange[: self._w(n + 1)] <= n)[None], pos)
            root = self._pick(logits[0, -1], temperature, top_p, g)
            n, produced = n + 1, produced + 1
            yield [int(root)], 0

    # ---- public ---------------------------------------------------------------------------
    def stream(self, ids: list, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
               speculative: bool = True, seed: Optional[int] = None, stop_at_eos: bool = True,
               stats: Optional[list] = None) -> Iterator[list]:
        """Yield lists of new token ids; `stats` collects the accept length of each verification."""
        if not ids:
            raise EngineError("empty prompt")
        if len(ids) >= self.max_seq_len:
            raise EngineError(f"prompt of {len(ids)} tokens does not fit the context of {self.max_seq_len}")
        V = self.target.args.vocab_size
        if min(ids) < 0 or max(ids) >= V:
            raise EngineError(f"token ids must lie in [0, {V})")
        g = torch.Generator(device=self.device)
        g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(7), "little"))
        stats = stats if stats is not None else []
        max_new = min(max_new_tokens, self.max_seq_len - len(ids))
        gen = self._spec(ids, max_new, temperature, top_p, g, stats) if speculative and self.draft is not None \
            else self._plain(ids, max_new, temperature, top_p, g)
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

    def generate(self, ids: list, max_new_tokens: int = 64, **kw) -> Result:
        t0, stats, out = time.perf_counter(), [], []
        for chunk in self.stream(ids, max_new_tokens, stats=stats, **kw):
            out.extend(chunk)
        reason = "stop" if out and out[-1] in self.stop_ids and kw.get("stop_at_eos", True) else "length"
        return Result(out, stats, time.perf_counter() - t0, len(ids), reason)
