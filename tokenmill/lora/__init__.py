"""Multi-LoRA serving: PEFT adapters on one base model, mixed in one flat batch.

- request.py  `LoRARequest(lora_name, lora_int_id, lora_path)`, vLLM's shape
- adapter.py  a PEFT directory -> A/B matrices per fused projection slice, and a content hash
- layers.py   `LoRALinear`: base(x) + the deltas of the adapters in this step's rows
- manager.py  adapters by name, the LRU of loaded ones, the slots of one batch
"""
from tokenmill.lora.request import LoRARequest

__all__ = ["LoRARequest"]
