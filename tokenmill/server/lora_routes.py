"""Adapters over HTTP: `/v1/models` entries, and vLLM's runtime `POST /v1/load_lora_adapter` /
`/v1/unload_lora_adapter` (only with `--lora-dir`, and only for paths inside it)."""
from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from tokenmill.lora.manager import resolve_inside
from tokenmill.server.errors import OpenAIError
from tokenmill.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from tokenmill.server.state import ServerState


def adapter_model_cards(state: ServerState) -> list[dict]:
    if state.lora is None:
        return []
    return [{"id": name, "object": "model", "created": state.created, "owned_by": "tokenmill",
             "root": req.lora_path, "parent": state.model_name, "max_model_len": state.limits.max_model_len}
            for name, req in list(state.lora.known.items())]


def _runtime_lora(state: ServerState) -> None:
    if state.lora is None or state.lora_dir is None:
        raise OpenAIError(400, "runtime LoRA loading is disabled: start the server with --enable-lora --lora-dir DIR")


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        _runtime_lora(state)
        if body.lora_name in state.served_model_names:
            raise OpenAIError(400, f"`{body.lora_name}` is the base model's name", "lora_name")
        try:
            path = resolve_inside(state.lora_dir, body.lora_path)
            await asyncio.to_thread(state.lora.add, body.lora_name, str(path))
        except ValueError as exc:
            raise OpenAIError(400, str(exc), "lora_path") from exc
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        _runtime_lora(state)
        try:
            state.lora.remove(body.lora_name)
        except KeyError:
            raise OpenAIError(404, f"no LoRA adapter named `{body.lora_name}` is loaded", "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
