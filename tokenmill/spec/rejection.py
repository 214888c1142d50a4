"""Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

For drafts d_1..d_k with target distributions p_1..p_{k+1} (already shaped by temperature,
top-k/top-p/min-p and penalties, exactly as the plain sampler shapes them) and draft
distributions q_1..q_k: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first
rejection sample from normalize(max(0, p_j - q_j)) and stop; if all k are accepted, sample a
bonus token from p_{k+1}. Every emitted token is then distributed exactly as p. A proposer
without a distribution (n-gram, greedy drafts) has q_j = one-hot(d_j), which reduces the rule to
"accept with probability p_j(d_j), else sample p_j with d_j removed". A greedy request's p_j is
one-hot at the argmax, so the rule accepts exactly the drafts equal to the target's argmax.
"""
from __future__ import annotations

import torch


def sample_from(weights: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from unnormalised nonnegative `weights` [V] with one uniform u in [0, 1)."""
    cum = weights.double().cumsum(0)
    total = cum[-1]
    idx = int(torch.searchsorted(cum, torch.tensor([u], dtype=cum.dtype) * total, right=True)[0])
    # u * total can round up to total: take the last token with nonzero weight instead
    return min(idx, int(torch.searchsorted(cum, total.reshape(1), right=False)[0]))


def verify_drafts(target: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                  uniforms: list[float]) -> tuple[list[int], int]:
    """target: [k+1, V] float probabilities; drafts: k token ids; draft_probs: [k, V] or None
    (one-hot drafts); uniforms: k + 1 draws in [0, 1) (k for the accept tests, one for the final
    sample). Returns (tokens to emit: the accepted drafts plus one sampled token, number accepted)."""
    k = len(drafts)
    assert target.shape[0] == k + 1 and len(uniforms) == k + 1
    if k:
        d = torch.tensor(drafts, device=target.device)
        rows = torch.arange(k, device=target.device)
        p_d = target[rows, d].double()
        q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs[rows, d].double()
        u = torch.tensor(uniforms[:k], dtype=torch.float64, device=target.device)
        # u < p/q  <=>  u * q < p; q(d) > 0 for a token the draft actually sampled
        rejected = (u * q_d >= p_d).nonzero()
        num_accepted = int(rejected[0, 0]) if rejected.numel() else k
    else:
        num_accepted = 0
    final = uniforms[k]
    if num_accepted == k:
        return drafts + [sample_from(target[k], final)], k
    j = num_accepted
    if draft_probs is None:
        residual = target[j].clone()
        residual[drafts[j]] = 0
    else:
        residual = (target[j] - draft_probs[j]).clamp_(min=0)
    if not bool((residual > 0).any()):
        # p_j == q_j up to rounding: a rejection then had probability ~0; p_j itself is the answer
        residual = target[j]
    return drafts[:j] + [sample_from(residual, final)], j
