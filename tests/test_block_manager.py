"""Block manager: prefix hits, sharing, salts, eviction order, accounting."""
from tokenmill.engine.block_manager import BlockManager
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence

BS = 4


def seq(tokens, salt=None) -> Sequence:
    return Sequence("r", list(tokens), SamplingParams(), cache_salt=salt)


def run_prefill(bm: BlockManager, s: Sequence) -> None:
    """Admit s with whatever prefix is cached and 'compute' the rest."""
    cached = bm.find_cached_prefix(s)
    assert bm.admit(s, cached, s.num_tokens - len(cached) * BS)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)


def test_shared_prefix_is_reused_and_ref_counted():
    bm = BlockManager(16, BS)
    a = seq(range(10))                      # 2 full blocks + 2 tokens
    run_prefill(bm, a)
    b = seq(list(range(8)) + [99, 98, 97])
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_table[:2]
    run_prefill(bm, b)
    assert b.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.prefix_queries == 21 and bm.prefix_hits == 8


def test_last_token_is_always_computed():
    bm = BlockManager(16, BS)
    run_prefill(bm, seq(range(8)))
    again = seq(range(8))
    assert len(bm.find_cached_prefix(again)) == 1   # block 2 holds the token that must produce logits


def test_salts_never_share():
    bm = BlockManager(16, BS)
    run_prefill(bm, seq(range(9), salt="alice"))
    assert bm.find_cached_prefix(seq(range(9), salt="bob")) == []
    assert bm.find_cached_prefix(seq(range(9))) == []
    assert len(bm.find_cached_prefix(seq(range(9), salt="alice"))) == 2


def test_different_prefix_same_block_tokens_does_not_hit():
    bm = BlockManager(16, BS)
    run_prefill(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # second block's tokens equal, first block's differ: the chain hash must miss
    assert bm.find_cached_prefix(seq([0, 2, 3, 4, 5, 6, 7, 8, 9])) == []


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(4, BS)
    a = seq(range(9))                         # 3 blocks (2 full, cached)
    run_prefill(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    assert len(bm.find_cached_prefix(seq(range(9)))) == 2      # still cached while free
    b = seq(range(100, 105))                  # 2 blocks: the never-cached ones go first
    run_prefill(bm, b)
    assert len(bm.find_cached_prefix(seq(range(9)))) == 2
    c = seq(range(200, 203))                  # 1 block: evicts the prefix's tail, not its head
    run_prefill(bm, c)
    assert len(bm.find_cached_prefix(seq(range(9)))) == 1
    d = seq(range(300, 303))                  # 1 more: the head goes too
    run_prefill(bm, d)
    assert bm.find_cached_prefix(seq(range(9))) == []
    for s in (b, c, d):
        bm.free(s)
    assert bm.num_free_blocks == bm.num_blocks


def test_admit_is_all_or_nothing():
    bm = BlockManager(3, BS)
    s = seq(range(20))                        # needs 5 blocks
    assert not bm.admit(s, [], 20)
    assert s.block_table == [] and bm.num_free_blocks == 3


def test_readmission_after_preemption_keeps_num_cached_tokens():
    """A preempted sequence re-admitted onto its own (now cached) blocks did not get those
    tokens from the prefix cache: usage and metrics must keep the first admission's count."""
    bm = BlockManager(16, BS)
    s = seq(range(10))
    run_prefill(bm, s)
    assert s.num_cached_tokens == 0
    bm.free(s)                              # preempted: blocks freed, hashes stay cached
    s.num_computed_tokens = 0
    s.num_preemptions += 1
    cached = bm.find_cached_prefix(s)
    assert len(cached) == 2
    assert bm.admit(s, cached, s.num_tokens - len(cached) * BS)
    assert s.num_computed_tokens == 8 and s.num_cached_tokens == 0
