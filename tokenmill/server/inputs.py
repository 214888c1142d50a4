"""Validated request -> what the engine runs: prompt token ids + SamplingParams.

Everything that depends on the model (context length, vocabulary, chat template) is checked
here, before the request reaches the engine, so a bad request is a 400 and never an engine
error. Tokenization happens here too: the server then knows the exact prompt length for the
context check and for `usage`. These functions are synchronous and CPU-bound; handlers run
them in a worker thread.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import OpenAIError
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields


@dataclass(slots=True, frozen=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int
    max_n: int
    chat_history_window: int | None = None    # --chat-history-window: longest templated chat prompt


@dataclass(slots=True)
class EngineInput:
    """One engine request (a completions call with a list of prompts makes several)."""

    prompt_token_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    priority: int
    cache_salt: str | None
    dropped_messages: int = 0              # chat messages the history window left out


def _bad(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def _max_tokens(requested: int | None, default: int | None, prompt_len: int, limits: ModelLimits,
                prompt_param: str, budget_param: str = "max_tokens") -> int:
    """Output budget. An explicit max_tokens that does not fit the context is an error (as in
    vLLM and OpenAI); an implicit default is clamped to what is left."""
    room = limits.max_model_len - prompt_len
    if room < 1:
        raise _bad(f"This model's maximum context length is {limits.max_model_len} tokens. However, "
                   f"your prompt has {prompt_len} tokens, leaving no room for output.", prompt_param)
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise _bad(f"This model's maximum context length is {limits.max_model_len} tokens. However, you "
                   f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for "
                   f"the completion). Please reduce the prompt or {budget_param}.", budget_param)
    return requested


def _sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None, limits: ModelLimits,
                     prompt_logprobs: int | None = None) -> SamplingParams:
    if req.n > limits.max_n:
        raise _bad(f"n must be at most {limits.max_n} on this server, got {req.n}", "n")
    if req.logit_bias:      # type: ignore[attr-defined]
        raise _bad("logit_bias is not supported", "logit_bias")
    if req.stop_token_ids and any(t >= limits.vocab_size for t in req.stop_token_ids):
        raise _bad(f"stop_token_ids must be < vocabulary size {limits.vocab_size}", "stop_token_ids")
    if req.min_tokens > max_tokens:
        raise _bad(f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=req.min_p or 0.0,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            skip_special_tokens=req.skip_special_tokens,
        )
    except ValueError as exc:   # SamplingParams has the last word on ranges
        raise _bad(str(exc)) from exc


def _encode(tokenizer: Any, text: str, param: str) -> list[int]:
    try:
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    except Exception as exc:    # e.g. lone surrogates from a "\ud800" JSON escape
        raise _bad(f"could not tokenize {param}: {exc}", param) from exc


def _truncate(ids: list[int], keep: int | None, limits: ModelLimits) -> list[int]:
    """truncate_prompt_tokens: the last `keep` tokens (-1: the context length)."""
    if keep is None:
        return ids
    if keep == 0:
        raise _bad("truncate_prompt_tokens must be -1 or >= 1", "truncate_prompt_tokens")
    keep = limits.max_model_len if keep == -1 else keep
    return ids[-keep:]


def _check_ids(ids: list[int], limits: ModelLimits, param: str) -> None:
    if not ids:
        raise _bad(f"{param} is empty", param)
    if any(t >= limits.vocab_size for t in ids):
        raise _bad(f"token ids in {param} must be < vocabulary size {limits.vocab_size}", param)


def completion_inputs(req: CompletionRequest, tokenizer: Any, limits: ModelLimits) -> list[EngineInput]:
    if req.suffix:
        raise _bad("suffix is not supported", "suffix")
    if req.best_of not in (None, req.n):
        raise _bad("best_of other than n is not supported", "best_of")
    if req.n > limits.max_n:
        raise _bad(f"n must be at most {limits.max_n} on this server, got {req.n}", "n")
    if req.prompt_logprobs is not None and req.stream:     # as vLLM: they come with the final response
        raise _bad("prompt_logprobs are not available when stream=True", "prompt_logprobs")
    p = req.prompt
    prompts: list[str | list[int]]
    if isinstance(p, str):
        prompts = [p]
    elif not p:
        raise _bad("prompt is empty", "prompt")
    elif isinstance(p[0], int):
        prompts = [p]                      # type: ignore[list-item]
    else:
        prompts = list(p)                  # type: ignore[arg-type]
    if len(prompts) * req.n > 4 * limits.max_n:
        raise _bad(f"too many prompts x n ({len(prompts)} x {req.n}) in one request", "prompt")
    # the completions API defaults to 16 tokens; "max_tokens": null means "as many as fit"
    explicit = "max_tokens" in req.model_fields_set
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if not prompt:
                raise _bad("prompt is empty", "prompt")
            ids, text = _encode(tokenizer, prompt, "prompt"), prompt
        else:
            ids, text = list(prompt), None
        kept = _truncate(ids, req.truncate_prompt_tokens, limits)
        if len(kept) < len(ids):
            ids, text = kept, None             # echo shows what the model saw
        _check_ids(ids, limits, "prompt")
        max_tokens = _max_tokens(req.max_tokens if explicit else None, None if explicit else 16,
                                 len(ids), limits, "prompt")
        params = _sampling_params(req, max_tokens, req.logprobs, limits, req.prompt_logprobs)
        out.append(EngineInput(ids, text, params, req.priority, req.cache_salt))
    return out


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def chat_input(req: ChatCompletionRequest, tokenizer: Any, limits: ModelLimits) -> EngineInput:
    if req.tools:
        raise _bad("tools are not supported", "tools")
    if req.response_format is not None and req.response_format.type != "text":
        raise _bad(f"response_format {req.response_format.type!r} is not supported", "response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise _bad("top_logprobs requires logprobs to be true", "top_logprobs")
    if req.add_generation_prompt and req.continue_final_message:
        raise _bad("add_generation_prompt and continue_final_message cannot both be true",
                   "continue_final_message")
    if getattr(tokenizer, "chat_template", None) is None:
        raise _bad("this model has no chat template; use /v1/completions", "messages")
    messages = [{"role": m.role, "content": _message_text(m.content)} for m in req.messages]

    def render(msgs: list[dict[str, str]]) -> list[int]:
        try:
            return list(tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False,
                                                      add_generation_prompt=req.add_generation_prompt,
                                                      continue_final_message=req.continue_final_message))
        except Exception as exc:    # template errors (raise_exception), unencodable text
            raise _bad(f"could not apply the chat template: {exc}", "messages") from exc
    ids = render(messages)
    dropped = 0
    if limits.chat_history_window is not None and len(ids) > limits.chat_history_window:
        ids, dropped = _fit_history(messages, render, limits.chat_history_window, ids)
    ids = _truncate(ids, req.truncate_prompt_tokens, limits)
    _check_ids(ids, limits, "messages")
    budget_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = _max_tokens(requested, None, len(ids), limits, "messages", budget_param)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _sampling_params(req, max_tokens, logprobs, limits)
    return EngineInput(ids, None, params, req.priority, req.cache_salt, dropped)


def _fit_history(messages: list[dict[str, str]], render: Any, window: int, ids: list[int]) -> tuple[list[int], int]:
    """--chat-history-window: drop the oldest turns (a user message and the replies after it)
    until the templated prompt fits `window` tokens. System/developer messages and the last user
    turn always stay; if the prompt still does not fit, the context check rejects it as usual.
    Returns (ids, messages dropped)."""
    kept = list(messages)
    dropped = 0
    while len(ids) > window:
        last_user = max((i for i, m in enumerate(kept) if m["role"] == "user"), default=len(kept))
        first = next((i for i, m in enumerate(kept[:last_user]) if m["role"] not in ("system", "developer")), None)
        if first is None:
            break
        end = first + 1                    # the turn: this message and the non-user replies after it
        while end < last_user and kept[end]["role"] not in ("user", "system", "developer"):
            end += 1
        dropped += end - first
        del kept[first:end]
        ids = render(kept)
    return ids, dropped
