"""Block accounting through the whole engine: random lengths, aborts, preemption."""
import random

import pytest

from tests.tiny_models import save_tiny_model_dir
from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def test_random_workload_with_aborts_returns_every_block(tiny_dir):
    # 24 blocks x 4 tokens: far less than the workload wants, so preemption happens too
    llm = LLM(model=tiny_dir, dtype="float32", block_size=4, max_model_len=96, max_num_seqs=16,
              kv_cache_memory=24 * 4 * 2 * 2 * 2 * 16 * 4, max_num_batched_tokens=64)
    engine = llm.engine
    rng = random.Random(0)
    live: list[str] = []
    finished = 0
    prefixes = [[rng.randrange(3, 300) for _ in range(rng.randint(4, 30))] for _ in range(3)]
    for i in range(220):
        n = rng.randint(1, 30)
        head = rng.choice(prefixes + [[]])          # shared prefixes exercise the prefix cache
        engine.add_request(str(i), head + [rng.randrange(3, 300) for _ in range(n)],
                           SamplingParams(temperature=rng.choice([0, 1.0]), max_tokens=rng.randint(1, 30),
                                          ignore_eos=True, seed=i),
                           cache_salt=rng.choice([None, None, "s1"]))
        live.append(str(i))
        for _ in range(rng.randint(0, 3)):
            for out in engine.step():
                if out.finished:
                    finished += 1
                    live.remove(out.request_id)
        if rng.random() < 0.25 and live:
            engine.abort_request(live.pop(rng.randrange(len(live))))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished += 1
                live.remove(out.request_id)
    assert not live
    assert finished > 100
    assert engine.scheduler.num_preemptions > 0
    bm = engine.block_manager
    assert bm.prefix_hits > 0
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_priority_preempts_less_important_running_requests(tiny_dir):
    llm = LLM(model=tiny_dir, dtype="float32", block_size=4, max_model_len=64, max_num_seqs=4,
              kv_cache_memory=20 * 4 * 2 * 2 * 2 * 16 * 4, scheduling_policy="priority")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(4):                                  # fill every seat and most blocks
        engine.add_request(f"low{i}", list(range(3, 20)), params, priority=5)
    for _ in range(3):
        engine.step()
    engine.add_request("high", list(range(30, 50)), params, priority=-1)
    engine.step()
    running = {s.request_id for s in engine.scheduler.running}
    assert "high-0" in running
    assert engine.scheduler.num_preemptions >= 1
    assert all(s.priority == 5 for s in engine.scheduler.waiting)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert len(done) == 5 and all(len(o.outputs[0].token_ids) == 40 for o in done.values())
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_outputs_identical_under_preemption_and_prefix_caching(tiny_dir):
    prompts = [[(7 * i + j) % 290 + 3 for j in range(5 + 9 * i)] for i in range(8)]
    prompts += [prompts[3][:20] + [5, 6, 7]]     # shares a cached prefix
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    def run(**kw):
        llm = LLM(model=tiny_dir, dtype="float32", block_size=4, max_model_len=128, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine

    roomy, _ = run()
    tight, engine = run(kv_cache_memory=32 * 4 * 2 * 2 * 2 * 16 * 4, max_num_batched_tokens=16)
    uncached, _ = run(enable_prefix_caching=False, enable_chunked_prefill=False)
    assert engine.scheduler.num_preemptions > 0
    assert tight == roomy == uncached
