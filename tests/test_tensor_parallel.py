"""Tensor parallelism: the head / column / vocabulary split, and TP=2 over gloo (two processes
on this machine) generating exactly what TP=1 generates in fp32."""
from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import UnsupportedConfig
from tokenmill.parallel.shard import HeadShard, even_ranges, head_shards
from tests.tiny_models import save_tiny_model_dir

PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog. " * 6, "你好世界", "fox"]


def test_heads_split_by_whole_kv_groups():
    # SmolLM2: 9 query heads, 3 KV heads, 2 ranks -> 1 and 2 KV heads, nothing stored twice
    assert head_shards(9, 3, 2) == [HeadShard(0, 3, 0, 1), HeadShard(3, 9, 1, 3)]
    assert head_shards(14, 2, 2) == [HeadShard(0, 7, 0, 1), HeadShard(7, 14, 1, 2)]     # Qwen2.5 0.5B
    # fewer KV heads than ranks: each KV head on 2 ranks, its 4 query heads split 2 + 2
    assert head_shards(8, 2, 4) == [HeadShard(0, 2, 0, 1), HeadShard(2, 4, 0, 1), HeadShard(4, 6, 1, 2),
                                    HeadShard(6, 8, 1, 2)]
    with pytest.raises(UnsupportedConfig, match="tensor_parallel_size=4 cannot split 14 query heads"):
        head_shards(14, 2, 4)
    assert even_ranges(49152, 2) == [(0, 24576), (24576, 49152)] and even_ranges(5, 2) == [(0, 2), (2, 5)]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    return save_tiny_model_dir(tmp_path_factory.mktemp("tp") / "qwen2", arch="qwen2")


def generate(model: str, tp: int, prompts=PROMPTS, **kw) -> list:
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=2 if i == 1 else None)
              for i in range(len(prompts))]
    with LLM(model, dtype="float32", tensor_parallel_size=tp, num_threads=1, **kw) as llm:
        return llm.generate(prompts, params, use_tqdm=False)


def test_tp2_greedy_equals_tp1_tiny_qwen2(qwen_dir):
    # a 32-token step budget: prompts prefill in chunks while others decode (mixed steps)
    kw = dict(max_model_len=256, kv_cache_memory=8 << 20, max_num_batched_tokens=32)
    one, two = generate(qwen_dir, 1, **kw), generate(qwen_dir, 2, **kw)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    # prompt logprobs go through the vocab-parallel lm_head in chunks on both ranks
    lp1, lp2 = one[1].prompt_logprobs, two[1].prompt_logprobs
    assert len(lp2) == len(lp1) > 1 and lp1[0] is None and lp2[0] is None
    for a, b in zip(lp1[1:], lp2[1:]):
        assert (a.token_id, a.top.keys()) == (b.token_id, b.top.keys())
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert abs(a.rank - b.rank) <= 1     # a random model's logits tie to 1e-6 (summation order differs)


def test_quantized_per_rank_and_refusal_names_the_slice(qwen_dir):
    # slices are quantized after the split: int8 and rtn4 (groups cut at the slice) run ...
    kw = dict(max_model_len=128, kv_cache_memory=8 << 20, quantization="rtn4")
    assert all(len(o.outputs[0].token_ids) == 24 for o in generate(qwen_dir, 2, **kw))
    # ... NF4's 64-value blocks do not fit a 32-column o_proj slice: refused, naming why
    with pytest.raises(UnsupportedConfig, match="nf4 with tensor_parallel_size=2: rank 0's slice of a layer"):
        generate(qwen_dir, 2, **{**kw, "quantization": "nf4"})


@pytest.mark.parametrize("extra", [dict(enable_lora=True), dict(speculative_config={"method": "ngram",
                                                                                     "num_speculative_tokens": 2})])
def test_refused_combinations_name_themselves(qwen_dir, extra):
    with pytest.raises(UnsupportedConfig, match="tensor_parallel_size > 1 is not supported"):
        LLM(qwen_dir, dtype="float32", tensor_parallel_size=2, **extra)


@pytest.mark.slow
def test_tp2_greedy_equals_tp1_smollm2():
    prompts = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
               "List three colours: red,"]
    kw = dict(max_model_len=512, kv_cache_memory=64 << 20, max_num_batched_tokens=16)
    one = generate("smollm2-135m-instruct", 1, prompts, **kw)
    two = generate("smollm2-135m-instruct", 2, prompts, **kw)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
