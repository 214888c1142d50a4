"""Group-wise asymmetric integer weights: the storage shared by rtn4, GPTQ and AWQ.

Convention (output-major, like nn.Linear.weight [N, K]):
    W[n, k] ~= (q[n, k] - zeros[n, g_idx[k]]) * scales[n, g_idx[k]]
with q and zeros integers in [0, 2^bits - 1], G = ceil(K / group_size) groups. `g_idx` is
k // group_size unless GPTQ's act-order assigned groups in another column order. The last
group is partial when group_size does not divide K (SmolLM2's 576 with group 128).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class GroupQuant:
    q: torch.Tensor          # uint8 [N, K], values in [0, 2^bits)
    scales: torch.Tensor     # float32 [N, G]
    zeros: torch.Tensor      # float32 [N, G], integer-valued zero points in [0, 2^bits)
    g_idx: torch.Tensor      # int32 [K], group of each input column
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        idx = self.g_idx.long()
        s = self.scales[:, idx]
        z = self.zeros[:, idx]
        return ((self.q.float() - z) * s).to(dtype)

    @staticmethod
    def cat(parts: list["GroupQuant"]) -> "GroupQuant":
        """Stack along the output dim (fusing q/k/v or gate/up). Input grouping must agree."""
        first = parts[0]
        for p in parts[1:]:
            if p.bits != first.bits or p.group_size != first.group_size or not torch.equal(p.g_idx, first.g_idx):
                raise ValueError("cannot fuse projections quantized with different bits, group size or g_idx")
        return GroupQuant(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]),
                          torch.cat([p.zeros for p in parts]), first.g_idx, first.bits, first.group_size)


def num_groups(k: int, group_size: int) -> int:
    return math.ceil(k / group_size)


def default_g_idx(k: int, group_size: int) -> torch.Tensor:
    return (torch.arange(k, dtype=torch.int32) // group_size).to(torch.int32)


def minmax_params(w: torch.Tensor, bits: int, min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric scale and integer zero point per row of `w` [R, C] from its min and max.
    The range always includes 0 so that a zero weight stays exactly representable. `min_zero`:
    the smallest zero point the storage format holds (AutoGPTQ v1 stores zero - 1 in `bits` bits,
    so 1); a row that would get a lower one (its weights all >= 0) gets that zero point and a
    scale wide enough that its max still fits the codes above it."""
    qmax = 2 ** bits - 1
    lo = w.amin(dim=1).clamp(max=0)
    hi = w.amax(dim=1).clamp(min=0)
    scale = (hi - lo) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))   # all-zero rows
    zero = torch.round(-lo / scale).clamp(0, qmax)
    low = zero < min_zero
    if low.any():
        scale = torch.where(low, torch.maximum(scale, hi / (qmax - min_zero)), scale)
        zero = torch.where(low, torch.full_like(zero, min_zero), zero)
    return scale, zero


def quantize_with(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes of `w` [R, C] given per-row scale/zero [R] (or broadcastable [R, C])."""
    if scale.dim() == 1:
        scale, zero = scale[:, None], zero[:, None]
    return torch.clamp(torch.round(w / scale) + zero, 0, 2 ** bits - 1)


def rtn_quantize(weight: torch.Tensor, bits: int = 4, group_size: int = 128) -> GroupQuant:
    """Round-to-nearest with min/max range per (row, group): the baseline GPTQ and AWQ beat."""
    w = weight.float()
    n, k = w.shape
    g = num_groups(k, group_size)
    q = torch.empty(n, k, dtype=torch.uint8)
    scales = torch.empty(n, g)
    zeros = torch.empty(n, g)
    for i in range(g):
        cols = slice(i * group_size, min(k, (i + 1) * group_size))
        s, z = minmax_params(w[:, cols], bits)
        q[:, cols] = quantize_with(w[:, cols], s, z, bits).to(torch.uint8)
        scales[:, i], zeros[:, i] = s, z
    return GroupQuant(q, scales, zeros, default_g_idx(k, group_size), bits, group_size)
