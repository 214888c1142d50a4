"""Large-M path for integer and NF4 weights: dequantize one L2-sized tile of output rows at a time and
multiply it right away (csrc/tiled_dequant_gemm.cpp), instead of writing the whole fp32 weight
to memory first. Measured in benchmarks/quant_kernels.py (`tiled` columns)."""
from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from tokenmill.cpu_extension import kernel_family
from tokenmill.quant.kernels import cpu_has_fast_bf16_dot

# TOKENMILL_TILED_DEQUANT=0 keeps the whole-weight dequantize + GEMM (benchmarks and tests flip this)
_ENABLED = os.environ.get("TOKENMILL_TILED_DEQUANT", "1") != "0"


@functools.cache
def tiled_kernels() -> ModuleType | None:
    """The compiled extension, or None (no AVX2/compiler, or TOKENMILL_CPU_KERNELS=0)."""
    return kernel_family("tiled_dequant_gemm")


def tiled_usable(k: int, group_size: int) -> bool:
    """A CPU weight of K = k columns in groups of group_size can take the tiled path."""
    return _ENABLED and group_size % 32 == 0 and k % group_size == 0 and tiled_kernels() is not None


def tiled_supported(x: torch.Tensor, k: int, group_size: int) -> bool:
    return x.device.type == "cpu" and tiled_usable(k, group_size)


def stack_with_tiled(lin, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                     perm: torch.Tensor | None, bits: int, group_size: int):
    """A decode-stack integer-dot linear (model/decode_stack.py) that hands the rows past its own to
    the tiled path, as the eager layer does, so wide decode batches stay in the stack."""
    if lin is None or not hasattr(lin, "with_tiled"):
        return lin
    return lin.with_tiled(codes, scale, offset, perm, bits, group_size, cpu_has_fast_bf16_dot())


def tiled_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                 bias: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    """x [M, Kx] @ W^T + bias with W [N, K >= Kx] = codes * scale + offset per group (see the C++ header).
    bf16 x multiplies bf16 tiles where the CPU has bf16 dot products, fp32 tiles otherwise."""
    return tiled_kernels().tiled_dequant_linear(x, codes, scale, offset, bias, bits, group_size,
                                                cpu_has_fast_bf16_dot())


def tiled_nf4_linear(x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor,
                     bias: torch.Tensor | None, block_size: int) -> torch.Tensor:
    """x [M, K] @ W^T + bias with W = table[code] * absmax per block (NF4, bitsandbytes order)."""
    return tiled_kernels().tiled_nf4_linear(x, codes, absmax, table, bias, block_size, cpu_has_fast_bf16_dot())
