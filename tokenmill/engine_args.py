"""EngineConfig <-> command-line flags, one flag per field, vLLM's names (`--max-model-len`)."""
from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from tokenmill.config import EngineConfig
from tokenmill.quant.kv_cache import KV_CACHE_DTYPES

_CHOICES = {"kv_cache_dtype": tuple(KV_CACHE_DTYPES)}

_HELP = {
    "model": "model name (see `tokenmill fetch --list`), a .gguf file or an HF directory",
    "dtype": "auto (bfloat16 on GPUs and CPUs with AVX512-BF16/AMX, else float32) | float32 | bfloat16 | float16",
    "quantization": "quantize weights at load time: int8 | rtn4 | nf4 (calibrated methods: `tokenmill quantize`)",
    "quantize_lm_head": "quantize the lm_head too",
    "kv_cache_dtype": "K/V storage: auto (the model dtype) | bfloat16 | int8 | fp8_e4m3 | fp8_e5m2 (1-byte codes, "
                      "one fp32 scale per token, KV head and 64 values)",
    "kv_cache_memory": "bytes for the KV cache (CPU default 2 GiB); accepts suffixes like 4G",
    "gpu_memory_utilization": "fraction of GPU memory for weights + KV cache (CUDA only)",
    "block_size": "tokens per KV-cache block",
    "scheduling_policy": "fcfs | priority",
    "num_threads": "CPU threads for torch (default: all cores)",
    "enforce_eager": "run every step through the eager PyTorch layers (off: pure-decode CPU steps run all "
                     "layers in one C++ call, same kernels and bits)",
    "speculative_config": 'speculative decoding, JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                          '"prompt_lookup_min": 2, "prompt_lookup_max": 4} or {"method": "draft_model", '
                          '"model": "...", "num_speculative_tokens": 4}; optional "disable_by_batch_size"',
    "enable_lora": "serve LoRA adapters: requests pick one by name in `model` (tokenmill/lora/)",
    "lora_modules": "adapters served by name: name=path ... (PEFT directories)",
    "max_loras": "distinct adapters that may run in one batch",
    "max_lora_rank": "largest adapter rank accepted",
    "max_cpu_loras": "adapters kept loaded in memory, least recently used evicted (default: max_loras)",
    "lora_dir": "enables POST /v1/load_lora_adapter and /v1/unload_lora_adapter for adapters inside this directory",
    "tensor_parallel_size": "ranks holding 1/N of every layer each (gloo on CPU, nccl on CUDA); spawned here, or "
                            "one per `torchrun` process (MASTER_ADDR/MASTER_PORT), rank 0 serving HTTP",
    "max_num_seqs": "most sequences in a step (default: 12 on CPU, sized for TPOT P95 < 40 ms; 256 on GPU)",
    "max_num_batched_tokens": "token budget of a step, prefill chunks included (default: 256 on CPU, "
                              "bounding the inter-token stall a prefill causes; 2048 on GPU)",
    "max_idle_batched_tokens": "token budget of a step in which no sequence streams output, so big prefill "
                               "chunks stall nobody (default: 2048, or max_num_batched_tokens when that is given)",
}


def parse_bytes(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        help_ = _HELP.get(f.name, "") + f" (default: {default})"
        if f.name == "model" and positional_model:
            parser.add_argument("model", nargs="?", default=default, help=help_)
            parser.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
        elif isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
        elif f.name == "lora_modules":
            parser.add_argument(flag, nargs="+", default=None, metavar="NAME=PATH", help=help_)
        elif f.name == "kv_cache_memory":
            parser.add_argument(flag, type=parse_bytes, default=default, help=help_)
        else:
            kind = {int: int, float: float}.get(type(default), str)
            if f.name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_idle_batched_tokens",
                          "num_threads", "max_cpu_loras"):
                kind = int
            parser.add_argument(flag, type=kind, default=default, help=help_, choices=_CHOICES.get(f.name))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    if getattr(args, "model_flag", None):
        values["model"] = args.model_flag
    return EngineConfig(**values)
