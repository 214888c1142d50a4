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

from tokenmill.cpu_extension import cpu_flags

# Rows M up to which each format's weight-only kernel beats the tiled dequantize + GEMM, from
# benchmarks/quant_kernels.py on the two CPU kinds this project runs on (all SmolLM2 linears,
# 2 threads, ms kernel / tiled; tables in benchmarks/README.md). torch's packed kernels have
# AVX-512 paths that scale much better with M, so the limit is per CPU kind:
#   AVX2 only (EPYC Zen 3): int8 34.1/37.1 at M=8, 71.3/51.7 at 16; int4 44.8/52.0 at 8,
#     82.6/45.1 at 16; nf4 47.4/47.2 at 12, 95.4/60.6 at 24
#   AVX-512 (EPYC, avx512_bf16/vnni, fp32 activations): int8 67.20/70.63 at 32, 94.04/87.49 at
#     48; int4 52.19/71.56 at 32, 108.93/122.45 at 64; nf4 36.38/41.95 at 16, 55.35/46.19 at 24
_MAX_ROWS = {"avx2": {"int8": 12, "int4": 12, "nf4": 12},
             "avx512": {"int8": 32, "int4": 64, "nf4": 16}}
# tokenmill's integer-dot kernel (int_dot.py) replaces torch's weight-only kernels where it is
# built (the layer then holds no torch-packed copy); above these rows the tiled GEMM takes over.
#   AVX512-VNNI: all SmolLM2 linears fed bf16, 2-core Zen 4 EPYC, ms int_dot / torch kernel /
#     tiled: int4 3.07 / 3.80 at M=1, 24.2 / 22.1 at 16, 45.4 / 42.0 / 53.4 at 32, 88.7 / 91.9 /
#     71.3 at 64; int8 6.8 / 7.9 at M=1, 17.7 / 32.5 at 16, 66.0 / 110.9 / 74.9 at 64 (x blocks
#     of 192/256; the blocks of 64 kept for accuracy, see int_dot.py, cost ~4 % at M=1 and ~20 %
#     at 16).
#   AVX2 (vpmaddubsw; 2-core AVX2-only EPYC, fed fp32, ms int_dot / torch kernel / tiled): int4 3.93 /
#     10.83 / 19.19 at M=1, 26.28 / 36.30 / 39.65 at 12, 50.85 / 45.94 / 44.14 at 16; int8 6.51 /
#     15.26 / 23.01 at M=1, 23.23 / 43.62 / 39.79 at 12, 47.21 / 56.36 / 43.74 at 16.
#   AVX512-VNNI with AMX (2-core Sapphire Rapids, fed bf16, ms int_dot / tiled with bf16 tiles
#     multiplied on AMX): int8 19.41 / 26.28 at M=20, 25.38 / 27.67 at 24, 33.06 / 29.43 at 32;
#     int4 16.87 / 22.02 at 16, 24.89 / 23.68 at 20, 37.72 / 29.48 at 32.
#   AMX-INT8 (the same kernel multiplying on AMX tiles from 4 (int8) / 8 (int4) rows, int_dot_amx.h;
#     2-core Sapphire Rapids, fed bf16, ms int_dot / tiled / bf16 GEMM, a noisy host): int8 15.81 /
#     33.30 / 25.25 at M=64, 28.43 / 36.58 / 26.77 at 128, 67.89 / 90.45 / 83.73 at 256, 97.08 / 84.82
#     / 77.92 at 512; int4 18.25 / 43.68 at 64, 45.96 / 36.10 at 128. After the kernel kept its
#     accumulators in registers and walked strips in L1-sized runs (commit fa7dc2e; ms AMX / tiled,
#     benchmarks/README.md): int8 38.95 / 44.78 at 256, 55.56 / 57.30 at 384, 72.40 / 68.04 at 512;
#     int4 36.58 / 39.32 at 192, 48.57 / 43.37 at 256.
_INT_DOT_MAX_ROWS = {"avx512_vnni": {"int8": 64, "int4": 32}, "avx512_vnni+amx": {"int8": 24, "int4": 16},
                     "amx_int8": {"int8": 384, "int4": 192}, "avx2": {"int8": 12, "int4": 12}}
# With AMX-BF16 the tiled path multiplies bf16 x on AMX tiles, decoding the weight 32 columns at a
# time (csrc/tiled_amx.h), and takes over from far fewer rows for bf16 activations. All SmolLM2
# linears on a 2-core Sapphire Rapids (benchmarks/quant_kernels.py, ms integer-dot AMX / tiled AMX):
# int8 22.67 / 24.51 at 128, 32.63 / 31.48 at 192; int4 13.31 / 16.21 at 64, 20.52 / 19.16 at 96;
# nf4 (its own kernel / tiled AMX) 9.60 / 10.64 at 4, 18.28 / 10.76 at 8.
_BF16_AMX_TILED_MAX_ROWS = {"int8": 160, "int4": 80, "nf4": 4}
_env = os.environ.get("TOKENMILL_QUANT_MAX_M_WEIGHT_ONLY")
# read once: this runs for every quantized linear of every step
_OVERRIDE: int | None = None if _env is None else int(_env)


@functools.cache
def weight_only_max_rows(fmt: str) -> int:
    """The crossover row count for `fmt` (int8 / int4 / nf4) on this CPU kind."""
    return _MAX_ROWS["avx512" if " avx512f" in cpu_flags() else "avx2"][fmt]


@functools.cache
def has_tiled_amx() -> bool:
    """The tiled path was built with its AMX-BF16 kernel (csrc/tiled_amx.h)."""
    from tokenmill.cpu_extension import kernel_family
    mod = kernel_family("tiled_dequant_gemm")
    return mod is not None and hasattr(mod, "amx_min_rows")


def _row_limit(fmt: str, dtype: torch.dtype, limit: int) -> int:
    """`limit`, lowered for bf16 x where the tiled path multiplies on AMX tiles."""
    if _OVERRIDE is not None:
        return _OVERRIDE
    if dtype == torch.bfloat16 and has_tiled_amx():
        return min(limit, _BF16_AMX_TILED_MAX_ROWS[fmt])
    return limit


def weight_only_rows(fmt: str, dtype: torch.dtype) -> int:
    """Rows M of `dtype` x up to which `fmt` takes its weight-only CPU kernel."""
    return _row_limit(fmt, dtype, weight_only_max_rows(fmt))


def use_weight_only_kernel(x: torch.Tensor, fmt: str) -> bool:
    """True when x [M, K] should go through `fmt`'s packed weight-only CPU kernel."""
    return x.device.type == "cpu" and x.shape[0] <= weight_only_rows(fmt, x.dtype)


@functools.cache
def _int_dot_limits() -> dict[str, int]:
    from tokenmill.quant.int_dot import int_dot_kernels   # int_dot imports this module
    mod = int_dot_kernels()
    isa = mod.isa() if mod is not None else ""
    if isa == "avx512_vnni" and mod.has_amx():
        isa = "amx_int8"       # the kernel multiplies on AMX tiles from a few rows
    elif isa == "avx512_vnni" and " amx_bf16" in cpu_flags():
        isa += "+amx"          # the tiled path's bf16 GEMM runs on AMX: it takes over at fewer rows
    return _INT_DOT_MAX_ROWS.get(isa, {"int8": 0, "int4": 0})


def int_dot_max_rows(fmt: str, dtype: torch.dtype) -> int:
    """Rows M of `dtype` x up to which `fmt` (int8 / int4) takes the integer-dot kernel (by the
    instruction set it was built for)."""
    return _row_limit(fmt, dtype, _int_dot_limits()[fmt])


def use_int_dot_kernel(x: torch.Tensor, fmt: str) -> bool:
    """True when x [M, K] should go through the integer-dot kernel (the layer checks it exists)."""
    return x.device.type == "cpu" and x.shape[0] <= int_dot_max_rows(fmt, x.dtype)


@functools.cache
def cpu_has_fast_bf16_dot() -> bool:
    """bf16 GEMM runs on native bf16 dot products (avx512_bf16 or AMX); without them torch
    converts to fp32 internally and bf16 is slower than fp32, so large-M dequantized paths
    multiply in fp32 there."""
    flags = cpu_flags()
    return any(f in flags for f in (" avx512_bf16", " amx_bf16"))


@functools.cache
def cpu_has_fast_int8_dot() -> bool:
    """`torch._int_mm` is only worth it with VNNI or AMX; on plain AVX2 it is ~20x slower
    than fp32 GEMM (measured: 2.7 s vs 0.12 s at M=32), so W8A8 then runs in float."""
    return any(f in cpu_flags() for f in (" amx_int8", " avx512_vnni", " avx_vnni"))
