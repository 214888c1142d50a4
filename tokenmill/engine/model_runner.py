"""Owns the model and the KV cache; turns a scheduler decision into one flat batch and logits."""
from __future__ import annotations

import logging
import math

import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.model.attention import AttentionMetadata, PrefillSpan
from tokenmill.model.decode_stack import DecodeStack
from tokenmill.engine.sampler import gather_logprobs
from tokenmill.model.llama import LlamaForCausalLM, hf_module_sources, hf_row_sizes
from tokenmill.quant.checkpoint import load_quantized_linears
from tokenmill.quant.apply import quantize_model, weight_bytes
from tokenmill.quant.config import QuantConfig
from tokenmill.sequence import Sequence

log = logging.getLogger("tokenmill")

DEFAULT_CPU_KV_BYTES = 2 << 30
# prompt-logprob rows go through the lm_head this many at a time: [rows, V] float32 logits of a
# 2048-token chunk at V = 152k would be 1.2 GB; 256 rows keep it at ~150 MB
PROMPT_LOGPROBS_ROWS = 256


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.tensor([], dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype, max_model_len: int,
                 checkpoint_quant: QuantConfig | None = None) -> None:
        """With `config.quantization` the float weights are quantized once they are loaded.
        With `checkpoint_quant` (a quantized checkpoint's config) `weights` holds quantized
        tensors and the quantized modules are built straight from them."""
        self.device, self.dtype = device, dtype
        self.block_size = config.block_size
        self.model_cfg = model_cfg
        with torch.device("meta"):
            model = LlamaForCausalLM(model_cfg, max_model_len)
        model = model.to_empty(device=device).to(dtype)
        if model_cfg.tie_word_embeddings:      # to_empty() materializes tied tensors separately
            model.lm_head.weight = model.embed_tokens.weight
        model.rope = type(model.rope).for_model(model_cfg, max_model_len).to(device)   # buffers on meta
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
        self.float_weight_bytes = weight_bytes(model, as_float=dtype)
        if config.quantization and quant is None:
            quant = QuantConfig(config.quantization, quantize_lm_head=config.quantize_lm_head)
            quantize_model(model, quant)
        self.quant = quant
        self.weight_bytes = weight_bytes(model)
        if quant is not None:
            log.info("weights quantized with %s: %.1f MB (float %s: %.1f MB)", quant.method,
                     self.weight_bytes / 1e6, str(dtype).removeprefix("torch."), self.float_weight_bytes / 1e6)
        self.model = model.eval()
        if not config.enforce_eager:
            model.decode_stack = DecodeStack.build(model)
        self.num_blocks = self._num_kv_blocks(config)
        shape = (self.num_blocks, self.block_size, model_cfg.num_kv_heads, model_cfg.head_dim)
        self.kv_cache_bytes = 2 * model_cfg.num_layers * math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device)) for _ in range(model_cfg.num_layers)]

    def _num_kv_blocks(self, config: EngineConfig) -> int:
        per_block = kv_bytes_per_token(self.model_cfg, self.dtype) * self.block_size
        budget = config.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                used = total - free
                budget = int(total * config.gpu_memory_utilization) - used - (1 << 30)  # activations
            else:
                budget = DEFAULT_CPU_KV_BYTES
        num_blocks = budget // per_block
        if num_blocks < 2:
            raise ValueError(f"KV cache budget of {budget} bytes holds {num_blocks} blocks; need >= 2")
        return int(num_blocks)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Run one forward pass over all scheduled tokens. Returns logits for the sequences whose
        scheduled tokens reach their end (they sample), in scheduled order: one row each, or
        1 + k rows for a sequence verifying k speculative drafts.
        Sequences owed prompt logprobs also get those of the prompt rows this step ran, appended
        to `seq.prompt_logprobs` (only those rows, and the sampling rows, reach the lm_head)."""
        bs = self.block_size
        # decode rows go first so they share one batched attention call. A sequence verifying
        # speculative drafts is decode rows too: its K/V rows are written before attention reads,
        # so query i attending to the first start + i + 1 positions is exactly its causal view
        def as_decode(seq: Sequence, n: int) -> bool:
            k = len(seq.spec_token_ids)
            return n == 1 or (k > 0 and seq.num_computed_tokens + n - k == seq.num_tokens)
        order = sorted(scheduled, key=lambda item: not as_decode(*item))
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
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
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            row = len(input_ids) - 1
            if as_decode(seq, n):
                for p in range(start + 1, end + 1):
                    decode_tables.append(table[: math.ceil(p / bs)])
                    decode_lens.append(p)
            else:
                bt = None if start == 0 else torch.tensor(table[: math.ceil(end / bs)], device=self.device)
                prefills.append(PrefillSpan(row - n + 1, row + 1, end, bt))
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
        nd = len(decode_tables)
        decode_bt = decode_lens_t = None
        if nd:
            width = max(len(t) for t in decode_tables)
            decode_bt = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.int32, device=dev)
            decode_lens_t = torch.tensor(decode_lens, dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev),
            num_decode_tokens=nd,
            decode_block_tables=decode_bt,
            decode_context_lens=decode_lens_t,
            prefills=prefills,
        )
        hidden = self.model(torch.tensor(input_ids, device=dev), torch.tensor(positions, device=dev),
                            self.kv_caches, meta)
        if prompt_spans:
            self._prompt_logprobs(hidden, prompt_spans)
        rows = [r for seq, _ in scheduled if seq.seq_id in sample_rows for r in sample_rows[seq.seq_id]]
        return self.model.compute_logits(hidden[torch.tensor(rows, device=dev, dtype=torch.long)])

    def _prompt_logprobs(self, hidden: torch.Tensor, spans: list[tuple[Sequence, int, int, int]]) -> None:
        """Reduce each prompt row to (logprob of the next prompt token, rank, top-n) right after
        its lm_head slice, so [T, V] logits never exist at once. Raw fp32 logits, as vLLM."""
        rows = [r for _, row, _, count in spans for r in range(row, row + count)]
        # the next token may lie past this chunk, so read it from the sequence
        targets = [t for seq, _, pos, count in spans for t in seq.token_ids[pos + 1:pos + 1 + count]]
        owner = [seq for seq, _, _, count in spans for _ in range(count)]
        num_top = [seq.params.prompt_logprobs or 0 for seq in owner]
        vocab = self.model_cfg.vocab_size
        for i in range(0, len(rows), PROMPT_LOGPROBS_ROWS):
            sl = slice(i, i + PROMPT_LOGPROBS_ROWS)
            idx = torch.tensor(rows[sl], device=hidden.device, dtype=torch.long)
            logits = self.model.compute_logits(hidden[idx])[:, :vocab]
            ids = torch.tensor(targets[sl], device=hidden.device, dtype=torch.long)
            for seq, lp in zip(owner[sl], gather_logprobs(logits, ids, num_top[sl])):
                seq.prompt_logprobs.append(lp)
