"""Small building blocks shared by the model files: Linear, RMSNorm, SwiGLU (rotary embedding: rope.py).

On CPU without autograd (serving, calibration) each runs as one fused C++ op
(csrc/fused_layer_ops.cpp) instead of a chain of small torch ops; the torch code below is the
reference the kernels are tested against and the path everywhere else.
"""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.cpu_kernels import dense_small_m_kernels, fused_layer_kernels


def fused_cpu_ops(x: torch.Tensor) -> ModuleType | None:
    """The fused kernels when they apply to x: CPU, no autograd (they have no backward)."""
    if x.device.type != "cpu" or torch.is_grad_enabled():
        return None
    return fused_layer_kernels()


class Linear(nn.Linear):
    """nn.Linear whose fp32 CPU forward over a few rows (decode batches, speculative verification)
    reads the weight once for all rows (csrc/dense_small_m.h): MKL's sgemm at 2-8 rows runs at a
    third of memory bandwidth (benchmarks/README.md). Quantized and LoRA layers replace it as
    they would replace nn.Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_cpu_ops(x) and dense_small_m_kernels()
        if (ops is not None and x.dim() == 2 and x.dtype == torch.float32 and self.weight.dtype == torch.float32
                and self.weight.is_contiguous()):
            rows = x.shape[0]
            if 0 < rows <= ops.max_rows:
                return ops.small_m_linear(x, self.weight, self.bias)
            if ops.chunked_pays(rows, self.out_features, self.in_features):    # as the C++ decode stack
                return ops.small_m_linear_chunked(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalizes in fp32; returns the weight's dtype (the matmul dtype), whatever x's is."""
        ops = fused_cpu_ops(x)
        if ops is not None and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous():
            return ops.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(self.weight.dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta in fp32, norm of it): a residual add and the norm after it, x unchanged."""
        ops = fused_cpu_ops(x)
        if (ops is not None and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous()
                and delta.is_contiguous() and delta.shape == x.shape):
            return tuple(ops.add_rms_norm(x, delta, self.weight, self.eps))
        x = x + delta.float()
        return x, self.forward(x)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    ops = fused_cpu_ops(gate_up)
    if ops is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation of GELU (Gemma's `gelu_pytorch_tanh`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
