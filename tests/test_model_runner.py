"""The paged model (flat batch, chunked prefill, batched decode) against HF transformers."""
import pytest
import torch

from tests.tiny_models import tiny_hf_model
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence


def make_runner(hf, block_size=4, num_blocks=64):
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    per_block = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * block_size
    econf = EngineConfig(block_size=block_size, kv_cache_memory=per_block * num_blocks)
    runner = ModelRunner(econf, cfg, hf.state_dict(), torch.device("cpu"), torch.float32, 512)
    return runner, BlockManager(runner.num_blocks, block_size)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_match_hf_through_chunks_and_decode(arch):
    hf = tiny_hf_model(arch)
    runner, bm = make_runner(hf)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 7, 13, 30)]
    seqs = [Sequence(str(i), p, SamplingParams(max_tokens=8)) for i, p in enumerate(prompts)]
    for s in seqs:
        assert bm.admit(s, [], 0)
    # step 1: every prompt in one flat batch, the long one split into a first chunk of 10
    chunks = [(s, min(10, s.num_tokens)) for s in seqs]
    for _ in range(6):
        scheduled = [(s, n) for s, n in chunks if n > 0]
        for s, n in scheduled:
            assert bm.grow(s, n)
        logits = runner.execute(scheduled)
        row = 0
        for s, n in scheduled:
            s.num_computed_tokens += n
            if s.num_computed_tokens == s.num_tokens:
                with torch.no_grad():
                    ref = hf(torch.tensor([s.token_ids])).logits[0, -1]
                torch.testing.assert_close(logits[row], ref, atol=1e-4, rtol=1e-4)
                row += 1
                s.append_token(int(ref.argmax()))
        assert row == logits.shape[0]
        chunks = [(s, min(10, s.num_tokens - s.num_computed_tokens)) for s in seqs]


def test_tied_embeddings_stay_tied():
    hf = tiny_hf_model("llama", tie=True)
    runner, _ = make_runner(hf)
    assert runner.model.lm_head.weight is runner.model.embed_tokens.weight
