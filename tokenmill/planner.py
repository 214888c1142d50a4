"""`tokenmill plan`: the memory bill of serving a model — weights, KV cache, activations — and
the concurrency it leaves, computed with the engine's own rules (the KV split of
engine/kv_groups.py, the quantized layouts of quant/), so the plan matches what the engine
allocates (tests/test_planner.py checks block counts and weight bytes against real engines).

KV bytes per token = layers x 2 (K and V) x KV heads x head_dim x bytes, with a window layer
counting only the ~window tokens it keeps, and int8/fp8 KV adding one fp32 scale per token and
KV head. The seed's worked examples, done right, are in README.md ("Capacity planning").
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tokenmill.config import ModelConfig
from tokenmill.engine.kv_groups import blocks_per_sequence, kv_bytes_per_token, plan_kv_groups
from tokenmill.parallel.shard import even_ranges, head_shards
from tokenmill.quant import kv_cache
from tokenmill.quant.config import QuantConfig

GiB = 1 << 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class WeightGroup:
    name: str
    params: int
    bytes: int


@dataclass(slots=True)
class KVGroupPlan:
    window: int | None
    layers: int
    blocks: int


@dataclass
class Plan:
    architecture: str
    weight_dtype: str
    quantization: str | None
    kv_cache_dtype: str
    max_model_len: int
    block_size: int
    tensor_parallel_size: int
    weights: list[WeightGroup]
    weight_bytes: int                       # per rank
    kv_layer_token_bytes: int               # K + V of one token in one layer (scales included), per rank
    kv_bytes_per_token: float               # per token of a max_model_len sequence, windows included, per rank
    activation_bytes: int                   # peak workspace estimate of one step, per rank
    kv_budget_bytes: int                    # per rank
    kv_groups: list[KVGroupPlan]
    concurrency: dict[int, int] = field(default_factory=dict)   # sequence length -> requests that fit
    request_kv_bytes: dict[int, int] = field(default_factory=dict)   # sequence length -> KV of one request

    def as_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def linear_bytes(out_f: int, in_f: int, dtype: torch.dtype, quant: QuantConfig | None) -> int:
    """Bytes of one [out, in] projection as tokenmill stores it (what `weight_bytes()` counts)."""
    if quant is None:
        return out_f * in_f * dtype.itemsize
    if quant.method in ("int8", "smoothquant"):
        return out_f * in_f + out_f * 4 + (in_f * 4 if quant.method == "smoothquant" else 0)
    if quant.method == "nf4":
        blocks = out_f * in_f // quant.block_size
        absmax = blocks + 4 * math.ceil(blocks / 256) + 4 if quant.double_quant else blocks * 4
        return out_f * in_f // 2 + absmax
    groups = 1 if quant.group_size == -1 else math.ceil(in_f / quant.group_size)
    return int(out_f * in_f // 2 + out_f * groups * 2.5)        # 4-bit codes, fp16 scales, 4-bit zeros


@dataclass(frozen=True, slots=True)
class RankShare:
    """The largest share any tensor-parallel rank holds (parallel/shard.py's split): the bill
    is per rank, and the fullest rank is the one that must fit."""
    q_heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, cfg: ModelConfig, tp: int) -> "RankShare":
        heads = head_shards(cfg.num_heads, cfg.num_kv_heads, tp)
        widest = lambda n: max(hi - lo for lo, hi in even_ranges(n, tp))     # noqa: E731
        return cls(max(h.num_heads for h in heads), max(h.num_kv_heads for h in heads),
                   widest(cfg.intermediate_size), widest(cfg.vocab_size))


def weight_groups(cfg: ModelConfig, dtype: torch.dtype, quant: QuantConfig | None, tp: int = 1) -> list[WeightGroup]:
    """Weights by group, per rank under tensor parallelism (the fullest rank: heads split by KV
    groups, MLP columns and vocabulary N ways; norms replicated)."""
    d = dtype.itemsize
    share = RankShare.of(cfg, tp)
    q = o_in = share.q_heads * cfg.head_dim
    qkv_out = q + 2 * share.kv_heads * cfg.head_dim
    inter = share.intermediate
    L = cfg.num_layers
    qkv = L * linear_bytes(qkv_out, cfg.hidden_size, dtype, quant)
    o = L * linear_bytes(cfg.hidden_size, o_in, dtype, quant)
    gate_up = L * linear_bytes(2 * inter, cfg.hidden_size, dtype, quant)
    down = L * linear_bytes(cfg.hidden_size, inter, dtype, quant)
    bias = L * d * ((qkv_out if cfg.attention_bias else 0) + (cfg.hidden_size if cfg.o_proj_bias else 0)
                    + ((2 * inter + cfg.hidden_size) if cfg.mlp_bias else 0))
    norms_per_layer = (4 if cfg.architecture == "gemma3" else 2) * cfg.hidden_size
    qk_norms = 2 * cfg.head_dim if cfg.architecture == "gemma3" else 0
    vocab = share.vocab
    groups = [
        WeightGroup("embed_tokens", vocab * cfg.hidden_size, vocab * cfg.hidden_size * d),
        WeightGroup("attention (qkv, o)", L * (qkv_out * cfg.hidden_size + cfg.hidden_size * o_in), qkv + o),
        WeightGroup("mlp (gate_up, down)", L * 3 * inter * cfg.hidden_size, gate_up + down),
        WeightGroup("norms and biases", L * (norms_per_layer + qk_norms) + cfg.hidden_size + bias // d,
                    (L * (norms_per_layer + qk_norms) + cfg.hidden_size) * d + bias),
    ]
    if not cfg.tie_word_embeddings:
        head_quant = quant if quant is not None and quant.quantize_lm_head else None
        groups.append(WeightGroup("lm_head", vocab * cfg.hidden_size,
                                  linear_bytes(vocab, cfg.hidden_size, dtype, head_quant)))
    return groups


def activation_bytes(cfg: ModelConfig, dtype: torch.dtype, max_batched_tokens: int, max_num_seqs: int,
                     max_model_len: int, tp: int = 1) -> int:
    """Peak workspace of one step (an estimate): the largest layer's live tensors for a chunk of
    `max_batched_tokens` (fp32 residual, qkv, the attention scores of the chunk over the whole
    context, gate_up and its activation) plus fp32 logits of the sampling rows."""
    t, d = max_batched_tokens, dtype.itemsize
    share = RankShare.of(cfg, tp)
    heads = share.q_heads
    residual = 2 * t * cfg.hidden_size * 4
    qkv = t * (heads + 2 * share.kv_heads) * cfg.head_dim * d
    scores = heads * t * max_model_len * 4
    mlp = t * 3 * share.intermediate * d
    logits = max_num_seqs * cfg.vocab_size * 4
    return residual + max(qkv + scores, mlp) + logits


def plan(cfg: ModelConfig, *, dtype: str = "bfloat16", quantization: QuantConfig | None = None,
         kv_cache_dtype: str = "auto", max_model_len: int | None = None, block_size: int = 16,
         memory: int | None = None, kv_cache_memory: int | None = None, reserve: int = 0,
         tensor_parallel_size: int = 1, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
         chunk_tokens: int | None = None, seq_lens: tuple[int, ...] = ()) -> Plan:
    """The bill. KV budget: `kv_cache_memory` if given, else memory - weights - activations -
    reserve (per rank). chunk_tokens: the longest prefill chunk (window groups hold one extra;
    the engine's max_idle_batched_tokens), default max_num_batched_tokens."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if (memory is None) == (kv_cache_memory is None):
        raise ValueError("give exactly one of memory (the device's bytes) and kv_cache_memory (the KV budget)")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    tp = tensor_parallel_size
    wdtype = DTYPES[dtype]
    max_len = cfg.resolve_max_model_len(max_model_len)
    groups = weight_groups(cfg, wdtype, quantization, tp)
    weights = sum(g.bytes for g in groups)
    act = activation_bytes(cfg, wdtype, max_num_batched_tokens, max_num_seqs, max_len, tp)
    budget = kv_cache_memory if kv_cache_memory is not None else memory - weights - act - reserve
    if budget <= 0:
        raise ValueError(f"nothing left for the KV cache: memory {memory / GiB:.2f} GiB - weights "
                         f"{weights / GiB:.2f} GiB - activations {act / GiB:.2f} GiB - reserve {reserve / GiB:.2f} GiB")
    kv_dtype = kv_cache.storage_dtype(kv_cache_dtype, wdtype)
    kv_heads = RankShare.of(cfg, tp).kv_heads      # every rank sizes its blocks by the fullest
    layer_token = 2 * kv_heads * kv_cache.token_head_bytes(cfg.head_dim, kv_dtype)
    chunk = chunk_tokens or max_num_batched_tokens
    kv_groups = plan_kv_groups(cfg, budget, block_size, layer_token * block_size, max_len, chunk)
    per_token = kv_bytes_per_token(kv_groups, layer_token, max_len, block_size)
    concurrency = {n: min(g.num_blocks // blocks_per_sequence(g.window, n, block_size) for g in kv_groups)
                   for n in seq_lens}
    request_kv = {n: sum(len(g.layers) * blocks_per_sequence(g.window, n, block_size) for g in kv_groups)
                  * block_size * layer_token for n in seq_lens}
    return Plan(cfg.architecture, dtype, None if quantization is None else quantization.method,
                str(kv_dtype).removeprefix("torch."), max_len, block_size, tp, groups, weights, layer_token,
                per_token, act, budget, [KVGroupPlan(g.window, len(g.layers), g.num_blocks) for g in kv_groups],
                concurrency, request_kv)


def format_plan(p: Plan, model: str) -> str:
    def gib(n: float) -> str:
        return f"{n / GiB:8.3f} GiB"
    tp = f", per rank of {p.tensor_parallel_size}" if p.tensor_parallel_size > 1 else ""
    lines = [f"model {model} ({p.architecture}), weights {p.weight_dtype}"
             f"{' quantized ' + p.quantization if p.quantization else ''}, KV {p.kv_cache_dtype}, "
             f"max_model_len {p.max_model_len}, block {p.block_size}{tp}", "", "weights:"]
    for g in p.weights:
        lines.append(f"  {g.name:24s} {g.params / 1e6:10.1f} M params {gib(g.bytes)}")
    lines += [f"  {'total':24s} {sum(g.params for g in p.weights) / 1e6:10.1f} M params {gib(p.weight_bytes)}", "",
              f"KV cache: {p.kv_layer_token_bytes:,} bytes per token per layer; {p.kv_bytes_per_token:,.0f} bytes "
              f"per token of a {p.max_model_len}-token sequence (all layers, windows included)",
              f"activations (peak step workspace, estimate): {gib(p.activation_bytes)}",
              f"KV budget: {gib(p.kv_budget_bytes)}"]
    for g in p.kv_groups:
        kind = "full attention" if g.window is None else f"window {g.window}"
        lines.append(f"  {g.layers} layers {kind}: {g.blocks:,} blocks of {p.block_size} tokens")
    for n, c in p.concurrency.items():
        lines.append(f"max concurrent {n}-token requests: {c:,} ({p.request_kv_bytes[n] / GiB:.3f} GiB KV each)")
    return "\n".join(lines)


def model_config_for(model: str) -> ModelConfig:
    """A known model name, a .gguf, an HF directory, or a bare config.json file."""
    from tokenmill.hub import resolve_model
    from tokenmill.model.loader import read_model_config
    path = Path(model)
    if path.is_file() and path.name.endswith(".json"):
        return ModelConfig.from_hf(json.loads(path.read_text()))
    return read_model_config(resolve_model(model))
