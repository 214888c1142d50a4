"""prompt_logprobs (vLLM semantics) through the whole engine, against HF transformers fp32."""
import pytest
import torch
import transformers

from tests.tiny_models import save_tiny_model_dir
from tokenmill import LLM, SamplingParams

BLOCK_BYTES = 4 * 2 * 2 * 2 * 16 * 4     # one 4-token block of the tiny model, K and V, fp32
KV = 256 * BLOCK_BYTES                   # the CPU default (2 GiB) takes seconds to zero


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32).eval()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_matches_hf(plp, ids: list[int], ref: torch.Tensor, k: int, tol: float = 1e-4) -> None:
    """The tiny model's resized embeddings make many logits near-equal, so ranks and top-n ids
    are checked up to ties within `tol`."""
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        e, row, tok = plp[i], ref[i - 1], ids[i]
        assert e.token_id == tok
        assert abs(e.logprob - row[tok].item()) < tol, i
        x = row[tok]
        assert int((row > x + tol).sum()) + 1 <= e.rank <= int((row > x - tol).sum()) + 1
        assert len(e.top) == k
        torch.testing.assert_close(torch.tensor(list(e.top.values())), row.topk(k).values, atol=tol, rtol=0)
        for t, v in e.top.items():
            assert abs(row[t].item() - v) < tol


def prompts_of(lengths: list[int]) -> list[list[int]]:
    return [[(11 * i + 7 * j) % 290 + 3 for j in range(n)] for i, n in enumerate(lengths)]


def test_validation():
    for bad in (-1, 21, 1.5, "3"):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20


def test_match_hf_with_small_chunks_batched_with_plain_requests(tiny_dir, hf):
    llm = LLM(model=tiny_dir, dtype="float32", block_size=4, max_model_len=128, max_num_batched_tokens=8,
              kv_cache_memory=KV)
    prompts = prompts_of([1, 9, 23, 37, 14, 30])
    ks = [2, None, 3, 0, None, 20]
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=k) for k in ks]
    rows = []                                  # rows that reach the lm_head, per call
    runner = llm.engine.runner
    inner = runner.model.compute_logits
    runner.model.compute_logits = lambda h: rows.append(h.shape[0]) or inner(h)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ids, k in zip(outs, prompts, ks):
        if k is None:
            assert out.prompt_logprobs is None
        else:
            assert_matches_hf(out.prompt_logprobs, ids, hf_logprobs(hf, ids), k)
        # the sampled tokens are still the greedy reference continuation
        assert out.outputs[0].token_ids[0] == int(hf_logprobs(hf, ids)[-1].argmax())
    # only prompt-logprob rows and sampling rows go through the vocab matmul
    assert sum(rows) == sum(len(p) - 1 for p, k in zip(prompts, ks) if k is not None) + 5 * len(prompts)


def test_preemption_does_not_duplicate_entries(tiny_dir, hf):
    prompts = prompts_of([5 + 9 * i for i in range(8)])
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=1 if i % 2 else None)
              for i in range(len(prompts))]
    llm = LLM(model=tiny_dir, dtype="float32", block_size=4, max_model_len=128,
              kv_cache_memory=32 * BLOCK_BYTES, max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for out, ids, p in zip(outs, prompts, params):
        if p.prompt_logprobs is not None:
            assert_matches_hf(out.prompt_logprobs, ids, hf_logprobs(hf, ids), 1)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_prefix_cache_hit_is_skipped_but_blocks_are_added(tiny_dir, hf):
    llm = LLM(model=tiny_dir, dtype="float32", block_size=4, max_model_len=128, kv_cache_memory=KV)
    ids = prompts_of([30])[0]
    ref = hf_logprobs(hf, ids)
    wanted = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    for _ in range(2):     # the second finds the first's blocks cached, and still computes every row
        out = llm.generate({"prompt_token_ids": ids}, wanted, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        assert_matches_hf(out.prompt_logprobs, ids, ref, 2)
    # a request without prompt_logprobs hits the blocks those requests added
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert plain.num_cached_tokens == 28
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids
