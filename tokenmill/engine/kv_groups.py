"""KV groups: layers that attend alike share a block table and a pool of blocks.

A full-attention model has one group: every layer, one table per sequence (the classic paged
cache). A model with sliding-window layers (Gemma 3: 5 local layers of window 512 to 1 global;
Mistral: all layers) gets one group per window size: a window group releases the blocks no
query can reach any more, so a long sequence holds global layers x its length + local layers x
about the window, not all layers x its length.

Each group has its own pool (its own K/V tensors and BlockManager). The byte budget is split so
that every pool holds the same number of `max_model_len` sequences — llama.cpp's choice for its
SWA cache. vLLM's hybrid allocator instead shares one pool between groups of equal layer count,
which serves short requests better (a short request takes as many window blocks as full ones,
so with this split the window pool fills first when all requests are far shorter than
max_model_len; the scheduler then preempts as for any full pool).

Prefix caching is off for a model with a window group: a hit would need the window group's
blocks of the last `window` tokens before the hit too, which released blocks no longer hold.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config import ModelConfig
from tokenmill.engine.block_manager import BlockManager
from tokenmill.sequence import Sequence


@dataclass(frozen=True, slots=True)
class KVGroup:
    window: int | None          # sliding window of its layers; None = full attention
    layers: tuple[int, ...]
    num_blocks: int = 0


def group_layers(cfg: ModelConfig) -> list[KVGroup]:
    """The model's layers grouped by window, full attention first, blocks not yet counted."""
    windows: dict[int | None, list[int]] = {}
    for i in range(cfg.num_layers):
        windows.setdefault(cfg.layer_window(i), []).append(i)
    order = sorted(windows, key=lambda w: (w is not None, w or 0))
    return [KVGroup(w, tuple(windows[w])) for w in order]


def blocks_per_sequence(window: int | None, num_tokens: int, block_size: int, chunk: int = 1) -> int:
    """Blocks a group holds for a sequence of num_tokens while it computes `chunk` new tokens:
    all of them, or what a window sees: the chunk's queries reach back window - 1 positions
    before its first token, which straddles one more block."""
    full = -(-num_tokens // block_size)
    if window is None:
        return full
    return min(full, -(-(window - 1 + chunk) // block_size) + 1)


def plan_kv_groups(cfg: ModelConfig, budget_bytes: int, block_size: int, layer_block_bytes: int,
                   max_model_len: int, chunk_tokens: int) -> list[KVGroup]:
    """Split the budget so that every group holds the same number of max_model_len sequences,
    a window group one prefill chunk of `chunk_tokens` more (so that one sequence alone can
    always make progress). layer_block_bytes: K and V of one block in one layer."""
    groups = group_layers(cfg)
    if len(groups) == 1 and groups[0].window is None:
        return [KVGroup(None, groups[0].layers, budget_bytes // (cfg.num_layers * layer_block_bytes))]
    need = [blocks_per_sequence(g.window, max_model_len, block_size) for g in groups]
    extra = [blocks_per_sequence(g.window, max_model_len, block_size, chunk_tokens) - n for g, n in zip(groups, need)]
    budget_bytes -= sum(len(g.layers) * e * layer_block_bytes for g, e in zip(groups, extra))
    per_sequence = sum(len(g.layers) * n * layer_block_bytes for g, n in zip(groups, need))
    sequences = max(budget_bytes, 0) / per_sequence
    return [KVGroup(g.window, g.layers, int(sequences * n) + e) for g, n, e in zip(groups, need, extra)]


def kv_bytes_per_token(groups: list[KVGroup], layer_token_bytes: int, num_tokens: int, block_size: int) -> float:
    """Average KV bytes per token of one sequence of num_tokens (windows included)."""
    blocks = sum(len(g.layers) * blocks_per_sequence(g.window, num_tokens, block_size) for g in groups)
    return blocks * block_size * layer_token_bytes / num_tokens


class GroupedBlockManager:
    """One BlockManager per KV group behind BlockManager's interface (what the scheduler and
    engine call): a sequence is admitted or grown in every group or in none."""

    def __init__(self, groups: list[KVGroup], block_size: int) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = False
        self.managers = [BlockManager(g.num_blocks, block_size, enable_prefix_caching=False, group=i,
                                      window=g.window) for i, g in enumerate(groups)]
        self.prefix_queries = self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return sum(m.num_blocks for m in self.managers)

    @property
    def num_free_blocks(self) -> int:
        return sum(m.num_free_blocks for m in self.managers)

    @property
    def usage(self) -> float:
        return max(m.usage for m in self.managers)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        return []

    def cache_full_blocks(self, seq: Sequence) -> None:
        pass

    def can_admit(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        return all(m.can_admit(seq, [], num_new_tokens) for m in self.managers)

    def admit(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        if not self.can_admit(seq, cached, num_new_tokens):
            return False
        for m in self.managers:
            assert m.admit(seq, [], num_new_tokens)
        return True

    def grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        for m in self.managers:     # right whatever happens next: no query reaches those blocks
            m.release_outside_window(seq)
        if any(m.grow_need(seq, num_new_tokens) > m.num_free_blocks for m in self.managers):
            return False
        for m in self.managers:
            assert m.grow(seq, num_new_tokens)
        return True

    def trim(self, seq: Sequence) -> None:
        for m in self.managers:
            m.trim(seq)

    def free(self, seq: Sequence) -> None:
        for m in self.managers:
            m.free(seq)
