"""Adapters by name, the LRU of loaded adapters, and the slots one batch runs with.

Three levels, vLLM's: adapters *known* by name (`--lora-modules`, runtime loads, or a
`LoRARequest` path offline); adapters *loaded* into memory (an LRU of at most `max_cpu_loras`;
a sequence holds its own reference, so eviction never pulls weights from under a running
request); adapters *resident* in one of `max_loras` slots of every `LoRALinear` (the scheduler
keeps the running set to at most `max_loras` distinct adapters, so one step always fits).

A loaded adapter is keyed by its files' path, size and mtime: an adapter rewritten in place is
read again and gets a new content hash, so it never reuses the prefix-cache blocks of the old
weights.
"""
from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.lora.adapter import CONFIG_FILE, FUSED_MODULES, WEIGHTS_FILE, LoRAAdapter, load_adapter
from tokenmill.lora.layers import LoRABatch, LoRALinear
from tokenmill.lora.request import LoRARequest
from tokenmill.model.llama import hf_row_sizes
from tokenmill.quant.apply import replace_module

log = logging.getLogger("tokenmill")


def parse_lora_modules(specs: list[str] | dict[str, str] | None) -> dict[str, str]:
    """`--lora-modules name=path ...` (or a dict) -> {name: path}."""
    if not specs:
        return {}
    if isinstance(specs, dict):
        return dict(specs)
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules entries are name=path, got {spec!r}")
        if name in out:
            raise ValueError(f"--lora-modules names {name!r} twice")
        out[name] = path
    return out


def resolve_inside(root: str | Path, path: str) -> Path:
    """`path` (absolute, or relative to root) resolved with symlinks; ValueError unless it lies
    inside root. Used for every adapter path that comes from a request."""
    base = Path(root).resolve()
    target = (base / path).resolve()
    if target != base and base not in target.parents:
        raise ValueError(f"lora_path {path!r} is outside the LoRA directory")
    return target


class LoRAManager:
    def __init__(self, model: nn.Module, model_cfg: ModelConfig, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None, dtype: torch.dtype, device: torch.device) -> None:
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_lora_rank}")
        if max_cpu_loras is not None and max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.model, self.model_cfg = model, model_cfg
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.dtype, self.device = dtype, device
        self.batch = LoRABatch()
        self.layers: dict[str, LoRALinear] = {}
        for i in range(model_cfg.num_layers):
            for fused in FUSED_MODULES:
                name = f"layers.{i}.{fused}"
                layer = LoRALinear(model.get_submodule(name), hf_row_sizes(model_cfg, name), max_loras, self.batch)
                replace_module(model, name, layer)
                self.layers[name] = layer
        self.known: dict[str, LoRARequest] = {}            # served adapters by name
        self._ids = itertools.count(1)
        self._loaded: OrderedDict[tuple, LoRAAdapter] = OrderedDict()
        self._slots: list[LoRAAdapter | None] = [None] * max_loras
        self._slot_used = [0] * max_loras                  # step of last use, for eviction
        self._steps = 0
        self._lock = threading.Lock()                      # the server registers while the engine runs

    # ---- names (server) ---------------------------------------------------------------------
    def add(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at `path` as `name`; it is read (and checked) now."""
        with self._lock:
            if name in self.known:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
            request = LoRARequest(name, next(self._ids), str(path))
        self.acquire(request)                              # errors surface here, not on first use
        with self._lock:
            self.known[name] = request
        log.info("LoRA adapter %s: %s", name, path)
        return request

    def remove(self, name: str) -> None:
        with self._lock:
            request = self.known.pop(name, None)
            if request is None:
                raise KeyError(name)
            for key in [k for k in self._loaded if k[0] == request.lora_path]:
                del self._loaded[key]

    # ---- loading ------------------------------------------------------------------------------
    def acquire(self, request: LoRARequest) -> LoRAAdapter:
        """The loaded adapter for a request (read from disk unless the LRU has these files)."""
        path = Path(request.lora_path).resolve()
        try:
            stats = tuple((s.st_size, s.st_mtime_ns) for s in ((path / f).stat() for f in (CONFIG_FILE, WEIGHTS_FILE)))
        except OSError:
            stats = None            # load_adapter says what is missing
        key = (str(request.lora_path), str(path), stats)
        with self._lock:
            adapter = self._loaded.get(key)
            if adapter is not None:
                self._loaded.move_to_end(key)
                return adapter
        adapter = load_adapter(request.lora_name, path, self.model_cfg, self.max_lora_rank)
        with self._lock:
            self._loaded[key] = adapter
            while len(self._loaded) > self.max_cpu_loras:
                self._loaded.popitem(last=False)
        return adapter

    # ---- one step ---------------------------------------------------------------------------
    def prepare(self, runs: list[tuple[LoRAAdapter | None, int, int]]) -> None:
        """Publish this step's adapter rows: `runs` are (adapter or None, first row, end row) in
        row order; consecutive runs of one adapter merge. Loads adapters into free slots."""
        self._steps += 1
        segments: list[tuple[int, int, int]] = []
        needed = {id(a) for a, _, _ in runs if a is not None}
        for adapter, start, end in runs:
            if adapter is None or start == end:
                continue
            slot = self._slot_for(adapter, needed)
            if segments and segments[-1][0] == slot and segments[-1][2] == start:
                segments[-1] = (slot, segments[-1][1], end)
            else:
                segments.append((slot, start, end))
        self.batch.segments = segments
        stack = getattr(self.model, "decode_stack", None)
        if stack is not None:
            stack.suspended = bool(segments)       # the C++ stack runs base weights only

    def _slot_for(self, adapter: LoRAAdapter, needed: set[int]) -> int:
        for i, held in enumerate(self._slots):
            if held is adapter:
                self._slot_used[i] = self._steps
                return i
        free = [i for i, held in enumerate(self._slots) if held is None or id(held) not in needed]
        if not free:
            raise RuntimeError(f"a step needs more than max_loras={self.max_loras} adapters")
        slot = min(free, key=lambda i: (self._slots[i] is not None, self._slot_used[i]))
        for name, layer in self.layers.items():
            layer.set_slot(slot, adapter.slices(name), self.dtype, self.device)
        self._slots[slot], self._slot_used[slot] = adapter, self._steps
        return slot
