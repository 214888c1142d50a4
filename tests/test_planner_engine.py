"""The plan against real engines: KV blocks per group equal the engine's, planned weight bytes
within 2 % of the loaded (and quantized) tensors."""
from __future__ import annotations

import pytest

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.hub import resolve_model
from tokenmill.model.loader import read_model_config
from tokenmill.planner import plan

pytestmark = pytest.mark.slow
BUDGET = 48 << 20


@pytest.mark.parametrize("model, quantization, kv", [
    ("smollm2-135m-instruct", None, "auto"),
    ("smollm2-135m-instruct", "int8", "int8"),
    ("qwen2.5-coder-0.5b-instruct", "rtn4", "bfloat16"),
    ("gemma-3-270m", "int8", "int8"),          # window groups
])
def test_plan_matches_the_engine(model, quantization, kv):
    engine = LLMEngine(EngineConfig(model=model, quantization=quantization, kv_cache_dtype=kv, max_model_len=1024,
                                    kv_cache_memory=BUDGET))
    runner = engine.runner
    p = plan(read_model_config(resolve_model(model)), dtype=str(engine.dtype).removeprefix("torch."),
             quantization=runner.quant, kv_cache_dtype=kv, max_model_len=engine.max_model_len,
             kv_cache_memory=BUDGET, chunk_tokens=runner.max_chunk)
    assert [(g.window, g.layers, g.blocks) for g in p.kv_groups] == \
        [(g.window, len(g.layers), g.num_blocks) for g in runner.kv_groups]
    assert abs(p.weight_bytes - runner.weight_bytes) <= 0.02 * runner.weight_bytes, (p.weight_bytes, runner.weight_bytes)


def test_plan_matches_a_tensor_parallel_engine():
    """SmolLM2 on 2 ranks: every rank sizes its KV blocks by the fullest rank (2 of the 3 KV
    heads), as the plan does; rank 0 (1 KV head, 3 query heads) holds less than that bill."""
    engine = LLMEngine(EngineConfig(model="smollm2-135m-instruct", max_model_len=1024, kv_cache_memory=BUDGET,
                                    tensor_parallel_size=2))
    try:
        runner = engine.runner
        bill = dict(dtype=str(engine.dtype).removeprefix("torch."), max_model_len=1024, kv_cache_memory=BUDGET,
                    chunk_tokens=runner.max_chunk)
        cfg = read_model_config(resolve_model("smollm2-135m-instruct"))
        p, whole = plan(cfg, tensor_parallel_size=2, **bill), plan(cfg, **bill)
        assert [g.blocks for g in p.kv_groups] == [g.num_blocks for g in runner.kv_groups]
        assert p.kv_layer_token_bytes * runner.block_size == runner.layer_block_bytes
        assert runner.weight_bytes < p.weight_bytes < 0.6 * whole.weight_bytes
    finally:
        engine.close()
