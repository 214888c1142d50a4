"""On-disk int32 packings of `GroupQuant` used by AutoGPTQ and AutoAWQ checkpoints.

Conventions checked against the sources (git HEAD of each repo):
  AutoGPTQ/AutoGPTQ  auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py, qlinear_cuda.py (pack, forward)
  casper-hansen/AutoAWQ  awq/modules/linear/gemm.py (WQLinear_GEMM.from_linear),
                         awq/utils/packing_utils.py (AWQ_ORDER, AWQ_REVERSE_ORDER, dequantize_gemm)

AutoGPTQ ("gptq" checkpoint format, a.k.a. v1), bits in {2, 4, 8}, p = 32 // bits codes per word:
  qweight int32 [K/p, N]: code of column k = p·i + j sits in bits j·bits.. of qweight[i, n] (packed along K)
  qzeros  int32 [G, N/p]: packed along N the same way, storing zero − 1. The kernels add 1 back
          after unpacking, WITHOUT wrapping: a stored nibble 2^bits − 1 reads as zero 2^bits, and
          zero 0 cannot be stored at all (AutoGPTQ's own packer turns it into −1 and corrupts the
          word). We unpack as the kernels compute, and refuse to pack zero 0.
  scales  fp16 [G, N]; g_idx int32 [K] (act-order groups; absent in old checkpoints -> k // group_size)
AutoAWQ GEMM ("gemm" version), bits 4:
  qweight int32 [K, N/8]: packed along N; nibble slot i of word j holds column 8j + AWQ_ORDER[i]
  qzeros  int32 [G, N/8]: same interleave, zero stored as-is;  scales fp16 [G, N]; groups k // group_size
"""
from __future__ import annotations

import torch

from tokenmill.quant.group import GroupQuant, default_g_idx

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]          # slot -> column within an 8-column word
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # column -> slot


def _pack_last(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., M] integer codes -> [..., M / (32/bits)] int32, code j of a word at bit j·bits."""
    per = 32 // bits
    if codes.shape[-1] % per:
        raise ValueError(f"packed dim {codes.shape[-1]} is not a multiple of {per}")
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], -1, per)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (c << shifts).sum(dim=-1)          # disjoint bit fields: sum == bitwise or
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _unpack_last(words: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., W] int32 -> [..., W·(32/bits)] int64 codes (inverse of _pack_last)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    return ((w[..., None] >> shifts) & (2 ** bits - 1)).reshape(*words.shape[:-1], -1)


def pack_gptq(gq: GroupQuant) -> dict[str, torch.Tensor]:
    if gq.bits not in (2, 4, 8):
        raise ValueError(f"AutoGPTQ packing supports 2/4/8 bits, got {gq.bits}")
    if (gq.zeros == 0).any():
        raise ValueError(f"{int((gq.zeros == 0).sum())} groups have zero point 0, which the AutoGPTQ "
                         "v1 format (stores zero - 1, kernels add 1 without wrapping) cannot hold")
    mask = 2 ** gq.bits - 1
    return {
        "qweight": _pack_last(gq.q, gq.bits).t().contiguous(),   # pack along K, then [K/p, N]
        "qzeros": _pack_last((gq.zeros.t().to(torch.int64) - 1) & mask, gq.bits),
        "scales": gq.scales.t().contiguous().to(torch.float16),
        "g_idx": gq.g_idx.to(torch.int32).contiguous(),
    }


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor | None, bits: int, group_size: int) -> GroupQuant:
    k, n = qweight.shape[0] * (32 // bits), qweight.shape[1]
    # Unpacking along K: unpack the last dim of qweightᵀ [N, K/p] -> [N, K] directly.
    q = _unpack_last(qweight.t(), bits)
    zeros = (_unpack_last(qzeros, bits)[:, :n] + 1).t()   # v1 quirk: stored zero - 1, no wrap
    gs = k if group_size == -1 else group_size
    if g_idx is None:
        g_idx = default_g_idx(k, gs)
    return GroupQuant(q.to(torch.uint8).contiguous(), scales.float().t().contiguous(),
                      zeros.float().contiguous(), g_idx.to(torch.int32).contiguous(), bits, gs)


def pack_awq(gq: GroupQuant) -> dict[str, torch.Tensor]:
    if gq.bits != 4:
        raise ValueError(f"AutoAWQ GEMM packing is 4-bit only, got {gq.bits}")
    if not torch.equal(gq.g_idx.to(torch.int32), default_g_idx(gq.q.shape[1], gq.group_size)):
        raise ValueError("AutoAWQ layout has no g_idx: groups must be k // group_size")
    n = gq.q.shape[0]
    slots = torch.tensor(AWQ_ORDER).repeat(n // 8) + torch.arange(0, n, 8).repeat_interleave(8)
    return {
        "qweight": _pack_last(gq.q.t()[:, slots], 4),
        "qzeros": _pack_last(gq.zeros.t().to(torch.int64)[:, slots], 4),
        "scales": gq.scales.t().contiguous().to(torch.float16),
    }


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               group_size: int) -> GroupQuant:
    k, n = qweight.shape[0], qweight.shape[1] * 8
    cols = torch.tensor(AWQ_REVERSE_ORDER).repeat(n // 8) + torch.arange(0, n, 8).repeat_interleave(8)
    q = _unpack_last(qweight, 4)[:, cols].t()
    zeros = _unpack_last(qzeros, 4)[:, cols].t()
    gs = k if group_size == -1 else group_size
    return GroupQuant(q.to(torch.uint8).contiguous(), scales.float().t().contiguous(),
                      zeros.float().contiguous(), default_g_idx(k, gs), 4, gs)
