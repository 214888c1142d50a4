"""What machine a benchmark ran on: every benchmark prints `machine_header()` first and stores
`machine_info()` in its JSON, because the CPU kind (AMX / AVX-512 / AVX2 only) changes which
kernels win, and figures are only comparable within one run on one machine."""
from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path
from typing import Any

import torch

# the flags that decide kernel choice (bf16/int8 dot products, AMX tiles)
CPU_FLAGS = ("amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx_vnni", "avx2", "fma")


def _cpuinfo_line(prefix: str) -> str | None:
    try:
        return next(x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                    if x.startswith(prefix))
    except (OSError, StopIteration):
        return None


def cpu_flags() -> list[str]:
    have = set((_cpuinfo_line("flags") or "").split())
    return [f for f in CPU_FLAGS if f in have]


def machine_info() -> dict[str, Any]:
    return {"cpu": _cpuinfo_line("model name") or platform.processor(), "cpu_count": os.cpu_count(),
            "cpu_flags": cpu_flags(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "date": datetime.datetime.now().isoformat(timespec="seconds")}


def machine_header() -> str:
    m = machine_info()
    return (f"machine: {m['cpu']} ({m['cpu_count']} CPUs; flags {' '.join(m['cpu_flags']) or '-'}), "
            f"torch {m['torch']}, {m['torch_threads']} threads, {m['date']}")
