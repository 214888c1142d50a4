"""Swap a float model's nn.Linear projections for quantized modules, and count weight bytes.

The model file never branches on the method: it builds plain nn.Linear layers, and this
module replaces them after the float weights are in (load-time quantization) or builds them
straight from a quantized checkpoint's tensors (see checkpoint.py).
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.quant.config import QuantConfig
from tokenmill.quant.group import rtn_quantize
from tokenmill.quant.int4 import Int4Linear
from tokenmill.quant.int8 import Int8Linear


def quantizable_linears(model: nn.Module, include_lm_head: bool) -> list[tuple[str, nn.Linear]]:
    """Every projection of the decoder layers (fused names: qkv_proj, o_proj, gate_up_proj,
    down_proj), plus the lm_head when asked."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("layers.")]
    if include_lm_head and isinstance(getattr(model, "lm_head", None), nn.Linear):
        found.append(("lm_head", model.lm_head))
    return found


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def group_size_for(cfg: QuantConfig, in_features: int) -> int:
    return in_features if cfg.group_size == -1 else cfg.group_size


def quantize_linear(linear: nn.Linear, cfg: QuantConfig) -> nn.Module:
    """Calibration-free methods: int8 (RTN per channel), rtn4, nf4."""
    w = linear.weight.detach().float()
    bias = None if linear.bias is None else linear.bias.detach().clone()
    if cfg.method == "int8":
        return Int8Linear.from_float(w, bias)
    if cfg.method == "rtn4":
        return Int4Linear(rtn_quantize(w, 4, group_size_for(cfg, w.shape[1])), bias)
    if cfg.method == "nf4":
        from tokenmill.quant.nf4 import NF4Linear
        return NF4Linear.from_float(w, bias, block_size=cfg.block_size, double_quant=cfg.double_quant)
    raise ValueError(f"{cfg.method} needs calibration data: run `tokenmill quantize` and load its output")


@torch.no_grad()
def quantize_model(model: nn.Module, cfg: QuantConfig) -> None:
    for name, linear in quantizable_linears(model, cfg.quantize_lm_head):
        replace_module(model, name, quantize_linear(linear, cfg))


def weight_bytes(model: nn.Module, as_float: torch.dtype | None = None) -> int:
    """Bytes of all weights as stored: quantized modules report their packed size, float
    parameters count dtype bytes (tied tensors once). With `as_float`, quantized modules count
    as float weights of that dtype (the size before quantization)."""
    total, seen = 0, set()
    for module in model.modules():
        if hasattr(module, "weight_bytes"):
            total += int(module.weight_bytes() if as_float is None else
                         module.out_features * module.in_features * as_float.itemsize)
            bias = getattr(module, "bias", None)
            total += 0 if bias is None else bias.numel() * bias.element_size()
            seen.update(id(b) for b in module.buffers())
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total
