"""Proposers: who guesses the next tokens. Each returns, per sequence, its draft tokens and the
distribution each was drawn from ([k, V]), or None when the drafts are one-hot (no distribution)."""
from __future__ import annotations

from typing import Protocol

import torch

from tokenmill.sequence import Sequence
from tokenmill.spec.config import SpeculativeConfig
from tokenmill.spec.ngram import propose_ngram

Proposal = tuple[list[int], "torch.Tensor | None"]


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        """Up to num_tokens[i] drafts for seqs[i], which is decoding (all but its last token computed)."""

    def forget(self, seq: Sequence) -> None:
        """seq finished or was aborted: drop what is kept for it."""

    def retain(self, live: set[int]) -> None:
        """Only these seq ids still run (the others were preempted): drop the rest."""

    def step_seconds(self, rows: list[int]) -> dict[int, float]:
        """What proposing one more token costs per round for r sequences, for each r, measured
        (adaptive k weighs it)."""


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        return [(propose_ngram(seq.token_ids, k, self.n_min, self.n_max), None) for seq, k in zip(seqs, num_tokens)]

    def forget(self, seq: Sequence) -> None:
        pass

    def retain(self, live: set[int]) -> None:
        pass

    def step_seconds(self, rows: list[int]) -> dict[int, float]:
        return dict.fromkeys(rows, 0.0)          # a list search, next to a forward pass
