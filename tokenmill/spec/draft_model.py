"""Draft-model proposals: a smaller model with the target's tokenizer runs K cheap decode steps.

The draft has its own ModelRunner and its own BlockManager: its KV tensors have its own layer
count and head shape, so they cannot live in the target's block tensors, and a separate pool
also keeps draft memory from ever preempting target sequences. Each target sequence has a
shadow `Sequence` here whose K/V follows the target's tokens; after verification the shadow
keeps the K/V of its longest prefix that the target kept (rollback) and catches up on the rest
in its next first draft step.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.sampler import Sampler
from tokenmill.hub import resolve_model
from tokenmill.model.loader import checkpoint_quant_config, load_model_weights, read_model_config
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence
from tokenmill.spec.config import SpeculativeConfig
from tokenmill.spec.costs import step_seconds
from tokenmill.spec.decoder import DraftView
from tokenmill.spec.proposers import Proposal
from tokenmill.spec.rejection import sample_from

log = logging.getLogger("tokenmill")

_SHADOW_PARAMS = SamplingParams(max_tokens=None)


def _common_prefix(a: list[int], b: list[int], start: int) -> int:
    """Length of the common prefix of a and b, given that the first `start` tokens agree."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer:
    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, sampler: Sampler, target: ModelConfig,
                 device: torch.device, dtype: torch.dtype, max_model_len: int, target_kv_bytes: int) -> None:
        path = resolve_model(spec.model)
        draft_cfg = read_model_config(path)
        if draft_cfg.vocab_size < target.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({draft_cfg.vocab_size}) is smaller "
                             f"than the target's ({target.vocab_size}); it must share the target's tokenizer")
        if draft_cfg.context_length < max_model_len:
            raise ValueError(f"speculative_config: the draft model's context ({draft_cfg.context_length}) is shorter "
                             f"than max_model_len={max_model_len}")
        draft_config = dataclasses.replace(
            config, model=str(path), tokenizer=None, quantization=spec.quantization,
            quantize_lm_head=spec.quantize_lm_head, speculative_config=None,
            kv_cache_memory=spec.draft_kv_cache_memory or max(target_kv_bytes // 4, 1 << 20))
        model_cfg, weights = load_model_weights(path, dtype)
        self.runner = ModelRunner(draft_config, model_cfg, weights, device, dtype, max_model_len,
                                  checkpoint_quant=checkpoint_quant_config(path))
        del weights
        self.block_manager = self.runner.make_block_manager(enable_prefix_caching=False)
        self.sampler = sampler
        self.shadows: dict[int, Sequence] = {}
        self.max_model_len = max_model_len
        log.info("speculative draft %s (%s, %d layers): KV cache %d blocks", spec.model, model_cfg.architecture,
                 model_cfg.num_layers, self.runner.num_blocks)

    def step_seconds(self, rows: list[int]) -> dict[int, float]:
        """One draft forward over r rows (a decode step of the draft for r sequences), timed."""
        return step_seconds(self.runner, self.block_manager, rows, max_model_len=self.max_model_len)

    def forget(self, seq: Sequence) -> None:
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.block_manager.free(shadow)

    def retain(self, live: set[int]) -> None:
        """Drop the shadows of sequences that stopped running (preempted ones recompute anyway)."""
        for seq_id in [s for s in self.shadows if s not in live]:
            self.block_manager.free(self.shadows.pop(seq_id))

    def _sync(self, seq: Sequence) -> Sequence:
        """The shadow of seq, holding seq's tokens, its K/V valid for their longest prefix it computed."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self.shadows[seq.seq_id] = Sequence(f"draft:{seq.request_id}", list(seq.token_ids),
                                                                _SHADOW_PARAMS)
            return shadow
        valid = _common_prefix(shadow.token_ids, seq.token_ids, seq.num_prompt_tokens)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, valid)
        shadow.token_ids = list(seq.token_ids)
        self.block_manager.trim(shadow)
        return shadow

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        # first step: each shadow catches up on the tokens it lacks (at least the last one)
        active, batch = [], []
        for i, seq in enumerate(seqs):
            shadow = self._sync(seq)
            n = shadow.num_tokens - shadow.num_computed_tokens
            if self.block_manager.grow(shadow, n):
                active.append(i)
                batch.append((shadow, n))
            else:                       # draft pool full: no proposal, and make room for the others
                self.forget(seq)
        for step in range(max(num_tokens, default=0)):
            if not active:
                break
            logits = self.runner.execute(batch)
            views = [DraftView.of(seqs[i], drafts[i]) for i in active]
            q = self.sampler.probs(logits, views)
            us = self.sampler.uniforms(views, torch.device("cpu"), torch.float64).tolist()
            next_active, batch = [], []
            for row, i in enumerate(active):
                shadow = self.shadows[seqs[i].seq_id]
                token = sample_from(q[row], us[row])
                drafts[i].append(token)
                probs[i].append(q[row])
                shadow.num_computed_tokens = shadow.num_tokens
                shadow.token_ids.append(token)
                if len(drafts[i]) < num_tokens[i] and self.block_manager.grow(shadow, 1):
                    next_active.append(i)
                    batch.append((shadow, 1))
            active = next_active
        return [(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs)]
