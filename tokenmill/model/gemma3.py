"""Gemma 3 text decoder: the Llama stack (llama.py) with Gemma's differences.

- embeddings scaled by sqrt(hidden) (in fp32: the residual stream is fp32 throughout);
- RMSNorm multiplies by (1 + w): the weights are loaded as 1 + w, so the shared RMSNorm and its
  fused kernel apply unchanged;
- q and k RMS-normed per head before rope; attention scale query_pre_attn_scalar ** -0.5;
- four norms per block (before and after attention, before and after the MLP), GELU-tanh GeGLU;
- sliding-window ("local") layers use their own rope base (10,000), full ("global") layers the
  checkpoint's (1,000,000) and its rope scaling; which layer is which comes from
  ModelConfig.layer_types and the window itself from the attention metadata of its KV group.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.layers import RMSNorm, gelu_tanh_and_mul
from tokenmill.model.llama import MLP, Attention, LlamaForCausalLM
from tokenmill.model.rope import RotaryEmbedding
from tokenmill.quant.kv_cache import KVCache


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, qk_norm=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, gelu_tanh_and_mul)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), positions, rope, kv_cache, meta)
        x = x + self.post_attention_layernorm(h).float()
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h).float()


class Gemma3ForCausalLM(LlamaForCausalLM):
    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        return Gemma3DecoderLayer(cfg)

    def reset_rope(self, max_positions: int, device: torch.device | None = None) -> None:
        cfg = self.cfg
        self.rope = RotaryEmbedding.for_model(cfg, max_positions).to(device)
        self.rope_local = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_local_theta or cfg.rope_theta,
                                          None, cfg.max_position_embeddings).to(device)
        self.layer_ropes = [self.rope if cfg.layer_window(i) is None else self.rope_local
                            for i in range(cfg.num_layers)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids).float() * torch.tensor(self.cfg.hidden_size ** 0.5)

    @torch.no_grad()
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """HF stores Gemma's norm weights as w (applied as 1 + w); the model holds 1 + w."""
        super().load_hf_state_dict({name: (w.float() + 1).to(w.dtype) if name.endswith("norm.weight") else w
                                    for name, w in weights.items()})
