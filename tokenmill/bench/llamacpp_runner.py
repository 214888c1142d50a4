"""llama.cpp side of `tokenmill bench throughput`: a `llama-server` child process driven over
loopback HTTP with the same token ids, greedy, exact output lengths (`ignore_eos`) and no prompt
cache, timed by wall clock around the requests like the in-process engines."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import httpx

from tokenmill.bench.anchors import ManagedServer, llama_server_spec
from tokenmill.bench.sharegpt import Request


class LlamaCppRunner:
    def __init__(self, name: str, gguf: Path, threads: int, parallel: int, ctx_per_seq: int, port: int) -> None:
        self.name, self.parallel = name, parallel
        spec = llama_server_spec("llama-cpp-server", gguf, port, parallel, ctx_per_seq, threads)
        self.server = ManagedServer(spec).__enter__()
        self.client = httpx.Client(base_url=spec.base_url, timeout=None, trust_env=False)

    def close(self) -> None:
        self.client.close()
        self.server.stop()

    def _complete(self, prompt_ids: list[int], n: int) -> list[int]:
        r = self.client.post("/completion", json={
            "prompt": prompt_ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
            "cache_prompt": False, "return_tokens": True, "stream": False})
        r.raise_for_status()
        body = r.json()
        got = body.get("tokens_predicted", len(body.get("tokens", [])))
        assert got == n, f"llama.cpp generated {got} tokens, asked for {n}"
        return list(body.get("tokens", []))

    def throughput(self, requests: Sequence[Request], batch_size: int | None = None) -> float:
        """All requests in flight at once over `parallel` server slots (continuous batching)."""
        start = time.perf_counter()
        with ThreadPoolExecutor(self.parallel) as pool:
            list(pool.map(lambda r: self._complete(r.prompt_token_ids, r.output_len), requests))
        return time.perf_counter() - start

    def decode(self, prompt_ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
        start = time.perf_counter()
        tokens = self._complete(prompt_ids, new_tokens)
        return time.perf_counter() - start, tokens

    def prefill(self, prompt_ids: list[int]) -> float:
        start = time.perf_counter()
        self._complete(prompt_ids, 1)
        return time.perf_counter() - start
