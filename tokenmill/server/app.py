"""The FastAPI app and `run_server` (what `tokenmill serve` runs)."""
from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill import __version__
from tokenmill.server.chat import create_chat_completion
from tokenmill.server.completions import create_completion
from tokenmill.server.dashboard import add_dashboard_route
from tokenmill.server.errors import error_response, install_error_handlers
from tokenmill.server.guards import ServerGuards
from tokenmill.server.lora_routes import adapter_model_cards, add_lora_routes
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.server.state import ServerState

log = logging.getLogger("tokenmill")

# uvicorn's own last-resort timeout, after our drain (which already waited shutdown_timeout)
UVICORN_GRACE_S = 3


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.engine.start()        # the engine thread needs the running loop to post results
        yield
        await state.engine.shutdown()

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible LLM server")
    app.state.tm = state
    install_error_handlers(app)
    app.add_middleware(ServerGuards, state=state)

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.is_alive:
            return error_response(503, "engine is not running")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        body = state.metrics.render() if state.metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        data = [{"id": name, "object": "model", "created": state.created, "owned_by": "tokenmill",
                 "root": state.model_root, "parent": None, "max_model_len": state.limits.max_model_len}
                for name in state.served_model_names] + adapter_model_cards(state)
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, state)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request, state)

    add_lora_routes(app, state)
    add_dashboard_route(app)
    return app


def run_server(args: argparse.Namespace) -> None:
    """Load the engine (before binding, so /health is only up once we can serve), then serve
    until SIGTERM/SIGINT has drained."""
    from tokenmill.engine.async_engine import AsyncLLMEngine
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine_args import engine_config_from_args
    from tokenmill.metrics import EngineMetrics
    from tokenmill.server.inputs import ModelLimits
    from tokenmill.server.shutdown import DrainingServer

    config = engine_config_from_args(args)
    engine = LLMEngine(config)
    names = args.served_model_name or [config.model]
    metrics = EngineMetrics(names[0], log_interval=None if args.disable_log_stats else args.log_stats_interval)
    max_n = args.max_n or engine.max_num_seqs
    window = args.chat_history_window
    if window is not None and not 0 < window < engine.max_model_len:
        raise SystemExit(f"--chat-history-window must be in [1, max_model_len={engine.max_model_len}), got {window}")
    state = ServerState(
        engine=AsyncLLMEngine(engine, metrics, max_queue_len=args.max_queue_len),
        tokenizer=engine.tokenizer,
        served_model_names=names,
        model_root=config.model,
        limits=ModelLimits(engine.max_model_len, engine.model_config.vocab_size, max_n, window),
        metrics=metrics,
        api_key=args.api_key,
        max_body_bytes=args.max_request_body_bytes,
        lora=engine.lora,
        lora_dir=config.lora_dir,
    )
    app = build_app(state)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                               access_log=not args.disable_uvicorn_access_log,
                               timeout_graceful_shutdown=UVICORN_GRACE_S)
    server = DrainingServer(uv_config, state, args.shutdown_timeout)
    log.info("serving %s as %s on http://%s:%d", config.model, ", ".join(names), args.host, args.port)
    server.run()
    log.info("server stopped")
