"""A PEFT LoRA adapter directory, read and checked against the base model.

PEFT layout: `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, ...) and
`adapter_model.safetensors` with `base_model.model.<HF module>.lora_A.weight` [r, in] and
`.lora_B.weight` [out, r]; the module computes W x + scaling * B (A x), scaling = alpha / r
(alpha / sqrt(r) with rsLoRA). Every config field that would change that math and is not
implemented here is refused by name: a silently ignored field gives fluent wrong text.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from tokenmill.config import ModelConfig
from tokenmill.model.llama import FUSED_PROJECTIONS, hf_module_sources, hf_row_sizes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# HF projections an adapter may target, and the fused module of ours each one is a slice of
TARGETABLE = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
FUSED_MODULES = tuple(FUSED_PROJECTIONS) + ("self_attn.o_proj", "mlp.down_proj")
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One HF projection's adapter: delta(x) = scaling * x @ a.T @ b.T."""
    a: torch.Tensor          # [r, in]
    b: torch.Tensor          # [out, r]
    scaling: float


@dataclass(eq=False)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    content_hash: str                     # sha256 of config + weights: identity in the prefix cache
    modules: dict[str, LoRAWeights]       # HF module name (model.layers.3.self_attn.q_proj) -> weights

    @property
    def num_params(self) -> int:
        return sum(w.a.numel() + w.b.numel() for w in self.modules.values())

    def slices(self, fused_module: str) -> list[LoRAWeights | None]:
        """Our fused module `layers.3.self_attn.qkv_proj` -> the adapter of each HF slice it
        stacks (None where the adapter leaves that slice alone)."""
        return [self.modules.get(src) for src in hf_module_sources(fused_module)]


def _refuse_unsupported(cfg: dict, where: str) -> None:
    checks = {
        "peft_type": lambda v: v in (None, "LORA"),
        "bias": lambda v: v in (None, "none"),
        "modules_to_save": lambda v: not v,
        "fan_in_fan_out": lambda v: not v,
        "use_dora": lambda v: not v,
        "rank_pattern": lambda v: not v,
        "alpha_pattern": lambda v: not v,
        "layer_replication": lambda v: not v,
        "trainable_token_indices": lambda v: not v,
    }
    for key, ok in checks.items():
        if not ok(cfg.get(key)):
            raise ValueError(f"{where}: adapter_config.json field {key}={cfg[key]!r} is not supported "
                             "(only plain LoRA on the attention/MLP projections)")


def _targets(cfg: dict, where: str) -> set[str]:
    targets = cfg.get("target_modules")
    if isinstance(targets, str):                    # PEFT: a regex over module names, or one name
        return set()
    bad = sorted(set(targets or ()) - TARGETABLE)
    if bad:
        raise ValueError(f"{where}: target_modules {bad} are not supported (supported: {sorted(TARGETABLE)})")
    return set(targets or ())


def content_hash(path: Path) -> str:
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        h.update((path / name).read_bytes())
    return h.hexdigest()


def load_adapter(name: str, path: str | Path, model_cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and validate a PEFT adapter for this base model. Raises ValueError with the reason."""
    root = Path(path)
    where = f"LoRA adapter {name!r} ({root})"
    if not (root / CONFIG_FILE).is_file():
        raise ValueError(f"{where}: no {CONFIG_FILE}")
    if not (root / WEIGHTS_FILE).is_file():
        extra = " (adapter_model.bin is a pickle and is not loaded; save with safetensors)" \
            if (root / "adapter_model.bin").exists() else ""
        raise ValueError(f"{where}: no {WEIGHTS_FILE}{extra}")
    try:
        cfg = json.loads((root / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: unreadable {CONFIG_FILE}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} is not a JSON object")
    _refuse_unsupported(cfg, where)
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"{where}: r must be a positive integer and lora_alpha a number, got r={rank!r} "
                         f"lora_alpha={alpha!r}")
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} exceeds --max-lora-rank {max_rank}")
    scaling = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    targets = _targets(cfg, where)
    try:
        tensors = load_file(str(root / WEIGHTS_FILE))
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"{where}: unreadable {WEIGHTS_FILE}: {exc}") from exc

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, kind = _split_key(key, where)
        pairs.setdefault(module, {})[kind] = tensor
    expected = projection_shapes(model_cfg)
    modules: dict[str, LoRAWeights] = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: {module} has lora_{''.join(ab)} but not both lora_A and lora_B")
        if module not in expected:
            raise ValueError(f"{where}: {module} is not a projection of this {model_cfg.architecture} model "
                             f"({model_cfg.num_layers} layers)")
        short = module.rsplit(".", 1)[1]
        if targets and short not in targets:
            raise ValueError(f"{where}: weights for {module} but target_modules lacks {short!r}")
        out_f, in_f = expected[module]
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
            raise ValueError(f"{where}: {module} lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                             f"rank {rank} on a [{out_f}, {in_f}] projection")
        modules[module] = LoRAWeights(a.float().contiguous(), b.float().contiguous(), float(scaling))
    if not modules:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    return LoRAAdapter(name, str(root), rank, content_hash(root), modules)


def _split_key(key: str, where: str) -> tuple[str, str]:
    """`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` -> (HF module, "A")."""
    parts = key.removeprefix(PEFT_PREFIX).split(".")
    if parts[-1] == "weight" and len(parts) >= 3 and parts[-2] in ("lora_A", "lora_B"):
        return ".".join(parts[:-2]), parts[-2][-1]
    if len(parts) >= 4 and parts[-1] == "weight" and parts[-3] in ("lora_A", "lora_B"):   # named adapter
        return ".".join(parts[:-3]), parts[-3][-1]
    raise ValueError(f"{where}: tensor {key!r} is not a LoRA A/B weight (embedding adapters, biases and "
                     "extra trained modules are not supported)")


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """HF projection name -> (out, in) for every targetable projection of the model."""
    inputs = {"self_attn.qkv_proj": cfg.hidden_size, "mlp.gate_up_proj": cfg.hidden_size,
              "self_attn.o_proj": cfg.num_heads * cfg.head_dim, "mlp.down_proj": cfg.intermediate_size}
    shapes = {}
    for i in range(cfg.num_layers):
        for fused in FUSED_MODULES:
            name = f"layers.{i}.{fused}"
            for src, rows in zip(hf_module_sources(name), hf_row_sizes(cfg, name)):
                shapes[src] = (rows, inputs[fused])
    return shapes
