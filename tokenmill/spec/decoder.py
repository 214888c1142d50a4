"""The engine's side of speculative decoding: ask the proposer for drafts before a step, verify
the target's scores of them after it.

Per step: `propose` gives each decoding sequence up to K draft tokens (`seq.spec_token_ids`);
the scheduler schedules them with the sequence's last token (1 + k query rows, a short
"prefill" span over the cached context); the runner returns logits for all 1 + k rows;
`verify` turns them into the tokens to emit (rejection sampling, `rejection.py`). The engine
then rolls the sequence back to its accepted length: `num_computed_tokens` drops by the
rejected drafts and the blocks they alone occupied are freed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenmill.engine.sampler import Sampler, gather_logprobs
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence, TokenLogprobs
from tokenmill.spec.adaptive import AcceptanceTracker
from tokenmill.spec.costs import (VERIFY_ROW_COST, MeasuredCosts, linear_costs, monotone_in_rows, probe_rows,
                                  step_seconds)
from tokenmill.spec.config import SpeculativeConfig
from tokenmill.spec.proposers import Proposer
from tokenmill.spec.rejection import verify_drafts

if TYPE_CHECKING:
    from tokenmill.engine.block_manager import BlockManager
    from tokenmill.engine.model_runner import ModelRunner


# Adaptive k times verification shapes up to this many decoding sequences; wider steps extrapolate.
MAX_CALIBRATED_BATCH = 16


@dataclass(slots=True)
class DraftView:
    """A sequence as it will be once `extra` (a prefix of its drafts) is accepted: what the
    sampler reads for penalties, min_tokens and the random draws."""

    params: SamplingParams
    prompt_token_ids: list[int]
    base_output: list[int]
    extra: list[int]
    generator: torch.Generator | None

    @property
    def output_token_ids(self) -> list[int]:
        return self.base_output + self.extra

    @property
    def num_output_tokens(self) -> int:
        return len(self.base_output) + len(self.extra)

    @classmethod
    def of(cls, seq: Sequence, extra: list[int]) -> "DraftView":
        return cls(seq.params, seq.prompt_token_ids, seq.output_token_ids, extra, seq.generator)


@dataclass(slots=True)
class SpecStats:
    """Cumulative counters (vLLM's spec-decode metrics)."""

    num_drafts: int = 0               # verification rounds with >= 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_decode_steps: int = 0         # steps with >= 1 decoding sequence
    num_draft_steps: int = 0          # of those, steps in which >= 1 sequence drafted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification round: accepted drafts + the one sampled token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position.extend([0] * (num_drafts - len(self.accepted_per_position)))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, sampler: Sampler, max_model_len: int,
                 draft_cost: float = VERIFY_ROW_COST) -> None:
        """draft_cost: one draft step plus one extra verified row, as a fraction of a target
        step: the round costs adaptive k assumes until `calibrate` measures them."""
        self.config = config
        self.proposer = proposer
        self.sampler = sampler
        self.max_model_len = max_model_len
        self.stats = SpecStats()
        self.draft_cost = draft_cost
        k = config.num_speculative_tokens
        self.tracker = AcceptanceTracker(k, linear_costs(k, draft_cost)) if config.adaptive_k else None
        self._draft_probs: dict[int, torch.Tensor] = {}

    def calibrate(self, target: "ModelRunner", target_blocks: "BlockManager") -> list[float] | None:
        """Adaptive k: time the target over 1..K+1 rows and on to the widest batch's verification,
        and draft steps over 1..that batch's rows, on this machine, and size drafts by those round
        costs per batch (spec/costs.py). Returns the one-sequence costs (None: nothing to do)."""
        if self.tracker is None:
            return None
        k = self.config.num_speculative_tokens
        max_batch = min(self.config.disable_by_batch_size or MAX_CALIBRATED_BATCH, MAX_CALIBRATED_BATCH)
        rows = probe_rows(k, max_batch)
        target_s = step_seconds(target, target_blocks, rows[:k + 1], max_model_len=self.max_model_len)
        if not target_s:
            return None
        target_s |= step_seconds(target, target_blocks, rows[k + 1:], repeats=1, max_model_len=self.max_model_len)
        batches = sorted({1, max_batch} | {b for b in (2, 4, 8) if b < max_batch})
        draft_s = self.proposer.step_seconds(batches) or {1: 0.0}
        self.tracker.measured = MeasuredCosts(monotone_in_rows(target_s), monotone_in_rows(draft_s), k,
                                              widest=max_batch)
        self.tracker.costs = self.tracker.measured.at(1)
        return self.tracker.costs

    def max_paying_batch(self) -> int | None:
        """Where adaptive k stops drafting even for a good draft (spec/adaptive.py); None without it."""
        return None if self.tracker is None else self.tracker.max_paying_batch()

    def _budget(self, seq: Sequence, batch: int, other_rows: int) -> int:
        """Drafts a sequence may take: every accepted one plus the sampled token must fit its
        max_tokens and the context length."""
        p = seq.params
        room = self.max_model_len - seq.num_tokens - 1
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - seq.num_output_tokens - 1)
        k = self.config.num_speculative_tokens if self.tracker is None else self.tracker.choose(seq.seq_id, batch, other_rows)
        return max(0, min(k, room))

    def propose(self, running: list[Sequence], token_budget: int | None = None) -> None:
        """Set `spec_token_ids` of every running sequence: drafts for those decoding, [] for the
        rest (or for all, above `disable_by_batch_size`). `token_budget`: the step's row budget,
        which caps the prefill rows adaptive k expects beside the verified ones."""
        self._draft_probs.clear()
        self.proposer.retain({s.seq_id for s in running})
        decoding, prefill_rows = [], 0
        for seq in running:
            seq.spec_token_ids = []
            if seq.num_computed_tokens == seq.num_tokens - 1 and seq.num_output_tokens:
                decoding.append(seq)
            else:
                prefill_rows += seq.num_tokens - seq.num_computed_tokens
        self.stats.num_decode_steps += bool(decoding)
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return
        if token_budget is not None:
            prefill_rows = min(prefill_rows, max(token_budget - len(decoding), 0))
        budgets = [self._budget(s, len(decoding), prefill_rows) for s in decoding]
        seqs = [s for s, k in zip(decoding, budgets) if k]
        if not seqs:
            return
        for seq, (drafts, probs) in zip(seqs, self.proposer.propose(seqs, [k for k in budgets if k])):
            seq.spec_token_ids = list(drafts)
            if probs is not None and drafts:
                self._draft_probs[seq.seq_id] = probs
        self.stats.num_draft_steps += any(s.spec_token_ids for s in seqs)

    def forget(self, seq: Sequence) -> None:
        seq.spec_token_ids = []
        self._draft_probs.pop(seq.seq_id, None)
        if self.tracker is not None:
            self.tracker.forget(seq.seq_id)
        self.proposer.forget(seq)

    def verify(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
        """logits: 1 + len(seq.spec_token_ids) consecutive rows per sequence (its last token,
        then each draft). Returns per sequence the tokens to emit and their logprobs (None where
        not asked for). Leaves `spec_token_ids` as scheduled; the engine rolls back."""
        views = [DraftView.of(seq, seq.spec_token_ids[:j]) for seq in seqs for j in range(len(seq.spec_token_ids) + 1)]
        target = self.sampler.probs(logits, views)
        uniforms = self.sampler.uniforms(views, torch.device("cpu"), torch.float64).tolist()
        out = []
        row = 0
        for seq in seqs:
            k = len(seq.spec_token_ids)
            probs = self._draft_probs.get(seq.seq_id)
            tokens, accepted = verify_drafts(target[row:row + k + 1], seq.spec_token_ids,
                                             None if probs is None else probs[:k], uniforms[row:row + k + 1])
            self.stats.record(k, accepted)
            if self.tracker is not None:
                self.tracker.record(seq.seq_id, k, accepted)
            lps: list[TokenLogprobs | None] = [None] * len(tokens)
            if seq.params.logprobs is not None:
                ids = torch.tensor(tokens, device=logits.device)
                lps = list(gather_logprobs(logits[row:row + len(tokens), : self.sampler.vocab_size], ids,
                                           [seq.params.logprobs] * len(tokens)))
            out.append((tokens, lps))
            row += k + 1
        return out
