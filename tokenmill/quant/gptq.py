"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"): quantize a weight column by column and push each column's rounding
error onto the columns not yet quantized, weighted by the inverse Hessian of the layer's
reconstruction loss ||x Wᵀ - x Ŵᵀ||², whose Hessian is H = 2/n Σ x xᵀ over calibration rows.

Our own implementation of the published algorithm (Cholesky form of H⁻¹, lazy block updates,
optional act-order). The result is a plain `GroupQuant` in ORIGINAL column order; act-order
only shows up in its `g_idx`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.quant.group import GroupQuant, minmax_params, num_groups


@dataclass(slots=True)
class HessianAccumulator:
    """Running H = 2/n Σ x xᵀ over every calibration row seen so far.

    Kept as a running average (rescaled at each `add`) rather than a raw sum, so its magnitude
    does not grow with the number of rows and float32 stays accurate over long calibrations."""
    in_features: int
    dtype: torch.dtype = torch.float32
    rows: int = 0
    _h: torch.Tensor | None = field(default=None, repr=False)

    def add(self, x: torch.Tensor) -> None:
        """x: [..., K] inputs of the layer (any leading dims, e.g. [batch, seq, K])."""
        x = x.detach().reshape(-1, self.in_features).to(self.dtype)
        m = x.shape[0]
        if m == 0:
            return
        if self._h is None:
            self._h = torch.zeros(self.in_features, self.in_features, dtype=self.dtype, device=x.device)
        total = self.rows + m
        self._h.mul_(self.rows / total)
        x = x * (2.0 / total) ** 0.5            # 2/n folded into the rows: one GEMM, no extra pass
        self._h.addmm_(x.t(), x)
        self.rows = total

    def hessian(self) -> torch.Tensor:
        if self._h is None:
            raise ValueError("no calibration rows were added")
        return self._h


def _inverse_hessian_upper(h: torch.Tensor, damp_percent: float) -> torch.Tensor:
    """Upper-triangular U with UᵀU = (H + λI)⁻¹. Row i of U, divided by U[i,i], is exactly the
    update GPTQ applies to columns > i after quantizing column i once columns < i are fixed, so
    H never has to be re-inverted per column.

    Computed without forming H⁻¹: factor the index-reversed matrix, JHJ = L Lᵀ, so H = R Rᵀ with
    R = JLJ upper-triangular, and U = R⁻¹ (then UᵀU = R⁻ᵀR⁻¹ = H⁻¹). One Cholesky plus one
    triangular solve; LAPACK's cholesky_inverse is several times slower on CPU.
    λ = damp_percent·mean(diag H); if H is still not positive definite (too few calibration rows,
    collinear channels) the damping grows tenfold until the factorization succeeds."""
    k = h.shape[0]
    diag_mean = torch.diagonal(h).mean()
    damp = damp_percent * diag_mean
    eye = torch.eye(k, dtype=h.dtype, device=h.device)
    for _ in range(6):
        lower, info = torch.linalg.cholesky_ex((h + damp * eye).flip(0, 1))
        if info.item() == 0:
            return torch.linalg.solve_triangular(lower.flip(0, 1), eye, upper=True)
        damp = damp * 10 if damp > 0 else 1e-6 * max(diag_mean.item(), 1.0)
    raise ValueError("Hessian is not positive definite even after heavy dampening")


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int = 4, group_size: int = 128,
                  damp_percent: float = 0.01, block_size: int = 128, act_order: bool = False) -> GroupQuant:
    """Quantize `weight` [N, K] (nn.Linear layout) given the layer-input Hessian [K, K].

    group_size = -1 means one group per row. With `act_order`, columns are processed in order of
    descending diag(H) (most-activated first, while there is still freedom to absorb their
    error) and groups are formed in that processing order: g_idx[perm[i]] = i // group_size.
    Group scale/zero come from min/max of the group's columns as they are when the loop reaches
    the group's first column, i.e. after the error updates of all earlier columns."""
    w = weight.detach().to(torch.float32).clone()
    n, k = w.shape
    gs = k if group_size == -1 else min(group_size, k)
    if gs <= 0:
        raise ValueError(f"group_size must be positive or -1, got {group_size}")
    qmax = 2 ** bits - 1
    h = hessian.detach().to(torch.float32).clone()

    # A column no calibration row ever activated carries no loss: quantize it as 0 and give it a
    # unit curvature so H stays invertible.
    dead = (torch.diagonal(h) == 0).nonzero().squeeze(1)
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    perm = None
    if act_order:
        perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
        w = w[:, perm]
        h = h[perm][:, perm]

    hinv = _inverse_hessian_upper(h, damp_percent)
    del h

    g = num_groups(k, gs)
    codes = torch.empty(n, k, dtype=torch.uint8)
    scales = torch.empty(n, g)
    zeros = torch.empty(n, g)
    scale = zero = None
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, i1:i2].clone()                 # this block, kept current column by column
        err1 = torch.zeros_like(w1)              # scaled errors, applied to w[:, i2:] lazily
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = i1 + i
            if j % gs == 0:
                end = min(j + gs, k)
                cur = w1[:, i:end - i1]
                if end > i2:                     # group runs past this block: add the pending update
                    later = w[:, i2:end] - err1[:, :i] @ hinv[i1:j, i2:end]
                    cur = torch.cat([cur, later], dim=1)
                scale, zero = minmax_params(cur, bits, min_zero=1)   # saved in AutoGPTQ v1 (formats.py)
                scales[:, j // gs], zeros[:, j // gs] = scale, zero
            col = w1[:, i]
            q = torch.clamp(torch.round(col / scale) + zero, 0, qmax)
            codes[:, j] = q.to(torch.uint8)
            e = (col - (q - zero) * scale) / hinv1[i, i]
            w1[:, i:].addr_(e, hinv1[i, i:], alpha=-1.0)
            err1[:, i] = e
        if i2 < k:
            w[:, i2:].addmm_(err1, hinv[i1:i2, i2:], alpha=-1.0)

    g_idx = (torch.arange(k) // gs).to(torch.int32)
    if perm is not None:                         # back to the checkpoint's column order
        inv = torch.argsort(perm)
        codes = codes[:, inv].contiguous()
        g_idx = g_idx[inv].contiguous()
    return GroupQuant(codes, scales, zeros, g_idx, bits, gs)
