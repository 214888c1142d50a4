"""Owns the model and the KV cache; turns a scheduler decision into one flat batch and logits."""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig, ModelConfig, UnsupportedConfig
from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.kv_groups import GroupedBlockManager, blocks_per_sequence, kv_bytes_per_token, plan_kv_groups
from tokenmill.model import causal_lm_class
from tokenmill.model.attention import AttentionMetadata, PrefillSpan
from tokenmill.model.decode_stack import DecodeStack
from tokenmill.engine.sampler import gather_logprobs
from tokenmill.lora.manager import LoRAManager
from tokenmill.model.llama import hf_module_sources, hf_row_sizes
from tokenmill.parallel.group import TensorParallel
from tokenmill.parallel.shard import shard_model
from tokenmill.quant.checkpoint import load_quantized_linears
from tokenmill.quant.apply import quantize_model, weight_bytes
from tokenmill.quant import kv_cache
from tokenmill.quant.config import QuantConfig
from tokenmill.sequence import Sequence

log = logging.getLogger("tokenmill")

DEFAULT_CPU_KV_BYTES = 2 << 30
# prompt-logprob rows go through the lm_head this many at a time: [rows, V] float32 logits of a
# 2048-token chunk at V = 152k would be 1.2 GB; 256 rows keep it at ~150 MB
PROMPT_LOGPROBS_ROWS = 256


def layer_token_bytes(cfg: ModelConfig, kv_dtype: torch.dtype) -> int:
    """K and V of one token in one layer (scales included)."""
    return 2 * cfg.num_kv_heads * kv_cache.token_head_bytes(cfg.head_dim, kv_dtype)


@dataclass(slots=True)
class StepInputs:
    """Everything one forward pass needs besides the weights and the KV cache: what rank 0
    broadcasts to the other tensor-parallel ranks each step."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    group_metas: list[AttentionMetadata]     # one per KV group
    logit_rows: torch.Tensor                 # rows that sample
    prompt_rows: torch.Tensor | None = None  # rows owed prompt logprobs


def to_device(obj, device: torch.device):
    """A copy of a step's inputs (tensors inside dataclasses and lists) on `device`: a step crosses
    to the other ranks through CPU memory, and each rank's tensors live on its own GPU."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, torch.device):
        return device
    if isinstance(obj, list):
        return [to_device(o, device) for o in obj]
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: to_device(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


@dataclass(slots=True)
class _Rows:
    """One scheduled sequence's rows in the flat batch."""
    seq: Sequence
    start: int          # first position
    end: int            # one past the last position
    first_row: int
    decode: bool        # one decode row per position (plain decode, speculative verification)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype, max_model_len: int,
                 checkpoint_quant: QuantConfig | None = None, tp: TensorParallel | None = None) -> None:
        """With `config.quantization` the float weights are quantized once they are loaded.
        With `checkpoint_quant` (a quantized checkpoint's config) `weights` holds quantized
        tensors and the quantized modules are built straight from them. With `tp` the model is
        sliced to this rank's part (parallel/shard.py) before any load-time quantization."""
        self.device, self.dtype = device, dtype
        self.tp = tp
        self.block_size = config.block_size
        self.model_cfg = model_cfg
        with torch.device("meta"):
            model = causal_lm_class(model_cfg.architecture)(model_cfg, max_model_len)
        model = model.to_empty(device=device).to(dtype)
        if model_cfg.tie_word_embeddings:      # to_empty() materializes tied tensors separately
            model.lm_head.weight = model.embed_tokens.weight
        model.reset_rope(max_model_len, device)   # its buffers were built on meta
        quant = None
        if checkpoint_quant is not None:
            if config.quantization and config.quantization != checkpoint_quant.method:
                raise ValueError(f"the checkpoint is quantized with {checkpoint_quant.method}; "
                                 f"cannot apply --quantization {config.quantization} on top")
            load_quantized_linears(model, weights, checkpoint_quant, hf_module_sources,
                                   lambda name: hf_row_sizes(model_cfg, name))
            model = model.to(device)
            quant = checkpoint_quant
        model.load_hf_state_dict(weights)
        kv_cfg = block_cfg = model_cfg      # KV heads this rank stores / that size a block
        if tp is not None:
            shard = shard_model(model, model_cfg, tp)
            kv_cfg = shard.local_config(model_cfg)
            block_cfg = dataclasses.replace(kv_cfg, num_kv_heads=shard.max_kv_heads)  # equal block counts
        self.float_weight_bytes = weight_bytes(model, as_float=dtype)
        if config.quantization and quant is None:
            quant = QuantConfig(config.quantization, quantize_lm_head=config.quantize_lm_head)
            try:
                quantize_model(model, quant)
            except ValueError as exc:
                if tp is None:
                    raise
                raise UnsupportedConfig(f"--quantization {quant.method} with tensor_parallel_size={tp.world_size}: "
                                        f"rank {tp.rank}'s slice of a layer cannot be quantized: {exc}") from exc
        self.quant = quant
        self.weight_bytes = weight_bytes(model)
        if quant is not None:
            log.info("weights quantized with %s: %.1f MB (float %s: %.1f MB)", quant.method,
                     self.weight_bytes / 1e6, str(dtype).removeprefix("torch."), self.float_weight_bytes / 1e6)
        self.model = model.eval()
        if not config.enforce_eager and tp is None:      # the C++ stack has no all-reduce
            model.decode_stack = DecodeStack.build(model)      # of the base weights
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            self.lora = LoRAManager(model, model_cfg, config.max_loras, config.max_lora_rank,
                                    config.max_cpu_loras, dtype, device)
        self.max_model_len = max_model_len
        # the longest chunk a step may compute for one sequence (a window group must hold it)
        self.max_chunk = config.resolve_max_idle_batched_tokens(device, max_model_len)
        self.kv_dtype = kv_cache.storage_dtype(config.kv_cache_dtype, dtype)
        self.layer_block_bytes = layer_token_bytes(block_cfg, self.kv_dtype) * self.block_size
        self.kv_groups = plan_kv_groups(model_cfg, self._kv_budget(config), self.block_size,
                                        self.layer_block_bytes, max_model_len, self.max_chunk)
        if any(g.num_blocks < 2 for g in self.kv_groups):
            raise ValueError(f"KV cache budget too small: {self.describe_kv_cache()}; need >= 2 blocks per group")
        self.num_blocks = self.kv_groups[0].num_blocks
        self.kv_caches: list[kv_cache.KVCache] = [None] * model_cfg.num_layers
        self.layer_group = [0] * model_cfg.num_layers
        for gi, g in enumerate(self.kv_groups):
            shape = (g.num_blocks, self.block_size, kv_cfg.num_kv_heads, kv_cfg.head_dim)
            for layer in g.layers:
                self.kv_caches[layer] = kv_cache.allocate(shape, self.kv_dtype, device)
                self.layer_group[layer] = gi
        self.kv_cache_bytes = sum(len(g.layers) * g.num_blocks for g in self.kv_groups) * self.layer_block_bytes

    @classmethod
    def from_config(cls, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                    tp: TensorParallel | None = None) -> "ModelRunner":
        """Load `config.model`'s checkpoint and build the runner (this rank's part under `tp`)."""
        from tokenmill.hub import resolve_model
        from tokenmill.model.loader import checkpoint_quant_config, gguf_reader, load_model_weights, read_model_config

        path = resolve_model(config.model)
        max_model_len = read_model_config(path).resolve_max_model_len(config.max_model_len)
        checkpoint_quant = checkpoint_quant_config(path)
        if tp is not None and checkpoint_quant is not None:
            raise UnsupportedConfig(f"tensor parallelism over a {checkpoint_quant.method}-quantized checkpoint is "
                                    "not supported: load the float checkpoint with --quantization instead (it is "
                                    "sliced first, then quantized)")
        model_cfg, weights = load_model_weights(path, dtype)
        runner = cls(config, model_cfg, weights, device, dtype, max_model_len, checkpoint_quant, tp)
        del weights
        gguf_reader.cache_clear()        # start-up only: its parsed metadata is large
        return runner

    def _kv_budget(self, config: EngineConfig) -> int:
        budget = config.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                used = total - free
                budget = int(total * config.gpu_memory_utilization) - used - (1 << 30)  # activations
            else:
                budget = DEFAULT_CPU_KV_BYTES
        return budget

    def make_block_manager(self, enable_prefix_caching: bool) -> BlockManager | GroupedBlockManager:
        """The block manager over this runner's KV groups."""
        if len(self.kv_groups) == 1 and self.kv_groups[0].window is None:
            return BlockManager(self.num_blocks, self.block_size, enable_prefix_caching)
        if enable_prefix_caching:
            log.info("prefix caching is off: the model has sliding-window layers (engine/kv_groups.py)")
        return GroupedBlockManager(self.kv_groups, self.block_size)

    def check_holds_max_model_len(self) -> None:
        """Every group can hold one max_model_len sequence and its largest chunk (else it could
        never finish)."""
        for g in self.kv_groups:
            need = blocks_per_sequence(g.window, self.max_model_len, self.block_size, self.max_chunk)
            if g.num_blocks < need:
                raise ValueError(f"the KV cache budget gives {g.num_blocks} blocks to the layers with window "
                                 f"{g.window}, fewer than one max_model_len={self.max_model_len} sequence needs "
                                 f"({need}); raise kv_cache_memory or lower max_model_len")

    def describe_kv_cache(self) -> str:
        """KV dtype, bytes per token (windows included), blocks per group and the max
        concurrency at max_model_len, for the start-up log."""
        parts = [f"{len(g.layers)} layers {'full' if g.window is None else f'window {g.window}'}: "
                 f"{g.num_blocks} blocks" for g in self.kv_groups]
        seqs = min(g.num_blocks / blocks_per_sequence(g.window, self.max_model_len, self.block_size)
                   for g in self.kv_groups)
        per_token = kv_bytes_per_token(self.kv_groups, self.layer_block_bytes // self.block_size,
                                       self.max_model_len, self.block_size)
        return (f"{str(self.kv_dtype).removeprefix('torch.')} K/V, {per_token:,.0f} bytes/token at "
                f"max_model_len={self.max_model_len}; {'; '.join(parts)} "
                f"(max {seqs:.1f} concurrent requests at max_model_len)")

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Run one forward pass over all scheduled tokens. Returns logits for the sequences whose
        scheduled tokens reach their end (they sample), in scheduled order: one row each, or
        1 + k rows for a sequence verifying k speculative drafts.
        Sequences owed prompt logprobs also get those of the prompt rows this step ran, appended
        to `seq.prompt_logprobs` (only those rows, and the sampling rows, reach the lm_head)."""
        # decode rows go first so they share one batched attention call. A sequence verifying
        # speculative drafts is decode rows too: its K/V rows are written before attention reads,
        # so query i attending to the first start + i + 1 positions is exactly its causal view.
        # Within decode and prefill rows, the rows of one LoRA adapter are contiguous
        def as_decode(seq: Sequence, n: int) -> bool:
            k = len(seq.spec_token_ids)
            return n == 1 or (k > 0 and seq.num_computed_tokens + n - k == seq.num_tokens)
        def row_order(item: tuple[Sequence, int]) -> tuple[bool, int]:
            return not as_decode(*item), 0 if item[0].lora is None else id(item[0].lora)
        order = sorted(scheduled, key=row_order)
        input_ids: list[int] = []
        positions: list[int] = []
        rows: list[_Rows] = []
        sample_rows: dict[int, range] = {}
        prompt_spans: list[tuple[Sequence, int, int, int]] = []   # (seq, first row, its position, rows)
        for seq, n in order:
            start = seq.num_computed_tokens
            end = start + n
            base = len(input_ids)
            if end <= seq.num_tokens:
                input_ids.extend(seq.token_ids[start:end])
            else:                                   # the last token(s), then the drafts to verify
                input_ids.extend(seq.token_ids[start:])
                input_ids.extend(seq.spec_token_ids[:end - seq.num_tokens])
            positions.extend(range(start, end))
            rows.append(_Rows(seq, start, end, base, as_decode(seq, n)))
            row = len(input_ids) - 1
            if end >= seq.num_tokens:               # one row per draft too: it verifies them
                sample_rows[seq.seq_id] = range(row - (end - seq.num_tokens), row + 1)
            if seq.needs_prompt_logprobs:
                # the row at position p predicts prompt token p + 1; positions whose entry exists
                # (recomputed after a preemption) are skipped; the last prompt row samples instead
                first = max(start, len(seq.prompt_logprobs) - 1)
                stop = min(end, seq.num_prompt_tokens - 1)
                assert first == len(seq.prompt_logprobs) - 1, "prompt logprobs need every prompt row"
                if first < stop:
                    prompt_spans.append((seq, base + first - start, first, stop - first))
        dev = self.device
        if self.lora is not None:
            self.lora.prepare([(r.seq.lora, r.first_row, r.first_row + r.end - r.start) for r in rows])
        logit_rows = [r for seq, _ in scheduled if seq.seq_id in sample_rows for r in sample_rows[seq.seq_id]]
        step = StepInputs(torch.tensor(input_ids, device=dev), torch.tensor(positions, device=dev),
                          [self._group_metadata(rows, gi, g.window) for gi, g in enumerate(self.kv_groups)],
                          torch.tensor(logit_rows, device=dev, dtype=torch.long))
        on_prompt_logits = None
        if prompt_spans:
            step.prompt_rows = torch.tensor([r for _, row, _, count in prompt_spans for r in range(row, row + count)],
                                            device=dev, dtype=torch.long)
            on_prompt_logits = self._prompt_logprobs(prompt_spans)
        if self.tp is not None:
            self.tp.broadcast(step if dev.type == "cpu" else to_device(step, torch.device("cpu")))
        return self.forward_step(step, on_prompt_logits)

    def forward_step(self, step: StepInputs, on_prompt_logits=None) -> torch.Tensor:
        """The step's forward pass on this rank; the logits of its sampling rows. Prompt rows go
        through the lm_head PROMPT_LOGPROBS_ROWS at a time, each chunk handed to
        `on_prompt_logits(first, logits)` ([T, V] logits of a long chunk never exist at once)."""
        metas = [step.group_metas[gi] for gi in self.layer_group]
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, metas)
        if step.prompt_rows is not None:
            for i in range(0, len(step.prompt_rows), PROMPT_LOGPROBS_ROWS):
                logits = self.model.compute_logits(hidden[step.prompt_rows[i:i + PROMPT_LOGPROBS_ROWS]])
                if on_prompt_logits is not None:
                    on_prompt_logits(i, logits)
        return self.model.compute_logits(hidden[step.logit_rows])

    def _group_metadata(self, rows: list[_Rows], group: int, window: int | None) -> AttentionMetadata:
        """Slots, decode block tables and prefill spans of one KV group (its own block tables;
        entries a window released are -1, read as block 0 and never attended to)."""
        bs, dev = self.block_size, self.device
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        for r in rows:
            table = r.seq.block_tables[group]
            slots.extend(table[p // bs] * bs + p % bs for p in range(r.start, r.end))
            if r.decode:
                for p in range(r.start + 1, r.end + 1):
                    decode_tables.append(table[: math.ceil(p / bs)])
                    decode_lens.append(p)
                continue
            first, last = r.first_row, r.first_row + r.end - r.start
            if r.start == 0:
                prefills.append(PrefillSpan(first, last, r.end, None, window, device=dev))
                continue
            key_block = 0 if window is None else max(0, r.start - window + 1) // bs
            bt = torch.tensor(table[key_block: math.ceil(r.end / bs)], device=dev)
            prefills.append(PrefillSpan(first, last, r.end, bt, window, key_start=key_block * bs))
        nd = len(decode_tables)
        decode_bt = decode_lens_t = None
        if nd:
            width = max(len(t) for t in decode_tables)
            decode_bt = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.int32, device=dev)
            if window is not None:
                decode_bt.clamp_(min=0)
            decode_lens_t = torch.tensor(decode_lens, dtype=torch.int32, device=dev)
        return AttentionMetadata(slot_mapping=torch.tensor(slots, device=dev), num_decode_tokens=nd,
                                 decode_block_tables=decode_bt, decode_context_lens=decode_lens_t,
                                 prefills=prefills, window=window)

    def _prompt_logprobs(self, spans: list[tuple[Sequence, int, int, int]]):
        """A consumer of prompt-row logits chunks that reduces each row to (logprob of the next
        prompt token, rank, top-n) and appends it to its sequence. Raw fp32 logits, as vLLM."""
        # the next token may lie past this chunk, so read it from the sequence
        targets = [t for seq, _, pos, count in spans for t in seq.token_ids[pos + 1:pos + 1 + count]]
        owner = [seq for seq, _, _, count in spans for _ in range(count)]
        num_top = [seq.params.prompt_logprobs or 0 for seq in owner]
        vocab = self.model_cfg.vocab_size

        def consume(first: int, logits: torch.Tensor) -> None:
            sl = slice(first, first + len(logits))
            ids = torch.tensor(targets[sl], device=logits.device, dtype=torch.long)
            for seq, lp in zip(owner[sl], gather_logprobs(logits[:, :vocab], ids, num_top[sl])):
                seq.prompt_logprobs.append(lp)
        return consume
