"""Gemma 3 270M (GGUF Q4_K_M / Q5_0 / Q8_0 / Q6_K dequantized, fp32): greedy parity with HF
transformers in ONE generate call, prompts from 1 to ~900 tokens (past the 512-token window of
the local layers), plain and under preemption; and the KV blocks a long sequence holds."""
import pytest

from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
LONG = " ".join(f"Entry {i}: the harbour master logged {i * 7 % 13} ships from port {chr(65 + i % 26)}, "
                f"{i * 3} tonnes of cargo." for i in range(30))
PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Write a haiku about autumn leaves falling on a quiet river at dusk.",
    "Once upon a time, in a land far, far away, there lived a",
    LONG + "\nThe next entry is Entry 40:",
]


@pytest.fixture(scope="module")
def reference():
    from tokenmill.hub import resolve_model
    refs = hf_greedy(resolve_model("gemma-3-270m"), PROMPTS, NEW_TOKENS)
    assert len(refs[-1][0]) > 600     # the window matters
    return refs


@pytest.mark.parametrize("kv_cache_memory", [256 << 20, 28 << 20], ids=["roomy", "preempting"])
def test_greedy_matches_hf(reference, kv_cache_memory):
    from tokenmill import LLM, SamplingParams
    # 28 MiB: one 768-token sequence and a 2048-token prefill chunk, not all six prompts at once
    llm = LLM(model="gemma-3-270m", dtype="float32", max_model_len=768, kv_cache_memory=kv_cache_memory)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in reference], params, use_tqdm=False)
    for (ids, ref), out in zip(reference, outs):
        assert out.outputs[0].token_ids == ref, f"prompt of {len(ids)} tokens"
    preempted = llm.engine.scheduler.num_preemptions
    assert (preempted > 0) == (kv_cache_memory < 64 << 20), preempted
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_long_sequence_holds_window_blocks_only():
    """A 2,000-token sequence, prefilled in 256-token chunks then decoded: the 3 global layers
    hold every block, the 15 local layers only those their 512-token window still sees."""
    from tokenmill.engine.kv_groups import GroupedBlockManager, plan_kv_groups
    from tokenmill.hub import resolve_model
    from tokenmill.model.loader import read_model_config
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.sequence import Sequence

    cfg = read_model_config(resolve_model("gemma-3-270m"))
    bs, window, n = 16, cfg.sliding_window, 2000
    groups = plan_kv_groups(cfg, 64 << 20, bs, 2 * cfg.num_kv_heads * cfg.head_dim * 4 * bs, 4096, 256)
    assert [(g.window, len(g.layers)) for g in groups] == [(None, 3), (512, 15)]
    bm = GroupedBlockManager(groups, bs)
    seq = Sequence("0", list(range(n)), SamplingParams())
    assert bm.admit(seq, [], 256)
    while seq.num_computed_tokens < n:
        chunk = min(256, n - seq.num_computed_tokens)
        assert bm.grow(seq, chunk)
        seq.num_computed_tokens += chunk
    for _ in range(8):                       # decode steps
        seq.append_token(1)
        assert bm.grow(seq, 1)
        seq.num_computed_tokens += 1
    full, local = (sum(b >= 0 for b in t) for t in seq.block_tables)
    # the last step's query sits at position n + 7 and sees keys from n + 7 - 511 on
    expected_local = -(-(n + 8) // bs) - (n + 7 - window + 1) // bs
    assert (full, local) == (-(-(n + 8) // bs), expected_local) == (126, 33)
    held = 3 * full + 15 * local
    assert held == 873 < 18 * full == 2268
    bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks
