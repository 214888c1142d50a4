"""Parity matrix: every config variant tokenmill honours, on a tiny random HF model saved as
safetensors and loaded by tokenmill's own loader, against transformers fp32 generating token by
token with its KV cache. Greedy tokens and every step's logits must match; and each variant's
feature, switched off in tokenmill's ModelConfig, must break the match (or refuse to load), so
no variant passes by accident."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.model.loader import load_model_weights, read_model_config
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, initializer_range=0.1)   # larger than HF default 0.02: attention that matters
SCALED = dict(original_max_position_embeddings=32)   # prompts of 48 tokens run past it


@dataclasses.dataclass
class Variant:
    config_cls: type
    overrides: dict
    off: dict                  # ModelConfig fields that switch the feature off
    prompt_len: int = 48
    steps: int = 16


VARIANTS = {
    "llama-untied": Variant(transformers.LlamaConfig, {}, {"tie_word_embeddings": True}),
    "llama-tied": Variant(transformers.LlamaConfig, {"tie_word_embeddings": True}, {"tie_word_embeddings": False}),
    "llama3-rope": Variant(transformers.LlamaConfig, {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, **SCALED}},
        {"rope_scaling": None}),
    "linear-rope": Variant(transformers.LlamaConfig, {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
                           {"rope_scaling": None}),
    # HF's dynamic NTK re-bases from the longest position of each call: prompt within the
    # original 32 positions, generation well past it
    "dynamic-rope": Variant(transformers.LlamaConfig, {"max_position_embeddings": 32, "rope_scaling": {
        "rope_type": "dynamic", "factor": 4.0}}, {"rope_scaling": None, "max_position_embeddings": 128},
        prompt_len=24, steps=40),
    "yarn-rope": Variant(transformers.Qwen2Config, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, **SCALED}},
                         {"rope_scaling": None}),
    "qwen2-bias": Variant(transformers.Qwen2Config, {}, {"attention_bias": False}),
    # off: a window shorter than the length (the model's window is longer than it: exact either way)
    "mistral-in-window": Variant(transformers.MistralConfig, {"sliding_window": 128}, {"sliding_window": 16}),
    # a window of 16 under 48-token prompts: prefill chunks past the window, decode through it
    "mistral-window": Variant(transformers.MistralConfig, {"sliding_window": 16}, {"sliding_window": None}),
    "qwen2-window": Variant(transformers.Qwen2Config, {"sliding_window": 16, "use_sliding_window": True,
                                                       "max_window_layers": 1},
                            {"sliding_window": None, "layer_types": None}),
    "head-dim-32": Variant(transformers.LlamaConfig, {"head_dim": 32}, {"head_dim": 16}),
    "llama-all-biases": Variant(transformers.LlamaConfig, {"attention_bias": True, "mlp_bias": True},
                                {"o_proj_bias": False, "mlp_bias": False}),
}


def build_hf(variant: Variant, seed: int = 0):
    torch.manual_seed(seed)
    cfg = variant.config_cls(**{**COMMON, **variant.overrides})
    model = {transformers.LlamaConfig: transformers.LlamaForCausalLM,
             transformers.Qwen2Config: transformers.Qwen2ForCausalLM,
             transformers.MistralConfig: transformers.MistralForCausalLM}[variant.config_cls](cfg)
    with torch.no_grad():   # random init leaves biases at zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    return model.float().eval()


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' own incremental decoding: one prefill call, then one token per call."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        logits, tokens = [out.logits[0, -1]], []
        for _ in range(steps - 1):
            tokens.append(int(logits[-1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits[0, -1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


def ours_greedy(cfg: ModelConfig, weights, prompt: list[int], steps: int, chunk: int = 16,
                max_model_len: int = 128) -> tuple[list[int], torch.Tensor]:
    """tokenmill's runner: chunked prefill (16 tokens a step), then batched-decode steps."""
    assert cfg.resolve_max_model_len(max_model_len) == max_model_len   # the engine's check
    block = 4
    per_block = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * block
    econf = EngineConfig(block_size=block, kv_cache_memory=per_block * 64)
    runner = ModelRunner(econf, cfg, dict(weights), torch.device("cpu"), torch.float32, max_model_len)
    bm = runner.make_block_manager(enable_prefix_caching=False)
    seq = Sequence("0", list(prompt), SamplingParams(max_tokens=steps))
    assert bm.admit(seq, [], 0)
    logits, tokens = [], []
    while len(tokens) < steps:
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        assert bm.grow(seq, n)
        out = runner.execute([(seq, n)])
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            logits.append(out[0])
            tokens.append(int(out[0].argmax()))
            seq.append_token(tokens[-1])
    return tokens, torch.stack(logits)


def saved(tmp_path: Path, model) -> Path:
    model.save_pretrained(tmp_path)
    return tmp_path


def prompt_of(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_transformers(tmp_path: Path, name: str) -> None:
    v = VARIANTS[name]
    model = build_hf(v)
    cfg, weights = load_model_weights(saved(tmp_path, model), torch.float32)
    prompt = prompt_of(v.prompt_len)
    ref_tokens, ref_logits = hf_greedy(model, prompt, v.steps)
    tokens, logits = ours_greedy(cfg, weights, prompt, v.steps)
    torch.testing.assert_close(logits, ref_logits, atol=2e-4, rtol=1e-4)
    assert tokens == ref_tokens


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_fails_with_its_feature_off(tmp_path: Path, name: str) -> None:
    v = VARIANTS[name]
    model = build_hf(v)
    cfg, weights = load_model_weights(saved(tmp_path, model), torch.float32)
    prompt = prompt_of(v.prompt_len)
    _, ref_logits = hf_greedy(model, prompt, v.steps)
    off = dataclasses.replace(cfg, **v.off)
    try:
        _, logits = ours_greedy(off, weights, prompt, v.steps)
    except (ValueError, RuntimeError, KeyError):
        return   # refused to load (a tensor with no place, a missing tensor, a shape mismatch)
    assert (logits - ref_logits).abs().max() > 1e-2, "the feature made no difference: the test proves nothing"


def test_dynamic_rope_is_chunking_invariant(tmp_path: Path) -> None:
    """The same tokens whether the prompt arrives in 16-token chunks or one by one."""
    v = VARIANTS["dynamic-rope"]
    cfg, weights = load_model_weights(saved(tmp_path, build_hf(v)), torch.float32)
    prompt = prompt_of(v.prompt_len)
    a = ours_greedy(cfg, weights, prompt, 24, chunk=16)[1]
    b = ours_greedy(cfg, weights, prompt, 24, chunk=64)[1]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_scaled_rope_extends_the_context(tmp_path: Path) -> None:
    """vLLM's derived max length: linear/dynamic multiply max_position_embeddings by the factor,
    yarn multiplies the original context; llama3 configs already state the extended length."""
    for name, expected in (("linear-rope", 512), ("dynamic-rope", 128), ("yarn-rope", 128), ("llama3-rope", 128)):
        path = saved(tmp_path / name, build_hf(VARIANTS[name]))
        assert read_model_config(path).context_length == expected, name


@pytest.mark.parametrize("chunk", [4, 64])
def test_window_parity_whatever_the_chunking(tmp_path: Path, chunk: int) -> None:
    """Prefill in chunks shorter than the window, and in one chunk longer than it."""
    v = VARIANTS["mistral-window"]
    model = build_hf(v)
    cfg, weights = load_model_weights(saved(tmp_path, model), torch.float32)
    prompt = prompt_of(v.prompt_len)
    ref, _ = hf_greedy(model, prompt, 8)
    assert ours_greedy(cfg, weights, prompt, 8, chunk=chunk)[0] == ref


def test_qwen2_sliding_window_only_counts_when_used(tmp_path: Path) -> None:
    base = {**COMMON, "sliding_window": 16}
    off = transformers.Qwen2Config(**base, use_sliding_window=False)
    on = transformers.Qwen2Config(**base, use_sliding_window=True, max_window_layers=1)
    assert ModelConfig.from_hf(off.to_dict()).sliding_window is None
    cfg = ModelConfig.from_hf(on.to_dict())
    assert (cfg.sliding_window, cfg.layer_window(0), cfg.layer_window(1)) == (16, None, 16)


@pytest.mark.parametrize("name", VARIANTS)
def test_hf_config_round_trip(name: str) -> None:
    """The config.json a quantized checkpoint of a GGUF model gets reads back as the same model."""
    from tokenmill.model.registry import hf_config_from_model, model_config_from_hf
    variant = VARIANTS[name]
    cfg = model_config_from_hf(variant.config_cls(**{**COMMON, **variant.overrides}).to_dict())
    assert model_config_from_hf(hf_config_from_model(cfg)) == cfg
