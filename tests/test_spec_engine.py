"""Speculative decoding through the engine: greedy output token-identical to plain decoding
(mixed batches, preemption, stops), sampled output distributed as without speculation, and
KV blocks all free after random workloads with rejections and aborts."""
import random
from pathlib import Path

import pytest
import torch
from scipy.stats import chi2_contingency

from tests.tiny_models import save_tiny_model_dir
from tokenmill import LLM, SamplingParams
from tokenmill.engine_args import add_engine_args, engine_config_from_args

KV = 1 << 22      # 8k tokens of the tiny model's cache (the 2 GiB default costs seconds to allocate)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# repetitive prompts make the n-gram lookup fire; the tiny random model also loops on its own
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12, 10, 11, 12, 10], [40, 41, 42, 43, 44, 45],
           list(range(100, 140)), [7] * 20, [3, 4] * 15 + [9]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _gen(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _assert_same_distribution(a, b):
    """Two-sample χ² per output position 1..3 (the verified ones); categories with < 10 samples
    are pooled."""
    for pos in (1, 2, 3):
        cats = sorted({t[pos] for t in a + b})
        table = [[sum(t[pos] == c for t in a) for c in cats], [sum(t[pos] == c for t in b) for c in cats]]
        keep = [j for j in range(len(cats)) if table[0][j] + table[1][j] >= 10]
        rare = [sum(row[j] for j in range(len(cats)) if j not in keep) for row in table]
        table = [[row[j] for j in keep] + ([r] if sum(rare) else []) for row, r in zip(table, rare)]
        assert chi2_contingency(table).pvalue > 0.001, (pos, table)


def _run_with_aborts(engine, rng, num_requests, make_request):
    """Add requests one by one with 0-3 steps between them, abort a quarter at random, drain."""
    live: list[str] = []
    for i in range(num_requests):
        prompt, params = make_request(i)
        engine.add_request(str(i), prompt, params)
        live.append(str(i))
        for _ in range(rng.randint(0, 3)):
            _step(engine, live)
        if rng.random() < 0.25 and live:
            engine.abort_request(live.pop(rng.randrange(len(live))))
    while engine.has_unfinished_requests():
        _step(engine, live)
    assert not live


def _step(engine, live: list[str]) -> None:
    finished = {o.request_id for o in engine.step() if o.finished}
    live[:] = [r for r in live if r not in finished]


def test_greedy_output_identical_with_ngram_speculation(tiny_dir):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 33, 7, 25, 40, 2)]
    base = LLM(model=tiny_dir, dtype="float32", max_model_len=256, kv_cache_memory=KV)
    spec = LLM(model=tiny_dir, dtype="float32", max_model_len=256, kv_cache_memory=KV, speculative_config=NGRAM)
    assert _ids(_gen(spec, PROMPTS, params)) == _ids(_gen(base, PROMPTS, params))
    stats = spec.engine.spec.stats
    assert stats.num_accepted_tokens > 20 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert 1 < stats.mean_acceptance_length <= 5
    # drafts never push a request past max_tokens: exact lengths
    assert [len(t) for t in _ids(_gen(spec, PROMPTS, params))] == [40, 33, 7, 25, 40, 2]
    bm = spec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_greedy_identical_under_preemption_and_with_plain_neighbours(tiny_dir):
    """A small cache forces preemption while drafts are in flight; sampled and prompt-logprob
    requests share the batch (they take the plain path or verify with their own params)."""
    kv = 40 * 4 * 2 * 2 * 2 * 16 * 4          # 40 blocks of 4 tokens
    kw = dict(dtype="float32", block_size=4, max_model_len=96, max_num_seqs=8, kv_cache_memory=kv,
              max_num_batched_tokens=32)
    prompts = PROMPTS * 2
    params = [SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)] * len(prompts)
    base = LLM(model=tiny_dir, **kw)
    spec = LLM(model=tiny_dir, speculative_config=NGRAM, **kw)
    assert _ids(_gen(spec, prompts, params)) == _ids(_gen(base, prompts, params))
    assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.spec.stats.num_accepted_tokens > 0
    mixed = params[:4] + [SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True),
                          SamplingParams(temperature=0, max_tokens=20, prompt_logprobs=2, ignore_eos=True)]
    got, want = _gen(spec, prompts[:6], mixed), _gen(base, prompts[:6], mixed)
    assert _ids(got)[:4] == _ids(want)[:4] and _ids(got)[5] == _ids(want)[5]
    assert len(_ids(got)[4]) == 20
    bm = spec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_stop_tokens_and_logprobs_match_plain_decoding(tiny_dir):
    base = LLM(model=tiny_dir, dtype="float32", max_model_len=256, kv_cache_memory=KV)
    spec = LLM(model=tiny_dir, dtype="float32", max_model_len=256, kv_cache_memory=KV, speculative_config=NGRAM)
    free = _ids(_gen(base, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)))
    # stop on a token that first appears deep in the output: drafts past it must be dropped
    for toks, prompt in zip(free, PROMPTS[:2]):
        stop = toks[12]
        p = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop], logprobs=2, ignore_eos=True)
        got, want = _gen(spec, [prompt], p)[0].outputs[0], _gen(base, [prompt], p)[0].outputs[0]
        assert got.token_ids == want.token_ids and got.token_ids[-1] == stop and got.finish_reason == "stop"
        assert [lp.token_id for lp in got.logprobs] == got.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4) and a.rank == b.rank and a.top.keys() == b.top.keys()


def test_sampled_output_distribution_unchanged_by_speculation(tiny_dir):
    """Two-sample χ² on the 2nd-4th output tokens (where verification decides) of 600 seeded
    requests with and without n-gram speculation; top-k 3 keeps the categories few. The prompt
    ends in the model's own greedy loop, so the n-gram drafts are often right."""
    def samples(llm, offset):
        params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True, seed=offset + i)
                  for i in range(600)]
        return _ids(_gen(llm, [prompt] * 600, params))
    base = LLM(model=tiny_dir, dtype="float32", max_model_len=64, max_num_seqs=128, kv_cache_memory=KV)
    spec = LLM(model=tiny_dir, dtype="float32", max_model_len=64, max_num_seqs=128, kv_cache_memory=KV, speculative_config=NGRAM)
    loop = _ids(_gen(base, [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)))[0]
    prompt = PROMPTS[1] + loop
    a, b = samples(base, 0), samples(spec, 10_000)
    assert spec.engine.spec.stats.num_accepted_tokens > 100   # the accept path really ran
    _assert_same_distribution(a, b)


def test_random_workload_with_speculation_returns_every_block(tiny_dir):
    llm = LLM(model=tiny_dir, dtype="float32", block_size=4, max_model_len=96, max_num_seqs=16,
              kv_cache_memory=30 * 4 * 2 * 2 * 2 * 16 * 4, max_num_batched_tokens=48, speculative_config=NGRAM)
    engine = llm.engine
    rng = random.Random(1)

    def request(i):
        base = rng.choice(PROMPTS)
        prompt = base[: rng.randint(2, len(base))] + [rng.randrange(3, 300) for _ in range(rng.randint(0, 10))]
        return prompt, SamplingParams(temperature=rng.choice([0, 0.7]), max_tokens=rng.randint(1, 40),
                                      ignore_eos=True, seed=i, top_k=rng.choice([-1, 5]))
    _run_with_aborts(engine, rng, 150, request)
    stats = engine.spec.stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert engine.scheduler.num_preemptions > 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_disable_by_batch_size_turns_speculation_off(tiny_dir):
    spec = LLM(model=tiny_dir, dtype="float32", max_model_len=128, kv_cache_memory=KV,
               speculative_config={**NGRAM, "disable_by_batch_size": 2})
    _gen(spec, PROMPTS[:3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    stats = spec.engine.spec.stats
    assert stats.num_drafts == 0          # 3 running > 2 throughout
    assert stats.num_draft_steps == 0 < stats.num_decode_steps
    _gen(spec, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert stats.num_drafts > 0 and 0 < stats.num_draft_steps <= stats.num_decode_steps


def test_cli_flag_takes_json_and_bad_config_fails_at_start(tiny_dir):
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", tiny_dir, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    cfg = engine_config_from_args(args)
    assert LLM(**{"model": cfg.model, "speculative_config": cfg.speculative_config, "dtype": "float32",
                  "max_model_len": 64, "kv_cache_memory": KV}).engine.spec.config.num_speculative_tokens == 3
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model=tiny_dir, dtype="float32", max_model_len=64, kv_cache_memory=KV, speculative_config={"method": "ngram"})


# ---- draft model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """A different random model with the same tokenizer: a poor draft, so rejections are common."""
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny_other"), seed=1)


@pytest.fixture(scope="module")
def near_dir(tiny_dir, tmp_path_factory):
    """The tiny model with noise on every weight: a draft that agrees with it often, not always."""
    import shutil
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.3 * param.std())
    out = tmp_path_factory.mktemp("tiny_near")
    model.save_pretrained(out)
    for src in Path(tiny_dir).glob("*token*"):
        shutil.copy(src, out / src.name)
    return str(out)


def _draft(model, k=4, **extra):
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, **extra}


def test_draft_model_greedy_identical_and_self_draft_always_accepted(tiny_dir, other_dir):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 33, 7, 25, 40, 2)]
    base = LLM(model=tiny_dir, dtype="float32", max_model_len=256, kv_cache_memory=KV)
    want = _ids(_gen(base, PROMPTS, params))
    same = LLM(model=tiny_dir, dtype="float32", max_model_len=256, kv_cache_memory=KV,
               speculative_config=_draft(tiny_dir))
    assert _ids(_gen(same, PROMPTS, params)) == want
    stats = same.engine.spec.stats
    assert stats.num_draft_tokens > 50 and stats.num_accepted_tokens == stats.num_draft_tokens
    # sampled: p == q, so every draft is accepted (up to rounding between the two code paths)
    _gen(same, PROMPTS, SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=5))
    assert same.engine.spec.stats.acceptance_rate > 0.95
    other = LLM(model=tiny_dir, dtype="float32", max_model_len=256, kv_cache_memory=KV,
                speculative_config=_draft(other_dir, k=3))
    assert _ids(_gen(other, PROMPTS, params)) == want
    assert other.engine.spec.stats.num_drafts > 0
    for llm in (same, other):
        bm = llm.engine.spec.proposer.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not llm.engine.spec.proposer.shadows


def test_draft_model_sampled_distribution_unchanged(tiny_dir, near_dir):
    """Two-sample χ² of output tokens 2-4 with a draft whose q differs from p (the residual
    max(0, p - q) path) against plain sampling."""
    prompt = PROMPTS[1]
    def samples(llm, offset):
        params = [SamplingParams(temperature=1.0, top_k=4, max_tokens=4, ignore_eos=True, seed=offset + i)
                  for i in range(600)]
        return _ids(_gen(llm, [prompt] * 600, params))
    base = LLM(model=tiny_dir, dtype="float32", max_model_len=64, max_num_seqs=128, kv_cache_memory=KV)
    spec = LLM(model=tiny_dir, dtype="float32", max_model_len=64, max_num_seqs=128, kv_cache_memory=KV,
               speculative_config=_draft(near_dir, k=3))
    a, b = samples(base, 0), samples(spec, 10_000)
    stats = spec.engine.spec.stats
    assert 50 < stats.num_accepted_tokens < stats.num_draft_tokens
    _assert_same_distribution(a, b)


def test_draft_model_under_preemption_and_aborts_frees_both_pools(tiny_dir, other_dir):
    llm = LLM(model=tiny_dir, dtype="float32", block_size=4, max_model_len=96, max_num_seqs=16,
              kv_cache_memory=30 * 4 * 2 * 2 * 2 * 16 * 4, max_num_batched_tokens=48,
              speculative_config=_draft(tiny_dir, k=3, draft_kv_cache_memory=20 * 4 * 2 * 2 * 2 * 16 * 4))
    engine = llm.engine
    rng = random.Random(2)
    _run_with_aborts(engine, rng, 80, lambda i: (
        rng.choice(PROMPTS)[: rng.randint(2, 20)],
        SamplingParams(temperature=rng.choice([0, 0.7]), max_tokens=rng.randint(1, 40), ignore_eos=True, seed=i)))
    assert engine.scheduler.num_preemptions > 0
    assert engine.spec.stats.num_accepted_tokens > 0
    for bm in (engine.block_manager, engine.spec.proposer.block_manager):
        assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_draft_model_refuses_a_smaller_vocabulary(tiny_dir, tmp_path):
    import json
    small = save_tiny_model_dir(tmp_path / "small")
    cfg = json.loads((tmp_path / "small" / "config.json").read_text())
    cfg["vocab_size"] = 100
    (tmp_path / "small" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(model=tiny_dir, dtype="float32", max_model_len=64, kv_cache_memory=KV, speculative_config=_draft(small))


def test_adaptive_k_stays_exact_and_sizes_drafts_by_cost_and_acceptance(tiny_dir, other_dir):
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * len(PROMPTS)
    base = LLM(model=tiny_dir, dtype="float32", max_model_len=256, kv_cache_memory=KV)
    want = _ids(_gen(base, PROMPTS, params))
    mean_draft, rounds = {}, {}
    for name, cfg in (("ngram", {**NGRAM, "num_speculative_tokens": 6}), ("other", _draft(other_dir, k=6))):
        llm = LLM(model=tiny_dir, dtype="float32", max_model_len=256, kv_cache_memory=KV,
                  speculative_config={**cfg, "adaptive_k": True})
        costs, bm = llm.engine.spec.tracker.costs, llm.engine.block_manager
        assert len(costs) == 7 and costs[0] == 1.0 and costs != [1 + k * 0.02 for k in range(7)]   # measured
        measured = llm.engine.spec.tracker.measured                      # and per batch, up to 16
        assert measured.widest == 16 and max(measured.target_seconds) == 16 * 7
        assert all(len(c) == 7 and c[0] == 1.0 for c in (measured.at(b, r) for b in (2, 16) for r in (0, 100)))
        assert bm.num_free_blocks == bm.num_blocks           # the timing probe gave its blocks back
        assert _ids(_gen(llm, PROMPTS, params)) == want
        stats = llm.engine.spec.stats
        mean_draft[name] = stats.num_draft_tokens / max(stats.num_drafts, 1)
        rounds[name] = stats.num_drafts
    # n-gram drafts are nearly free and often right here: long drafts; the unrelated draft model
    # costs about a target step per draft and is always rejected: after the first rounds it
    # stops drafting, but for a one-token probe every few rounds (or it never drafts: with the
    # six prompts decoding together even a good draft at that cost does not pay)
    assert mean_draft["ngram"] > 2.0 and mean_draft["other"] < 1.5, mean_draft
    assert rounds["other"] < 0.4 * 40 * len(PROMPTS), rounds


def test_quantized_draft_keeps_greedy_output_exact(tiny_dir):
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * len(PROMPTS)
    base = LLM(model=tiny_dir, dtype="float32", max_model_len=256, kv_cache_memory=KV)
    llm = LLM(model=tiny_dir, dtype="float32", max_model_len=256, kv_cache_memory=KV,
              speculative_config=_draft(tiny_dir, k=3, quantization="int8", quantize_lm_head=True))
    assert _ids(_gen(llm, PROMPTS, params)) == _ids(_gen(base, PROMPTS, params))
    draft = llm.engine.spec.proposer.runner
    assert draft.quant is not None and draft.quant.quantize_lm_head and draft.weight_bytes < base.engine.runner.weight_bytes
    assert llm.engine.spec.stats.acceptance_rate > 0.5     # int8 copy of the target: mostly right
