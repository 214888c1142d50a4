"""Per-request sampling parameters (vLLM names and semantics)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. Penalties follow vLLM: `repetition_penalty` (1 = off) applies
    to tokens in the prompt or the output; `presence_penalty`/`frequency_penalty` (0 = off,
    OpenAI semantics) apply to output tokens only. `logprobs` = number of top alternatives
    returned per generated token (None = off); the sampled token's logprob is always included.
    `prompt_logprobs` = the same for every prompt token given the tokens before it (vLLM's
    extension; entry 0 of the result is None). Such requests never take prefix-cache hits.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1          # -1 or 0 = off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        if self.top_k == 0:
            self.top_k = -1
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise ValueError with a clear message for any out-of-range field."""
        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and math.isfinite(value), f"{name} must be a finite number, got {value!r}")
        check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
              f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
              f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
              "min_tokens must be <= max_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, int) and 0 <= value <= 20),
                  f"{name} must be an integer in [0, 20], got {value!r}")
        check(0.01 <= self.repetition_penalty <= 100,
              f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty}")
        check(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        check(all(isinstance(s, str) and s for s in self.stop_strings), "stop strings must be non-empty strings")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
