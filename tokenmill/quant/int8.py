"""INT8 weights, symmetric per output channel: weight-only (`int8`, RTN) and W8A8 (`smoothquant`).

Weight-only: y = x @ (q * s)^T. W8A8 (SmoothQuant, Xiao et al. 2023): the calibration has
already folded smoothing factors into the weight (W' = W diag(m)) and stores 1/m as
`smooth_inv`; at run time the activation is smoothed (x / m), quantized per token to int8 with
a dynamic scale, and multiplied with the int8 weight with integer accumulation.
"""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.cpu_kernels import dense_small_m_kernels
from tokenmill.quant.int_dot import KERNEL_DTYPES, Int8DotWeights, int8_block, int_dot_available
from tokenmill.quant.kernels import (cpu_has_fast_int8_dot, int_dot_max_rows, use_int_dot_kernel,
                                     use_weight_only_kernel, weight_only_rows)
from tokenmill.quant.tiled import stack_with_tiled, tiled_linear, tiled_supported, tiled_usable


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [N, K] and fp32 scales [N] with max |w| of each row mapped to 127."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 of each row of x [M, K]: integer-valued codes and scales [M, 1]."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
    return torch.round(xf / scale).clamp(-127, 127), scale


class Int8Linear(nn.Module):
    """Drop-in for nn.Linear: `forward(x)` returns x's dtype."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 smooth_inv: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale.float())
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16), persistent=False)
        self.register_buffer("bias", bias)
        self.register_buffer("smooth_inv", None if smooth_inv is None else smooth_inv.float())
        self.act_quant = smooth_inv is not None
        block = int8_block(self.in_features)
        self.int_dot: Int8DotWeights | None = None
        if block is not None and qweight.device.type == "cpu" and int_dot_available():
            self.int_dot = Int8DotWeights.build(self.qweight, self.scale, bias, block)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                   smooth_inv: torch.Tensor | None = None) -> "Int8Linear":
        q, s = quantize_per_channel(weight)
        return cls(q, s, bias, smooth_inv)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scale[:, None]

    def weight_bytes(self) -> int:
        extra = 0 if self.smooth_inv is None else self.smooth_inv.numel() * 4
        return self.qweight.numel() + self.scale.numel() * 4 + extra

    def stack_linear(self, ext: ModuleType, dtype: torch.dtype):
        """This layer's decode kernel for the C++ decode stack (model/decode_stack.py), or None
        (SmoothQuant's per-call smoothing stays on the eager path)."""
        if self.int_dot is None or self.smooth_inv is not None:
            return None
        lin = self.int_dot.stack_linear(ext, dtype)
        # past the integer-dot rows the eager layer runs the tiled path, unless torch's weight-only
        # kernel still takes some of those rows
        if (lin is None or not tiled_usable(self.in_features, self.in_features)
                or weight_only_rows("int8", dtype) > int_dot_max_rows("int8", dtype)):
            return lin
        return stack_with_tiled(lin, self.qweight, self.scale, None, None, 8, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int_dot is not None and use_int_dot_kernel(x, "int8") and x.dtype in KERNEL_DTYPES:
            # weight-only int8 too: x quantized per block of <= 256 columns costs little accuracy
            # (measured in benchmarks/README.md) and lets the products run in integers
            xs = x if self.smooth_inv is None else (x * self.smooth_inv).to(x.dtype)
            return self.int_dot.linear(xs.contiguous())
        small = self._small_batch_kernel(x)
        if small is not None:
            return small.small_m_linear_int8(x, self.qweight, self.scale, self.bias)
        out_dtype = x.dtype
        if self.act_quant:
            y = self._w8a8(x)
        elif use_weight_only_kernel(x, "int8"):
            y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scale_bf16)
        elif tiled_supported(x, self.in_features, self.in_features):
            y = self._tiled(x)
        else:
            y = F.linear(x, self.dequantize().to(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(out_dtype)

    def _small_batch_kernel(self, x: torch.Tensor) -> ModuleType | None:
        """fp32 rows widened from the int8 codes in registers, one pass over the codes for up to 8
        rows (model/csrc/dense_small_m.h): on CPUs without VNNI torch's weight-only kernel casts x
        to bf16 and streamed the 0.5B Qwen's codes at a third of memory bandwidth (benchmarks/README.md)."""
        if (self.act_quant or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2
                or torch.is_grad_enabled() or (self.bias is not None and self.bias.dtype != torch.float32)):
            return None
        ops = dense_small_m_kernels()
        return ops if ops is not None and 0 < x.shape[0] <= ops.max_rows else None

    def _w8a8(self, x: torch.Tensor) -> torch.Tensor:
        qx, sx = quantize_per_token(x.float() * self.smooth_inv)
        if x.device.type == "cuda" or cpu_has_fast_int8_dot():
            if x.device.type == "cuda" and qx.shape[0] <= 16:     # _int_mm needs M > 16 on CUDA
                qx = F.pad(qx, (0, 0, 0, 17 - qx.shape[0]))
            acc = torch._int_mm(qx.to(torch.int8), self.qweight.t())[: x.shape[0]]
            return acc.float() * sx * self.scale
        # Same integer products without an int8 dot unit: integer-valued codes are exact in
        # bf16/fp32 and fp32 accumulates them exactly while a sum stays below 2^24.
        if use_weight_only_kernel(x, "int8"):
            return torch._weight_int8pack_mm(qx.to(torch.bfloat16), self.qweight, self.scale_bf16).float() * sx
        if tiled_supported(x, self.in_features, self.in_features):
            return self._tiled(qx) * sx
        return F.linear(qx, self.qweight.float()) * sx * self.scale

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        """x @ (q * scale)^T, tile by tile: one group per row (group = K), no offset."""
        return tiled_linear(x, self.qweight, self.scale, None, None, 8, self.in_features)
