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
