"""`LoRALinear`: a base projection (float or quantized) plus the LoRA deltas of this step's rows.

The runner orders the flat batch so that the rows of one adapter are contiguous (decode rows
grouped by adapter, then prefill rows grouped by adapter) and publishes the runs as
`LoRABatch.segments`. Each run costs one shrink matmul (x @ A^T over the stacked A of every
adapted slice) and one expand per slice, added in place into that slice's columns of the base
output: a loop over the step's adapters, never over tokens. Base rows take no extra work, and
a step without adapter rows is exactly the base forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.lora.adapter import LoRAWeights


@dataclass(slots=True)
class LoRABatch:
    """This step's runs of adapter rows: (slot, first row, end row)."""
    segments: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass(slots=True)
class SlotWeights:
    """One adapter on one fused projection: `a` stacks the A of each adapted slice; `expands`
    are (A rows r0:r1, output columns o0:o1, scaling * B)."""
    a: torch.Tensor
    expands: list[tuple[int, int, int, int, torch.Tensor]]


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, slice_sizes: list[int], num_slots: int, batch: LoRABatch) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.slice_sizes = slice_sizes
        self.slots: list[SlotWeights | None] = [None] * num_slots
        self.batch = batch

    def set_slot(self, slot: int, slices: list[LoRAWeights | None], dtype: torch.dtype, device: torch.device) -> None:
        """Put one adapter's slices (None = slice not adapted) into a slot; an adapter that
        adapts none of them leaves the slot empty (its rows then cost nothing here)."""
        a_parts, expands, r0, o0 = [], [], 0, 0
        for size, w in zip(self.slice_sizes, slices):
            if w is not None:
                r = w.a.shape[0]
                a_parts.append(w.a)
                expands.append((r0, r0 + r, o0, o0 + size, (w.b * w.scaling).to(device, dtype)))
                r0 += r
            o0 += size
        self.slots[slot] = SlotWeights(torch.cat(a_parts).to(device, dtype), expands) if a_parts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for slot, start, end in self.batch.segments:
            w = self.slots[slot]
            if w is None:
                continue
            h = x[start:end] @ w.a.T                          # shrink: [rows, sum of ranks]
            rows = y[start:end]
            for r0, r1, o0, o1, b in w.expands:               # expand into the slice's columns
                rows[:, o0:o1].addmm_(h[:, r0:r1], b.T)
        return y
