"""The outer shell every HTTP request passes first (raw ASGI, before FastAPI parses anything).

In order: refuse new work while draining (503), count in-flight requests for the drain,
check the API key on /v1/* (401, constant-time compare), cap the body size (413) and
reject bodies that are not UTF-8 (400). The body is read here once, bounded, and replayed to
the app, so an oversized upload never reaches the JSON parser. Raw ASGI rather than
BaseHTTPMiddleware because the latter wraps `receive` and breaks disconnect detection.
"""
from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.server.errors import error_bytes
from tokenmill.server.state import ServerState

_BODY_METHODS = {"POST", "PUT", "PATCH"}


async def send_error(send: Send, status: int, message: str, param: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = error_bytes(status, message, param)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())] + (headers or [])})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


def authorized(scope: Scope, api_key: str) -> bool:
    value = _header(scope, b"authorization") or b""
    scheme, _, token = value.partition(b" ")
    # compare_digest on bytes of any length is constant-time in the token's content
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), api_key.encode())


class ServerGuards:
    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        st = self.state
        if st.draining:
            await send_error(send, 503, "server is shutting down", headers=[(b"connection", b"close")])
            return
        st.active_requests += 1
        try:
            await self._guarded(scope, receive, send)
        finally:
            st.active_requests -= 1

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        st = self.state
        if st.api_key and scope["path"].startswith("/v1") and not authorized(scope, st.api_key):
            await send_error(send, 401, "invalid or missing API key (use `Authorization: Bearer KEY`)",
                             headers=[(b"www-authenticate", b"Bearer")])
            return
        if scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        limit = st.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await send_error(send, 413, f"request body is {int(declared)} bytes; the limit is {limit}")
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return                      # client left mid-upload: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await send_error(send, 413, f"request body exceeds the limit of {limit} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            await send_error(send, 400, f"request body is not valid UTF-8 (byte {exc.start})")
            return
        await self.app(scope, _replay(body, receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that hands out the buffered body once, then defers to the real one (which
    from then on only ever reports the client's disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
