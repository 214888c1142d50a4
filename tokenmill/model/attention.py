"""Paged attention in plain torch: write new K/V into cache slots, read past K/V by block table.

The flat batch holds all decode tokens first (one per sequence), then the prefill chunks.
On CPU, decode rows go through a C++ kernel that reads K/V straight from the blocks
(`csrc/paged_decode_attention.cpp`); elsewhere, or without a compiler, through ONE batched SDPA
call over K/V gathered block-wise and padded to the longest context. Each prefill chunk gets
its own SDPA call (few per step, many tokens each).

A sliding-window layer (metadata with `window` W) lets query position i see keys j with
i - W < j <= i (HF's convention: W positions including itself); the blocks before that may be
freed already, so no path reads them unmasked.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.model.cpu_kernels import paged_decode_kernels
from tokenmill.model.layers import fused_cpu_ops
from tokenmill.quant.kv_cache import KVCache, dequantize, gather_blocks, write_quantized


@dataclass(slots=True)
class PrefillSpan:
    """Query tokens [start, end) of one sequence whose context has `context_len` tokens
    (the cached prefix plus this chunk). `block_table` is None when the chunk is the whole
    context, so the fresh K/V can be used without reading the cache back; else it lists the
    blocks of context positions [key_start, context_len) (a window skips the blocks before)."""

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor | None
    window: int | None = None
    key_start: int = 0                    # context position of the block table's first key (block-aligned)
    device: torch.device | None = None    # of the mask (the block table's when there is one)
    mask: torch.Tensor | None = None      # [n, context_len - key_start] True = attend; None = plain causal

    def __post_init__(self) -> None:
        # built once per step here, not once per layer
        if (self.block_table is not None or self.window is not None) and self.mask is None:
            n = self.end - self.start
            dev = self.block_table.device if self.block_table is not None else self.device
            qpos = torch.arange(self.context_len - n, self.context_len, device=dev)[:, None]
            kpos = torch.arange(self.key_start, self.context_len, device=dev)[None, :]
            self.mask = kpos <= qpos
            if self.window is not None:
                self.mask &= kpos > qpos - self.window


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor                 # [T] cache slot of every token (block * bs + offset)
    num_decode_tokens: int                     # decode rows are tokens [0, num_decode_tokens)
    decode_block_tables: torch.Tensor | None   # [D, max_blocks] int32, padded with block 0
    decode_context_lens: torch.Tensor | None   # [D] int32
    prefills: list[PrefillSpan]
    window: int | None = None                  # sliding window of the layers this metadata serves
    decode_mask: torch.Tensor | None = None    # torch fallback only; built on first use, shared by layers


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor) -> None:
    """Store this step's K/V rows [T, Hk, D] at their cache slots (block * block_size + offset)."""
    ops = fused_cpu_ops(k)
    if (ops is not None and k.dtype == k_cache.dtype and v.dtype == v_cache.dtype and slots.dtype == torch.long
            and k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()):
        ops.write_kv_(k, v, k_cache, v_cache, slots)
        return
    _, _, num_kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,          # [T, Hq, D]
    k: torch.Tensor,          # [T, Hk, D]
    v: torch.Tensor,          # [T, Hk, D]
    cache: KVCache,           # [num_blocks, block_size, Hk, D] (+ scales when quantized)
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    k_cache, v_cache, k_scale, v_scale = cache
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if k_scale is None:
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    else:
        write_quantized(k, v, cache, meta.slot_mapping, fused_cpu_ops(k))

    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    nd = meta.num_decode_tokens
    kernels = paged_decode_kernels() if nd and q.device.type == "cpu" else None
    if kernels is not None and not meta.prefills:      # pure decode step: the kernel's output is the answer
        return kernels.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                              meta.decode_context_lens, scale, meta.window or 0, k_scale, v_scale)
    out = torch.empty_like(q)
    if kernels is not None:
        out[:nd] = kernels.paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                                  meta.decode_context_lens, scale, meta.window or 0, k_scale, v_scale)
    elif nd:
        # Fold the query heads of one KV group into the query-length axis: [D, Hk, G, D]
        # against K [D, Hk, L, D] is exact GQA without repeating K/V.
        bt = meta.decode_block_tables
        if meta.decode_mask is None:
            width = bt.shape[1] * block_size
            kpos = torch.arange(width, device=q.device)[None, :]
            lens = meta.decode_context_lens[:, None]
            mask = kpos < lens
            if meta.window is not None:
                mask &= kpos >= lens - meta.window
            meta.decode_mask = mask.view(nd, 1, 1, -1)
        kd = _gather(k_cache, k_scale, bt, q.dtype).view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
        vd = _gather(v_cache, v_scale, bt, q.dtype).view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
        qd = q[:nd].view(nd, num_kv_heads, group, head_dim)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[:nd] = od.reshape(nd, num_heads, head_dim)
    for span in meta.prefills:
        qs = q[span.start:span.end].transpose(0, 1).unsqueeze(0)            # [1, Hq, n, D]
        if span.block_table is None:
            ks, vs = k[span.start:span.end], v[span.start:span.end]
            mask, causal = span.mask, span.mask is None
        else:
            keys = span.context_len - span.key_start
            ks = _gather(k_cache, k_scale, span.block_table, q.dtype).view(-1, num_kv_heads, head_dim)[:keys]
            vs = _gather(v_cache, v_scale, span.block_table, q.dtype).view(-1, num_kv_heads, head_dim)[:keys]
            mask, causal = span.mask, False     # query i sits at position context_len - n + i
        ks = ks.transpose(0, 1).unsqueeze(0).to(q.dtype)
        vs = vs.transpose(0, 1).unsqueeze(0).to(q.dtype)
        os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal,
                                             scale=scale, enable_gqa=group > 1)
        out[span.start:span.end] = os_.squeeze(0).transpose(0, 1)
    return out


def _gather(cache: torch.Tensor, scales: torch.Tensor | None, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The blocks `table` names, dequantized to dtype: [*table.shape, block_size, Hk, D]."""
    return dequantize(gather_blocks(cache, table), None if scales is None else scales[table], dtype)
