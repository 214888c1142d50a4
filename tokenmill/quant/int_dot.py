"""Small-M path for int4 and int8 weights on CPUs with AVX512-VNNI or AVX2 (csrc/int_dot_linear.h).

x is quantized per call to int8 in blocks (one scale per block: the int4 weight's group, or 64
columns for per-channel int8) and multiplied with the weight codes in
integers. Measured against torch's weight-only kernels in benchmarks/quant_kernels.py
(`int_dot` columns); which path a layer takes is decided in kernels.py.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import ModuleType

import torch

from tokenmill.cpu_extension import kernel_family
from tokenmill.quant.kernels import int_dot_max_rows

CHUNK = 64             # columns per integer dot instruction
# Activation block for per-channel int8 weights. SmolLM2 held-out PPL with every int8 matmul on
# this kernel (fp32 5.992; float activations 6.007, +0.24 %): blocks of 64 6.021 (+0.48 %), of
# 192/256 6.053 (+1.01 %, over the +1 % int8 budget) though ~4 % (M=1) to 20 % (M=16) faster.
INT8_BLOCK = 64
# TOKENMILL_INT_DOT=0: layers built afterwards keep torch's weight-only kernels (benchmarks, A/B)
ENABLED = os.environ.get("TOKENMILL_INT_DOT", "1") != "0"


@functools.cache
def int_dot_kernels() -> ModuleType | None:
    """The compiled kernels when this CPU has AVX512-VNNI or AVX2, else None."""
    mod = kernel_family("int_dot_linear")
    return mod if mod is not None and mod.available() else None


def int_dot_available() -> bool:
    """Whether layers built now get the integer-dot path."""
    return ENABLED and int_dot_kernels() is not None


def int8_block(k: int) -> int | None:
    """The activation block for K input columns (None: K is not a multiple of it)."""
    return INT8_BLOCK if k % INT8_BLOCK == 0 else None


def pack_int4_chunks(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..15, K % 64 == 0) -> [N, K/2]: per 64-column chunk, byte j holds
    column j (low nibble) and column j + 32 (high nibble)."""
    n, k = q.shape
    c = q.to(torch.uint8).reshape(n, k // CHUNK, 2, CHUNK // 2)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


KERNEL_DTYPES = (torch.float32, torch.bfloat16)   # x dtypes the kernel reads (and returns)


def _stack_can_run(ext: ModuleType, dtype: torch.dtype) -> bool:
    """The decode stack was built with the kernels and feeds them a dtype they read."""
    return dtype in KERNEL_DTYPES and ext.has_int_dot()


def _bias32(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach().float().contiguous()


@dataclass(frozen=True)
class Int4DotWeights:
    """An int4 weight in the kernel's layout: w = q * scales + offsets per group of `block`
    columns (fp16 tables); `perm` puts x's columns in the weight's order (GPTQ act-order)."""

    codes: torch.Tensor     # uint8 [N, K/2], pack_int4_chunks
    scales: torch.Tensor    # float16 [N, K/block]
    offsets: torch.Tensor   # float16 [N, K/block]
    perm: torch.Tensor | None
    bias: torch.Tensor | None   # float32 [N]
    block: int

    @classmethod
    def build(cls, q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, perm: torch.Tensor | None,
              bias: torch.Tensor | None, block: int) -> "Int4DotWeights":
        return cls(pack_int4_chunks(q), scales.half().contiguous(), offsets.half().contiguous(),
                   None if perm is None else perm.long().contiguous(), _bias32(bias), block)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] contiguous fp32/bf16 -> x @ W^T + bias in x's dtype."""
        return int_dot_kernels().int4_dot_linear(x, self.codes, self.scales, self.offsets, self.bias, self.perm,
                                                 self.block)

    def stack_linear(self, ext: ModuleType, dtype: torch.dtype):
        """The same kernel on the same tensors as a linear of the C++ decode stack, or None."""
        if not _stack_can_run(ext, dtype):
            return None
        return ext.Linear.int4(self.codes, self.scales, self.offsets, self.bias, self.perm, self.block,
                               int_dot_max_rows("int4", dtype))


@dataclass(frozen=True)
class Int8DotWeights:
    """A per-channel int8 weight: w = codes * row_scale; code_sums = 128 * each block's code sum."""

    codes: torch.Tensor       # int8 [N, K] (shared with the layer's other paths)
    row_scale: torch.Tensor   # float32 [N]
    code_sums: torch.Tensor   # float32 [N, K/block]
    bias: torch.Tensor | None   # float32 [N]
    block: int

    @classmethod
    def build(cls, codes: torch.Tensor, row_scale: torch.Tensor, bias: torch.Tensor | None,
              block: int) -> "Int8DotWeights":
        n, k = codes.shape
        sums = codes.reshape(n, k // block, block).sum(dim=-1, dtype=torch.int32).float() * 128
        return cls(codes, row_scale.float().contiguous(), sums.contiguous(), _bias32(bias), block)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] contiguous fp32/bf16 -> x @ W^T + bias in x's dtype."""
        return int_dot_kernels().int8_dot_linear(x, self.codes, self.row_scale, self.code_sums, self.bias,
                                                 self.block)

    def stack_linear(self, ext: ModuleType, dtype: torch.dtype):
        """The same kernel on the same tensors as a linear of the C++ decode stack, or None."""
        if not _stack_can_run(ext, dtype):
            return None
        return ext.Linear.int8(self.codes, self.row_scale, self.code_sums, self.bias, self.block,
                               int_dot_max_rows("int8", dtype))


def quantize_blocks_reference(x: torch.Tensor, block: int) -> torch.Tensor:
    """The kernel's activation quantization in torch, dequantized: per block of `block` columns,
    codes round(x * (127 / amax)) (nearest even) times amax / 127."""
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv) * (amax / 127.0)).reshape(m, k)
