"""Quantized checkpoints as HF-layout directories, and building quantized modules from them.

A directory holds config.json (the model's HF config plus `quantization_config` =
QuantConfig.to_hf() and `torch_dtype`), model.safetensors and the tokenizer files. Every
projection keeps its HF name (`model.layers.0.self_attn.q_proj.*`): tokenmill fuses q/k/v and
gate/up in memory, so saving splits a fused module's rows per HF projection and loading
concatenates them again (GroupQuant.cat and friends) -- never through a float weight.

Tensors per projection `<p>` (biases, when the model has them, are `<p>.bias` in float):
  gptq         AutoGPTQ v1: <p>.qweight int32 [K/8, N], .qzeros int32 [G, N/8], .scales fp16 [G, N],
               .g_idx int32 [K]                                   (formats.pack_gptq)
  awq          AutoAWQ GEMM: <p>.qweight int32 [K, N/8], .qzeros int32 [G, N/8], .scales fp16 [G, N]
  rtn4         tokenmill: <p>.q4 uint8 [N, ceil(K/2)] (column 2i in the low nibble of byte i,
               2i+1 in the high one), .scales float32 [N, G], .zeros uint8 [N, G]; groups k // group_size
  int8         tokenmill: <p>.qweight int8 [N, K], .weight_scale float32 [N]
  smoothquant  as int8 plus <p>.smooth_inv float32 [K] (activations are multiplied by it, then
               quantized per token; all ones where 1/s was folded into the preceding RMSNorm)
  nf4          tokenmill: <p>.codes uint8 [N, K/2] and either .absmax float32 [N, K/B] or
               .absmax_q int8 [N*K/B] + .absmax_scale float32 + .absmax_mean float32 []
               (see nf4.py). With double quant the second-level absmax_scale/absmax_mean
               belong to the whole FUSED weight (q|k|v or gate|up) and are repeated, identical,
               in each of its parts: absmax_q splits by rows, its 256-value groups do not.
AWQ and SmoothQuant fold scales into the RMSNorm weights (and AWQ into up_proj's rows): those
are ordinary float tensors here, already folded.

The model-specific naming comes in as two callables (`sources`: fused module name -> HF module
names, `row_sizes`: -> their row counts; tokenmill.model.llama provides both), so this module
needs nothing from the model layer.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenmill.quant import formats
from tokenmill.quant.apply import quantizable_linears, replace_module
from tokenmill.quant.config import QuantConfig
from tokenmill.quant.group import GroupQuant, default_g_idx
from tokenmill.quant.int4 import Int4Linear, pack_q4, unpack_q4
from tokenmill.quant.int8 import Int8Linear
from tokenmill.quant.nf4 import NF4Linear

Tensors = dict[str, torch.Tensor]
Sources = Callable[[str], list[str]]
RowSizes = Callable[[str], list[int]]
QUANT_MODULES = (Int4Linear, Int8Linear, NF4Linear)


def read_quant_config(hf_config: dict[str, Any]) -> QuantConfig | None:
    qc = hf_config.get("quantization_config")
    return None if qc is None else QuantConfig.from_hf(qc)


# ---- encode: one quantized module -> tensors per HF projection -------------------------------
def _split(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return [p.contiguous() for p in torch.split(t, sizes, dim=0)]


def _encode(cfg: QuantConfig, module: nn.Module, sizes: list[int]) -> list[Tensors]:
    if isinstance(module, Int4Linear):
        gq = module.group_quant()
        out = []
        for q, s, z in zip(_split(gq.q, sizes), _split(gq.scales, sizes), _split(gq.zeros, sizes)):
            part = GroupQuant(q, s, z, gq.g_idx, gq.bits, gq.group_size)
            if cfg.method == "gptq":
                out.append(formats.pack_gptq(part))
            elif cfg.method == "awq":
                out.append(formats.pack_awq(part))
            elif cfg.method == "rtn4":
                out.append({"q4": pack_q4(q), "scales": s.float(), "zeros": z.to(torch.uint8)})
            else:
                raise ValueError(f"a 4-bit group-wise module in a {cfg.method} model")
        return out
    if isinstance(module, Int8Linear):
        out = []
        for q, s in zip(_split(module.qweight, sizes), _split(module.scale, sizes)):
            d = {"qweight": q, "weight_scale": s.float()}
            if module.smooth_inv is not None:
                d["smooth_inv"] = module.smooth_inv.float().contiguous()
            out.append(d)
        return out
    if isinstance(module, NF4Linear):
        out = []
        if module.double_quant:
            nbr = module.in_features // module.block_size        # absmax blocks per row
            absq = _split(module.absmax_q.view(module.out_features, nbr), sizes)
            for codes, aq in zip(_split(module.codes, sizes), absq):
                out.append({"codes": codes, "absmax_q": aq.reshape(-1).contiguous(),
                            "absmax_scale": module.absmax_scale.contiguous(),
                            "absmax_mean": module.absmax_mean.contiguous()})
        else:
            for codes, am in zip(_split(module.codes, sizes), _split(module.absmax, sizes)):
                out.append({"codes": codes, "absmax": am})
        return out
    raise TypeError(f"not a quantized module: {type(module).__name__}")


def checkpoint_tensors(model: nn.Module, cfg: QuantConfig, sources: Sources, row_sizes: RowSizes) -> Tensors:
    """HF-named tensors of the whole model: quantized projections per `_encode`, every float
    parameter under its HF name (fused ones split by rows; a tied lm_head is not repeated)."""
    out: Tensors = {}
    for name, module in model.named_modules():
        if not isinstance(module, QUANT_MODULES):
            continue
        sizes, srcs = row_sizes(name), sources(name)
        bias = getattr(module, "bias", None)
        biases = [None] * len(srcs) if bias is None else _split(bias.float(), sizes)
        for src, tensors, b in zip(srcs, _encode(cfg, module, sizes), biases):
            # clone: parts may share storage (one g_idx / smooth_inv for q, k and v)
            out.update({f"{src}.{k}": v.contiguous().clone() for k, v in tensors.items()})
            if b is not None:
                out[f"{src}.bias"] = b
    for pname, param in model.named_parameters():     # shared (tied) parameters come once
        module, _, kind = pname.rpartition(".")
        srcs = sources(module)
        parts = [param.detach()] if len(srcs) == 1 else _split(param.detach(), row_sizes(module))
        for src, t in zip(srcs, parts):
            out[f"{src}.{kind}"] = t.contiguous().clone()
    return out


def save_quantized(model: nn.Module, cfg: QuantConfig, hf_config: dict[str, Any], out_dir: str | Path,
                   sources: Sources, row_sizes: RowSizes, tokenizer: Any = None) -> Path:
    """Write `out_dir` (config.json, model.safetensors, tokenizer files)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(model, cfg, sources, row_sizes)
    dtypes = {t.dtype for k, t in tensors.items() if k.endswith(".weight") and t.is_floating_point()}
    config = dict(hf_config)
    config["quantization_config"] = cfg.to_hf()
    config["torch_dtype"] = str(next(iter(dtypes)) if len(dtypes) == 1 else torch.float32).removeprefix("torch.")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


# ---- decode: HF projection tensors -> one (fused) quantized module ---------------------------
def _decode(cfg: QuantConfig, parts: list[Tensors], sizes: list[int], in_features: int,
            bias: torch.Tensor | None) -> nn.Module:
    gs = in_features if cfg.group_size == -1 else cfg.group_size
    if cfg.method == "gptq":
        gqs = [formats.unpack_gptq(p["qweight"], p["qzeros"], p["scales"], p.get("g_idx"), 4, cfg.group_size)
               for p in parts]
        return Int4Linear(GroupQuant.cat(gqs), bias)
    if cfg.method == "awq":
        gqs = [formats.unpack_awq(p["qweight"], p["qzeros"], p["scales"], cfg.group_size) for p in parts]
        return Int4Linear(GroupQuant.cat(gqs), bias)
    if cfg.method == "rtn4":
        gqs = [GroupQuant(unpack_q4(p["q4"], in_features), p["scales"].float(), p["zeros"].float(),
                          default_g_idx(in_features, gs), 4, gs) for p in parts]
        return Int4Linear(GroupQuant.cat(gqs), bias)
    if cfg.method in ("int8", "smoothquant"):
        smooth = parts[0].get("smooth_inv")
        if cfg.method == "smoothquant" and smooth is None:
            raise ValueError("smoothquant checkpoint lacks smooth_inv")
        if smooth is not None and any(not torch.equal(p["smooth_inv"], smooth) for p in parts[1:]):
            raise ValueError("fused projections must share their SmoothQuant smooth_inv")
        return Int8Linear(torch.cat([p["qweight"] for p in parts]).to(torch.int8),
                          torch.cat([p["weight_scale"].float() for p in parts]), bias,
                          None if smooth is None else smooth.float())
    if cfg.method == "nf4":
        n = sum(sizes)
        codes = torch.cat([p["codes"] for p in parts])
        if cfg.double_quant:
            first = parts[0]
            for p in parts[1:]:
                if not (torch.equal(p["absmax_scale"], first["absmax_scale"])
                        and torch.equal(p["absmax_mean"], first["absmax_mean"])):
                    raise ValueError("fused NF4 projections must share absmax_scale / absmax_mean")
            state = {"absmax_q": torch.cat([p["absmax_q"] for p in parts]),
                     "absmax_scale": first["absmax_scale"], "absmax_mean": first["absmax_mean"]}
        else:
            state = {"absmax": torch.cat([p["absmax"] for p in parts])}
        return NF4Linear(codes, state, bias, n, in_features, cfg.block_size, cfg.double_quant)
    raise ValueError(f"unknown quantization method {cfg.method!r}")


@torch.no_grad()
def load_quantized_linears(model: nn.Module, weights: Tensors, cfg: QuantConfig, sources: Sources,
                           row_sizes: RowSizes) -> None:
    """Replace the model's projections by quantized modules built from the checkpoint tensors,
    which are popped from `weights` (what remains is the float part of the model). The
    lm_head is quantized iff the checkpoint has quantized lm_head tensors."""
    has_head = any(k.startswith("lm_head.") and k != "lm_head.weight" for k in weights)
    for name, linear in quantizable_linears(model, include_lm_head=has_head):
        parts, biases = [], []
        for src in sources(name):
            prefix = f"{src}."
            keys = [k for k in weights if k.startswith(prefix) and "." not in k[len(prefix):]]
            b = weights.pop(f"{src}.bias", None)
            part = {k[len(prefix):]: weights.pop(k) for k in keys if k != f"{src}.bias"}
            if not part or "weight" in part:
                raise ValueError(f"{cfg.method} checkpoint has no quantized tensors for {src}")
            parts.append(part)
            biases.append(b)
        if (linear.bias is not None) != all(b is not None for b in biases):
            raise ValueError(f"{name}: checkpoint bias does not match the model's")
        bias = None if linear.bias is None else torch.cat(biases).float()
        module = _decode(cfg, parts, row_sizes(name), linear.in_features, bias)
        if (module.out_features, module.in_features) != (linear.out_features, linear.in_features):
            raise ValueError(f"{name}: quantized shape {(module.out_features, module.in_features)} != "
                             f"model {(linear.out_features, linear.in_features)}")
        replace_module(model, name, module)
