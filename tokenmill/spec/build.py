"""The engine's one entry point into spec/: config in, a SpeculativeDecoder (or None) out."""
from __future__ import annotations

import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.engine.sampler import Sampler
from tokenmill.spec.config import SpeculativeConfig
from tokenmill.spec.costs import VERIFY_ROW_COST
from tokenmill.spec.decoder import SpeculativeDecoder
from tokenmill.spec.proposers import NgramProposer, Proposer


def build_speculative_decoder(config: EngineConfig, sampler: Sampler, target: ModelConfig, device: torch.device,
                              dtype: torch.dtype, max_model_len: int, target_kv_bytes: int,
                              target_weight_bytes: int) -> SpeculativeDecoder | None:
    spec = SpeculativeConfig.parse(config.speculative_config)
    if spec is None:
        return None
    proposer: Proposer
    cost = VERIFY_ROW_COST
    if spec.method == "ngram":
        proposer = NgramProposer(spec)
    else:
        from tokenmill.spec.draft_model import DraftModelProposer
        proposer = DraftModelProposer(config, spec, sampler, target, device, dtype, max_model_len, target_kv_bytes)
        # until measured (adaptive k, SpeculativeDecoder.calibrate): decode streams the weights,
        # so a draft step costs about its share of the bytes
        cost += proposer.runner.weight_bytes / target_weight_bytes
    return SpeculativeDecoder(spec, proposer, sampler, max_model_len, draft_cost=cost)
