"""What a request names to run on an adapter (vLLM's `LoRARequest`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1 (0 is the base model), got {self.lora_int_id!r}")
