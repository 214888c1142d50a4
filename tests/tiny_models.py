"""Tiny random HF models built in-process (no downloads) for parity tests."""
from __future__ import annotations

import torch
import transformers


def tiny_hf_model(arch: str = "llama", seed: int = 0, tie: bool = False):
    """A 2-layer random model with GQA (4 query heads, 2 KV heads)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        cfg = transformers.LlamaConfig(rope_theta=10000.0, **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(rope_theta=1000000.0, **common)
        model = transformers.Qwen2ForCausalLM(cfg)
        # random init leaves biases at zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        raise ValueError(arch)
    return model.float().eval()


def tiny_tokenizer():
    """A byte-level BPE tokenizer with 300 ids (ids 0-2 special), trained in-process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog. 你好世界"] * 20, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")


def save_tiny_model_dir(path, arch: str = "llama", seed: int = 0) -> str:
    """An HF-layout directory (config.json, safetensors, tokenizer) for engine-level tests."""
    tok = tiny_tokenizer()
    model = tiny_hf_model(arch, seed=seed)
    model.resize_token_embeddings(len(tok))   # keep vocab == tokenizer size
    model.config.vocab_size = len(tok)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
