"""Hand-written CPU kernels, compiled on first use with the system C++ compiler (cached by
torch under ~/.cache/torch_extensions). When compilation is impossible the engine falls back
to the plain-torch path, which tests hold the kernels equal to."""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

log = logging.getLogger("tokenmill")

_SRC = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"


@functools.cache
def paged_decode_kernels() -> ModuleType | None:
    """The compiled extension, or None (TOKENMILL_CPU_KERNELS=0 disables it)."""
    if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load
        return load(name="tokenmill_paged_decode", sources=[str(_SRC)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"], extra_ldflags=["-fopenmp"],
                    verbose=False)
    except Exception as exc:  # no compiler, no ninja, ...: keep serving on the torch path
        log.warning("CPU paged-attention kernel unavailable (%s); using the torch path", exc)
        return None
