"""Per-request draft length from the request's own acceptance history.

A draft position j is only tested when drafts 1..j-1 were all accepted, and on code that is where
the draft is most likely right again: acceptance is bursty, not an independent coin per position
(the i.i.d. model of Leviathan et al. picked k = 2-3 on Qwen2.5-Coder where k = 4 measured
faster). So the tracker estimates the conditional acceptance q_j = P(draft j accepted | 1..j-1
accepted) per position, and k drafts are worth E(k) = 1 + sum_{j<=k} q_1 ... q_j tokens per
verification round, which costs C(k) plain target steps (k draft steps plus a target step over
1 + k rows; measured at start-up, spec/costs.py). The chosen k in [0, K] maximises E(k) / C(k);
k = 0 (no drafts: E = C = 1) wins where speculation does not pay on this machine or for this
request's text, and such a request tries drafting again every `probe_every` rounds. C(k) is
taken at the step's shape (b sequences decoding: b (1 + k) verified rows, beside the step's P
prefill rows, which count as P / b rows of work on both sides of the ratio), so past the batch
or prefill load where even a good draft stops paying, nobody drafts, and nobody probes either.

Estimates are decayed counts, so they follow the request as its text changes (prose after code).
A request without history borrows the pooled estimate of all requests, which itself starts from
an optimistic prior so long drafts get tried.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.spec.costs import MeasuredCosts


def best_k(q: list[float], costs: list[float], min_k: int = 0, other_rows: float = 0.0) -> int:
    """k in [min_k, len(q)] maximising the step's work per round cost costs[k] (costs[0] = 1: a
    plain step): expected tokens (1 + sum of prefix products of q) plus `other_rows`, the prefill
    rows per decoding sequence in the same step, each worth a row of work. Where those fill a
    compute-bound step, a verified row displaces a prefill row and drafts stop paying."""
    tokens = 1.0 + other_rows
    best, best_rate, reach = 0, tokens / costs[0] if min_k == 0 else 0.0, 1.0
    for k, qk in enumerate(q, start=1):
        reach *= min(max(qk, 0.0), 1.0)
        tokens += reach
        rate = tokens / costs[k]
        if k >= min_k and rate > best_rate:
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
    costs: list[float]               # C(k) above, k = 0..max_k, one sequence decoding alone
    measured: MeasuredCosts | None = None   # C(k) at any step's shape, once timed at start-up
    prior_q: float = 0.8             # optimistic: untested positions look worth a try
    prior_weight: float = 2.0        # rounds an estimate borrows from the level above
    decay: float = 0.8               # per round of a request: recent rounds dominate
    pool_decay: float = 0.99         # per round, for the pooled estimate
    probe_every: int = 8             # rounds without drafts before a request tries again
    _pool: _Counts = field(init=False)
    _seqs: dict[int, _Counts] = field(default_factory=dict)
    _idle: dict[int, int] = field(default_factory=dict)

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

    def costs_at(self, batch: int, other_rows: int = 0) -> list[float]:
        """C(k) with `batch` sequences decoding beside `other_rows` prefill rows."""
        if self.measured is None or (batch <= 1 and other_rows == 0):
            return self.costs
        return self.measured.at(batch, other_rows)

    def pays_at(self, batch: int, other_rows: int = 0) -> bool:
        """Whether a draft as good as the prior (q = prior_q at every position) pays in this step."""
        share = other_rows / max(batch, 1)
        return best_k([self.prior_q] * self.max_k, self.costs_at(batch, other_rows), 0, share) > 0

    def max_paying_batch(self) -> int:
        """The widest batch (up to the widest measured) at which a good draft still pays."""
        widest = self.measured.widest if self.measured is not None else 1
        return max((b for b in range(1, widest + 1) if self.pays_at(b)), default=0)

    def choose(self, seq_id: int, batch: int = 1, other_rows: int = 0) -> int:
        costs, share = self.costs_at(batch, other_rows), other_rows / max(batch, 1)
        q = self.conditional_acceptance(seq_id)
        k = best_k(q, costs, 0, share)
        if k:
            self._idle.pop(seq_id, None)
            return k
        if not self.pays_at(batch, other_rows):
            return 0                  # the step's shape, not this request's text, rules drafts out
        idle = self._idle[seq_id] = self._idle.get(seq_id, 0) + 1
        if idle < self.probe_every:
            return 0
        self._idle[seq_id] = 0        # its text may have changed: measure the draft again
        return best_k(q, costs, min_k=1, other_rows=share)

    def record(self, seq_id: int, proposed: int, accepted: int) -> None:
        self._seqs.setdefault(seq_id, _Counts.empty(self.max_k)).add(proposed, accepted, self.decay)
        self._pool.add(proposed, accepted, self.pool_decay)

    def forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        self._idle.pop(seq_id, None)
