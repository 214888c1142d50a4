"""Rotary position embedding and its context-extension variants.

Every variant is a table of per-position angles (plus a constant cos/sin scale), computed once
for the engine's max length, so the attention code never branches on the type:
- default / linear (positions divided by `factor`) / llama3 (low frequencies divided by
  `factor`, high kept, a smooth ramp between) / yarn (per-frequency blend of interpolation and
  extrapolation, cos/sin scaled by `attention_factor`) — the formulas of HF transformers'
  `modeling_rope_utils`, which the parity tests hold us to;
- `freq_factors` — llama.cpp's `rope_freqs` tensor (inv_freq / factor per pair), how GGUF
  stores Llama-3 scaling;
- dynamic (NTK) — HF recomputes the base from the longest position of each forward call, so
  its answer depends on how a sequence is chunked. We use the base that HF's token-by-token
  generation gives position p, base(max(p + 1, L)): identical to HF's prefill for positions
  within `max_position_embeddings` L and to its generate loop beyond, and independent of how the
  scheduler chunks a prompt (each cached key is rotated once, at its own position).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.model.layers import fused_cpu_ops

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None   # llama3 / yarn: the pre-training context
    low_freq_factor: float = 1.0                           # llama3
    high_freq_factor: float = 4.0                          # llama3
    beta_fast: float = 32.0                                # yarn
    beta_slow: float = 1.0                                 # yarn
    attention_factor: float | None = None                  # yarn: cos/sin scale (None: 0.1 ln(factor) + 1)
    mscale: float | None = None                            # yarn: DeepSeek-style attention_factor inputs
    mscale_all_dim: float | None = None
    truncate: bool = True                                  # yarn: integer correction range
    freq_factors: tuple[float, ...] | None = None          # GGUF rope_freqs

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {self.rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        if self.rope_type != "default" and not self.factor > 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")

    def context_length(self, max_position_embeddings: int) -> int:
        """The longest context the scaled model is meant for (vLLM's derived max length)."""
        if self.rope_type in ("linear", "dynamic"):
            return int(max_position_embeddings * self.factor)
        if self.rope_type == "yarn":
            original = self.original_max_position_embeddings or max_position_embeddings
            return max(max_position_embeddings, int(original * self.factor))
        return max_position_embeddings


def base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3(inv: torch.Tensor, s: RopeScaling, max_pos: int) -> torch.Tensor:
    old = s.original_max_position_embeddings or max_pos
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(head_dim: int, theta: float, s: RopeScaling, max_pos: int) -> tuple[torch.Tensor, float]:
    original = s.original_max_position_embeddings or max_pos

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp                                 # 1: keep the frequency, 0: interpolate it
    inv = base_inv_freq(head_dim, theta)
    inv = inv / s.factor * (1 - extrapolate) + inv * extrapolate
    if s.attention_factor is not None:
        scale = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        scale = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        scale = _yarn_mscale(s.factor)
    return inv, float(scale)


def rope_angles(head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None,
                max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Angles [max_positions, head_dim / 2] (fp32) and the constant cos/sin scale."""
    s = scaling or RopeScaling()
    pos = torch.arange(max_positions, dtype=torch.float32)
    inv = base_inv_freq(head_dim, theta)
    scale = 1.0
    if s.freq_factors is not None:
        inv = inv / torch.tensor(s.freq_factors, dtype=torch.float32)
    if s.rope_type == "linear":
        inv = inv / s.factor
    elif s.rope_type == "llama3":
        inv = _llama3(inv, s, max_position_embeddings)
    elif s.rope_type == "yarn":
        inv, scale = _yarn(head_dim, theta, s, max_position_embeddings)
    elif s.rope_type == "dynamic":
        seq_len = torch.clamp(pos + 1, min=max_position_embeddings).double()
        base = theta * ((s.factor * seq_len / max_position_embeddings) - (s.factor - 1)) ** (head_dim / (head_dim - 2))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_per_pos = 1.0 / (base.float()[:, None] ** exponents[None, :])
        return pos[:, None] * inv_per_pos, scale
    return torch.outer(pos, inv), scale


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (HF `rotate_half` layout) over a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: RopeScaling | None = None, max_position_embeddings: int | None = None) -> None:
        super().__init__()
        angles, scale = rope_angles(head_dim, max_positions, theta, scaling,
                                    max_position_embeddings or max_positions)
        self.register_buffer("cos", angles.cos() * scale, persistent=False)   # [max_pos, head_dim/2]
        self.register_buffer("sin", angles.sin() * scale, persistent=False)

    @classmethod
    def for_model(cls, cfg, max_positions: int) -> "RotaryEmbedding":
        """The table a ModelConfig asks for, covering positions [0, max_positions)."""
        return cls(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; positions: [T]. May rotate q and k IN PLACE (the fused
        CPU op does: they are views of a fresh qkv projection) — use the returned tensors."""
        ops = fused_cpu_ops(q)
        if (ops is not None and q.stride(-1) == 1 and k.stride(-1) == 1 and positions.dtype == torch.long
                and positions.is_contiguous() and self.cos.dtype == torch.float32):
            ops.rope_(q, k, positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
