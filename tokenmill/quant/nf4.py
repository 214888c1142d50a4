"""NF4 (NormalFloat-4; Dettmers et al., QLoRA) weight-only quantization, bitsandbytes-style.

W [N, K] is flattened row-major and cut into blocks of `block_size` weights (K % block_size == 0,
so a block never straddles rows). Each block keeps absmax = max|w|, and each weight the index
of the code-book value nearest to w / absmax.

Storage (the buffers `state_dict()` saves; `weight_bytes()` counts them, bias excluded):
    codes         uint8 [N, K/2]   two codes a byte, bitsandbytes' order: flattened element 2i
                                   in the HIGH nibble of byte i, element 2i+1 in the LOW nibble
    absmax        float32 [N, K/B]                      (double_quant=False), or
    absmax_q      int8 [N*K/B]     (absmax - mean) / scale, rounded, in [-127, 127]
    absmax_scale  float32 [ceil(N*K/B / 256)]            one scale per 256 absmax values
    absmax_mean   float32 []                             (double_quant=True)
Double quant here is a *linear* symmetric int8 second level; bitsandbytes uses its 8-bit
dynamic (non-linear) map there instead, so the saved absmax bytes are not bnb-interchangeable.
The codes are chosen against the absmax the runtime will actually use (the double-quantized
one), not the exact one, so the second level adds no mismatch beyond its own rounding.

Resident bytes: weight_bytes() plus, with double quant, 4 bytes per block for the fp32 absmax
expanded once at construction (`absmax_f32`, a non-persistent buffer): with block 64 that is
0.5 + (1 + 4)/64 ~ 0.58 bytes/weight resident, 0.52 saved (fp32 dense: 4).
"""
from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.cpu_extension import kernel_family
from tokenmill.quant.kernels import use_weight_only_kernel
from tokenmill.quant.tiled import tiled_nf4_linear, tiled_supported


# bitsandbytes' NF4 table (create_normal_map(offset=0.9677083, use_extra_value=True)): normal
# quantiles, 8 positive and 7 negative plus an exact 0, scaled to [-1, 1]. `normal_float_codebook`
# rebuilds it; tests hold the two equal bit for bit.
NF4_CODEBOOK = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
ABSMAX_GROUP = 256   # absmax values sharing one fp32 scale in the second level


def normal_float_codebook(offset: float = 0.9677083) -> torch.Tensor:
    """QLoRA's construction: quantiles of N(0, 1) at evenly spaced probabilities from `offset`
    down to 0.5 — 8 for the positive side, 7 for the negative — plus an exact zero, normalized
    by the largest. The asymmetry (8 vs 7) buys the exact zero with 16 codes. The default offset
    is bitsandbytes' rounding of 1 - (1/32 + 1/30) / 2 (the mean of the 15- and 16-level end
    quantiles), which reproduces its published values exactly."""
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9)[:-1].double())
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8)[:-1].double())
    v = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).float().sort().values
    return v / v.max()


@functools.cache
def nf4_kernels() -> ModuleType | None:
    """The compiled extension, or None (TOKENMILL_CPU_KERNELS=0 disables it)."""
    return kernel_family("nf4_matmul")


def _check_shape(n: int, k: int, block_size: int) -> None:
    if block_size <= 0 or block_size % 2:
        raise ValueError(f"NF4 block_size must be a positive even number, got {block_size}")
    if k % block_size:
        raise ValueError(f"NF4 needs in_features divisible by block_size: weight [{n}, {k}], "
                         f"K={k} % block_size={block_size} = {k % block_size}")


def _double_quant(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """absmax [nb] -> (int8 [nb], scale [ceil(nb/256)], mean []): linear symmetric int8 of the
    centred values, per group of 256; the last group is zero-padded for the scale only."""
    mean = absmax.mean()
    centred = absmax - mean
    pad = (-centred.numel()) % ABSMAX_GROUP
    groups = F.pad(centred, (0, pad)).view(-1, ABSMAX_GROUP)
    scale = groups.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))   # constant groups
    q = torch.round(groups / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.flatten()[: absmax.numel()], scale, mean


def _expand_absmax(q: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(ABSMAX_GROUP)[: q.numel()] + mean


class NF4Linear(nn.Module):
    """y = x @ W^T + b with W in NF4. Few rows (decode): a C++ kernel streams the packed codes
    once, decoding in registers; many rows (prefill): the tiled dequantize+GEMM (quant/tiled.py);
    no kernels / CUDA: dequantize to x's dtype and matmul. All compute in x's dtype class (fp32
    accumulation in the kernels)."""

    def __init__(self, codes: torch.Tensor, absmax_parts: dict[str, torch.Tensor], bias: torch.Tensor | None,
                 out_features: int, in_features: int, block_size: int, double_quant: bool) -> None:
        super().__init__()
        _check_shape(out_features, in_features, block_size)
        self.out_features, self.in_features = out_features, in_features
        self.block_size, self.double_quant = block_size, double_quant
        self.register_buffer("codes", codes.to(torch.uint8).reshape(out_features, in_features // 2).contiguous())
        nb = out_features * in_features // block_size
        if double_quant:
            self.register_buffer("absmax_q", absmax_parts["absmax_q"].to(torch.int8).reshape(nb).contiguous())
            self.register_buffer("absmax_scale", absmax_parts["absmax_scale"].float().reshape(-1).contiguous())
            self.register_buffer("absmax_mean", absmax_parts["absmax_mean"].float().reshape(()))
            absmax = _expand_absmax(self.absmax_q, self.absmax_scale, self.absmax_mean)
            self.register_buffer("absmax_f32", absmax.view(out_features, -1).contiguous(), persistent=False)
        else:
            self.register_buffer("absmax", absmax_parts["absmax"].float().reshape(out_features, -1).contiguous())
        self.register_buffer("table", torch.tensor(NF4_CODEBOOK), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, block_size: int = 64,
                   double_quant: bool = True) -> "NF4Linear":
        n, k = weight.shape
        _check_shape(n, k, block_size)
        w = weight.detach().float().reshape(-1, block_size)
        absmax = w.abs().amax(dim=1)
        parts: dict[str, torch.Tensor]
        if double_quant:
            q, scale, mean = _double_quant(absmax)
            parts = {"absmax_q": q, "absmax_scale": scale, "absmax_mean": mean}
            absmax = _expand_absmax(q, scale, mean)
        else:
            parts = {"absmax": absmax}
        table = torch.tensor(NF4_CODEBOOK)
        safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))   # all-zero blocks -> code 0.0
        scaled = (w / safe[:, None]).clamp(-1, 1)
        idx = torch.bucketize(scaled, (table[1:] + table[:-1]) / 2).to(torch.uint8).flatten()
        codes = (idx[0::2] << 4) | idx[1::2]
        return cls(codes, parts, bias, n, k, block_size, double_quant)

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None, out_features: int,
                   in_features: int, block_size: int, double_quant: bool) -> "NF4Linear":
        """Rebuild from saved buffers (`codes` plus `absmax` or `absmax_q/_scale/_mean`)."""
        return cls(tensors["codes"], tensors, bias, out_features, in_features, block_size, double_quant)

    def _absmax(self) -> torch.Tensor:
        """fp32 absmax [N, K/B] the compute uses."""
        return self.absmax_f32 if self.double_quant else self.absmax

    def weight_bytes(self) -> int:
        names = ("codes", "absmax_q", "absmax_scale", "absmax_mean") if self.double_quant else ("codes", "absmax")
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in names)

    def dequantize(self) -> torch.Tensor:
        """W [N, K] float32."""
        kern = nf4_kernels() if self._kernel_ok() else None
        if kern is not None:
            return kern.nf4_dequantize(self.codes, self._absmax(), self.table, self.block_size)
        idx = torch.stack([self.codes >> 4, self.codes & 0x0F], dim=-1).view(self.out_features, -1, self.block_size)
        return (self.table[idx.long()] * self._absmax()[:, :, None]).view(self.out_features, self.in_features)

    def _kernel_ok(self) -> bool:
        return self.codes.device.type == "cpu" and self.block_size % 32 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        use_kernel = (use_weight_only_kernel(x2, "nf4") and x.dtype in (torch.float32, torch.bfloat16)
                      and self._kernel_ok() and nf4_kernels() is not None)
        if use_kernel:
            y = self.kernel_forward(x2)
        elif tiled_supported(x2, self.in_features, self.block_size):
            y = self.tiled_forward(x2)
        else:
            y = self.dequant_forward(x2)
        return y.view(*lead, self.out_features)

    def kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] fp32/bf16 on CPU, kernel compiled: the streaming kernel (fp32 accumulation)."""
        return nf4_kernels().nf4_linear(x, self.codes, self._absmax(), self.table, self.bias, self.block_size)

    def tiled_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] on CPU, tiled kernel compiled: decode an L2-sized tile of rows, multiply it."""
        return tiled_nf4_linear(x, self.codes, self._absmax(), self.table, self.bias, self.block_size)

    def dequant_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K]: dequantize to x's dtype, then one GEMM. Always available."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block_size={self.block_size}, double_quant={self.double_quant}")
