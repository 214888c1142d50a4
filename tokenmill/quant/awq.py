"""AWQ (Lin et al. 2023, "Activation-aware Weight Quantization"): a few input channels carry
large activations; scaling their weight columns up by s_k (and the activations down by 1/s_k)
quantizes exactly those columns more finely at no runtime cost. Then, per (row, group), the
min/max range is shrunk where clipping outliers lowers that group's output error.

Our own implementation of the published method. Result: the quantized SCALED weight W·diag(s)
and s, with y ≈ (x / s) @ dequant(q)ᵀ (s is folded into the previous op or divided at run time).
"""
from __future__ import annotations

import torch

from tokenmill.quant.group import GroupQuant, default_g_idx, minmax_params, num_groups, quantize_with


def _grouped(w: torch.Tensor, gs: int) -> torch.Tensor:
    """[N, K] -> [N, G, gs], zero-padding a partial last group. Padding cannot move a group's
    min/max because `minmax_params` always stretches the range to include 0."""
    n, k = w.shape
    g = num_groups(k, gs)
    if g * gs != k:
        w = torch.nn.functional.pad(w, (0, g * gs - k))
    return w.reshape(n, g, gs)


def quantize_ranges(weight: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int,
                    group_size: int) -> GroupQuant:
    """Quantize `weight` [N, K] with the per-(row, group) range [lo, hi] ([N, G] each, lo ≤ 0 ≤ hi):
    weights outside are clipped to the range, scale/zero come from the range itself."""
    n, k = weight.shape
    g = num_groups(k, group_size)
    w = _grouped(weight.float(), group_size)
    w = torch.minimum(torch.maximum(w, lo[..., None]), hi[..., None]).reshape(n * g, group_size)
    scale, zero = minmax_params(torch.stack([lo.reshape(-1), hi.reshape(-1)], dim=1), bits)
    q = quantize_with(w, scale, zero, bits).reshape(n, g * group_size)[:, :k]
    return GroupQuant(q.to(torch.uint8).contiguous(), scale.reshape(n, g), zero.reshape(n, g),
                      default_g_idx(k, group_size), bits, group_size)


def _ranges(weight: torch.Tensor, gs: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = _grouped(weight.float(), gs)
    return w.amin(dim=2).clamp(max=0), w.amax(dim=2).clamp(min=0)


def _fake_quant(weight: torch.Tensor, bits: int, gs: int) -> torch.Tensor:
    lo, hi = _ranges(weight, gs)
    return quantize_ranges(weight, lo, hi, bits, gs).dequantize()


def _search_scale(weight: torch.Tensor, x: torch.Tensor, bits: int, gs: int, n_grid: int) -> torch.Tensor:
    """s = mean|x_k|^α for the α in {0, 1/n_grid, ..} minimizing ||x Wᵀ - (x/s) Q(W·s)ᵀ||².
    α = 0 is s = 1 (plain RTN), so the search never does worse than RTN on these rows."""
    x_mean = x.abs().mean(dim=0)
    ref = x @ weight.t()
    best_err, best = float("inf"), torch.ones_like(x_mean)
    for step in range(n_grid):
        s = x_mean.pow(step / n_grid).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()          # center s around 1 in log space (as AWQ)
        err = (ref - (x / s) @ _fake_quant(weight * s, bits, gs).t()).pow(2).sum().item()
        if err < best_err:
            best_err, best = err, s
    return best


def _search_clip(weight: torch.Tensor, x: torch.Tensor, bits: int, gs: int, n_grid: int = 20,
                 max_shrink: float = 0.5, max_rows: int = 512, row_chunk: int = 128
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, group): the range [r·lo, r·hi], r in [max_shrink, 1], minimizing the group's own
    output error Σ_t (x_t,g · (Q(w_g) - w_g))² over ≤ max_rows calibration rows."""
    if x.shape[0] > max_rows:
        x = x[:: -(-x.shape[0] // max_rows)][:max_rows]     # evenly spaced, deterministic
    n, k = weight.shape
    xg = _grouped(x, gs).permute(1, 2, 0)                  # [G, gs, T]
    lo_all, hi_all = _ranges(weight, gs)
    best_lo, best_hi = lo_all.clone(), hi_all.clone()
    ratios = torch.linspace(1.0, max_shrink, n_grid).tolist()
    for r0 in range(0, n, row_chunk):                       # bound the [G, rows, T] temporaries
        rows = slice(r0, min(n, r0 + row_chunk))
        w = weight[rows].float()
        wg = _grouped(w, gs).transpose(0, 1)               # [G, R, gs]
        lo, hi = lo_all[rows], hi_all[rows]
        best_err = torch.full_like(lo, float("inf"))
        for r in ratios:
            dq = quantize_ranges(w, lo * r, hi * r, bits, gs).dequantize()
            delta = _grouped(dq, gs).transpose(0, 1) - wg
            err = torch.bmm(delta, xg).pow(2).sum(dim=2).t()   # [R, G]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_lo[rows] = torch.where(better, lo * r, best_lo[rows])
            best_hi[rows] = torch.where(better, hi * r, best_hi[rows])
    return best_lo, best_hi


def awq_quantize(weight: torch.Tensor, x: torch.Tensor, bits: int = 4, group_size: int = 128,
                 search_scale: bool = True, n_grid: int = 20, clip: bool = True
                 ) -> tuple[GroupQuant, torch.Tensor]:
    """weight [N, K], x [S, K] calibration inputs of this layer (each row counts equally).
    Returns (GroupQuant of W·diag(s), s [K] > 0); s is all ones when search_scale is False."""
    w = weight.detach().float()
    x = x.detach().reshape(-1, w.shape[1]).float()
    # Every calibration token weighs the same: on raw rows the squared error is dominated by the
    # few massive-activation tokens (attention sinks, row norms 100x the rest), and the scale
    # search then fits them at every other token's cost (Qwen2.5 down_proj: held-out error above
    # RTN's). The layer is linear, so a unit-norm row's error is that token's relative error.
    x = x / x.norm(dim=1, keepdim=True).clamp(min=1e-12)
    gs = w.shape[1] if group_size == -1 else min(group_size, w.shape[1])
    s = _search_scale(w, x, bits, gs, n_grid) if search_scale else torch.ones(w.shape[1])
    ws, xs = w * s, x / s
    lo, hi = _search_clip(ws, xs, bits, gs) if clip else _ranges(ws, gs)
    return quantize_ranges(ws, lo, hi, bits, gs), s
