"""Which slice of every layer a rank owns, and slicing a loaded model down to it.

- Attention is split by whole KV groups, so each rank runs ordinary GQA on its own heads: with
  at least as many KV heads as ranks, rank r gets a contiguous run of KV heads and all the query
  heads that read them (uneven when the ranks do not divide the KV heads: SmolLM2's 3 KV heads on
  2 ranks give 1 and 2, with 3 and 6 query heads, no KV head stored twice); with fewer KV heads
  than ranks, each KV head is replicated on world/num_kv ranks, which split its query heads.
- qkv and gate_up are column-parallel (output rows sliced), o_proj and down_proj row-parallel
  (input columns sliced; rank 0 keeps the bias) followed by one all-reduce each.
- The embedding and lm_head are vocab-parallel: each rank looks up / scores its vocabulary rows,
  the embedding all-reduces (one rank owns each token), the logits are gathered.
Slicing happens on the float weights, before load-time quantization, so every quantizer sees an
ordinary (smaller) Linear.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ModelConfig, UnsupportedConfig
from tokenmill.model.layers import Linear
from tokenmill.parallel.group import TensorParallel


@dataclass(frozen=True, slots=True)
class HeadShard:
    q_lo: int
    q_hi: int
    kv_lo: int
    kv_hi: int

    @property
    def num_heads(self) -> int:
        return self.q_hi - self.q_lo

    @property
    def num_kv_heads(self) -> int:
        return self.kv_hi - self.kv_lo


def even_ranges(n: int, world: int) -> list[tuple[int, int]]:
    """[0, n) in `world` contiguous runs whose sizes differ by at most one."""
    return [(r * n // world, (r + 1) * n // world) for r in range(world)]


def head_shards(num_heads: int, num_kv_heads: int, world: int) -> list[HeadShard]:
    group = num_heads // num_kv_heads
    if num_kv_heads >= world:
        return [HeadShard(lo * group, hi * group, lo, hi) for lo, hi in even_ranges(num_kv_heads, world)]
    share = world // num_kv_heads            # ranks per KV head
    if world % num_kv_heads or group % share:
        raise UnsupportedConfig(f"tensor_parallel_size={world} cannot split {num_heads} query heads over "
                                f"{num_kv_heads} KV heads: with fewer KV heads than ranks, the ranks must be a "
                                f"multiple of the KV heads and split each KV head's {group} query heads evenly")
    per = group // share
    return [HeadShard((r // share) * group + (r % share) * per, (r // share) * group + (r % share + 1) * per,
                      r // share, r // share + 1) for r in range(world)]


@dataclass(frozen=True, slots=True)
class ShardPlan:
    heads: HeadShard
    mlp: tuple[int, int]           # intermediate columns [lo, hi)
    vocab: tuple[int, int]         # vocabulary rows [lo, hi)
    vocab_sizes: list[int]         # every rank's vocabulary rows, in rank order
    max_kv_heads: int              # the most KV heads a rank holds: every rank sizes its KV blocks by it

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The rank's own shapes (KV cache allocation)."""
        return dataclasses.replace(cfg, num_heads=self.heads.num_heads, num_kv_heads=self.heads.num_kv_heads,
                                   intermediate_size=self.mlp[1] - self.mlp[0])


def plan_shards(cfg: ModelConfig, tp: TensorParallel) -> ShardPlan:
    world = tp.world_size
    if cfg.intermediate_size < world or cfg.vocab_size < world:
        raise UnsupportedConfig(f"tensor_parallel_size={world} exceeds the model's MLP or vocabulary size")
    heads = head_shards(cfg.num_heads, cfg.num_kv_heads, world)
    vocab = even_ranges(cfg.vocab_size, world)
    return ShardPlan(heads[tp.rank], even_ranges(cfg.intermediate_size, world)[tp.rank], vocab[tp.rank],
                     [hi - lo for lo, hi in vocab], max(h.num_kv_heads for h in heads))


def _linear_from(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    out = Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    out.weight.data.copy_(weight)
    if bias is not None:
        out.bias.data.copy_(bias)
    return out.requires_grad_(False)


def _rows(linear: nn.Linear, runs: list[tuple[int, int]]) -> Linear:
    """Column-parallel: the output rows of `runs`, concatenated."""
    cat = lambda t: torch.cat([t[lo:hi] for lo, hi in runs])     # noqa: E731
    return _linear_from(cat(linear.weight), None if linear.bias is None else cat(linear.bias))


def _columns(linear: nn.Linear, lo: int, hi: int, keep_bias: bool) -> Linear:
    """Row-parallel: input columns [lo, hi); the bias is added once, by the rank that keeps it."""
    return _linear_from(linear.weight[:, lo:hi], linear.bias if keep_bias else None)


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, lo + n) of the embedding; tokens outside contribute zeros, and the all-reduce
    adds the one rank that owns each token (exact in any dtype)."""

    def __init__(self, weight: torch.Tensor, lo: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.lo, self.tp = lo, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        inside = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.tp.all_reduce(rows * inside.unsqueeze(-1).to(rows.dtype))


@torch.no_grad()
def shard_model(model: nn.Module, cfg: ModelConfig, tp: TensorParallel) -> ShardPlan:
    """Slice a fully loaded float model down to rank `tp.rank`'s part, in place."""
    plan = plan_shards(cfg, tp)
    h, d = plan.heads, cfg.head_dim
    q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
    lo, hi = plan.mlp
    inter = cfg.intermediate_size
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _rows(attn.qkv_proj, [(h.q_lo * d, h.q_hi * d),
                                              (q_size + h.kv_lo * d, q_size + h.kv_hi * d),
                                              (q_size + kv_size + h.kv_lo * d, q_size + kv_size + h.kv_hi * d)])
        attn.o_proj = _columns(attn.o_proj, h.q_lo * d, h.q_hi * d, tp.is_driver)
        attn.num_heads, attn.num_kv_heads = h.num_heads, h.num_kv_heads
        attn.q_size, attn.kv_size = h.num_heads * d, h.num_kv_heads * d
        attn.output_reduce = tp.all_reduce
        mlp.gate_up_proj = _rows(mlp.gate_up_proj, [(lo, hi), (inter + lo, inter + hi)])
        mlp.down_proj = _columns(mlp.down_proj, lo, hi, tp.is_driver)
        mlp.output_reduce = tp.all_reduce
    v_lo, v_hi = plan.vocab
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight[v_lo:v_hi], v_lo, tp)
    if cfg.tie_word_embeddings:
        model.lm_head = Linear(cfg.hidden_size, v_hi - v_lo, bias=False, device=model.embed_tokens.weight.device,
                               dtype=model.embed_tokens.weight.dtype)
        model.lm_head.weight = model.embed_tokens.weight
    else:
        model.lm_head = _rows(model.lm_head, [(v_lo, v_hi)])
    model.logits_gather = functools.partial(tp.gather_columns, sizes=plan.vocab_sizes)
    return plan
