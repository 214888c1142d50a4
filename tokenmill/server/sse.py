"""Server-sent events as OpenAI streams them: `data: {json}\n\n` per chunk, then `data: [DONE]`."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    # compact separators: chunks are many and small; ensure_ascii=False keeps text readable
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class SSEResponse(StreamingResponse):
    """StreamingResponse that always closes its generator when the response ends.

    When the client disconnects, Starlette cancels the task that drives the body iterator,
    but a generator suspended at `yield` would only be finalized by the garbage collector.
    Closing it here runs the generator's `finally` (which aborts the engine requests) right
    away, so the KV blocks of a dropped stream are freed within one engine step."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._gen = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._gen, "aclose", None)
            if aclose is not None:
                await aclose()
