"""Build and load the hand-written CPU kernels (C++ compiled on first use with the system
compiler), safely across processes, crashes and machines.

torch's `cpp_extension.load` guards its build folder with a lock *file* that a killed process
leaves behind, after which every later load waits forever (this hung CI for 90 minutes), and it
keys the cache by source and flags only, so a `-march=native` build from an AVX-512 host would be
reused on an AVX2 host that shares the home folder and die with SIGILL. So each build lives in a
folder keyed by source, flags, torch version and the CPU's feature flags, and builders serialize
on an `flock` (released by the kernel when its holder dies), which lets a stale torch lock file
be removed safely."""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import re
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("tokenmill")

CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math")
LDFLAGS = ("-fopenmp",)


def cpu_flags() -> str:
    """The CPU's /proc/cpuinfo `flags` line (the machine name where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def source_texts(source: Path) -> list[str]:
    """The source and every local header it pulls in ("..." includes, recursively): a build is
    stale when any of them changes."""
    seen: dict[Path, str] = {}
    todo = [source.resolve()]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen[path] = path.read_text()
        todo.extend((path.parent / inc).resolve() for inc in _LOCAL_INCLUDE.findall(seen[path]))
    return list(seen.values())


def build_directory(name: str, source: Path) -> Path:
    key = hashlib.sha256("\0".join([*source_texts(source), *CFLAGS, *LDFLAGS, torch.__version__,
                                    cpu_flags()]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("TOKENMILL_KERNEL_CACHE", Path.home() / ".cache" / "tokenmill" / "kernels"))
    return root / f"{name}-{key}"


KERNELS_SOURCE = Path(__file__).parent / "csrc" / "kernels.cpp"


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The one extension holding every hand-written CPU kernel (csrc/kernels.cpp), or None."""
    return load_cpu_extension("tokenmill_kernels", KERNELS_SOURCE)


def kernel_family(name: str) -> ModuleType | None:
    """One kernel family's submodule (e.g. "fused_layer_ops"), or None when the extension could
    not be built or was built without it (nf4 / tiled need AVX2)."""
    ext = cpu_kernels()
    return None if ext is None else getattr(ext, name, None)


def load_cpu_extension(name: str, source: Path) -> ModuleType | None:
    """The compiled module, or None when it cannot be built (no compiler, no AVX2, ...) or
    TOKENMILL_CPU_KERNELS=0; callers then keep their plain-torch path."""
    if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load
        folder = build_directory(name, source)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder.with_suffix(".flock"), "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)          # one builder at a time, released on death
            (folder / "lock").unlink(missing_ok=True)  # torch's baton, stale if we hold the flock
            return load(name=name, sources=[str(source)], build_directory=str(folder),
                        extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), verbose=False)
    except Exception as exc:
        log.warning("CPU kernel %s unavailable (%s); using the torch path", name, exc)
        return None
