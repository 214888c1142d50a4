"""POST /v1/completions: legacy text completion, streaming or not."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.server.errors import error_body
from tokenmill.server.generation import Generation, engine_error, wait_for_finals
from tokenmill.server.inputs import completion_inputs
from tokenmill.server.logprobs import completion_logprobs, prompt_logprobs_json
from tokenmill.server.protocol import CompletionRequest
from tokenmill.server.sse import DONE, SSEResponse, sse_event
from tokenmill.server.state import ServerState

CLIENT_CLOSED = 499   # nginx's code; never reaches the (gone) client, but shows in access logs


async def create_completion(body: CompletionRequest, request: Request, state: ServerState) -> Response:
    arrival = time.monotonic()
    model, lora = state.check_model(body.model)
    inputs = await asyncio.to_thread(completion_inputs, body, state.tokenizer, state.limits)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    gen = Generation.start(state.engine, request_id, inputs, arrival, lora)
    echo = [inp.prompt_text if inp.prompt_text is not None else state.tokenizer.decode(inp.prompt_token_ids)
            for inp in inputs] if body.echo else None
    if body.stream:
        return SSEResponse(_stream(gen, body, state, request_id, model, echo))
    finals = await wait_for_finals(gen, request)
    if finals is None:
        return Response(status_code=CLIENT_CLOSED)
    choices = []
    for i, out in finals:
        for o in out.outputs:
            prefix = echo[i] if echo else ""
            choice = {
                "index": i * gen.n + o.index,
                "text": prefix + o.text,
                "logprobs": completion_logprobs(o.logprobs, state.token_texts, len(prefix))
                if o.logprobs is not None else None,
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
            }
            if body.prompt_logprobs is not None and out.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, state.token_texts)
            choices.append(choice)
    return JSONResponse({"id": request_id, "object": "text_completion", "created": int(time.time()),
                         "model": model, "choices": choices, "usage": gen.usage().as_dict()})


async def _stream(gen: Generation, body: CompletionRequest, state: ServerState, request_id: str, model: str,
                  echo: list[str] | None) -> AsyncIterator[bytes]:
    created = int(time.time())
    opts = body.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    offsets: dict[int, int] = {}           # choice -> text length sent so far (logprobs text_offset)

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        payload: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created,
                                   "model": model, "choices": choices}
        if include_usage:
            payload["usage"] = usage
        return sse_event(payload)

    try:
        async for d in gen.deltas():
            text = d.text
            if echo and d.index not in offsets:
                text = echo[d.index // gen.n] + text
            start = offsets.get(d.index, 0)
            offsets[d.index] = start + len(text)
            yield chunk([{"index": d.index, "text": text,
                          "logprobs": completion_logprobs(d.logprobs, state.token_texts, start)
                          if d.logprobs is not None else None,
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
