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


@pytest.mark.parametrize("kv,tol", [("bfloat16", 4e-3), ("int8", 8e-3), ("fp8_e4m3", 4e-2), ("fp8_e5m2", 8e-2)])
def test_quantized_kv_cache_tracks_the_float_logits(kv, tol):
    """Chunked prefill and decode through a quantized KV cache stay near the float cache's
    logits (the error bound grows with the format's coarseness), and the byte budget buys
    the blocks its bytes per token say."""
    hf = tiny_hf_model("llama")
    budget, block = 1 << 20, 4
    runs = {}
    for name in ("auto", kv):
        econf = EngineConfig(block_size=block, kv_cache_memory=budget, kv_cache_dtype=name)
        runner = ModelRunner(econf, ModelConfig.from_hf(hf.config.to_dict()), hf.state_dict(), torch.device("cpu"),
                             torch.float32, 512)
        cfg = runner.model_cfg
        elem = {"auto": 4 * cfg.head_dim, "bfloat16": 2 * cfg.head_dim}.get(name, cfg.head_dim + 4)
        assert runner.num_blocks == budget // (2 * cfg.num_layers * cfg.num_kv_heads * elem * block)
        bm = runner.make_block_manager(False)
        seq = Sequence("0", torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(3)).tolist(),
                       SamplingParams(max_tokens=8))
        assert bm.admit(seq, [], 0)
        out = []
        while len(out) < 8:
            n = min(10, seq.num_tokens - seq.num_computed_tokens)
            assert bm.grow(seq, n)
            logits = runner.execute([(seq, n)])
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                out.append(logits[0])
                seq.append_token(int(logits[0].argmax()) if name == "auto" else runs["auto"][1][len(out) - 1])
        runs[name] = (torch.stack(out), seq.output_token_ids)
    ref, got = runs["auto"][0], runs[kv][0]
    err = (got - ref).abs().max() / ref.abs().max()
    assert 0 < err < tol, err
