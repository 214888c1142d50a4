"""The engine requests behind one HTTP request, and the per-choice view handlers render.

One HTTP request = one engine request per prompt (a completions `prompt` may be a list),
each with `n` sequences. Choice index = prompt index * n + sequence index, as in OpenAI.
`Generation.abort()` ends all of them; handlers call it in `finally`, so whatever way the
handler exits (done, client gone, error) the engine stops working for a client that is gone.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.requests import Request

from tokenmill.engine.async_engine import (AsyncLLMEngine, EngineDeadError, QueueFullError, RequestFailedError,
                                           RequestStream)
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sequence import TokenLogprobs
from tokenmill.server.errors import OpenAIError
from tokenmill.server.inputs import EngineInput

T = TypeVar("T")
RETRY_AFTER_S = "1"


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


@dataclass(slots=True)
class ChoiceDelta:
    """What is new for one choice since the last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None     # for token_ids; None when not requested
    finish_reason: str | None = None         # set exactly once, on the choice's last delta
    stop_reason: int | str | None = None


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    dropped_messages: int = 0        # chat messages --chat-history-window left out (reported when > 0)

    def as_dict(self) -> dict[str, int]:
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                 "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.dropped_messages:
            usage["dropped_messages"] = self.dropped_messages
        return usage


@dataclass(eq=False)
class Generation:
    engine: AsyncLLMEngine
    inputs: list[EngineInput]
    streams: list[RequestStream] = field(default_factory=list)
    _tokens: dict[int, int] = field(default_factory=dict)          # choice -> output tokens so far
    _finished: set[int] = field(default_factory=set)
    _pending_lp: dict[int, list[TokenLogprobs]] = field(default_factory=dict)

    @classmethod
    def start(cls, engine: AsyncLLMEngine, request_id: str, inputs: list[EngineInput],
              arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> "Generation":
        """Submit every prompt (on `lora_request`'s adapter when given); all or nothing (a full
        queue aborts those already queued)."""
        limit = engine.max_queue_len
        if limit is not None and len(inputs) > limit:     # could never fit: retrying would not help
            raise OpenAIError(400, f"{len(inputs)} prompts in one request exceed this server's queue "
                                   f"limit of {limit}", "prompt")
        gen = cls(engine, inputs)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        try:
            for i, inp in enumerate(inputs):
                rid = request_id if len(inputs) == 1 else f"{request_id}-{i}"
                gen.streams.append(engine.submit(rid, inp.prompt_token_ids, inp.params, priority=inp.priority,
                                                 arrival_time=arrival, cache_salt=inp.cache_salt,
                                                 lora_request=lora_request))
        except QueueFullError as exc:
            gen.abort()
            raise OpenAIError(503, str(exc), headers={"Retry-After": RETRY_AFTER_S}) from exc
        except EngineDeadError as exc:
            gen.abort()
            raise OpenAIError(503, f"engine unavailable: {exc}") from exc
        return gen

    @property
    def n(self) -> int:
        return self.inputs[0].params.n

    def abort(self) -> None:
        for s in self.streams:
            s.abort()

    def usage(self) -> Usage:
        return Usage(sum(len(i.prompt_token_ids) for i in self.inputs), sum(self._tokens.values()),
                     sum(i.dropped_messages for i in self.inputs))

    # ---- iteration ---------------------------------------------------------------------------
    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from all streams, in arrival order."""
        if len(self.streams) == 1:
            async for out in self.streams[0]:
                yield 0, out
            return
        q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    q.put_nowait((i, out))
            except Exception as exc:
                q.put_nowait((i, exc))
            finally:
                q.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await q.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Per-choice increments for streaming. Tokens whose text is still held back (an
        incomplete character, a possible stop string) keep their logprobs for the next delta."""
        async with contextlib.aclosing(self._merged()) as merged:
            async for i, out in merged:
                for o in out.outputs:
                    idx = i * self.n + o.index
                    self._tokens[idx] = len(o.token_ids)
                    new_ids = o.token_ids[len(o.token_ids) - o.num_delta_tokens:] if o.num_delta_tokens else []
                    if o.logprobs is not None and o.num_delta_tokens:
                        self._pending_lp.setdefault(idx, []).extend(o.logprobs[-o.num_delta_tokens:])
                    finish = o.finish_reason if o.finish_reason and idx not in self._finished else None
                    if not o.delta_text and finish is None:
                        continue
                    if finish is not None:
                        self._finished.add(idx)
                    lps = self._pending_lp.pop(idx, []) if o.logprobs is not None else None
                    yield ChoiceDelta(idx, o.delta_text, new_ids, lps, finish, o.stop_reason if finish else None)

    async def finals(self) -> list[tuple[int, RequestOutput]]:
        """Wait for every prompt to finish; (prompt index, final output), in prompt order."""
        last: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(self._merged()) as merged:
            async for i, out in merged:
                last[i] = out
        for i, out in last.items():
            for o in out.outputs:
                self._tokens[i * self.n + o.index] = len(o.token_ids)
        return sorted(last.items(), key=lambda kv: kv[0])


def engine_error(exc: BaseException) -> OpenAIError:
    """An error that came out of a request stream -> the HTTP error to answer with."""
    if isinstance(exc, ValueError):            # the engine rejected the prompt
        return OpenAIError(400, str(exc))
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, str(exc))
    if isinstance(exc, RequestFailedError):
        return OpenAIError(500, str(exc))
    return OpenAIError(500, f"{type(exc).__name__}: {exc}")


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away. Only valid once the body has been read: from then
    on, the only message the server can receive for this request is http.disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; raise ClientGone (cancelling it) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientGone()


async def wait_for_finals(gen: Generation, request: Request) -> list | None:
    """Every prompt's final output, or None when the client went away first. The request is
    aborted either way, so its KV blocks are freed."""
    try:
        return await unless_disconnected(request, gen.finals())
    except ClientGone:
        return None
    except Exception as exc:
        raise engine_error(exc) from exc
    finally:
        gen.abort()
