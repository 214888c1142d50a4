"""Per-request draft length from the request's own acceptance history.

A draft position j is only tested when drafts 1..j-1 were all accepted, and on code that is where
the draft is most likely right again: acceptance is bursty, not an independent coin per position
(the i.i.d. model of Leviathan et al. picked k = 2-3 on Qwen2.5-Coder where k = 4 measured
faster). So the tracker estimates the conditional acceptance q_j = P(draft j accepted | 1..j-1
accepted) per position, and k drafts are worth E(k) = 1 + sum_{j<=k} q_1 ... q_j tokens per
verification round, which costs 1 + k c target-step equivalents (c: one draft step plus one more
verified row, relative to a target step). The chosen k in [1, K] maximises E(k) / (1 + k c).

Estimates are decayed counts, so they follow the request as its text changes (prose after code).
A request without history borrows the pooled estimate of all requests, which itself starts from
an optimistic prior so long drafts get tried.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def best_k(q: list[float], cost: float) -> int:
    """k in [1, len(q)] maximising expected tokens (1 + sum of prefix products of q) per cost."""
    best, best_rate, reach, tokens = 1, 0.0, 1.0, 1.0
    for k, qk in enumerate(q, start=1):
        reach *= min(max(qk, 0.0), 1.0)
        tokens += reach
        rate = tokens / (1 + k * cost)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


@dataclass(slots=True)
class _Counts:
    accepted: list[float]
    tested: list[float]

    @classmethod
    def empty(cls, k: int) -> "_Counts":
        return cls([0.0] * k, [0.0] * k)

    def add(self, proposed: int, num_accepted: int, decay: float) -> None:
        for j in range(len(self.tested)):
            self.accepted[j] *= decay
            self.tested[j] *= decay
        for j in range(min(num_accepted + 1, proposed)):     # positions 0..a tested; the first a passed
            self.tested[j] += 1
            self.accepted[j] += j < num_accepted


@dataclass(slots=True)
class AcceptanceTracker:
    max_k: int
    cost: float                      # c above
    prior_q: float = 0.8             # optimistic: untested positions look worth a try
    prior_weight: float = 2.0        # rounds an estimate borrows from the level above
    decay: float = 0.8               # per round of a request: recent rounds dominate
    pool_decay: float = 0.99         # per round, for the pooled estimate
    _pool: _Counts = field(init=False)
    _seqs: dict[int, _Counts] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._pool = _Counts.empty(self.max_k)

    def pooled(self) -> list[float]:
        w = self.prior_weight
        return [(a + self.prior_q * w) / (t + w) for a, t in zip(self._pool.accepted, self._pool.tested)]

    def conditional_acceptance(self, seq_id: int) -> list[float]:
        pool = self.pooled()
        own = self._seqs.get(seq_id)
        if own is None:
            return pool
        w = self.prior_weight
        return [(a + p * w) / (t + w) for a, t, p in zip(own.accepted, own.tested, pool)]

    def choose(self, seq_id: int) -> int:
        return best_k(self.conditional_acceptance(seq_id), self.cost)

    def record(self, seq_id: int, proposed: int, accepted: int) -> None:
        self._seqs.setdefault(seq_id, _Counts.empty(self.max_k)).add(proposed, accepted, self.decay)
        self._pool.add(proposed, accepted, self.pool_decay)

    def forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
