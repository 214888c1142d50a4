"""OpenAI-style error bodies, and the handlers that make every failure path produce one.

Shape: `{"error": {"message": str, "type": str, "param": str | None, "code": int}}`; `code`
repeats the HTTP status (as vLLM does), `type` is `invalid_request_error` for 4xx and
`server_error` for 5xx. FastAPI's default 422 for a schema violation becomes 400, because
OpenAI clients (and the issue) expect 400 for any bad parameter.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

log = logging.getLogger("tokenmill")


class OpenAIError(Exception):
    """Raise anywhere in a handler to answer with an OpenAI-style error."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def error_bytes(status: int, message: str, param: str | None = None) -> bytes:
    """For raw-ASGI middleware that answers before FastAPI is involved."""
    return json.dumps(error_body(status, message, param)).encode()


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    """First pydantic error -> ("body.top_k: Input should be a valid integer", "top_k")."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        ctx = err.get("ctx") or {}
        return f"request body is not valid JSON: {ctx.get('error', err.get('msg'))}", None
    # union branches add type tags to the location ("stop", "constrained-str"): keep the field path
    path: list[str] = []
    for part in loc:
        if not (part.isdigit() or part.isidentifier()) or part in _TYPE_TAGS:
            break
        path.append(part)
    param = ".".join(path) or None
    where = ".".join(loc) or "body"
    return f"{where}: {err.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # 404 unknown route, 405 wrong method, 400 unparsable body (FastAPI's own)
        return error_response(exc.status_code, str(exc.detail), None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in request handler")
        return error_response(500, f"internal error: {type(exc).__name__}")
