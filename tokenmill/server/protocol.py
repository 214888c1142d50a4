"""Request bodies of the OpenAI API (plus vLLM's extra sampling fields), as pydantic models.

Strict mode on purpose: a float `top_k`, a string `n` or a boolean `max_tokens` is a client
bug, and silently coercing it would hide that bug. Ints are still accepted where a float is
expected (JSON has one number type). NaN and infinities are refused (Python's json accepts
them). Unknown fields are ignored, as the OpenAI SDK may send newer ones.
Ranges checked here are the static ones; those that depend on the model (context length,
vocabulary) are checked in `inputs.py`.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
MAX_STOP = 64        # stop strings are checked on every new token; keep the list bounded


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False     # vLLM: usage in every chunk


NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=1024)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX - 4096)   # + sequence index stays 64-bit
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    # > 0 in vLLM; the floor keeps logits / penalty finite in float32 (1e-300 would overflow to inf)
    repetition_penalty: float | None = Field(None, ge=1e-6, le=100.0)
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP)] | None = None
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    cache_salt: NonEmptyStr | None = None
    # vLLM: keep only the last N prompt tokens (-1: the model's context length)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)   # vLLM extension, non-streaming only
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ResponseFormat(_Strict):
    type: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)             # deprecated by OpenAI, still common
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    logit_bias: dict[str, float] | None = None
    tools: list[dict] | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True                     # vLLM
    continue_final_message: bool = False                   # vLLM


class LoadLoRAAdapterRequest(_Strict):
    lora_name: NonEmptyStr
    lora_path: NonEmptyStr            # inside --lora-dir (relative to it, or absolute)


class UnloadLoRAAdapterRequest(_Strict):
    lora_name: NonEmptyStr
    lora_int_id: int | None = None    # vLLM sends it; the name decides here
