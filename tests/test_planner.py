"""`tokenmill plan`: the seed's worked examples from public configs (done right), and the plan
checked against what real engines allocate and load."""
from __future__ import annotations

import pytest

from tokenmill.config import ModelConfig
from tokenmill.planner import GiB, plan
from tokenmill.quant.config import QuantConfig

# public config.json files (the fields that matter), written here: no model hub offline
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
             "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float16"}
LLAMA3_8B = LLAMA2_7B | {"intermediate_size": 14336, "num_key_value_heads": 8, "vocab_size": 128256,
                         "max_position_embeddings": 8192, "rope_theta": 500000.0, "torch_dtype": "bfloat16"}
QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
             "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28,
             "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
             "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 131072, "use_sliding_window": False,
             "max_window_layers": 28, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# parameter counts the model cards publish
PUBLISHED_PARAMS = {"llama2": 6_738_415_616, "llama3": 8_030_261_248, "qwen25": 7_615_616_512}
CONFIGS = {"llama2": LLAMA2_7B, "llama3": LLAMA3_8B, "qwen25": QWEN25_7B}


def cfg(name: str) -> ModelConfig:
    return ModelConfig.from_hf(CONFIGS[name])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_weight_groups_add_up_to_the_published_parameter_count(name):
    p = plan(cfg(name), dtype="float16", kv_cache_memory=GiB)
    assert sum(g.params for g in p.weights) == PUBLISHED_PARAMS[name]
    assert p.weight_bytes == 2 * PUBLISHED_PARAMS[name]


def test_seed_formula_for_a_7b_mha_model_gives_8_gib_not_2_1_gb():
    """2 * 32 layers * 4096 * 2048 tokens * 8 requests * 2 bytes = 8 GiB (the seed prints ~2.1 GB)."""
    p = plan(cfg("llama2"), dtype="float16", kv_cache_memory=GiB, seq_lens=(2048, 4096))
    assert p.request_kv_bytes[2048] * 8 == 2 * 32 * 4096 * 2048 * 8 * 2 == 8 * GiB
    assert p.request_kv_bytes[4096] == 2 * GiB              # so "0.4 GB per 4k request" is not a 7B MHA model


@pytest.mark.parametrize("name, gib_per_4k", [("llama3", 0.5), ("qwen25", 0.21875)])
def test_seeds_0_4_gb_per_4k_request_fits_gqa_models(name, gib_per_4k):
    p = plan(cfg(name), dtype="bfloat16", kv_cache_memory=GiB, seq_lens=(4096,))
    assert p.request_kv_bytes[4096] == gib_per_4k * GiB


@pytest.mark.parametrize("name, kv_bytes_per_token", [("llama2", 524288), ("llama3", 131072), ("qwen25", 57344)])
def test_80_gib_card_with_int8_weights_and_10_gib_reserve(name, kv_bytes_per_token):
    """The concurrency that follows: what is left after int8 weights, the activation estimate and
    the reserve, in whole 4,096-token requests."""
    p = plan(cfg(name), dtype="bfloat16", quantization=QuantConfig("int8"), memory=80 * GiB, reserve=10 * GiB,
             max_model_len=4096, seq_lens=(4096,))
    params = PUBLISHED_PARAMS[name]
    assert 0.9 * params < p.weight_bytes < 1.2 * params          # ~1 byte per weight, embeddings bf16
    assert p.kv_budget_bytes == 80 * GiB - p.weight_bytes - p.activation_bytes - 10 * GiB
    blocks = p.kv_budget_bytes // (p.kv_groups[0].layers * 16 * kv_bytes_per_token // cfg(name).num_layers)
    assert p.kv_groups[0].blocks == blocks and p.concurrency[4096] == blocks // 256
    assert p.concurrency[4096] == {"llama2": 31, "llama3": 120, "qwen25": 277}[name]


def test_windows_and_kv_dtype_enter_bytes_per_token():
    qwen = dict(QWEN25_7B, use_sliding_window=True, sliding_window=1024, max_window_layers=0)
    full = plan(cfg("qwen25"), dtype="bfloat16", kv_cache_memory=GiB, max_model_len=8192)
    windowed = plan(ModelConfig.from_hf(qwen), dtype="bfloat16", kv_cache_memory=GiB, max_model_len=8192)
    int8 = plan(cfg("qwen25"), dtype="bfloat16", kv_cache_dtype="int8", kv_cache_memory=GiB, max_model_len=8192)
    assert full.kv_bytes_per_token == 57344
    assert windowed.kv_bytes_per_token < full.kv_bytes_per_token / 6
    assert int8.kv_layer_token_bytes == 2 * 4 * (128 + 2 * 4)      # codes + a scale per 64 values


def test_tensor_parallel_splits_weights_and_kv_heads():
    one = plan(cfg("llama3"), dtype="bfloat16", kv_cache_memory=GiB)
    two = plan(cfg("llama3"), dtype="bfloat16", kv_cache_memory=GiB, tensor_parallel_size=2)
    assert two.kv_layer_token_bytes * 2 == one.kv_layer_token_bytes
    assert abs(two.weight_bytes * 2 - one.weight_bytes) < 0.001 * one.weight_bytes   # norms replicated
    # 3 ranks split Llama-3's 8 KV heads 2 / 3 / 3 (whole GQA groups): the bill is the fullest rank's
    three = plan(cfg("llama3"), dtype="bfloat16", kv_cache_memory=GiB, tensor_parallel_size=3)
    assert three.kv_layer_token_bytes * 8 == one.kv_layer_token_bytes * 3
    with pytest.raises(ValueError, match="cannot split 32 query heads over 8 KV heads"):
        plan(cfg("llama3"), dtype="bfloat16", kv_cache_memory=GiB, tensor_parallel_size=12)
