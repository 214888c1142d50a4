"""`--speculative-config` / `LLM(speculative_config=...)`: vLLM's keys, validated up front."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")


@dataclass(slots=True)
class SpeculativeConfig:
    """method "ngram": prompt lookup (the last n tokens, n from prompt_lookup_max down to
    prompt_lookup_min, are searched for earlier in the sequence; the tokens that followed are the
    proposal). method "draft_model": a smaller model with the same tokenizer (`model`) proposes.
    `adaptive_k` (tokenmill's extension): each request drafts the k that its own running acceptance
    and the measured round costs at the step's batch make most profitable, up to
    num_speculative_tokens. `disable_by_batch_size`: no speculation in a step with more running
    sequences than this (verification costs more than it saves once the batch alone keeps the
    matmuls busy)."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = None
    draft_kv_cache_memory: int | None = None   # bytes for the draft's own KV cache (default: 1/4 of the target's)
    quantization: str | None = None            # the draft's load-time quantization: int8 | rtn4 | nf4
    quantize_lm_head: bool = False             # the draft's lm_head too (a 0.5B draft's 152k-row head is
                                               # most of its step in fp32)
    adaptive_k: bool = False                   # per-request k in [0, num_speculative_tokens] (spec/adaptive.py)

    def __post_init__(self) -> None:
        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"speculative_config: {msg}")

        check(self.method in METHODS, f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        check(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 16,
              f"num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        if self.method == "draft_model":
            check(isinstance(self.model, str) and bool(self.model), "method draft_model needs 'model'")
        else:
            check(self.model is None, "'model' is only for method draft_model")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            check(isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi,
                  f"need integers 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r}, {hi!r}")
        b = self.disable_by_batch_size
        check(b is None or (isinstance(b, int) and b >= 1), f"disable_by_batch_size must be an integer >= 1, got {b!r}")
        check(self.quantization is None or self.method == "draft_model", "'quantization' is only for method draft_model")
        check(not self.quantize_lm_head or self.quantization is not None, "'quantize_lm_head' needs 'quantization'")
        check(isinstance(self.adaptive_k, bool), f"adaptive_k must be true or false, got {self.adaptive_k!r}")
        m = self.draft_kv_cache_memory
        check(m is None or (isinstance(m, int) and m > 0), f"draft_kv_cache_memory must be a positive integer, got {m!r}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig | None":
        """A dict, its JSON text (the CLI flag) or an instance; None stays None. Unknown keys
        are refused by name rather than ignored."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} (known: {sorted(known)})")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        return cls(**value)
