"""Everything a request handler needs, in one object hung on `app.state.tm`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.async_engine import AsyncLLMEngine
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
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False               # SIGTERM received: new requests get 503
    active_requests: int = 0             # HTTP requests being served (the drain waits for 0)
    token_texts: TokenTexts = field(init=False)

    def __post_init__(self) -> None:
        self.token_texts = TokenTexts(self.tokenizer)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, requested: str | None) -> str:
        """The name to report. A request without `model` gets the default; an unknown one, 404."""
        if requested is None or requested in self.served_model_names:
            return self.model_name
        raise OpenAIError(404, f"The model `{requested}` does not exist. Available: "
                               f"{', '.join(self.served_model_names)}", "model")
