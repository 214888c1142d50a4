"""Write adapters in PEFT's format (the training script, benchmarks and tests make them)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenmill.config import ModelConfig
from tokenmill.lora.adapter import CONFIG_FILE, PEFT_PREFIX, WEIGHTS_FILE, projection_shapes

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_adapter(path: str | Path, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int,
                 alpha: float, use_rslora: bool = False, base_model: str | None = None,
                 dtype: torch.dtype = torch.float32) -> Path:
    """`weights`: HF module name (model.layers.0.self_attn.q_proj) -> (A [r, in], B [out, r]),
    stored as `dtype`."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    targets = sorted({name.rsplit(".", 1)[1] for name in weights})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "lora_dropout": 0.0, "target_modules": targets, "use_rslora": use_rslora, "bias": "none",
              "fan_in_fan_out": False, "modules_to_save": None, "base_model_name_or_path": base_model}
    tensors = {}
    for name, (a, b) in weights.items():
        tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a.detach().to(dtype).contiguous()
        tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b.detach().to(dtype).contiguous()
    save_file(tensors, str(root / WEIGHTS_FILE))
    (root / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return root


def random_adapter(path: str | Path, cfg: ModelConfig, rank: int, targets: tuple[str, ...] = ALL_TARGETS,
                   seed: int = 0, alpha: float | None = None, use_rslora: bool = False,
                   std: float = 0.02, layers: range | None = None) -> Path:
    """An adapter of random A and B (PEFT initialises B to zero; nonzero B makes it change the
    output), for tests and benchmarks."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, (out_f, in_f) in projection_shapes(cfg).items():
        layer = int(name.split(".")[2])
        if name.rsplit(".", 1)[1] in targets and (layers is None or layer in layers):
            a = torch.randn(rank, in_f, generator=gen) / in_f ** 0.5
            b = torch.randn(out_f, rank, generator=gen) * std
            weights[name] = (a, b)
    return save_adapter(path, weights, rank, alpha if alpha is not None else 2 * rank, use_rslora)
