"""Offline batch API, shaped like vLLM's `LLM`."""
from __future__ import annotations

import itertools
from dataclasses import fields
from typing import Any, Sequence as Seq

from tqdm import tqdm

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

Prompt = str | dict[str, Any]   # "text" | {"prompt": "text"} | {"prompt_token_ids": [...]}


class LLM:
    """`LLM(model="smollm2-135m-instruct", dtype="float32", max_model_len=2048, ...)`.
    Keyword arguments are EngineConfig fields (vLLM's engine argument names)."""

    def __init__(self, model: str = EngineConfig.model, **kwargs: Any) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (nothing to do on one rank)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Seq[int] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run all prompts to completion with continuous batching; outputs in input order.
        `lora_request`: one adapter for every prompt, or one (or None: the base) per prompt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        loras = [lora_request] * len(prompts) if lora_request is None or isinstance(lora_request, LoRARequest) \
            else list(lora_request)
        if len(loras) != len(prompts):
            raise ValueError("need one lora_request per prompt")
        order: dict[str, int] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            rid = str(next(self._ids))
            if isinstance(prompt, dict):
                prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
            self.engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0, lora_request=loras[i])
            order[rid] = i
        return self._run(order, use_tqdm)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [{"prompt_token_ids": list(tok.apply_chat_template(
            conv, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False))}
            for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]
