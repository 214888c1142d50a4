"""An in-process server (FastAPI TestClient) over a real engine on a tiny model: the server
paths that need an engine but not a real model's weights."""
from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.metrics import EngineMetrics
from tokenmill.server.app import build_app
from tokenmill.server.inputs import ModelLimits
from tokenmill.server.state import ServerState

BASE = "tiny"
# a minimal chat template for the tiny tokenizer (it has none)
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def make_client(model: Path, chat_history_window: int | None = None, **engine_kw) -> TestClient:
    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", max_model_len=256,
                                    kv_cache_memory=16 << 20, **engine_kw))
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    limits = ModelLimits(engine.max_model_len, engine.model_config.vocab_size, 8, chat_history_window)
    state = ServerState(engine=AsyncLLMEngine(engine), tokenizer=engine.tokenizer, served_model_names=[BASE],
                        model_root=str(model), limits=limits, metrics=EngineMetrics(BASE, log_interval=None),
                        lora=engine.lora, lora_dir=engine.config.lora_dir)
    return TestClient(build_app(state))
