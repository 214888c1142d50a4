"""POST /v1/chat/completions: the model's chat template, streaming or not."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.server.completions import CLIENT_CLOSED
from tokenmill.server.errors import error_body
from tokenmill.server.generation import Generation, engine_error, wait_for_finals
from tokenmill.server.inputs import chat_input
from tokenmill.server.logprobs import chat_logprobs
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.sse import DONE, SSEResponse, sse_event
from tokenmill.server.state import ServerState


async def create_chat_completion(body: ChatCompletionRequest, request: Request, state: ServerState) -> Response:
    arrival = time.monotonic()
    model, lora = state.check_model(body.model)
    inp = await asyncio.to_thread(chat_input, body, state.tokenizer, state.limits)
    if inp.dropped_messages and state.metrics is not None:
        state.metrics.history_truncated.inc()
        state.metrics.history_dropped.inc(inp.dropped_messages)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    gen = Generation.start(state.engine, request_id, [inp], arrival, lora)
    if body.stream:
        return SSEResponse(_stream(gen, body, state, request_id, model))
    finals = await wait_for_finals(gen, request)
    if finals is None:
        return Response(status_code=CLIENT_CLOSED)
    choices = []
    for _, out in finals:
        for o in out.outputs:
            choices.append({
                "index": o.index,
                "message": {"role": "assistant", "content": o.text},
                "logprobs": chat_logprobs(o.logprobs, state.token_texts) if o.logprobs is not None else None,
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
            })
    return JSONResponse({"id": request_id, "object": "chat.completion", "created": int(time.time()),
                         "model": model, "choices": choices, "usage": gen.usage().as_dict()})


async def _stream(gen: Generation, body: ChatCompletionRequest, state: ServerState, request_id: str,
                  model: str) -> AsyncIterator[bytes]:
    created = int(time.time())
    opts = body.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        payload: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                                   "model": model, "choices": choices}
        if include_usage:
            payload["usage"] = usage
        return sse_event(payload)

    try:
        # OpenAI opens every choice with a role-only delta before any content
        for i in range(gen.n):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        async for d in gen.deltas():
            delta = {"content": d.text} if d.text or d.finish_reason is None else {}
            yield chunk([{"index": d.index, "delta": delta,
                          "logprobs": chat_logprobs(d.logprobs, state.token_texts) if d.logprobs is not None else None,
                          "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}],
                        gen.usage().as_dict() if continuous else None)
        if include_usage:
            yield chunk([], gen.usage().as_dict())
    except Exception as exc:      # engine failure mid-stream: headers are sent, so report in-band
        err = engine_error(exc)
        yield sse_event(error_body(err.status, err.message, err.param))
    finally:
        gen.abort()
    yield DONE
