"""What a verification round costs on this machine, measured at start-up (adaptive k weighs it).

A round with k drafts costs k draft steps plus one target step over 1 + k rows, against one
target step over 1 row without speculation; with B sequences decoding, k draft steps over B rows
and a target step over B (1 + k) rows against one over B rows, so a batch wide enough to make
the target step compute-bound makes drafts stop paying. Whether an extra verified row is nearly
free (the step is memory-bound: the weights are read once for all rows) or costs a third of a
step (a 4-bit target on a CPU without VNNI, whose integer kernels are compute-bound past two
rows: benchmarks/README.md) depends on the machine, the weight format, the model and the batch,
so the engine times it instead of assuming it.
"""
from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence

if TYPE_CHECKING:
    from tokenmill.engine.block_manager import BlockManager
    from tokenmill.engine.model_runner import ModelRunner

# Before anything is measured (and for tests that build a decoder by hand): an extra verified row
# costs 2 % of a step, as on a memory-bound step.
VERIFY_ROW_COST = 0.02


def linear_costs(max_k: int, per_draft: float) -> list[float]:
    """costs[k] = 1 + k * per_draft: each draft adds a draft step and a verified row."""
    return [1.0 + k * per_draft for k in range(max_k + 1)]


def seconds_at(measured: Mapping[int, float], rows: int) -> float:
    """A forward's seconds over `rows` rows from the row counts that were timed: linear between
    them and beyond the last two (past a few rows the step is compute-bound: linear in rows)."""
    if rows in measured:
        return measured[rows]
    pts = sorted(measured.items())
    if len(pts) == 1:
        return pts[0][1] * rows / pts[0][0]
    i = min(max(bisect.bisect(pts, (rows,)), 1), len(pts) - 1)     # pts[i - 1], pts[i] bracket rows
    (r0, s0), (r1, s1) = pts[i - 1], pts[i]
    return max(0.0, s0 + (s1 - s0) * (rows - r0) / (r1 - r0))


def monotone_in_rows(measured: Mapping[int, float]) -> dict[int, float]:
    """The timings made non-decreasing in rows (pool adjacent violators, equal weights): a forward
    over more rows never costs less, so a probe that says so was noise (seen on a busy host: 14
    rows timed slower than 28, which mispriced every round between them) and is averaged with its
    neighbours instead of bending the cost curve."""
    rows = sorted(measured)
    pools: list[tuple[float, int]] = []    # (sum, count) of consecutive row counts
    for r in rows:
        total, count = measured[r], 1
        while pools and pools[-1][0] / pools[-1][1] > total / count:
            t, c = pools.pop()
            total, count = total + t, count + c
        pools.append((total, count))
    return dict(zip(rows, [total / count for total, count in pools for _ in range(count)]))


def round_costs(target_seconds: Mapping[int, float], draft_seconds: Mapping[int, float] | float, max_k: int,
                batch: int = 1, other_rows: int = 0) -> list[float]:
    """costs[k], k = 0..max_k: a round in which `batch` decoding sequences take k drafts each (k
    draft steps over `batch` rows, one target step over other_rows + batch * (1 + k) rows), in
    units of a plain target step over other_rows + batch rows. `other_rows`: the step's prefill
    rows, which ride in both: a step already full of them makes every verified row cost compute."""
    draft = draft_seconds if isinstance(draft_seconds, (int, float)) else seconds_at(draft_seconds, batch)
    base = seconds_at(target_seconds, other_rows + batch)
    return [(seconds_at(target_seconds, other_rows + batch * (1 + k)) + k * draft) / base for k in range(max_k + 1)]


@dataclass(slots=True)
class MeasuredCosts:
    """Round costs from the start-up timings, at any step's decoding batch and prefill rows."""

    target_seconds: dict[int, float]   # one forward over r rows
    draft_seconds: dict[int, float]    # one draft step over b rows
    max_k: int
    widest: int                        # the widest batch whose verification was timed
    _cache: dict[tuple[int, int], list[float]] = field(default_factory=dict)

    def at(self, batch: int, other_rows: int = 0) -> list[float]:
        key = (batch, other_rows)
        costs = self._cache.get(key)
        if costs is None:
            if len(self._cache) >= 4096:     # prefill row counts vary: keep the table bounded
                self._cache.clear()
            costs = self._cache[key] = round_costs(self.target_seconds, self.draft_seconds, self.max_k,
                                                   batch, other_rows)
        return costs


def probe_rows(max_k: int, max_batch: int) -> list[int]:
    """Row counts to time: every verification shape of one sequence (1..K+1), then doubling up to
    the widest batch's verification (max_batch * (K+1)); seconds_at fills in between."""
    rows, top = list(range(1, max_k + 2)), max_batch * (max_k + 1)
    r = max_k + 1
    while r < top:
        r = min(2 * r, top)
        rows.append(r)
    return rows


def step_seconds(runner: "ModelRunner", block_manager: "BlockManager", rows: list[int], repeats: int = 3,
                 context: int = 32, max_model_len: int | None = None) -> dict[int, float]:
    """Median seconds of one forward over r rows of one sequence (its last token + r - 1 drafts,
    as verification runs them; a batch's rows cost about the same in the linears, which dominate)
    after a `context`-token prefill, for each r that fits the context length and the KV pool; {}
    when none does. The blocks are returned afterwards."""
    rows = sorted(r for r in rows if max_model_len is None or context + r <= max_model_len)
    seq = Sequence("spec-cost-probe", [1 + i % 64 for i in range(context)], SamplingParams(max_tokens=None))
    seq.num_preemptions = 1      # a probe, not a client's prompt: kept out of the prefix-cache hit rate
    while rows and not block_manager.admit(seq, [], context + rows[-1]):
        rows.pop()
    if not rows:
        return {}
    try:
        runner.execute([(seq, context)])
        out = {}
        for r in rows:
            seq.spec_token_ids = [1 + i % 64 for i in range(r - 1)]
            times = []
            for _ in range(repeats + 1):        # the first run warms this shape up
                seq.num_computed_tokens = context - 1
                t0 = time.perf_counter()
                runner.execute([(seq, r)])
                times.append(time.perf_counter() - t0)
            out[r] = statistics.median(times[1:])
        return out
    finally:
        seq.spec_token_ids = []
        block_manager.free(seq)
