"""tokenmill side of the benchmark: the offline `LLM` API with continuous batching."""
from __future__ import annotations

import time
from typing import Any, Sequence

from tokenmill.bench.sharegpt import Request
from tokenmill.sampling_params import SamplingParams


class TokenmillRunner:
    """Greedy, `ignore_eos` generation through `LLM.generate`; every call returns wall seconds."""

    name = "tokenmill"

    def __init__(self, model: str, dtype: str, max_num_seqs: int, kv_cache_memory: int,
                 enable_prefix_caching: bool = False, name: str = "tokenmill", **engine_kwargs: Any) -> None:
        self.name = name
        from tokenmill import LLM
        from tokenmill.hub import resolve_model
        from tokenmill.model.loader import read_model_config

        # 2048 covers every benchmark workload; a smaller checkpoint context is the limit then.
        max_model_len = min(2048, read_model_config(resolve_model(model)).context_length)
        # Prefix caching is off by default: repeats reuse the same prompts, and HF has no cache.
        self.llm = LLM(model=model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                       kv_cache_memory=kv_cache_memory, enable_prefix_caching=enable_prefix_caching,
                       **engine_kwargs)

    def _generate(self, prompts: Sequence[list[int]], lens: Sequence[int]) -> tuple[list[list[int]], float]:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        secs = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        got = [len(t) for t in tokens]
        assert got == list(lens), f"tokenmill generated {got[:8]}..., asked for {list(lens)[:8]}..."
        return tokens, secs

    def throughput(self, requests: Sequence[Request], batch_size: int | None = None) -> float:
        """All requests submitted at once; the scheduler batches them (batch_size is ignored)."""
        return self._generate([r.prompt_token_ids for r in requests], [r.output_len for r in requests])[1]

    def decode(self, prompt_ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
        tokens, secs = self._generate([prompt_ids], [new_tokens])
        return secs, tokens[0]

    def prefill(self, prompt_ids: list[int]) -> float:
        return self._generate([prompt_ids], [1])[1]
