"""A request's state as it moves through the engine."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.lora.adapter import LoRAAdapter


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # queued (new, or preempted and waiting to be recomputed)
    RUNNING = "running"      # holds KV blocks, scheduled every step
    FINISHED = "finished"


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of the sampled (or, for prompt logprobs, the actual next prompt) token, its rank
    in the distribution (1 = most likely) and the top-n alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float]


_seq_counter = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    """One generation stream. Invariant: `token_ids == prompt_token_ids + output_token_ids`;
    positions `< num_computed_tokens` have their K/V in the blocks of `block_table` (one table
    per KV group: `block_tables`; most models have one)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0            # prompt tokens served from the prefix cache
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    block_hashes: list[int] = field(default_factory=list)   # prefix hash of each full block
    # speculative drafts to verify this step, after the last token (never part of token_ids)
    spec_token_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None         # extra prefix-cache key: requests only share with same salt
    lora: LoRAAdapter | None = None       # the adapter this sequence runs with (None: the base model)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # when params.prompt_logprobs is set: entry i = prompt token i given tokens < i (entry 0 None);
    # grows as prefill chunks run, and is never recomputed after a preemption
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def block_table(self) -> list[int]:
        """The first KV group's block table (the only one of a full-attention model)."""
        return self.block_tables[0]

    @property
    def prefix_cache_key(self) -> str | None:
        """What besides the tokens decides a block's K/V: the salt, and the adapter's weights
        (its content hash, so a changed adapter under the same name never hits old blocks)."""
        if self.lora is None:
            return self.cache_salt
        return f"{self.cache_salt or ''}|lora:{self.lora.content_hash}"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked for and not all computed yet: every prompt row must run
        through the model (no prefix-cache hits)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
