"""KV-cache storage formats (`--kv-cache-dtype auto | bfloat16 | int8 | fp8_e4m3 | fp8_e5m2`).

`bfloat16` stores K/V in bf16 whatever the model computes in (halves an fp32 model's KV bytes).

K and V are stored as 1-byte codes with fp32 scales per (token, KV head, group of 64 values),
computed when the row is written: scale = absmax(group) / QMAX, code = value / scale (rounded
for int8, cast for fp8). Per-token scales need no calibration and follow every token's own range
(K rows of some heads reach ~100x others); groups of 64 keep one outlier dimension of a wide head
(Gemma 3: head_dim 256) from flattening the other 255 (Gemma 3 int8 perplexity: one scale per
row +0.59 %, benchmarks/README.md). A head_dim that 64 does not divide (or 64 itself) has one
scale per row. The attention paths dequantize as they read: the C++ decode kernel folds the
scales into the row it converts once per KV head, the torch paths multiply after the gather.

Bytes per token and KV head: head_dim + 4 * head_dim / 64 (scales) instead of 2 * head_dim for bf16.
"""
from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch

# --kv-cache-dtype -> storage dtype; "auto" stores K/V in the model's dtype
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
SCALE_BYTES = 4
SCALE_GROUP = 64          # values per scale


def scale_groups(head_dim: int) -> int:
    """Scales per (token, KV head) row."""
    return head_dim // SCALE_GROUP if head_dim % SCALE_GROUP == 0 else 1


class KVCache(NamedTuple):
    """One layer's paged K/V: [num_blocks, block_size, Hk, D], plus [num_blocks, block_size, Hk, G]
    fp32 scales when the codes are quantized (G = scale_groups(D); None: K/V in a float dtype)."""
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def token_head_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's K (or V) for one KV head, scale included."""
    size = torch.tensor([], dtype=dtype).element_size()
    return head_dim * size + (SCALE_BYTES * scale_groups(head_dim) if dtype in QMAX else 0)


def allocate(shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> KVCache:
    def scales() -> torch.Tensor | None:
        groups = (scale_groups(shape[3]),)
        return torch.ones(shape[:3] + groups, dtype=torch.float32, device=device) if dtype in QMAX else None
    return KVCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   scales(), scales())


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [..., D] -> (codes [..., D] of dtype, fp32 scales [..., G])."""
    # multiplications by fp32 reciprocals: what the fused C++ write computes, bit for bit
    d = x.shape[-1]
    xf = x.float().reshape(*x.shape[:-1], scale_groups(d), -1)
    scale = xf.abs().amax(dim=-1).clamp_(min=1e-12) * (1.0 / QMAX[dtype])
    y = (xf * scale.reciprocal().unsqueeze(-1)).reshape(x.shape)
    codes = y.round_().clamp_(-127, 127).to(dtype) if dtype == torch.int8 else y.to(dtype)
    return codes, scale


def gather_blocks(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """cache[table] (CPU torch has no indexing kernels for fp8: gather the bytes)."""
    if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return cache.view(torch.uint8)[table].view(cache.dtype)
    return cache[table]


def dequantize(codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Codes [..., D] and scales [..., G] (None: codes are floats already) -> dtype."""
    if scale is None:
        return codes.to(dtype)
    grouped = codes.float().reshape(*codes.shape[:-1], scale.shape[-1], -1)
    return (grouped * scale.unsqueeze(-1)).reshape(codes.shape).to(dtype)


def write_quantized(k: torch.Tensor, v: torch.Tensor, cache: KVCache, slots: torch.Tensor,
                    fused_ops: ModuleType | None = None) -> None:
    """Quantize this step's K/V rows [T, Hk, D] into their cache slots (one C++ op when the
    fused CPU kernels are given: ~10 torch ops per layer otherwise)."""
    _, _, heads, dim = cache.k.shape
    if (fused_ops is not None and k.dtype == v.dtype == torch.float32 and slots.dtype == torch.long
            and k.stride(-1) == 1 and v.stride(-1) == 1):
        fused_ops.write_kv_quantized_(k, v, cache.k, cache.v, cache.k_scale, cache.v_scale, slots, QMAX[cache.k.dtype])
        return
    for x, codes, scales in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
        q, s = quantize(x, codes.dtype)
        # as bytes: CPU torch has no index_copy for fp8
        codes.view(torch.uint8).view(-1, heads, dim).index_copy_(0, slots, q.view(torch.uint8))
        scales.view(-1, heads, scales.shape[-1]).index_copy_(0, slots, s)
