"""The hand-written CPU kernels of the model (paged decode attention; the fused elementwise ops
of a decoder layer), compiled on first use (see tokenmill/cpu_extension.py). When compilation is
impossible the engine falls back to the plain-torch paths, which tests hold the kernels equal to."""
from __future__ import annotations

import functools
from types import ModuleType

from tokenmill.cpu_extension import kernel_family


@functools.cache
def paged_decode_kernels() -> ModuleType | None:
    """The compiled extension, or None (TOKENMILL_CPU_KERNELS=0 disables it)."""
    return kernel_family("paged_decode_attention")


@functools.cache
def fused_layer_kernels() -> ModuleType | None:
    """rms_norm, add_rms_norm, rope_, silu_and_mul (csrc/fused_layer_ops.cpp), or None."""
    return kernel_family("fused_layer_ops")


@functools.cache
def dense_small_m_kernels() -> ModuleType | None:
    """small_m_linear (csrc/dense_small_m.h): fp32 x W^T for up to `max_rows` rows in one pass over
    W, or None (also when the build has no SIMD, where it would not beat MKL)."""
    ext = kernel_family("dense_small_m")
    return ext if ext is not None and ext.vectorized else None
