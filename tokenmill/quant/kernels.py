"""Which matmul path a quantized linear takes, by device and by the number of rows M.

The weight-only CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) stream the
packed weight once per call but scale ~linearly with M, while the tiled dequantize + GEMM
(tiled.py) decodes an L2-sized tile of rows and then runs at GEMM speed. So small M goes to the
weight-only kernel and large M to the tiled GEMM (or, without it, whole-weight dequantize + GEMM). The crossover was measured with
`benchmarks/quant_kernels.py` (numbers in benchmarks/README.md); override it with
TOKENMILL_QUANT_MAX_M_WEIGHT_ONLY (one limit for all formats) for experiments.
"""
from __future__ import annotations

import functools
import os

import torch

# Crossovers from benchmarks/quant_kernels.py (AMD EPYC Zen 3, AVX2, 2 threads, all SmolLM2
# linears, ms; table in benchmarks/README.md): int8 kernel vs tiled 34.1 vs 37.1 at M=8,
# 71.3 vs 51.7 at M=16; int4 (group 64) 44.8 vs 52.0 at M=8, 82.6 vs 45.1 at M=16.
INT8_MAX_ROWS = 12
INT4_MAX_ROWS = 12
_env = os.environ.get("TOKENMILL_QUANT_MAX_M_WEIGHT_ONLY")
# read once: this runs for every quantized linear of every step
_OVERRIDE: int | None = None if _env is None else int(_env)


def use_weight_only_kernel(x: torch.Tensor, max_rows: int) -> bool:
    """True when x [M, K] should go through the packed weight-only CPU kernel."""
    return x.device.type == "cpu" and x.shape[0] <= (max_rows if _OVERRIDE is None else _OVERRIDE)


def _cpuinfo() -> str:
    try:
        return open("/proc/cpuinfo").read()
    except OSError:
        return ""


@functools.cache
def cpu_has_fast_bf16_dot() -> bool:
    """bf16 GEMM runs on native bf16 dot products (avx512_bf16 or AMX); without them torch
    converts to fp32 internally and bf16 is slower than fp32, so large-M dequantized paths
    multiply in fp32 there."""
    flags = _cpuinfo()
    return any(f in flags for f in (" avx512_bf16", " amx_bf16"))


@functools.cache
def cpu_has_fast_int8_dot() -> bool:
    """`torch._int_mm` is only worth it with VNNI or AMX; on plain AVX2 it is ~20x slower
    than fp32 GEMM (measured: 2.7 s vs 0.12 s at M=32), so W8A8 then runs in float."""
    return any(f in _cpuinfo() for f in (" amx_int8", " avx512_vnni", " avx_vnni"))
