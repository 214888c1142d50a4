"""Llama-family decoder (Llama / SmolLM2 / Qwen2) over a flat, unpadded token batch.

q/k/v and gate/up are fused into one matmul each: fewer, larger GEMMs are what the CPU (AMX)
and GPU both like. `load_hf_state_dict` maps HF tensor names onto the fused layout.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.model.attention import AttentionMetadata, paged_attention
from tokenmill.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, rope, kv_cache, meta):
        """x is the fp32 residual stream: SmolLM2's activations reach ~25,000, where bf16 keeps
        only 2-3 significant digits, so a bf16 residual flips near-tied greedy choices."""
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, kv_cache, meta).float()
        return x + self.mlp(self.post_attention_layernorm(x)).float()


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Returns the final hidden states [T, hidden] in the model dtype; call `compute_logits`
        on the rows that sample."""
        x = self.embed_tokens(input_ids).float()
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, positions, self.rope, kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Every parameter must be covered."""
        fused = {
            "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
        }
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, tensor: torch.Tensor) -> None:
            if name not in params:
                raise KeyError(f"checkpoint tensor {name} has no place in the model")
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(params[name].shape)}")
            params[name].copy_(tensor)
            loaded.add(name)

        for i in range(self.cfg.num_layers):
            pre = f"model.layers.{i}."
            for dst, srcs in fused.items():
                for kind in ("weight", "bias"):
                    parts = [weights.get(f"{pre}{s}.{kind}") for s in srcs]
                    if all(p is not None for p in parts):
                        put(f"layers.{i}.{dst}.{kind}", torch.cat(parts, dim=0))
            for name in ("input_layernorm.weight", "post_attention_layernorm.weight",
                         "self_attn.o_proj.weight", "mlp.down_proj.weight"):
                put(f"layers.{i}.{name}", weights[pre + name])
        put("embed_tokens.weight", weights["model.embed_tokens.weight"])
        put("norm.weight", weights["model.norm.weight"])
        if not self.cfg.tie_word_embeddings:
            put("lm_head.weight", weights["lm_head.weight"])
        missing = set(params) - loaded - ({"lm_head.weight"} if self.cfg.tie_word_embeddings else set())
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {sorted(missing)[:5]}")
