"""Config keys that change the math and are not implemented are refused by name, before any
weight is read; keys nobody decided on are refused too; GGUF rope scaling is honoured with the
same formulas as the HF config keys."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

from tests.test_config_parity import hf_greedy, ours_greedy, prompt_of
from tests.test_loader import write_tiny_gguf
from tokenmill.config import ModelConfig
from tokenmill.model import registry
from tokenmill.model.loader import load_model_weights
from tokenmill.model.registry import UnsupportedConfig

BASE = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1).to_dict()

REFUSED = {
    "partial_rotary_factor": 0.5,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "hidden_act": "gelu",
    "num_local_experts": 8,
    "use_mrope": True,
    "embedding_multiplier": 12.0,
    "some_future_key": 1,                                   # not decided on: refused
    "rope_scaling": {"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0], "long_factor": [2.0]},
    "architectures": ["LlamaForSequenceClassification"],
    "model_type": "gemma3",
}


@pytest.mark.parametrize("key", list(REFUSED))
def test_refused_key_is_named_and_no_weight_is_read(tmp_path: Path, monkeypatch, key: str) -> None:
    cfg = {**BASE, key: REFUSED[key]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"")

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the config was validated")

    monkeypatch.setattr(safetensors.torch, "load_file", no_weights)
    with pytest.raises(UnsupportedConfig, match=key):
        load_model_weights(tmp_path, torch.float32)


def test_unknown_rope_subkey_is_named() -> None:
    cfg = {**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                    "mystery": 3}}
    with pytest.raises(UnsupportedConfig, match="rope_scaling.mystery"):
        ModelConfig.from_hf(cfg)


def test_neutral_values_of_conditional_keys_load() -> None:
    cfg = {**BASE, "partial_rotary_factor": 1.0, "attn_logit_softcapping": None, "use_mrope": False,
           "hidden_act": "silu", "rope_scaling": None}
    assert ModelConfig.from_hf(cfg).rope_scaling is None


def test_real_checkpoint_configs_are_accepted() -> None:
    """Config files as the Hub ships them (transformers-4 layout, rope_scaling dicts)."""
    llama32 = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
               "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64,
               "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
               "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
               "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
               "pretraining_tp": 1, "rms_norm_eps": 1e-05,
               "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"},
               "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
               "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256}
    qwen25 = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
              "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
              "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
              "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
              "use_sliding_window": False, "vocab_size": 151936,
              "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}}
    a = ModelConfig.from_hf(llama32)
    assert (a.rope_scaling.rope_type, a.rope_theta, a.context_length) == ("llama3", 500000.0, 131072)
    b = ModelConfig.from_hf(qwen25)
    assert (b.rope_scaling.rope_type, b.sliding_window, b.context_length) == ("yarn", None, 131072)


def test_supported_models_table_comes_from_the_registry() -> None:
    table = registry.supported_models_markdown()
    for arch in registry.ARCHITECTURES:
        assert arch.hf_classes[0] in table
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert table in readme, "README's supported-models table is stale: regenerate it with " \
                            "`python -m tokenmill.model.registry`"


# ---- GGUF -----------------------------------------------------------------------------------

def _hf_twin(expected: dict[str, np.ndarray], **rope) -> transformers.LlamaForCausalLM:
    """The HF model with the tiny GGUF's weights and the equivalent HF rope config."""
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, rope_theta=50000.0, rms_norm_eps=1e-6,
                                   tie_word_embeddings=False, **rope)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in expected.items()})
    return model


def _gguf_parity(path: Path, expected, **rope) -> None:
    hf = _hf_twin(expected, **rope)
    cfg, weights = load_model_weights(path, torch.float32)
    prompt = [p % 96 for p in prompt_of(48)]
    ref_tokens, ref_logits = hf_greedy(hf, prompt, 8)
    tokens, logits = ours_greedy(cfg, weights, prompt, 8, max_model_len=256)
    # fp32 rounding differences (two implementations of norm/rope/SiLU) grow through a random
    # model to ~1e-5 of its largest logit (28.5 for the yarn twin: 3.6e-4 absolute), so the bound
    # scales with the logits (greedy tokens must still match exactly)
    atol = 2e-5 * ref_logits.abs().max().item()
    torch.testing.assert_close(logits, ref_logits, atol=max(atol, 2e-4), rtol=1e-4)
    assert tokens == ref_tokens


def test_gguf_yarn_keys_match_hf_yarn(tmp_path: Path) -> None:
    def keys(w: gguf.GGUFWriter) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(32)

    path = tmp_path / "yarn.gguf"
    expected = write_tiny_gguf(path, "llama", heads=4, kv_heads=2, head_dim=16, tied=False, bias=False,
                               extra=keys)
    _gguf_parity(path, expected, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 32})


def test_gguf_rope_freqs_match_hf_llama3(tmp_path: Path) -> None:
    """convert_hf_to_gguf stores Llama-3 scaling as per-pair divisors of the frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}
    hf_cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_theta=50000.0,
                                      max_position_embeddings=256, rope_scaling=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    base = 1.0 / (50000.0 ** (torch.arange(0, 16, 2).float() / 16))
    divisors = (base / scaled).numpy().astype(np.float32)
    assert divisors.max() > 1.5   # the scaling touches some frequencies

    path = tmp_path / "llama3.gguf"
    expected = write_tiny_gguf(path, "llama", heads=4, kv_heads=2, head_dim=16, tied=False, bias=False,
                               extra=lambda w: w.add_tensor("rope_freqs.weight", divisors))
    _gguf_parity(path, expected, rope_scaling=rope)


@pytest.mark.parametrize("extra, key", [
    (lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE), "rope.scaling.type"),
    (lambda w: w.add_expert_count(8), "expert_count"),
    (lambda w: w.add_uint32("llama.attention.value_length", 8), "attention.value_length"),
])
def test_gguf_refusals_name_the_key(tmp_path: Path, extra, key: str) -> None:
    path = tmp_path / "bad.gguf"
    write_tiny_gguf(path, "llama", heads=4, kv_heads=2, head_dim=16, tied=False, bias=False, extra=extra)
    with pytest.raises(UnsupportedConfig, match=key):
        load_model_weights(path, torch.float32)
