"""What a verification round costs on this machine, measured at start-up (adaptive k weighs it).

A round with k drafts costs k draft steps plus one target step over 1 + k rows, against one
target step over 1 row without speculation. Whether an extra verified row is nearly free (the
step is memory-bound: the weights are read once for all rows) or costs a third of a step (a
4-bit target on a CPU without VNNI, whose integer kernels are compute-bound past two rows:
benchmarks/README.md) depends on the machine, the weight format and the model, so the engine
times it instead of assuming it.
"""
from __future__ import annotations

import statistics
import time
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


def round_costs(target_seconds: dict[int, float], draft_seconds: float, max_k: int) -> list[float]:
    """costs[k], k = 0..max_k: a round with k drafts in units of a plain one-row target step."""
    base = target_seconds[1]
    return [(target_seconds[1 + k] + k * draft_seconds) / base for k in range(max_k + 1)]


def step_seconds(runner: "ModelRunner", block_manager: "BlockManager", rows: list[int], repeats: int = 3,
                 context: int = 32) -> dict[int, float]:
    """Median seconds of one forward over r rows of one sequence (its last token + r - 1 drafts,
    as verification runs them) after a `context`-token prefill, for each r; {} when the KV pool
    has no room. The blocks are returned afterwards."""
    seq = Sequence("spec-cost-probe", [1 + i % 64 for i in range(context)], SamplingParams(max_tokens=None))
    seq.num_preemptions = 1      # a probe, not a client's prompt: kept out of the prefix-cache hit rate
    if not block_manager.admit(seq, [], context + max(rows)):
        return {}
    try:
        runner.execute([(seq, context)])
        out = {}
        for r in rows:
            seq.spec_token_ids = [1 + i % 64 for i in range(r - 1)]
            seq.num_computed_tokens = context - 1
            times = []
            for _ in range(repeats + 1):        # the first run warms this shape up
                t0 = time.perf_counter()
                runner.execute([(seq, r)])
                times.append(time.perf_counter() - t0)
            out[r] = statistics.median(times[1:])
        return out
    finally:
        seq.spec_token_ids = []
        block_manager.free(seq)
