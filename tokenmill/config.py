"""Configuration dataclasses. Engine flags map 1:1 to CLI flags (vLLM names)."""
from __future__ import annotations

from dataclasses import dataclass, field
import logging
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tokenmill.model.rope import RopeScaling

log = logging.getLogger("tokenmill")


def cpu_has_fast_bf16() -> bool:
    """bf16 GEMMs are only fast with AVX512-BF16 or AMX; on plain AVX2 they run ~3x slower
    than fp32 (SmolLM2 linears at 1 token: 104 vs 34 ms on a Zen 3 EPYC)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


class UnsupportedConfig(ValueError):
    """A checkpoint (or a setting for it) asks for math tokenmill does not implement."""


@dataclass(slots=True)
class ModelConfig:
    """Architecture hyper-parameters, in HF transformers' vocabulary. Built from a checkpoint by
    tokenmill/model/registry.py (HF) or loader.py (GGUF), which refuse what it cannot express."""

    architecture: str                 # "llama" | "qwen2" | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # q/k/v projections carry a bias (Qwen2; Llama attention_bias)
    o_proj_bias: bool = False         # the output projection too (Llama attention_bias)
    mlp_bias: bool = False            # gate/up/down carry biases (Llama mlp_bias)
    sliding_window: int | None = None # some layer attends only this far back
    eos_token_ids: list[int] = field(default_factory=list)
    # per layer "full_attention" | "sliding_attention"; None: every layer (Mistral) when
    # sliding_window is set
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None       # rope base of the sliding layers (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale is its -0.5 power (Gemma); None: head_dim

    def layer_window(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends through, or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a HF `config.json` dict; raises UnsupportedConfig naming any key it cannot honour."""
        from tokenmill.model.registry import model_config_from_hf
        return model_config_from_hf(cfg)

    @property
    def context_length(self) -> int:
        """The longest context the checkpoint supports (extended by rope scaling where it says so)."""
        if self.rope_scaling is None:
            return self.max_position_embeddings
        return self.rope_scaling.context_length(self.max_position_embeddings)

    def resolve_max_model_len(self, requested: int | None) -> int:
        """The engine's max length: `requested` (vLLM's --max-model-len) or the checkpoint's context."""
        limit = self.context_length
        if requested is not None and requested > limit:
            raise ValueError(f"max_model_len={requested} exceeds the model's context length {limit}")
        return requested or limit


# (max_num_seqs, max_num_batched_tokens) when not given, for GPUs and CPUs. On a
# CPU both are set for the serving SLA (TTFT P95 < 500 ms, TPOT P95 < 40 ms): a decode step's time
# grows with the seats in use, and a step that carries a prefill chunk stalls every stream for the
# chunk's time (~1 ms per token on 2 cores), so a small budget bounds the ITL spikes. SmolLM2
# decode steps on a 2-core EPYC (benchmarks/profile_decode.py, int8 / rtn4 / bf16, ms): 25.4 /
# 20.3 / 31.6 at 8 sequences, 40.0 / 39.0 / 40.4 at 16, 60.5 / 60.8 / 50.0 at 24; 12 seats keep
# the step near 30 ms, leaving room for the prefill chunks within a 40 ms TPOT.
# The third figure is the budget of an idle step, one where no sequence is streaming output: no
# inter-token latency to protect, so prefill takes big chunks, which run faster per token (a
# 512-token SmolLM2 prompt on a 2-core Sapphire Rapids: 2944 tok/s in 256-token chunks, 4184 in one).
SCHEDULER_DEFAULTS = {"gpu": (256, 2048, 2048), "cpu": (12, 256, 2048)}


def _scheduler_defaults(device: torch.device) -> tuple[int, int, int]:
    return SCHEDULER_DEFAULTS["cpu" if device.type == "cpu" else "gpu"]


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to start. Field names are vLLM's engine arguments."""

    model: str = "smollm2-135m-instruct"
    tokenizer: str | None = None
    dtype: str = "auto"                       # auto | float32 | bfloat16 | float16
    device: str = "auto"                      # auto | cpu | cuda
    max_model_len: int | None = None
    max_num_seqs: int | None = None           # None: SCHEDULER_DEFAULTS for the device
    max_num_batched_tokens: int | None = None # None: the device's default chunk budget
    max_idle_batched_tokens: int | None = None # budget when no sequence streams output; None: the device's
                                               # default, or max_num_batched_tokens when that is given
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
    kv_cache_dtype: str = "auto"              # auto (the model dtype) | bfloat16 | int8 | fp8_e4m3 | fp8_e5m2
    enforce_eager: bool = False               # True: always the eager layers, never the C++ decode stack
    speculative_config: Any = None            # dict / JSON text / SpeculativeConfig (tokenmill/spec/config.py)
    enable_lora: bool = False                 # serve LoRA adapters (tokenmill/lora/)
    lora_modules: Any = None                  # ["name=path", ...] or {name: path}: adapters served by name
    max_loras: int = 4                        # distinct adapters in one batch
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None          # adapters kept loaded (LRU); None: max_loras
    lora_dir: str | None = None               # runtime load_lora_adapter paths must lie inside it
    tensor_parallel_size: int = 1             # ranks, each holding 1/N of every layer (tokenmill/parallel/)

    def resolve_max_num_seqs(self, device: torch.device) -> int:
        if self.max_num_seqs is None:
            return _scheduler_defaults(device)[0]
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        return self.max_num_seqs

    def resolve_max_num_batched_tokens(self, device: torch.device, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            if self.max_num_batched_tokens < 1:
                raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
            return self.max_num_batched_tokens
        budget = _scheduler_defaults(device)[1]
        return budget if self.enable_chunked_prefill else max(max_model_len, budget)

    def resolve_max_idle_batched_tokens(self, device: torch.device, max_model_len: int) -> int:
        budget = self.resolve_max_num_batched_tokens(device, max_model_len)
        if self.max_idle_batched_tokens is None:
            # a step budget the user chose caps every step; only the device default widens when idle
            return budget if self.max_num_batched_tokens is not None else max(budget, _scheduler_defaults(device)[2])
        if self.max_idle_batched_tokens < budget:
            raise ValueError(f"max_idle_batched_tokens={self.max_idle_batched_tokens} is below the step budget "
                             f"max_num_batched_tokens={budget}")
        return self.max_idle_batched_tokens

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
