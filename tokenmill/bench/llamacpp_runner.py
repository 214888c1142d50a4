"""llama.cpp side of `tokenmill bench throughput`: a `llama-server` child process driven over
loopback HTTP with the same token ids, greedy, exact output lengths (`ignore_eos`) and no prompt
cache, timed by wall clock around the requests like the in-process engines.

The server is restarted (untimed) after every throughput phase: llama-server's batch-1 decode
measured right after a 64-prompt, 32-slot phase ran at 80.6 tok/s against 119.1 on a fresh
server (benchmarks/README.md), so without the restart its single-stream figures would depend on
what ran before them. tokenmill's engines carry no state between phases either."""
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

    def _restart(self) -> None:
        self.server.stop()
        self.server = ManagedServer(self.server.spec).__enter__()
        self._complete([1, 2, 3, 4], 4)    # first request on a fresh server: untimed

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
        took = time.perf_counter() - start
        self._restart()
        return took

    def decode(self, prompt_ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
        start = time.perf_counter()
        tokens = self._complete(prompt_ids, new_tokens)
        return time.perf_counter() - start, tokens

    def prefill(self, prompt_ids: list[int]) -> float:
        start = time.perf_counter()
        self._complete(prompt_ids, 1)
        return time.perf_counter() - start
