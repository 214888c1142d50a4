"""Loader tests on tiny GGUF files written in-process, plus one on the real SmolLM2 (slow)."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from tokenmill.model.loader import load_model_weights, unpermute_qk

HIDDEN, FFN, VOCAB, LAYERS = 64, 128, 96, 2

# GGUF name -> storage type in the tiny files; quantized types only on rows of >= 32 values.
GGUF_TYPES = {
    "attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.F16, "attn_output": Q.Q4_0,
    "ffn_gate": Q.Q5_1, "ffn_up": Q.BF16, "ffn_down": Q.Q4_1,
}


def hf_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.LlamaModel.permute, verbatim in numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def roundtrip(x: np.ndarray, qtype: Q) -> np.ndarray:
    """What the loader should give back for `x` stored as `qtype` (quantization is row-wise,
    so it commutes with the row permutation)."""
    if qtype == Q.F32:
        return x
    return dequantize(quantize(x, qtype), qtype).reshape(x.shape)


def write_tiny_gguf(path: Path, arch: str, *, heads: int, kv_heads: int, head_dim: int,
                    tied: bool, bias: bool, seed: int = 0, extra=None) -> dict[str, np.ndarray]:
    """Write a tiny model and return the HF-named, HF-layout fp32 tensors the loader must yield."""
    rng = np.random.default_rng(seed)
    rand = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if extra is not None:   # more keys or tensors: extra(writer)
        extra(w)

    expected: dict[str, np.ndarray] = {}

    def put(gguf_name: str, hf_name: str, x: np.ndarray, qtype: Q = Q.F32,
            permute_heads: tuple[int, int | None] | None = None) -> None:
        expected[hf_name] = roundtrip(x, qtype)
        stored = hf_permute(x, *permute_heads) if permute_heads else x
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(gguf_name, stored.astype(np.float16 if qtype == Q.F16 else np.float32))
        else:
            w.add_tensor(gguf_name, quantize(stored, qtype), raw_dtype=qtype)

    put("token_embd.weight", "model.embed_tokens.weight", rand(VOCAB, HIDDEN), Q.Q8_0)
    for i in range(LAYERS):
        hf = f"model.layers.{i}."
        llama = arch == "llama"
        shapes = {"attn_q": (heads * head_dim, HIDDEN), "attn_k": (kv_heads * head_dim, HIDDEN),
                  "attn_v": (kv_heads * head_dim, HIDDEN), "attn_output": (HIDDEN, heads * head_dim),
                  "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
        hf_names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
        perms = {"attn_q": (heads, heads), "attn_k": (heads, kv_heads)} if llama else {}
        put(f"blk.{i}.attn_norm.weight", hf + "input_layernorm.weight", rand(HIDDEN))
        put(f"blk.{i}.ffn_norm.weight", hf + "post_attention_layernorm.weight", rand(HIDDEN))
        for g, shape in shapes.items():
            put(f"blk.{i}.{g}.weight", f"{hf}{hf_names[g]}.weight", rand(*shape), GGUF_TYPES[g], perms.get(g))
        if bias:
            for g in ("attn_q", "attn_k", "attn_v"):
                put(f"blk.{i}.{g}.bias", f"{hf}{hf_names[g]}.bias", rand(shapes[g][0]), Q.F32, perms.get(g))
    put("output_norm.weight", "model.norm.weight", rand(HIDDEN))
    if not tied:
        put("output.weight", "lm_head.weight", rand(VOCAB, HIDDEN), Q.Q8_0)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, np.ndarray]) -> None:
    assert set(got) == set(expected)
    for name, x in expected.items():
        assert tuple(got[name].shape) == x.shape, name
        torch.testing.assert_close(got[name], torch.from_numpy(x), rtol=0, atol=0, msg=name)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    x = np.arange(8 * 6 * 3, dtype=np.float32).reshape(8 * 6, 3)  # head_dim 6: not self-inverse
    for n_head, n_kv in ((8, 8), (8, 2)):  # q: permuted with n_head; k: with n_kv
        rows = n_kv * 6
        permuted = torch.from_numpy(hf_permute(x[:rows], n_head, n_kv))
        assert not torch.equal(permuted, torch.from_numpy(x[:rows]))
        assert torch.equal(unpermute_qk(permuted, n_kv), torch.from_numpy(x[:rows]))


@pytest.mark.parametrize("tied", [True, False])
def test_llama_gguf(tmp_path: Path, tied: bool) -> None:
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, "llama", heads=4, kv_heads=2, head_dim=16, tied=tied, bias=False)
    cfg, weights = load_model_weights(path, torch.float32)
    assert_same(weights, expected)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 2, 64, 128)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 16, VOCAB)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (50000.0, 1e-6, 256)
    assert cfg.eos_token_ids == [2]
    assert cfg.tie_word_embeddings is tied and ("lm_head.weight" in weights) is not tied
    assert cfg.attention_bias is False


def test_qwen2_gguf_has_biases_and_no_permutation(tmp_path: Path) -> None:
    path = tmp_path / "tiny-qwen2.gguf"
    # head_dim 32 != hidden / heads: it must come from attention.key_length.
    expected = write_tiny_gguf(path, "qwen2", heads=4, kv_heads=2, head_dim=32, tied=False, bias=True)
    cfg, weights = load_model_weights(path, torch.float32)
    assert_same(weights, expected)
    assert cfg.architecture == "qwen2" and cfg.attention_bias and not cfg.tie_word_embeddings
    assert cfg.head_dim == 32
    assert weights["model.layers.1.self_attn.k_proj.bias"].shape == (64,)


def test_dtype_conversion(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, "llama", heads=4, kv_heads=4, head_dim=16, tied=True, bias=False)
    _, weights = load_model_weights(path, torch.bfloat16)
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(weights[name], torch.from_numpy(expected[name]).to(torch.bfloat16))


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(path, "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ValueError, match="mamba"):
        load_model_weights(path, torch.float32)


@pytest.mark.parametrize("tied", [True, False])
def test_hf_directory(tmp_path: Path, tied: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=50000.0, tie_word_embeddings=tied)
    model = LlamaForCausalLM(hf_cfg).eval()
    model.save_pretrained(tmp_path)
    cfg, weights = load_model_weights(tmp_path, torch.float32)
    ref = model.state_dict()
    if tied:
        ref.pop("lm_head.weight")
    assert set(weights) == set(ref)
    for name, t in ref.items():
        assert torch.equal(weights[name], t), name
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta) == (LAYERS, 2, 16, 50000.0)
    assert cfg.tie_word_embeddings is tied


@pytest.mark.slow
def test_smollm2_matches_transformers() -> None:
    """Our dequantized, un-permuted state dict == transformers' own GGUF loader, tensor by tensor."""
    from transformers import AutoModelForCausalLM

    from tokenmill.hub import fetch
    from tokenmill.model.loader import load_tokenizer

    path = fetch("smollm2-135m-instruct")
    cfg, weights = load_model_weights(path, torch.float32)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.tie_word_embeddings) == (30, 9, 3, True)
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).state_dict()
    assert set(weights) | {"lm_head.weight"} == set(ref)
    for name, t in ref.items():
        ours = weights.get(name, weights["model.embed_tokens.weight"])  # HF ties lm_head to embed
        assert ours.shape == t.shape, name
        assert (ours - t).abs().max().item() < 1e-6, name
    tok = load_tokenizer(path)
    assert "<|im_start|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
