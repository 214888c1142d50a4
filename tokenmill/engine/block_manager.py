"""Physical KV-cache blocks: allocation, reference counts, free LRU and the prefix cache.

Invariants:
- every block is either free (ref_count 0, in `free_blocks`) or referenced by >= 1 running
  sequence; when no sequence runs, `num_free_blocks == num_blocks`.
- a block is shared only when full and hashed; sequences append only into their own last,
  partial block, so shared blocks are never written.
- a full block's hash chains (parent hash, its token ids, extra keys); a hit is confirmed
  against the token ids stored in the block.
- free blocks keep their hash and stay findable until evicted (least recently freed first).
- a manager serves one KV group (engine/kv_groups.py): the table `seq.block_tables[group]`. A
  sliding-window group releases the blocks no query can see any more; their table entries
  become RELEASED (-1), so logical block i stays entry i.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


def chain_hash(parent: int | None, token_ids: tuple[int, ...], extra: str | None) -> int:
    """128-bit chained block hash; collisions are astronomically unlikely and a hit is still
    confirmed against the stored tokens."""
    h = hashlib.blake2b(digest_size=16)
    h.update((parent or 0).to_bytes(16, "little"))
    h.update(repr(token_ids).encode())
    if extra:
        h.update(extra.encode())
    return int.from_bytes(h.digest(), "little")


RELEASED = -1   # table entry of a block a sliding window has left behind


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 group: int = 0, window: int | None = None) -> None:
        if window is not None and enable_prefix_caching:
            raise ValueError("prefix caching of a sliding-window KV group is not implemented")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.group, self.window = group, window
        self.released: dict[int, int] = {}    # seq_id -> leading table entries released (window only)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}      # block hash -> block id
        self.prefix_queries = 0               # prompt tokens looked up (for the hit rate)
        self.prefix_hits = 0                  # of those, tokens served from cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------------
    def _update_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Extend seq.block_hashes over the full blocks among its first num_tokens tokens."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(chain_hash(parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]),
                                                seq.prefix_cache_key))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of seq. At least one token is always
        left to compute, because the step must produce logits for the next token. A sequence
        still owed prompt logprobs gets no hit: cached tokens never pass through the lm_head
        (as in vLLM; it still adds its own blocks to the cache)."""
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        self._update_hashes(seq, max_blocks * bs)
        hits: list[int] = []
        for i in range(max_blocks):
            bid = self.cached.get(seq.block_hashes[i])
            if bid is None or self.blocks[bid].token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(bid)
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of seq that are now completely computed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        self._update_hashes(seq, num_full * bs)
        for i in range(num_full):
            block = self.blocks[seq.block_tables[self.group][i]]
            if block.hash is not None:
                continue
            h = seq.block_hashes[i]
            if h in self.cached:          # another sequence computed the same block first
                continue
            block.hash, block.token_ids = h, tuple(seq.token_ids[i * bs:(i + 1) * bs])
            self.cached[h] = block.block_id

    # ---- allocation ---------------------------------------------------------------------
    def _take_free_block(self) -> Block:
        bid, _ = self.free_blocks.popitem(last=False)      # least recently freed
        block = self.blocks[bid]
        if block.hash is not None:                         # evict its cache entry
            if self.cached.get(block.hash) == bid:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block

    def table(self, seq: Sequence) -> list[int]:
        while len(seq.block_tables) <= self.group:
            seq.block_tables.append([])
        return seq.block_tables[self.group]

    def can_admit(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        reused_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        total = len(cached) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(cached)
        return need + reused_free <= self.num_free_blocks

    def admit(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        """Give a new (or preempted) sequence its cached prefix blocks plus room for
        num_new_tokens more. Returns False, changing nothing, when memory is short."""
        table = self.table(seq)
        assert not table
        if not self.can_admit(seq, cached, num_new_tokens):
            return False
        for bid in cached:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free_blocks[bid]
            block.ref_count += 1
            table.append(bid)
        num_cached = len(cached) * self.block_size
        seq.num_computed_tokens = num_cached
        # Only the first admission counts: after a preemption the hits are the sequence's own
        # blocks (recompute savings), not prompt tokens served to the client from the cache.
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = num_cached
        if self.enable_prefix_caching and seq.num_preemptions == 0:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += num_cached
        return self.grow(seq, num_new_tokens)

    def grow_need(self, seq: Sequence, num_new_tokens: int) -> int:
        return self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(self.table(seq))

    def grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens beyond seq.num_computed_tokens. False if short."""
        self.release_outside_window(seq)
        need = self.grow_need(seq, num_new_tokens)
        if need > self.num_free_blocks:
            return False
        table = self.table(seq)
        for _ in range(need):
            table.append(self._take_free_block().block_id)
        return True

    def release_outside_window(self, seq: Sequence) -> None:
        """Window group: release the blocks wholly before the window of seq's next query
        (position num_computed_tokens sees keys from num_computed_tokens - window + 1 on)."""
        if self.window is None:
            return
        table = self.table(seq)
        first_needed = max(0, seq.num_computed_tokens - self.window + 1) // self.block_size
        done = self.released.get(seq.seq_id, 0)
        for i in range(done, min(first_needed, len(table))):
            self._release(table[i])
            table[i] = RELEASED
        self.released[seq.seq_id] = max(done, min(first_needed, len(table)))

    def _release(self, bid: int, front: bool = False) -> None:
        block = self.blocks[bid]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {bid} freed twice"
        if block.ref_count == 0:
            self.free_blocks[bid] = None
            if front:
                self.free_blocks.move_to_end(bid, last=False)

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past seq's computed tokens (the slots of rejected speculative
        drafts). They hold no cached prefix, so they go to the front of the free list."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        table = self.table(seq)
        while len(table) > keep:
            self._release(table.pop(), front=True)

    def free(self, seq: Sequence) -> None:
        """Drop seq's references. Tail blocks are released first so that they are evicted
        before the (more shareable) head of the prefix."""
        table = self.table(seq)
        for bid in reversed(table):
            if bid != RELEASED:
                self._release(bid)
        table.clear()
        self.released.pop(seq.seq_id, None)
