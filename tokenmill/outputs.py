"""Results handed back to callers (shaped like vLLM's RequestOutput)."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.sequence import TokenLogprobs


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None          # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    delta_text: str = ""                      # text new since the previous output (streaming)
    num_delta_tokens: int = 0                 # tokens new since the previous output


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # params.prompt_logprobs set: one entry per prompt token, entry 0 None (vLLM)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
