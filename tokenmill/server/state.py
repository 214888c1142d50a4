"""Everything a request handler needs, in one object hung on `app.state.tm`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.lora.manager import LoRAManager
from tokenmill.lora.request import LoRARequest
from tokenmill.metrics import EngineMetrics
from tokenmill.server.errors import OpenAIError
from tokenmill.server.inputs import ModelLimits
from tokenmill.server.logprobs import TokenTexts


@dataclass(eq=False)
class ServerState:
    engine: AsyncLLMEngine
    tokenizer: Any
    served_model_names: list[str]
    model_root: str                      # what the names stand for (path or known model name)
    limits: ModelLimits
    metrics: EngineMetrics | None = None
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    lora: LoRAManager | None = None      # adapters served by name (--enable-lora)
    lora_dir: str | None = None          # runtime adapter loads only from inside it
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False               # SIGTERM received: new requests get 503
    active_requests: int = 0             # HTTP requests being served (the drain waits for 0)
    token_texts: TokenTexts = field(init=False)

    def __post_init__(self) -> None:
        self.token_texts = TokenTexts(self.tokenizer)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, requested: str | None) -> tuple[str, LoRARequest | None]:
        """The name to report and the adapter it selects (None: the base model). A request
        without `model` gets the base model; an unknown name, 404."""
        if requested is None or requested in self.served_model_names:
            return self.model_name, None
        adapter = self.lora.known.get(requested) if self.lora is not None else None
        if adapter is not None:
            return requested, adapter
        available = self.served_model_names + (list(self.lora.known) if self.lora is not None else [])
        raise OpenAIError(404, f"The model `{requested}` does not exist. Available: {', '.join(available)}", "model")
