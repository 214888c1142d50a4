"""Configuration dataclasses. Engine flags map 1:1 to CLI flags (vLLM names)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def cpu_has_fast_bf16() -> bool:
    """bf16 GEMMs are only fast with AVX512-BF16 or AMX; on plain AVX2 they run ~3x slower
    than fp32 (SmolLM2 linears at 1 token: 104 vs 34 ms on a Zen 3 EPYC)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


@dataclass(slots=True)
class ModelConfig:
    """Architecture hyper-parameters, in HF transformers' vocabulary."""

    architecture: str                 # "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # q/k/v projections carry a bias (Qwen2)
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a HF `config.json` dict."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"unsupported architecture {model_type!r} (supported: llama, qwen2)")
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture="qwen2" if model_type == "qwen2" else "llama",
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
            eos_token_ids=eos_ids,
        )


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to start. Field names are vLLM's engine arguments."""

    model: str = "smollm2-135m-instruct"
    tokenizer: str | None = None
    dtype: str = "auto"                       # auto | float32 | bfloat16 | float16
    device: str = "auto"                      # auto | cpu | cuda
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None        # bytes for the KV cache
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"           # fcfs | priority
    seed: int = 0
    num_threads: int | None = None            # CPU intra-op threads (None = torch default)
    quantization: str | None = None           # quantize at load time: int8 | rtn4 | nf4
    quantize_lm_head: bool = False            # also quantize the lm_head (off: it is small and sensitive)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
        if self.dtype == "auto":
            return torch.bfloat16 if device.type != "cpu" or cpu_has_fast_bf16() else torch.float32
        if self.dtype not in names:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose from auto, {', '.join(names)}")
        return names[self.dtype]
