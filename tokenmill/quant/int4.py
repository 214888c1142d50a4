"""4-bit group-wise weights (rtn4, GPTQ, AWQ share this runtime form).

Small M runs tokenmill's integer-dot kernel on x86 CPUs with AVX512-VNNI or AVX2 (int_dot.py), else
torch's packed int4 CPU kernel. Both want the group size to divide K (SmolLM2's 576 with group
128 runs as group 64, see below; the tiled path decodes the zero-padded K and multiplies only the
real columns), and act-order checkpoints get their input columns permuted once at load so groups
are contiguous (x is permuted the same way per call). AWQ's scales are folded into the preceding
layers by the calibration, so they never appear here.
"""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.quant.group import GroupQuant
from tokenmill.quant.int_dot import CHUNK, KERNEL_DTYPES, Int4DotWeights, int_dot_available
from tokenmill.quant.kernels import use_int_dot_kernel, use_weight_only_kernel
from tokenmill.quant.tiled import stack_with_tiled, tiled_linear, tiled_supported, tiled_usable

_KERNEL_GROUPS = (32, 64, 128, 256)


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..15) -> [N, ceil(K/2)]: column 2i in the low nibble of byte i."""
    if q.shape[1] % 2:
        q = F.pad(q, (0, 1))
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8).contiguous()


def unpack_q4(packed: torch.Tensor, k: int) -> torch.Tensor:
    q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    return q[:, :k].contiguous()


class Int4Linear(nn.Module):
    def __init__(self, gq: GroupQuant, bias: torch.Tensor | None) -> None:
        super().__init__()
        if gq.bits != 4:
            raise ValueError(f"Int4Linear holds 4-bit weights, got bits={gq.bits}")
        self.out_features, self.in_features = gq.shape
        self.bits, self.group_size = gq.bits, gq.group_size
        g_idx = gq.g_idx.long()
        perm = torch.argsort(g_idx, stable=True)
        identity = torch.equal(perm, torch.arange(len(perm)))
        # Columns in group order: group j holds columns [j*g, (j+1)*g) of the permuted input.
        q, sorted_g = gq.q[:, perm], g_idx[perm]
        counts = torch.bincount(sorted_g, minlength=gq.scales.shape[1])
        if not identity and (counts[:-1] != gq.group_size).any():
            raise ValueError("act-order g_idx whose groups are not all group_size wide is not supported")
        self.register_buffer("perm", None if identity else perm)
        self.register_buffer("g_idx", gq.g_idx.to(torch.int32))
        self.register_buffer("bias", bias)
        g = gq.group_size
        kpad = -self.in_features % g
        self.k_padded = self.in_features + kpad
        # Padded columns get code == zero point, i.e. weight 0; x is padded with zeros too.
        zero_cols = gq.zeros[:, -1:].to(torch.uint8).expand(-1, kpad)
        q = torch.cat([q, zero_cols], dim=1)
        n_groups = self.k_padded // g
        scales = gq.scales[:, :n_groups].float()
        zeros = gq.zeros[:, :n_groups].float()
        self.register_buffer("q4", pack_q4(q.to(torch.uint8)))   # [N, Kp/2]: tiled / dequant paths
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.register_buffer("offsets", (-zeros * scales).contiguous())   # w = q * s + offset
        # torch's packer also wants N divisible by 16; other shapes take the dequantize path
        use_kernel = g in _KERNEL_GROUPS and q.device.type == "cpu" and self.out_features % 16 == 0
        self.register_buffer("packed", None)
        self.register_buffer("scale_zero", None)
        self.int_dot: Int4DotWeights | None = None
        # The kernel's own group: a group of g columns is also g/2^i groups with equal scales, so
        # when g does not divide K (576 with 128) the kernel runs at the largest such size that does
        # (64) on the unpadded K: no per-call padding of x (measured ~0.3 ms of a 9.7 ms step).
        self.kernel_group, self.kernel_k = g, self.k_padded
        kg = g
        while kpad and kg > 32 and self.in_features % kg:
            kg //= 2
        if kpad and self.in_features % kg == 0 and kg in _KERNEL_GROUPS:
            self.kernel_group, self.kernel_k = kg, self.in_features
        kk = self.kernel_k

        def per_kernel_group(table: torch.Tensor) -> torch.Tensor:
            """A per-group table [N, groups] repeated out to the kernel's (smaller) group over kk columns."""
            return table.repeat_interleave(g // self.kernel_group, dim=1)[:, : kk // self.kernel_group]

        if (kk == self.in_features and self.kernel_group % CHUNK == 0 and q.device.type == "cpu"
                and int_dot_available()):
            self.int_dot = Int4DotWeights.build(q[:, :kk], per_kernel_group(scales), per_kernel_group(self.offsets),
                                                self.perm, bias, self.kernel_group)
        elif use_kernel:
            # torch's int4 kernel dequantizes as (q - 8) * scale + offset, so
            # (q - z) * s == (q - 8) * s + (8 - z) * s.
            ks, kz = per_kernel_group(scales), per_kernel_group(zeros)
            self.packed = torch._convert_weight_to_int4pack_for_cpu(q[:, :kk].contiguous().to(torch.int32), 2)
            sz = torch.stack([ks, (8 - kz) * ks], dim=-1).transpose(0, 1)   # [G_kernel, N, 2]
            self.scale_zero = sz.contiguous().to(torch.bfloat16)

    def weight_bytes(self) -> int:
        """Bytes as stored in a checkpoint: 4-bit codes, fp16 scales and 4-bit zeros."""
        n_groups = self.scales.shape[1]
        return self.out_features * self.in_features // 2 + self.out_features * n_groups * (2 + 0.5)

    def group_quant(self) -> GroupQuant:
        """The stored weight back in GroupQuant form (original column order), for saving."""
        q = unpack_q4(self.q4, self.in_features)
        if self.perm is not None:
            q = q[:, torch.argsort(self.perm)]
        return GroupQuant(q.contiguous(), self.scales, self.zeros, self.g_idx, self.bits, self.group_size)

    def dequantize(self) -> torch.Tensor:
        """Float weight [N, K] in the ORIGINAL column order."""
        g = self.group_size
        s = self.scales.repeat_interleave(g, dim=1)[:, : self.k_padded]
        z = self.zeros.repeat_interleave(g, dim=1)[:, : self.k_padded]
        w = ((unpack_q4(self.q4, self.k_padded).float() - z) * s)[:, : self.in_features]
        if self.perm is not None:
            w = w[:, torch.argsort(self.perm)]
        return w

    def _kernel_input(self, x: torch.Tensor, dtype: torch.dtype, width: int) -> torch.Tensor:
        """x in the packed weight's column order (group order), zero padded to `width` columns."""
        xp = (x if self.perm is None else x.index_select(1, self.perm)).to(dtype)
        if width != self.in_features:
            xp = F.pad(xp, (0, width - self.in_features))
        return xp

    def stack_linear(self, ext: ModuleType, dtype: torch.dtype):
        """This layer's decode kernels for the C++ decode stack (model/decode_stack.py), or None."""
        lin = None if self.int_dot is None else self.int_dot.stack_linear(ext, dtype)
        if lin is None or not tiled_usable(self.k_padded, self.group_size):
            return lin
        return stack_with_tiled(lin, self.q4, self.scales, self.offsets, self.perm, 4, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int_dot is not None and use_int_dot_kernel(x, "int4") and x.dtype in KERNEL_DTYPES:
            return self.int_dot.linear(x.contiguous())     # the decode hot path: nothing else per call
        out_dtype = x.dtype
        if self.packed is not None and use_weight_only_kernel(x, "int4"):
            xp = self._kernel_input(x, torch.bfloat16, self.kernel_k)
            y = torch._weight_int4pack_mm_for_cpu(xp, self.packed, self.kernel_group, self.scale_zero)
        elif tiled_supported(x, self.k_padded, self.group_size):
            xp = self._kernel_input(x, x.dtype, self.in_features)     # the kernel skips the padded columns
            y = tiled_linear(xp, self.q4, self.scales, self.offsets, None, 4, self.group_size)
        else:
            y = F.linear(x, self.dequantize().to(x.dtype))     # original column order: no permute
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(out_dtype)
