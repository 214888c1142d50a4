"""Workloads of `tokenmill bench scheduler`: each is an async function of (client, seed) that
returns the streamed results grouped by role, e.g. {"stream": [...], "long": [...]}.

- prefix:       one ~1,000-token system prompt + 100 short questions, sent one at a time, so
                TTFT is the request's own prefill (no queueing in either configuration).
- multiturn:    ShareGPT conversations, each replayed closed-loop: turn k+1 is sent (after a
                short think time) once turn k's answer has streamed, and its prompt is the chat
                template of the history with the answers the server actually generated.
- interference: 8 short-prompt streams decode long answers while 2,000-token prompts keep
                arriving every few seconds until the streams finish.
- priority:     ShareGPT requests at a rate well above capacity; 20% carry priority 0 (high),
                the rest priority 1 (lower value = served sooner).
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import httpx

from tokenmill.bench.datasets import DatasetConfig, multiturn_dialogues, prefix_shared_requests, random_requests
from tokenmill.bench.metrics_math import RequestResult
from tokenmill.bench.serve import COMPLETIONS, arrival_gaps, send_request
from tokenmill.bench.sharegpt import Conversation, Request, sample_requests

Groups = dict[str, list[RequestResult]]


@dataclass
class Client:
    """What a workload needs to stream requests at one server."""

    http: httpx.AsyncClient
    base_url: str
    model: str
    tokenizer: Any
    t0: float = 0.0

    async def send(self, req: Request, extra: dict[str, Any] | None = None, keep_text: bool = False) -> RequestResult:
        return await send_request(self.http, self.base_url, COMPLETIONS, self.model, req, self.t0,
                                  extra=extra, keep_text=keep_text)


@dataclass(slots=True)
class PrefixWorkload:
    num_questions: int = 100
    prefix_len: int = 1000
    question_len: int = 24
    output_len: int = 8


@dataclass(slots=True)
class MultiturnWorkload:
    num_conversations: int = 16
    max_turns: int = 4
    max_prompt_tokens: int = 1536
    max_output_tokens: int = 96
    think_time_s: float = 0.5
    start_gap_s: float = 0.5           # conversation i starts at i * start_gap_s
    conversations: list[Conversation] | None = None    # None: ShareGPT


@dataclass(slots=True)
class InterferenceWorkload:
    num_streams: int = 8
    stream_prompt_len: int = 64
    stream_output_len: int = 128
    long_prompt_len: int = 2000
    long_output_len: int = 4
    first_long_at_s: float = 1.0
    long_every_s: float = 2.5
    max_step_s: float = 1.0            # sizes the pool of long prompts: streams last < output_len * this


@dataclass(slots=True)
class PriorityWorkload:
    num_requests: int = 120
    request_rate: float = 6.0          # Poisson; ~3x what 32 slots sustain on 2 cores
    high_fraction: float = 0.2
    max_output_tokens: int = 128
    conversations: list[Conversation] | None = None    # None: ShareGPT


async def prefix_workload(c: Client, seed: int, w: PrefixWorkload) -> Groups:
    cfg = DatasetConfig(name="prefix-shared", num_prompts=w.num_questions, seed=seed, input_len=w.question_len,
                        output_len=w.output_len, prefix_len=w.prefix_len)
    out = []
    for req in prefix_shared_requests(c.tokenizer, cfg):   # one at a time: TTFT = own prefill
        out.append(await c.send(req))
    return {"question": out}


async def multiturn_workload(c: Client, seed: int, w: MultiturnWorkload) -> Groups:
    cfg = DatasetConfig(name="multiturn", num_prompts=0, seed=seed, max_prompt_tokens=w.max_prompt_tokens,
                        max_output_tokens=w.max_output_tokens, max_turns=w.max_turns)
    dialogues = multiturn_dialogues(c.tokenizer, cfg, w.num_conversations, w.conversations)
    first: list[RequestResult] = []
    later: list[RequestResult] = []

    async def converse(i: int, user_turns: list[str], output_lens: list[int]) -> None:
        await asyncio.sleep(i * w.start_gap_s)
        history: list[dict[str, str]] = []
        for k, (user, out_len) in enumerate(zip(user_turns, output_lens)):
            history.append({"role": "user", "content": user})
            text, ids = await asyncio.to_thread(_chat_prompt, c.tokenizer, history)  # keep the loop free
            res = await c.send(Request(text, ids, out_len), keep_text=True)
            (first if k == 0 else later).append(res)
            if not res.success:
                return
            history.append({"role": "assistant", "content": res.text})
            await asyncio.sleep(w.think_time_s)

    await asyncio.gather(*(converse(i, d.user_turns, d.output_lens) for i, d in enumerate(dialogues)))
    return {"turn 1": first, "turns >= 2": later}


def _chat_prompt(tokenizer: Any, history: list[dict[str, str]]) -> tuple[str, list[int]]:
    text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


async def interference_workload(c: Client, seed: int, w: InterferenceWorkload) -> Groups:
    def prompts(n: int, seed_: int, input_len: int, output_len: int) -> list[Request]:
        return random_requests(c.tokenizer, DatasetConfig(name="random", num_prompts=n, seed=seed_,
                                                          input_len=input_len, output_len=output_len))

    streams = prompts(w.num_streams, seed, w.stream_prompt_len, w.stream_output_len)
    # built up front (enough for the streams' lifetime): tokenizing inside the loop would stall
    # the client and show up as inter-token latency
    budget = math.ceil(w.stream_output_len * w.max_step_s / w.long_every_s) + 1
    longs = iter(prompts(budget, seed + 10_000, w.long_prompt_len, w.long_output_len))
    stream_tasks = [asyncio.create_task(c.send(r)) for r in streams]
    long_tasks: list[asyncio.Task[RequestResult]] = []
    await asyncio.sleep(w.first_long_at_s)
    while not all(t.done() for t in stream_tasks):     # long prompts arrive while the streams decode
        req = next(longs, None)
        if req is None:
            break
        long_tasks.append(asyncio.create_task(c.send(req)))
        await asyncio.wait(stream_tasks, timeout=w.long_every_s)   # returns early once all are done
    return {"stream": list(await asyncio.gather(*stream_tasks)), "long prompt": list(await asyncio.gather(*long_tasks))}


async def priority_workload(c: Client, seed: int, w: PriorityWorkload) -> Groups:
    reqs = sample_requests(c.tokenizer, w.num_requests, 512, w.max_output_tokens, seed=seed,
                           conversations=w.conversations)
    rng = random.Random(seed)
    high = set(rng.sample(range(len(reqs)), round(w.high_fraction * len(reqs))))
    gaps = arrival_gaps(len(reqs), w.request_rate, 1.0, seed)
    tasks: list[tuple[bool, asyncio.Task[RequestResult]]] = []
    for i, (req, gap) in enumerate(zip(reqs, gaps)):
        tasks.append((i in high, asyncio.create_task(c.send(req, extra={"priority": 0 if i in high else 1}))))
        await asyncio.sleep(gap)
    results = [(is_high, await t) for is_high, t in tasks]
    return {"high": [r for h, r in results if h], "low": [r for h, r in results if not h]}


Workload = Callable[[Client, int], Awaitable[Groups]]


async def run_workload(base_url: str, model: str, tokenizer: Any, workload: Workload, seed: int,
                       timeout_s: float = 1800.0) -> tuple[Groups, float]:
    """Run one workload against a server; returns its grouped results and wall seconds."""
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, trust_env=False) as http:
        c = Client(http, base_url, model, tokenizer, t0=time.perf_counter())
        groups = await asyncio.wait_for(workload(c, seed), timeout=timeout_s)
        return groups, time.perf_counter() - c.t0

