"""Llama-family decoder (Llama / SmolLM2 / Qwen2) over a flat, unpadded token batch.

q/k/v and gate/up are fused into one matmul each: fewer, larger GEMMs are what the CPU (AMX)
and GPU both like. `load_hf_state_dict` maps HF tensor names onto the fused layout.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.model.attention import AttentionMetadata, paged_attention
from tokenmill.model.layers import Linear, RMSNorm, silu_and_mul
from tokenmill.model.rope import RotaryEmbedding
from tokenmill.quant.kv_cache import KVCache


def unchanged(t: torch.Tensor) -> torch.Tensor:
    return t


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, qk_norm: bool = False) -> None:
        """qk_norm: RMSNorm over each head's q and k before rope (Gemma 3, Qwen 3)."""
        super().__init__()
        # sums the ranks' partial o_proj outputs under tensor parallelism (parallel/shard.py)
        self.output_reduce: Callable[[torch.Tensor], torch.Tensor] = unchanged
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:     # per head: rows of head_dim
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        o = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.output_reduce(self.o_proj(o.reshape(t, self.q_size)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, act_and_mul: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act_and_mul = act_and_mul
        self.output_reduce: Callable[[torch.Tensor], torch.Tensor] = unchanged   # as Attention's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_reduce(self.down_proj(self.act_and_mul(self.gate_up_proj(x))))


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
        h = self.self_attn(self.input_layernorm(x), positions, rope, kv_cache, meta)
        x, h = self.post_attention_layernorm.add_forward(x, h)
        return x + self.mlp(h)          # type promotion keeps the sum fp32


class LlamaForCausalLM(nn.Module):
    """The decoder stack; subclasses (gemma3.py) change the layer, the embedding and the ropes."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.reset_rope(max_positions)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # all layers of a pure-decode step in one C++ call (model/decode_stack.py); set by the
        # runner once the weights are final, None = the eager layers below
        self.decode_stack = None
        # joins the ranks' vocabulary slices of the logits under tensor parallelism
        self.logits_gather: Callable[[torch.Tensor], torch.Tensor] = unchanged

    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        return DecoderLayer(cfg)

    def reset_rope(self, max_positions: int, device: torch.device | None = None) -> None:
        """(Re)build the cos/sin tables (they are buffers, lost when built on the meta device);
        `layer_ropes[i]` is layer i's."""
        self.rope = RotaryEmbedding.for_model(self.cfg, max_positions).to(device)
        self.layer_ropes = [self.rope] * self.cfg.num_layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids).float()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], metas: list[AttentionMetadata]) -> torch.Tensor:
        """Returns the final hidden states [T, hidden] in the model dtype; call `compute_logits`
        on the rows that sample. `metas[i]` is layer i's attention metadata (layers of one KV
        group share the object)."""
        x = self.embed(input_ids)
        if self.decode_stack is not None and self.decode_stack.applies(x, kv_caches, metas):
            return self.norm(self.decode_stack(x, positions, kv_caches, metas[0]))
        for layer, rope, kv, meta in zip(self.layers, self.layer_ropes, kv_caches, metas):
            x = layer(x, positions, rope, kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_gather(self.lm_head(hidden)).float()

    @torch.no_grad()
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors into every parameter, fusing q/k/v and gate/up. Linears that
        were already replaced by quantized modules have no parameters left to fill (their
        tensors are theirs to read). Any other tensor the model has no place for is an error:
        silently dropping, say, a q_norm or a bias would give fluent wrong text."""
        missing, used = [], set()
        for name, param in self.named_parameters():
            sources = hf_param_sources(name)
            if any(s not in weights for s in sources):
                missing.append(name)
                continue
            tensor = torch.cat([weights[s] for s in sources], dim=0) if len(sources) > 1 else weights[sources[0]]
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
            param.copy_(tensor)
            used.update(sources)
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {missing[:5]}")
        if self.cfg.tie_word_embeddings:
            used.add("lm_head.weight")         # HF saves the tied copy; it is embed_tokens
        owners = {hf: module for name, module in self.named_modules()
                  if name and not list(module.children()) for hf in hf_module_sources(name)}
        unexpected = [n for n in weights if n not in used and not n.endswith(IGNORED_TENSOR_SUFFIXES)
                      and not _owned_by_parameterless(owners.get(n.rpartition(".")[0]))]
        if unexpected:
            raise ValueError(f"checkpoint tensors with no place in the {self.cfg.architecture} model "
                             f"(their math would be dropped): {sorted(unexpected)[:5]}")


# Stored by some older checkpoints and recomputed from the config.
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


def _owned_by_parameterless(module: nn.Module | None) -> bool:
    """A quantized module (no nn.Parameters) loads its own tensors."""
    return module is not None and next(module.parameters(recurse=False), None) is None


# Our fused projections and the HF projections they stack, in row order.
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def hf_module_sources(module: str) -> list[str]:
    """`layers.3.self_attn.qkv_proj` -> the HF module names whose rows it stacks."""
    if module.startswith("layers."):
        _, idx, rest = module.split(".", 2)
        return [f"model.layers.{idx}.{part}" for part in FUSED_PROJECTIONS.get(rest, (rest,))]
    return [module if module == "lm_head" else f"model.{module}"]


def hf_param_sources(param: str) -> list[str]:
    module, _, kind = param.rpartition(".")
    return [f"{m}.{kind}" for m in hf_module_sources(module)]


def hf_row_sizes(cfg: ModelConfig, module: str) -> list[int]:
    """Rows of each HF projection that `module` stacks, in `hf_module_sources` order."""
    rest = module.split(".", 2)[2] if module.startswith("layers.") else module
    if rest == "self_attn.qkv_proj":
        kv = cfg.num_kv_heads * cfg.head_dim
        return [cfg.num_heads * cfg.head_dim, kv, kv]
    if rest == "mlp.gate_up_proj":
        return [cfg.intermediate_size, cfg.intermediate_size]
    if rest == "lm_head":
        return [cfg.vocab_size]
    if rest == "self_attn.o_proj" or rest == "mlp.down_proj":
        return [cfg.hidden_size]
    raise ValueError(f"no HF projection layout for {module!r}")
