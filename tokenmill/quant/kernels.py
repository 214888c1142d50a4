"""Which matmul path a quantized linear takes, by device and by the number of rows M.

The weight-only CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) stream the
packed weight once per call but scale ~linearly with M, while dequantize-then-GEMM pays one
pass that writes the whole float weight and then runs at GEMM speed. So small M goes to the
weight-only kernel and large M to dequantize + GEMM. The crossover was measured with
`benchmarks/quant_kernels.py` (numbers in benchmarks/README.md); override it with
TOKENMILL_QUANT_MAX_M_WEIGHT_ONLY for experiments.
"""
from __future__ import annotations

import functools
import os

import torch

# AMD EPYC (Zen 3, AVX2, 2 threads), all SmolLM2 linears: int8 weight-only 133 ms vs
# dequant+fp32 GEMM 310 ms at M=32; 537 vs 486 ms at M=128 (benchmarks/README.md).
_DEFAULT_MAX_M = 96


def max_rows_weight_only() -> int:
    return int(os.environ.get("TOKENMILL_QUANT_MAX_M_WEIGHT_ONLY", _DEFAULT_MAX_M))


def use_weight_only_kernel(x: torch.Tensor) -> bool:
    """True when x [M, K] should go through the packed weight-only CPU kernel."""
    return x.device.type == "cpu" and x.shape[0] <= max_rows_weight_only()


@functools.cache
def cpu_has_fast_int8_dot() -> bool:
    """`torch._int_mm` is only worth it with VNNI or AMX; on plain AVX2 it is ~20x slower
    than fp32 GEMM (measured: 2.7 s vs 0.12 s at M=32), so W8A8 then runs in float."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return any(f in flags for f in (" amx_int8", " avx512_vnni", " avx_vnni"))
