"""Per-request draft length from the request's own running acceptance.

Model (Leviathan et al. 2023): each draft position is accepted with probability alpha, so k
drafts emit E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens per verification round, which costs
1 + k * c target-step equivalents (c: one draft step plus one extra verified row, relative to a
target step). The chosen k in [1, K] maximises E(k) / (1 + k c): long drafts where the draft
model tracks the request, short ones where it does not (prose after code, a poor draft).

alpha is estimated per request: each round tested `accepted` positions successfully and, unless
all were accepted, one more unsuccessfully; successes and trials decay geometrically so the
estimate follows the request as its text changes, and a prior keeps early rounds sane.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def best_k(alpha: float, cost: float, max_k: int) -> int:
    """k in [1, max_k] maximising expected tokens per unit of cost."""
    alpha = min(max(alpha, 0.0), 0.999)
    def rate(k: int) -> float:
        return (1 - alpha ** (k + 1)) / (1 - alpha) / (1 + k * cost)
    return max(range(1, max_k + 1), key=rate)


@dataclass(slots=True)
class AcceptanceTracker:
    max_k: int
    cost: float                      # c above
    prior_alpha: float = 0.6
    prior_weight: float = 2.0        # trials the prior counts for
    decay: float = 0.8               # per round: recent rounds dominate
    _state: dict[int, tuple[float, float]] = field(default_factory=dict)   # seq_id -> (successes, trials)

    def alpha(self, seq_id: int) -> float:
        s, t = self._state.get(seq_id, (0.0, 0.0))
        return (s + self.prior_alpha * self.prior_weight) / (t + self.prior_weight)

    def choose(self, seq_id: int) -> int:
        return best_k(self.alpha(seq_id), self.cost, self.max_k)

    def record(self, seq_id: int, proposed: int, accepted: int) -> None:
        s, t = self._state.get(seq_id, (0.0, 0.0))
        trials = accepted + (1 if accepted < proposed else 0)
        self._state[seq_id] = (self.decay * s + accepted, self.decay * t + trials)

    def forget(self, seq_id: int) -> None:
        self._state.pop(seq_id, None)
