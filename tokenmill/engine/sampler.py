"""Batched token sampling with vLLM semantics.

Pipeline per row: penalties -> min_tokens EOS mask -> (greedy: argmax) | (temperature -> top-k
-> top-p -> min-p -> exponential race). Rows are grouped so the common case (all greedy, no
penalties, no logprobs) is a single argmax over the raw logits with no copy.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import TokenLogprobs


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]   # None where params.logprobs is None


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _flat_index(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Flat positions row * V + token of every (row, token) occurrence; ids outside [0, V) dropped."""
    lens = [len(t) for t in token_lists]
    if not sum(lens):
        return torch.empty(0, dtype=torch.long, device=device)
    toks = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_lists), device=device), torch.tensor(lens, device=device))
    ok = (toks >= 0) & (toks < vocab_size)
    return (rows * vocab_size + toks)[ok]


def apply_penalties(logits: torch.Tensor, prompt_ids: list[list[int]], output_ids: list[list[int]],
                    repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """vLLM penalties, in place on contiguous float32 `logits` [R, V]; penalty tensors are [R].

    repetition: tokens seen in prompt or output get logit/p if logit > 0 else logit*p.
    frequency: logit -= count_in_output * f.  presence: logit -= p if the token is in the output.
    Sparse: only the (row, token) pairs that occur are touched, so the cost is O(#tokens), not
    O(R * V) (a dense torch.where over 256 x 152k floats costs hundreds of ms on CPU)."""
    R, V = logits.shape
    flat = logits.view(-1)   # requires contiguous logits, so writes land in place
    out_idx = _flat_index(output_ids, V, logits.device)
    seen = torch.cat([out_idx, _flat_index(prompt_ids, V, logits.device)])
    if seen.numel():
        # duplicates are harmless: each copy computes the same value from the original logit
        pen = repetition[seen // V]
        vals = flat[seen]
        flat[seen] = torch.where(vals > 0, vals / pen, vals * pen)
    if out_idx.numel():
        rows = out_idx // V
        flat.index_add_(0, out_idx, -frequency[rows])            # once per occurrence: count * f
        uniq = torch.unique(out_idx)                             # outputs only: small
        flat.index_add_(0, uniq, -presence[uniq // V])
    return logits


def _apply_min_p(probs: torch.Tensor, min_p: list[float], max_prob: torch.Tensor) -> None:
    """Zero tokens with prob < min_p * max_prob (in place; probs need not be normalised)."""
    if any(m > 0 for m in min_p):
        mp = torch.tensor(min_p, dtype=probs.dtype, device=probs.device)[:, None]
        probs.masked_fill_(probs < mp * max_prob, 0.0)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index i of each row with probability weights[i] / sum(weights); u: [R] uniforms in [0, 1)."""
    cum = weights.cumsum(dim=-1)
    total = cum[:, -1:].contiguous()
    idx = torch.searchsorted(cum, u[:, None] * total, right=True)
    # u * total can round up to total: fall back to the last token with nonzero weight
    last = torch.searchsorted(cum, total, right=False)
    # NaN weights (degenerate parameters) must still yield a valid token id, never V
    return torch.minimum(idx, last).clamp_(max=weights.shape[-1] - 1)[:, 0]


def _truncated_candidates(x: torch.Tensor, ps: list[SamplingParams],
                          temps: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Rows of x [R, V] with top-k and/or top-p, as (row indices, probs [r, K], token ids [r, K]):
    unnormalised probabilities over each row's top-K candidates after temperature, top-k, top-p
    and min-p. Top-k masks candidates past k; top-p is exact once the K candidates hold >= top_p
    of the mass (always true with top-k), otherwise K grows for the rows still short of it (up
    to V), and those rows come in a later tuple."""
    dev = x.device
    R, V = x.shape
    ks = [p.top_k if 0 < p.top_k < V else V for p in ps]
    has_k = torch.tensor([0 < p.top_k < V for p in ps], device=dev)
    # top_p == 1 -> threshold 2: never drops anything
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in ps], dtype=torch.float32, device=dev)
    k_t = torch.tensor(ks, device=dev)
    K = min(V, max(256, max((k for k in ks if k < V), default=0)))
    pending = torch.arange(R, device=dev)
    while pending.numel():
        xp = x if pending.numel() == R else x[pending]
        vals, idx = xp.topk(K, dim=-1)                     # sorted, descending
        t = temps[pending][:, None]
        vals.div_(t)
        vals.masked_fill_(torch.arange(K, device=dev)[None, :] >= k_t[pending][:, None], float("-inf"))
        hk = has_k[pending]
        # normaliser of the (top-k masked) distribution: the candidates hold all of it under
        # top-k; otherwise it needs the whole row
        lse = vals.logsumexp(dim=-1)
        if not bool(hk.all()):
            lse = torch.where(hk, lse, (xp / t).logsumexp(dim=-1))
        probs = (vals - lse[:, None]).exp_()
        cum = probs.cumsum(dim=-1)
        tp = top_p[pending][:, None]
        drop = (cum - probs) >= tp                         # mass strictly ahead >= top_p
        drop[:, 0] = False                                 # always keep the top token
        probs.masked_fill_(drop, 0.0)
        done = hk | (cum[:, -1] >= tp[:, 0]) if K < V else torch.ones_like(hk)
        _apply_min_p(probs, [ps[j].min_p for j in pending.tolist()], probs[:, :1])
        yield pending[done], probs[done], idx[done]
        pending = pending[~done]
        K = V if K * 8 > V // 4 else K * 8   # a huge topk costs as much as a full sort


class SamplingContext(Protocol):
    """What sampling reads of a sequence. A `Sequence` is one; speculative decoding passes views
    of a sequence as it would be with some drafts accepted."""

    params: SamplingParams
    prompt_token_ids: list[int]
    generator: torch.Generator | None

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_output_tokens(self) -> int: ...


class Sampler:
    def __init__(self, vocab_size: int, seed: int = 0, eos_token_ids: list[int] | None = None):
        self.vocab_size = vocab_size
        self.seed = seed
        self.eos_token_ids = list(eos_token_ids or [])
        # rows without a per-request seed draw from this; sampling needs one uniform per row, so a
        # CPU generator serves any device
        self.generator = torch.Generator().manual_seed(seed)

    def _min_tokens_blocked(self, seq: SamplingContext) -> list[int]:
        p = seq.params
        if not p.min_tokens or seq.num_output_tokens >= p.min_tokens:
            return []
        ids = list(p.stop_token_ids or [])
        if not p.ignore_eos:
            ids += self.eos_token_ids
        return ids

    def __call__(self, logits: torch.Tensor, seqs: list[SamplingContext]) -> SamplerOutput:
        """logits: [len(seqs), V'] (any float dtype; math in float32), row i belongs to seqs[i].
        Columns past vocab_size (padded lm_head) are never sampled."""
        assert logits.dim() == 2 and logits.shape[0] == len(seqs)
        logits = logits[:, : self.vocab_size]
        dev = logits.device
        n = len(seqs)
        params = [s.params for s in seqs]
        blocked = [self._min_tokens_blocked(s) for s in seqs]
        # rows that need a processed float32 copy of their logits
        proc = [i for i in range(n)
                if not params[i].greedy or _has_penalties(params[i]) or blocked[i]]

        if not proc:  # fast path: pure greedy batch
            ids = logits.argmax(dim=-1)
        else:
            ids = torch.empty(n, dtype=torch.long, device=dev)
            proc_set = set(proc)
            direct = [i for i in range(n) if i not in proc_set]
            if direct:
                d = torch.tensor(direct, device=dev)
                ids[d] = logits[d].argmax(dim=-1)
            if len(proc) == n:
                x = logits.float() if logits.dtype != torch.float32 else logits.clone()
            else:
                x = logits[torch.tensor(proc, device=dev)].float()   # advanced index -> a copy
            x = x.contiguous()   # penalties write through x.view(-1); no-op unless vocab was padded
            self._penalize(x, [seqs[i] for i in proc], [blocked[i] for i in proc])
            local_greedy = [j for j, i in enumerate(proc) if params[i].greedy]
            local_rand = [j for j, i in enumerate(proc) if not params[i].greedy]
            if local_greedy:
                g = torch.tensor(local_greedy, device=dev)
                ids[torch.tensor([proc[j] for j in local_greedy], device=dev)] = x[g].argmax(dim=-1)
            if local_rand:
                r_rows = [proc[j] for j in local_rand]
                xr = x if len(local_rand) == len(proc) else x[torch.tensor(local_rand, device=dev)]
                ids[torch.tensor(r_rows, device=dev)] = self._sample(xr, [seqs[i] for i in r_rows])

        token_ids = ids.tolist()
        return SamplerOutput(token_ids, self._logprobs(logits, ids, params))

    def _penalize(self, x: torch.Tensor, seqs: list[SamplingContext], blocked: list[list[int]]) -> None:
        dev = x.device
        V = x.shape[1]
        ps = [s.params for s in seqs]
        if any(_has_penalties(p) for p in ps):
            # rows without penalties get empty token lists and neutral values: they are untouched
            outs = [s.output_token_ids if _has_penalties(p) else [] for s, p in zip(seqs, ps)]
            prompts = [s.prompt_token_ids if p.repetition_penalty != 1.0 else [] for s, p in zip(seqs, ps)]
            f32 = dict(dtype=torch.float32, device=dev)
            apply_penalties(x, prompts, outs, torch.tensor([p.repetition_penalty for p in ps], **f32),
                            torch.tensor([p.presence_penalty for p in ps], **f32),
                            torch.tensor([p.frequency_penalty for p in ps], **f32))
        rows = [j for j, b in enumerate(blocked) for t in b if 0 <= t < V]
        cols = [t for b in blocked for t in b if 0 <= t < V]
        if rows:
            x[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")

    def uniforms(self, seqs: list[SamplingContext], device: torch.device,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One U[0,1) draw per row: from the row's own generator when seeded (so the draw does not
        depend on batch neighbours), else from the sampler's global generator."""
        u = [0.0] * len(seqs)
        unseeded = [j for j, s in enumerate(seqs) if s.generator is None]
        if unseeded:
            for j, v in zip(unseeded, torch.rand(len(unseeded), dtype=torch.float64,
                                                 generator=self.generator).tolist()):
                u[j] = v
        for j, s in enumerate(seqs):
            if s.generator is not None:
                u[j] = torch.rand((), dtype=torch.float64, generator=s.generator).item()
        return torch.tensor(u, dtype=dtype, device=device)

    def _sample(self, x: torch.Tensor, seqs: list[SamplingContext]) -> torch.Tensor:
        """Random rows: x [R, V] float32 (modified in place). Returns sampled ids [R].

        Inverse-CDF sampling with one uniform per row (an O(V) cumsum; drawing V exponentials per
        row for an exponential race costs ~10x more on CPU). Rows with top-k/top-p sample among
        top-K candidates only, so they never touch the full vocabulary after the topk."""
        dev = x.device
        R, V = x.shape
        ps = [s.params for s in seqs]
        u = self.uniforms(seqs, dev)
        temps = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev)
        ids = torch.empty(R, dtype=torch.long, device=dev)
        trunc = [j for j, p in enumerate(ps) if 0 < p.top_k < V or p.top_p < 1.0]
        full = [j for j, p in enumerate(ps) if not (0 < p.top_k < V or p.top_p < 1.0)]
        if trunc:
            ti = torch.tensor(trunc, device=dev)
            xt = x if len(trunc) == R else x[ti]
            ids[ti] = self._sample_truncated(xt, [ps[j] for j in trunc], temps[ti], u[ti])
        if full:
            fi = torch.tensor(full, device=dev)
            xf = x if len(full) == R else x[fi]
            probs = xf.div_(temps[fi][:, None]).softmax(dim=-1)
            _apply_min_p(probs, [ps[j].min_p for j in full], probs.amax(dim=-1, keepdim=True))
            ids[fi] = _inverse_cdf(probs, u[fi])
        return ids

    @staticmethod
    def _sample_truncated(x: torch.Tensor, ps: list[SamplingParams], temps: torch.Tensor,
                          u: torch.Tensor) -> torch.Tensor:
        """Rows with top-k and/or top-p: inverse-CDF draws among their candidates."""
        ids = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        for rows, probs, idx in _truncated_candidates(x, ps, temps):
            ids[rows] = idx.gather(1, _inverse_cdf(probs, u[rows])[:, None])[:, 0]
        return ids

    def probs(self, logits: torch.Tensor, seqs: list[SamplingContext]) -> torch.Tensor:
        """The distribution each row's next token is drawn from, [R, V] float32 rows summing to
        1: penalties, the min_tokens mask, temperature, top-k, top-p and min-p applied exactly as
        in `__call__`; one-hot at the argmax for greedy rows. Speculative decoding verifies
        drafts against these."""
        assert logits.dim() == 2 and logits.shape[0] == len(seqs)
        x = logits[:, : self.vocab_size].float().clone().contiguous()
        dev = x.device
        self._penalize(x, seqs, [self._min_tokens_blocked(s) for s in seqs])
        out = torch.zeros_like(x)
        ps = [s.params for s in seqs]
        greedy = [i for i, p in enumerate(ps) if p.greedy]
        if greedy:
            g = torch.tensor(greedy, device=dev)
            out[g, x[g].argmax(dim=-1)] = 1.0
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in ps], dtype=torch.float32, device=dev)
        V = x.shape[1]
        trunc = [i for i, p in enumerate(ps) if not p.greedy and (0 < p.top_k < V or p.top_p < 1.0)]
        full = [i for i, p in enumerate(ps) if not p.greedy and not (0 < p.top_k < V or p.top_p < 1.0)]
        if trunc:
            ti = torch.tensor(trunc, device=dev)
            dense = torch.zeros(len(trunc), V, dtype=x.dtype, device=dev)
            for rows, pr, idx in _truncated_candidates(x[ti], [ps[i] for i in trunc], temps[ti]):
                dense[rows] = dense[rows].scatter_(1, idx, pr)
            out[ti] = dense
        if full:
            fi = torch.tensor(full, device=dev)
            pr = (x[fi] / temps[fi][:, None]).softmax(dim=-1)
            _apply_min_p(pr, [ps[i].min_p for i in full], pr.amax(dim=-1, keepdim=True))
            out[fi] = pr
        return out / out.sum(dim=-1, keepdim=True)

    @staticmethod
    def _logprobs(logits: torch.Tensor, ids: torch.Tensor,
                  params: list[SamplingParams]) -> list[TokenLogprobs | None]:
        """From the RAW logits (before penalties / temperature), like vLLM's default."""
        out: list[TokenLogprobs | None] = [None] * len(params)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return out
        if len(rows) == len(params):
            xr, chosen = logits, ids
        else:
            r = torch.tensor(rows, device=logits.device)
            xr, chosen = logits[r], ids[r]
        for i, lp in zip(rows, gather_logprobs(xr, chosen, [params[i].logprobs or 0 for i in rows])):
            out[i] = lp
        return out


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """Per row of raw `logits` [R, V]: logprob and rank of token_ids[r], plus the top num_top[r]
    alternatives. Math in float32. log_softmax(x)[t] = x[t] - logsumexp(x), so the full [R, V]
    log-probs are never materialised; ranks and top-n are the same on the raw logits."""
    x = logits.float()
    lse = x.logsumexp(dim=-1, keepdim=True)
    chosen_x = x.gather(1, token_ids[:, None])
    ranks = ((x > chosen_x).sum(dim=-1) + 1).tolist()
    chosen_ids, chosen_lp = token_ids.tolist(), (chosen_x - lse)[:, 0].tolist()
    nmax = max(num_top, default=0)
    top_v: list[list[float]] = [[] for _ in num_top]
    top_i: list[list[int]] = [[] for _ in num_top]
    if nmax:
        tv, tix = x.topk(nmax, dim=-1)
        top_v, top_i = (tv - lse).tolist(), tix.tolist()
    return [TokenLogprobs(token_id=chosen_ids[r], logprob=chosen_lp[r], rank=ranks[r],
                          top=dict(zip(top_i[r][:k], top_v[r][:k]))) for r, k in enumerate(num_top)]
