"""The hand-written paged decode-attention kernel, compiled on first use (see
tokenmill/cpu_extension.py). When compilation is impossible the engine falls back to the
plain-torch path, which tests hold the kernel equal to."""
from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from tokenmill.cpu_extension import load_cpu_extension

_SRC = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"


@functools.cache
def paged_decode_kernels() -> ModuleType | None:
    """The compiled extension, or None (TOKENMILL_CPU_KERNELS=0 disables it)."""
    return load_cpu_extension("tokenmill_paged_decode", _SRC)
